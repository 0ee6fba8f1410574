"""The argparse parser of each `gapserve` service subcommand: the subcommands come
from the CLI's own table, their parsers from shared.config, which each service's
main() parses its flags and GAPSERVE_* variables with."""

from __future__ import annotations

import argparse

from gapserve import cli
from shared import config
from shared.flag_spec import env_name


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """{subcommand: parser} for every CLI subcommand that has a service parser."""
    parsers = {}
    for command in cli.COMMANDS:
        build = getattr(config, f"{command}_parser", None)
        if build is not None:
            parsers[command] = build()
    return parsers


def flag_env_names(parser: argparse.ArgumentParser) -> set[str]:
    """The GAPSERVE_* variable of every --flag the parser takes."""
    return {env_name(flags[0]) for action in parser._actions
            if action.dest != "help"
            for flags in [[f for f in action.option_strings
                           if f.startswith("--") and not f.startswith("--no-")]] if flags}
