"""Command-line flags shared by the services and the `gapserve` CLI.

Every flag `--foo-bar` also reads the environment variable GAPSERVE_FOO_BAR: the
flag wins over the variable, the variable over the default. A bad value in a
variable is reported like a bad flag (naming the variable), before anything starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

ENV_PREFIX = "GAPSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(flag: str) -> str:
    """`--max-num-seqs` -> `GAPSERVE_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """parser.parse_args with environment variables as defaults; the parser is
    left unchanged, so it can be reused with another environment."""
    environ = os.environ if environ is None else environ
    saved = {a.dest: a.default for a in parser._actions}
    try:
        for action in parser._actions:
            flags = [f for f in action.option_strings
                     if f.startswith("--") and not f.startswith("--no-")]
            if not flags or action.dest == "help":
                continue
            name = env_name(flags[0])
            if name in environ:
                action.default = _env_value(parser, action, name, environ[name])
        return parser.parse_args(argv)
    finally:
        for action in parser._actions:
            action.default = saved[action.dest]


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str,
               raw: str):
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            parser.error(f"environment variable {name}={raw!r} is not a boolean "
                         "(use 1/0, true/false, yes/no, on/off)")
        return word in _TRUE
    try:
        value = action.type(raw) if action.type else raw
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        parser.error(f"environment variable {name}={raw!r}: {e}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"environment variable {name}={raw!r} is not one of "
                     f"{', '.join(map(str, action.choices))}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def address_list(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, sep, p = a.rpartition(":")
        if not sep or not host or not p.isdigit():
            raise argparse.ArgumentTypeError(f"{a!r} is not host:port")
    if not addresses:
        raise argparse.ArgumentTypeError("needs at least one host:port")
    return addresses


# ---------------------------------------------------------------------------
# flag groups: `gapserve serve` takes their union


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("all services")
    g.add_argument("--host", default="127.0.0.1", help="bind address")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/gRPC endpoint for traces (standard OTEL_* variables too)")
    g.add_argument("--log-format", choices=("auto", "json", "console"), default="auto",
                   help="auto: console on a TTY, JSON lines otherwise")
    g.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"))


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: SmolLM2-135M-Instruct)")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Limits both the worker (to size its buffers) and the scheduler need."""
    g = parser.add_argument_group("limits")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget of one step (default 2048; 8192 on big GPUs)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="most requests running at once (default 256)")


def add_worker_flags(parser: argparse.ArgumentParser, *, with_ports: bool = True) -> None:
    g = parser.add_argument_group("worker")
    if with_ports:
        g.add_argument("--port", type=port, default=None, help="default 50053 + rank")
        g.add_argument("--metrics-port", type=port, default=None,
                       help="default 8002 + rank; 0 turns it off")
        g.add_argument("--rank", type=non_negative_int, default=0)
    g.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    g.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    g.add_argument("--dtype", default="auto",
                   choices=("auto", "float32", "bfloat16", "float16"),
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--kv-cache-memory", type=positive_int, default=None,
                   help="bytes of KV cache on CPU")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--seed", type=int, default=0)
    add_worker_benchmark_flags(g)


def add_worker_benchmark_flags(g) -> None:
    """Measuring the stack without a model's cost (issue 16; docs/benchmarks.md)."""
    g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                   help="dummy: random weights of the checkpoint's shapes (config.json only)")
    g.add_argument("--zero-cost-steps", action=argparse.BooleanOptionalAction, default=False,
                   help="benchmarks only, needs --load-format dummy: steps skip the forward "
                        "pass and answer made-up tokens (benchmarks/stack_ceiling.py)")


def add_scheduler_flags(parser: argparse.ArgumentParser, *, with_ports: bool = True) -> None:
    g = parser.add_argument_group("scheduler")
    if with_ports:
        g.add_argument("--port", type=port, default=50052)
        g.add_argument("--metrics-port", type=port, default=8001, help="0 turns it off")
        g.add_argument("--worker-addresses", type=address_list,
                       default=["127.0.0.1:50053"],
                       help="comma list of host:port, one per tensor-parallel rank")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0)
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)


def add_frontend_flags(parser: argparse.ArgumentParser, *, with_model: bool = True,
                       with_scheduler_address: bool = True) -> None:
    g = parser.add_argument_group("frontend")
    g.add_argument("--http-port", type=port, default=8000)
    g.add_argument("--grpc-port", type=port, default=50051)
    if with_scheduler_address:
        g.add_argument("--scheduler-address", default="127.0.0.1:50052")
    if with_model:
        add_model_flag(g)
    g.add_argument("--served-model-name", default=None,
                   help="defaults to the model directory's name")
    g.add_argument("--api-server-count", type=positive_int, default=1,
                   help="frontend processes sharing the HTTP and gRPC ports (SO_REUSEPORT), "
                        "as vLLM's: more CPU for detokenizing and streaming")


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve worker", description="Run one worker rank.")
    add_common_flags(p)
    add_model_flag(p)
    add_worker_flags(p)
    add_limit_flags(p)
    return p


def scheduler_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve scheduler", description="Run the scheduler.")
    add_common_flags(p)
    add_scheduler_flags(p)
    add_limit_flags(p)
    return p


def frontend_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve frontend", description="Run the frontend.")
    add_common_flags(p)
    add_frontend_flags(p)
    return p
