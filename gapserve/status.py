"""`gapserve status`: the live capacity diagnosis of a running stack, read from
the frontend's GET /v1/status (or straight from the scheduler with --scheduler-address);
under data parallelism the sums over all replicas, then a line per replica.

It prints what runs and waits, the KV cache's use, which limit stopped admission,
and one diagnosis with its lever (scheduler_svc/diagnosis.py):
  healthy             nothing waits for capacity
  concurrency-capped  RUNNING is at --max-num-seqs: raise it if KV usage allows
  memory-capped       no free KV blocks: --kv-cache-memory / --gpu-memory-utilization,
                      or a shorter --max-model-len
  budget-capped       prefills take the step's token budget: --max-num-batched-tokens
  past capacity       requests are preempted: shed load or scale out
docs/tuning.md says which flag answers which symptom.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from shared import config as flags
from shared.flag_spec import add_flags
from shared.arg_types import key_list, port


def status_parser() -> argparse.ArgumentParser:
    # the whole docstring, its table's lines kept (argparse would re-wrap them)
    p = argparse.ArgumentParser(prog="gapserve status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None,
                   help="the frontend's HTTP address (default: http://127.0.0.1:<--http-port>)")
    # the same variable the frontend reads, so a shell set up for the stack asks it
    p.add_argument("--http-port", type=port, default=8000,
                   help="the frontend's HTTP port on this machine, when --url is not given")
    p.add_argument("--scheduler-address", default=None,
                   help="ask the scheduler's GetStatus instead (host:port)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument("--api-key", type=key_list, default=[],
                   help="for a frontend started with --api-key (the first key is sent)")
    add_flags(p, flags.LinkSecurityFlags)  # for --scheduler-address: TLS and the internal token
    return p


def from_scheduler(address: str, args=None) -> dict:
    from google.protobuf.json_format import MessageToDict

    from shared.link_security import LinkSecurity
    from shared.proto import engine_pb2, engine_pb2_grpc

    security = LinkSecurity.from_args(args) if args is not None else LinkSecurity()
    with security.channel(address) as channel:
        reply = engine_pb2_grpc.EngineStub(channel).GetStatus(
            engine_pb2.GetStatusRequest(), timeout=5.0, metadata=security.metadata)
    return MessageToDict(reply, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def from_frontend(url: str, api_key: str | None = None) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/v1/status")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=5.0) as reply:
        return json.load(reply)


def render(status: dict) -> str:
    lines = [f"diagnosis: {status.get('diagnosis', '?')}"]
    for key in ("summary", "lever"):
        if status.get(key):
            lines.append(f"  {key}: {status[key]}")
    for key, value in status.items():
        if key not in ("diagnosis", "summary", "lever", "replicas", "spec_decode") \
                and not key.startswith("spec_") and key != "speculative_config":
            lines.append(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}")
    lines += _spec_lines(status)
    lines += _replica_lines(status.get("replicas"))
    return "\n".join(lines)


def _spec_lines(status: dict) -> list[str]:
    """Speculative decoding (docs/spec_decode.md): the config and vLLM's acceptance
    figures, from the frontend's summary or the scheduler's raw counters."""
    if not status.get("speculative_config"):
        return ["speculative decoding: off"]
    from types import SimpleNamespace

    from shared.speculative_config import spec_decode_summary
    raw = {k: status.get(k, 0) for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                         "spec_num_accepted_tokens")}
    s = status.get("spec_decode") or spec_decode_summary(SimpleNamespace(
        speculative_config=status["speculative_config"],
        spec_num_accepted_tokens_per_pos=[int(n) for n in
                                          status.get("spec_num_accepted_tokens_per_pos", [])],
        **{k: int(v) for k, v in raw.items()}))
    lines = [f"speculative decoding: {s['config']}"]
    if s["acceptance_rate"] is None:
        return lines + ["  no drafts proposed yet"]
    per_pos = " ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"])
    lines.append(f"  acceptance rate {s['acceptance_rate']:.3f} ({s['num_accepted_tokens']} "
                 f"of {s['num_draft_tokens']} drafts), {s['mean_acceptance_length']:.2f} "
                 f"tokens per draft step; by position {per_pos}")
    return lines


def _replica_lines(rows: list[dict] | None) -> list[str]:
    """Data parallelism (frontend_svc/engine/replicas.py): one line per replica."""
    if not rows:
        return []
    out = [f"replicas: {sum(1 for r in rows if r.get('in_routing'))} of {len(rows)} in routing"]
    for r in rows:
        state = "in routing" if r.get("in_routing") else \
            "connected, not serving" if r.get("connected") else "lost"
        extra = "".join(f" {k}={r[k]}" for k in ("in_flight", "routed", "failovers",
                                                 "cached_blocks", "num_running",
                                                 "num_waiting", "kv_cache_usage", "diagnosis")
                        if r.get(k) is not None)
        out.append(f"  replica {r.get('replica')} {r.get('address')}: {state}{extra}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = flags.parse_args(status_parser(), argv)
    args.url = args.url or f"http://127.0.0.1:{args.http_port}"
    try:
        status = (from_scheduler(args.scheduler_address, args) if args.scheduler_address
                  else from_frontend(args.url, args.api_key[0] if args.api_key else None))
    except (OSError, urllib.error.URLError) as e:
        print(f"gapserve status: cannot reach {args.scheduler_address or args.url}: {e}",
              file=sys.stderr)
        return 1
    except Exception as e:  # grpc.RpcError: keep grpc out of the frontend path's imports
        print(f"gapserve status: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0
