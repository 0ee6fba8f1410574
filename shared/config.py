"""Command-line flags shared by the services and the `gapserve` CLI.

Every flag `--foo-bar` also reads the environment variable GAPSERVE_FOO_BAR: the
flag wins over the variable, the variable over the default. A bad value in a
variable is reported like a bad flag (naming the variable), before anything starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from shared.arg_types import (WorkerGroups, address_groups, address_list, fraction,  # noqa: F401
                              key_list, non_negative_float, non_negative_int, port,
                              positive_int, positive_seconds, readable_file, worker_groups)
from shared.speculative_config import speculative_config_arg

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
    g.add_argument("--instance-id", default=None,
                   help="an id reported by grpc.health.v1 and /health, so `gapserve serve` "
                        "knows it reached its own children (serve draws one per start)")
    # resilience (docs/resilience.md)
    g.add_argument("--drain-timeout-s", type=non_negative_float, default=10.0,
                   help="on SIGTERM: stop admitting and let running requests finish for at "
                        "most this long; what is left is handed back (the frontend "
                        "re-submits it to the next scheduler)")


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: SmolLM2-135M-Instruct)")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Limits both the worker (to size its buffers) and the scheduler need."""
    g = parser.add_argument_group("limits")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget of one step (default: 8192 on GPUs with 70 GiB or "
                        "more, else 2048); the scheduler and the workers must agree")
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
    g.add_argument("--quantization", default=None, choices=("int8",),
                   help="CPU: steps of at most 32 tokens read int8 weights (a scale per "
                        "32 inputs), wider ones the --dtype weights")
    g.add_argument("--kv-cache-memory", type=positive_int, default=None,
                   help="bytes of KV cache on CPU")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    g.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   metavar="JSON", help="speculative decoding, vLLM's JSON: "
                   '{"method": "ngram", "num_speculative_tokens": 3} (prompt lookup) or '
                   '{"method": "draft_model", "quantization": "int8", ...} (the served '
                   "model's int8 copy drafts) or a \"model\": DIR; the scheduler adopts it "
                   "(docs/spec_decode.md)")
    add_cpu_compute_flags(g)
    add_tensor_parallel_flags(parser)
    add_worker_benchmark_flags(g)


# --- the CPU compute plan (issue 29, worker_svc/compute_plan.py): each switch turns one
# C kernel or weight layout off; the env spelling is GAPSERVE_CPU_...=off
CPU_SWITCHES = {
    "prepack": "matmul weights prepacked in oneDNN's layout (off: plain tensors, F.linear)",
    "fused-ops": "a layer's norms, RoPE, KV write and SiLU in C (off: torch ops)",
    "decode-layers": "small decode steps run every layer in one C call (off: the "
                     "Python loop over the same kernels)",
    "small-batch": "steps of few tokens on the small-batch matmul kernel and its weight "
                   "copies (off: oneDNN for every step; --quantization int8 needs it)",
    "argmax-screen": "greedy rows of small steps screen the vocabulary projection "
                     "in int8, the argmax unchanged (off: the full projection)",
    "attention": "decode attention in the C paged kernel (off: torch SDPA)",
}


CPU_FLAG_DESTS = (*(f"cpu_{n.replace('-', '_')}" for n in CPU_SWITCHES), "cpu_threads")


def add_cpu_compute_flags(g) -> None:
    for name, what in CPU_SWITCHES.items():
        g.add_argument(f"--cpu-{name}", action=argparse.BooleanOptionalAction, default=True,
                       help=f"CPU: {what}")
    g.add_argument("--cpu-threads", type=non_negative_int, default=0,
                   help="torch threads of this rank; 0: $OMP_NUM_THREADS if set, else the "
                        "usable cores split among the tensor-parallel ranks on this host")


def fault_stop_after_steps(environ: Mapping[str, str] | None = None) -> int | None:
    """GAPSERVE_FAULT_STOP_AFTER_STEPS (worker_svc/fault_injection.py): an environment
    variable only, no flag, so a typo on a production command line cannot set it."""
    value = (os.environ if environ is None else environ).get(
        ENV_PREFIX + "FAULT_STOP_AFTER_STEPS", "")
    return int(value) if value.strip() else None


def fault_fail_on_token(environ: Mapping[str, str] | None = None) -> int | None:
    """GAPSERVE_FAULT_FAIL_ON_TOKEN=<id> (worker_svc/fault_injection.py): the worker
    raises in every step whose scheduled tokens include that token id, to drill a
    request that fails by itself. An environment variable only, like the one above."""
    value = (os.environ if environ is None else environ).get(
        ENV_PREFIX + "FAULT_FAIL_ON_TOKEN", "")
    return int(value) if value.strip() else None


