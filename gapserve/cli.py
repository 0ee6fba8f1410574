"""`gapserve`: one command for the whole stack, and one per service.

    gapserve serve [MODEL] [flags]  worker, scheduler and frontend as three processes
    gapserve worker [flags]       one worker rank       (containers)
    gapserve scheduler [flags]    the scheduler         (containers)
    gapserve frontend [flags]     the frontend          (containers)
    gapserve status [--url URL]   the live capacity diagnosis
    gapserve sim ...              the scheduler simulator

Every flag --foo-bar also reads GAPSERVE_FOO_BAR; `gapserve <command> --help` lists them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

# command -> "module:function" taking argv; imported lazily so each service loads
# only its own dependencies (the frontend never imports torch, for one).
COMMANDS = {
    "serve": "gapserve.serve:main",
    "worker": "worker_svc.server:main",
    "scheduler": "scheduler_svc.server:main",
    "frontend": "frontend_svc.server:main",
    "status": "gapserve.status:main",
    "sim": "scheduler_svc.sim.cli:main",
}


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from gapserve.serve import serve_parser
    from gapserve.status import status_parser
    from shared import config

    return {"serve": serve_parser, "worker": config.worker_parser,
            "scheduler": config.scheduler_parser, "frontend": config.frontend_parser,
            "status": status_parser}


def build_parser() -> argparse.ArgumentParser:
    """One parser with a subcommand per service, each holding exactly the flags that
    service's main() parses (for --help, docs and checks of deployment files)."""
    parser = argparse.ArgumentParser(prog="gapserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, make in _parsers().items():
        own = make()
        sub.add_parser(name, parents=[own], add_help=False, description=own.description,
                       formatter_class=own.formatter_class)
    sim = sub.add_parser("sim", help="the scheduler simulator (see gapserve sim --help)")
    sim.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _start_nice(command: str) -> None:
    """A service started with GAPSERVE_PROCESS_NICE (gapserve serve sets it from
    --helper-nice) lowers its priority by that much before it starts a thread."""
    from shared.arg_types import niceness
    from shared.config import NICE_ENV
    raw = os.environ.get(NICE_ENV)
    if raw is None or command not in ("worker", "scheduler", "frontend"):
        return
    try:
        os.nice(niceness(raw))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"gapserve {command}: {NICE_ENV}={raw!r}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    target = COMMANDS.get(command)
    if target is None:
        print(f"gapserve: unknown command {command!r}; one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    _start_nice(command)
    if command in ("serve", "worker", "scheduler", "frontend"):
        from shared.shutdown import dump_stacks_on_sigusr1
        dump_stacks_on_sigusr1()  # `kill -USR1 <pid>`: every thread's stack to its log
    module, _, function = target.partition(":")
    result = getattr(importlib.import_module(module), function)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
