"""The argparse parser of each `gapserve` subcommand, taken from the CLI itself."""

from __future__ import annotations

import argparse


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    from gapserve import cli
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the gapserve CLI has no subcommands")