# --- the default model's cache (shared/default_model.py): variables only, read at use
DEFAULT_MODEL_WHEEL_ENV = ENV_PREFIX + "DEFAULT_MODEL_WHEEL"
# a folder holding Gemma 3 270M's five wheels (shared/gemma3_270m.py), skipping pip
GEMMA3_WHEELS_ENV = ENV_PREFIX + "GEMMA3_WHEELS"


def cache_dir_override(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_CACHE_DIR: where the default model is converted to (None: unset or
    empty, shared/default_model.py then uses ~/.cache/gapserve)."""
    return (os.environ if environ is None else environ).get(ENV_PREFIX + "CACHE_DIR") or None


def default_model_wheel(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_DEFAULT_MODEL_WHEEL: a local copy of the default model's wheel, so the
    first start skips pip's download (offline machines, CI caches)."""
    return (os.environ if environ is None else environ).get(DEFAULT_MODEL_WHEEL_ENV) or None


def gemma3_wheels(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_GEMMA3_WHEELS: a folder holding Gemma 3 270M's five wheels, so
    shared/gemma3_270m.py skips pip's download (offline machines, CI caches)."""
    return (os.environ if environ is None else environ).get(GEMMA3_WHEELS_ENV) or None


# --- structured outputs (issue 30, docs/structured_outputs.md)
def structured_output_compile_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """GAPSERVE_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S: seconds a grammar may take to
    compile (the frontend's validation and rank 0's compile) before the request is
    refused; default shared.structured_output.DEFAULT_COMPILE_TIMEOUT_S."""
    from shared.structured_output import DEFAULT_COMPILE_TIMEOUT_S
    value = (os.environ if environ is None else environ).get(
        ENV_PREFIX + "STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S", "")
    if not value.strip():
        return DEFAULT_COMPILE_TIMEOUT_S
    timeout = float(value)
    if not timeout > 0:
        raise ValueError(f"{ENV_PREFIX}STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S must be positive, "
                         f"got {value!r}")
    return timeout


def add_structured_output_flags(g) -> None:
    """The frontend's bound on compiling a request's grammar (the 400 before anything
    is queued). Rank 0 compiles under GAPSERVE_STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S,
    which is also this flag's default, so one variable sets both; `gapserve serve`
    hands the flag's value to the inner services in that variable."""
    from shared.structured_output import DEFAULT_COMPILE_TIMEOUT_S
    g.add_argument("--structured-outputs-compile-timeout-s", type=positive_seconds,
                   default=None, metavar="S",
                   help="seconds a request's JSON schema / regex / grammar may take to "
                        "compile before it is a 400 (default: "
                        f"${ENV_PREFIX}STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S, else "
                        f"{DEFAULT_COMPILE_TIMEOUT_S:g}; rank 0 compiles under that "
                        "variable, which gapserve serve sets from this flag)")


def compile_timeout_s(args: argparse.Namespace) -> float:
    """--structured-outputs-compile-timeout-s, else the variable, else the default."""
    value = getattr(args, "structured_outputs_compile_timeout_s", None)
    return value if value is not None else structured_output_compile_timeout_s()


# --- tensor parallelism (issue 17): how the ranks of one worker find each other
def add_tensor_parallel_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tensor parallelism (with --tensor-parallel-size > 1)")
    g.add_argument("--master-addr", default=None,
                   help="rank 0's host for the rendezvous (default: $MASTER_ADDR, "
                        "else 127.0.0.1)")
    g.add_argument("--master-port", type=port, default=None,
                   help="rendezvous port rank 0 listens on (default: $MASTER_PORT, "
                        "else 29500)")
    g.add_argument("--distributed-timeout", type=float, default=60.0,
                   help="seconds a collective or a peer's heartbeat may stall before "
                        "the group counts as lost and the rank exits")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl on CUDA, gloo on CPU")


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
        g.add_argument("--worker-addresses", type=address_groups, default="127.0.0.1:50053",
                       help="comma list of host:port, one per tensor-parallel rank; more "
                            "groups after ';' are spares the scheduler fails over to when "
                            "the active group is lost (docs/resilience.md)")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0)
    g.add_argument("--long-prefill-exempt-lone-request", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="the threshold does not cap a request that is alone (running + "
                        "waiting); --no-... applies it always, as vLLM does")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True)
    g.add_argument("--num-scheduler-steps", type=positive_int, default=1,
                   help="multi-step decode: while all running requests decode and none "
                        "waits, run up to this many forward passes per step, so each "
                        "gRPC message carries that many tokens a request (streams then "
                        "arrive in bursts of that many tokens); 1 = off "
                        "(docs/scheduling.md)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events in vLLM's format for prefix-aware routers, "
                        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv_events.md)')
    # resilience (docs/resilience.md)
    g.add_argument("--step-timeout-s", type=non_negative_float, default=120.0,
                   help="a step not answered within this many seconds means the worker is "
                        "lost (hung or stopped): requests are recomputed on a reconnected "
                        "one; 0 waits forever")


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
    add_tool_calling_flags(g)


# --- tool calling (issue 30, docs/tool_calling.md): vLLM's flags, read by the frontend
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def add_tool_calling_flags(g) -> None:
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=False,
                   help='let requests with tools use tool_choice "auto" (the default when '
                        "tools are sent): the reply is parsed with --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read out of a reply for tool_choice auto: "
                        "hermes (<tool_call>{...}</tool_call>), llama3_json")
    g.add_argument("--chat-template", type=readable_file, default=None, metavar="FILE",
                   help="a Jinja chat template replacing the model's; without it, "
                        "requests with tools use gapserve's tools-aware template for "
                        "ChatML models whose template ignores tools (SmolLM2)")
    g.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="accept a chat request's own chat_template (or "
                        "chat_template_kwargs.chat_template), rendered in the sandbox; "
                        "without it such a request is a 400, as in vLLM")
    add_structured_output_flags(g)


def tool_flags_problem(args: argparse.Namespace) -> str | None:
    """vLLM's rule, said before anything starts."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    return None


# ---------------------------------------------------------------------------
# security and admission control (docs/security.md)


def add_link_security_flags(parser: argparse.ArgumentParser) -> None:
    """TLS/mTLS for every gRPC link and the token the inner services require."""
    g = parser.add_argument_group("gRPC link security (every service)")
    g.add_argument("--tls-cert", default=None,
                   help="PEM certificate chain: served by gRPC servers, shown as the "
                        "client certificate under mTLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle: clients verify servers with it, and servers "
                        "require client certificates signed by it (mTLS)")
    g.add_argument("--internal-token", default=None,
                   help="shared secret the scheduler and workers require of their "
                        "callers (prefer the GAPSERVE_INTERNAL_TOKEN variable)")
    g.add_argument("--allow-insecure-inner", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="scheduler and worker: start on a non-loopback --host without "
                        "--internal-token or mTLS (only on a network you trust)")


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    """Client authentication and bounds on what one client may ask of the frontend."""
    g = parser.add_argument_group("client authentication and admission (frontend)")
    g.add_argument("--api-key", type=key_list, default=[],
                   help="comma list of accepted keys (Authorization: Bearer, gRPC "
                        "metadata); none = no authentication. Prefer GAPSERVE_API_KEY")
    g.add_argument("--priority-keys", type=key_list, default=[],
                   help="comma list of keys that may set a priority other than 0 "
                        "(also accepted as API keys)")
    g.add_argument("--prefix-cache-scope", choices=("key", "global"), default="key",
                   help="key: each API key has its own prefix cache (no key can probe "
                        "another's prompts through cached_tokens or latency); global: "
                        "all share one. A request's cache_salt scopes within its key")
    g.add_argument("--max-queued-requests", type=non_negative_int, default=1024,
                   help="requests (choices) let wait beyond the scheduler's "
                        "max-num-seqs, by this frontend and (under gapserve serve) by the "
                        "scheduler over all frontends; more get 429")
    g.add_argument("--payload-limit", type=positive_int, default=8 << 20,
                   help="largest HTTP request body in bytes (413 above)")
    g.add_argument("--max-client-batch-size", type=positive_int, default=128,
                   help="most prompts in one completion request")
    g.add_argument("--max-choices-per-request", type=positive_int, default=256,
                   help="most choices (prompts x n) one request may start")
    g.add_argument("--max-stop-sequences", type=positive_int, default=16,
                   help="most stop strings per request")
    g.add_argument("--max-stop-sequence-length", type=positive_int, default=256,
                   help="longest stop string in characters")
    g.add_argument("--max-stop-token-ids", type=positive_int, default=256,
                   help="most stop_token_ids per request")
    g.add_argument("--max-prompt-bytes", type=positive_int, default=None,
                   help="longest text prompt in UTF-8 bytes, checked before tokenizing "
                        "(default: max-model-len times the longest token's bytes)")
    g.add_argument("--tokenizer-threads", type=positive_int, default=2,
                   help="threads that tokenize and render chat templates off the "
                        "event loop")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    g.add_argument("--ssl-keyfile", default=None, help="private key of --ssl-certfile")


def add_scheduler_admission_flags(parser: argparse.ArgumentParser) -> None:
    """The scheduler's own bound, over every frontend (`gapserve serve` shares the
    frontend's flag of the same name)."""
    g = parser.add_argument_group("admission (scheduler)")
    g.add_argument("--max-queued-requests", type=non_negative_int, default=1024,
                   help="requests the scheduler lets wait beyond --max-num-seqs, counted "
                        "over all frontends; more are refused (RESOURCE_EXHAUSTED, "
                        "HTTP 429 at the frontend)")


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve worker", description="Run one worker rank.")
    add_common_flags(p)
    add_model_flag(p)
    add_worker_flags(p)
    add_limit_flags(p)
    add_link_security_flags(p)
    return p


def scheduler_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve scheduler", description="Run the scheduler.")
    add_common_flags(p)
    add_scheduler_flags(p)
    add_limit_flags(p)
    add_link_security_flags(p)
    add_scheduler_admission_flags(p)
    return p


def frontend_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve frontend", description="Run the frontend.")
    add_common_flags(p)
    add_frontend_flags(p)
    add_link_security_flags(p)
    add_admission_flags(p)
    add_data_parallel_routing_flags(p)
    return p


# ---------------------------------------------------------------------------
# data parallelism (issue 32; docs/deploy.md, "Data parallelism and routing"): N
# replicas, each a scheduler with its own workers, behind the frontend's routing


def endpoint_list(text: str) -> list[str]:
    """Comma-separated ZMQ endpoints (tcp://host:port, ipc://path)."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    for e in endpoints:
        if "://" not in e:
            raise argparse.ArgumentTypeError(f"{e!r} is not a ZMQ endpoint such as "
                                             f"tcp://host:5557")
    return endpoints


def routing_threshold(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def relative_threshold(text: str) -> float:
    value = float(text)
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text}")
    return value


def add_data_parallel_routing_flags(parser: argparse.ArgumentParser, *,
                                    with_addresses: bool = True) -> None:
    """The frontend's side: which replicas, where their KV events are, the rule."""
    g = parser.add_argument_group(
        "data-parallel routing (frontend; docs/deploy.md, \"Data parallelism and routing\")")
    if with_addresses:
        g.add_argument("--scheduler-addresses", type=address_list, default=None,
                       help="comma list of host:port, one scheduler per data-parallel "
                            "replica (replaces --scheduler-address); the frontend holds a "
                            "session to each and routes every request to one")
        g.add_argument("--kv-events-endpoints", type=endpoint_list, default=[],
                       help="comma list of ZMQ endpoints, each replica's KV event "
                            "publisher (its --kv-events-config endpoint, as reachable from "
                            "here), in the order of --scheduler-addresses")
        g.add_argument("--kv-events-replay-endpoints", type=endpoint_list, default=[],
                       help="the replay endpoints of the same publishers (fill sequence "
                            "gaps); optional, in the same order")
    g.add_argument("--data-parallel-routing", choices=("kv-aware", "round-robin"),
                   default="kv-aware",
                   help="kv-aware: the replica holding the longest cached prefix unless "
                        "the load is imbalanced (SGLang's cache-aware rule); round-robin: "
                        "in turn")
    g.add_argument("--routing-cache-threshold", type=routing_threshold, default=0.3,
                   help="kv-aware: the share of the prompt a replica's cached prefix must "
                        "exceed to win; below it the replica with the fewest cached blocks "
                        "takes the request (default: sglang-router 0.3.2's --cache-threshold)")
    g.add_argument("--routing-balance-abs-threshold", type=non_negative_int, default=64,
                   help="kv-aware: in-flight requests by which the busiest replica must "
                        "exceed the idlest (and ...; default: sglang-router 0.3.2's)")
    g.add_argument("--routing-balance-rel-threshold", type=relative_threshold, default=1.5,
                   help="... this many times the idlest's) for the idlest to take the "
                        "request whatever the caches hold (default: sglang-router 0.3.2's)")


def add_data_parallel_serve_flags(parser: argparse.ArgumentParser) -> None:
    """`gapserve serve`: how many replicas, and where each one's ports are."""
    g = parser.add_argument_group("data parallelism (gapserve serve)")
    g.add_argument("--data-parallel-size", type=positive_int, default=1,
                   help="independent scheduler + worker groups (replicas), each its own "
                        "scheduler and --tensor-parallel-size worker ranks; replica i "
                        "listens on every inner port + i x --data-parallel-port-stride "
                        "(scheduler, workers, their metrics, KV events); the frontend(s) "
                        "route between them")
    g.add_argument("--data-parallel-port-stride", type=positive_int, default=100,
                   help="port offset between consecutive replicas; more than "
                        "--tensor-parallel-size")
