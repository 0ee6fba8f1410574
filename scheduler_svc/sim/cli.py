"""`gapserve sim`: capacity planning with the real scheduler and a simulated worker.

Every scheduler flag is accepted; a flag given as a comma list (--max-num-seqs 32,24,16)
sweeps it, one result row per setting (several swept flags: every combination).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from scheduler_svc.core import ConfigError, SchedulerConfig
from scheduler_svc.sim.report import json_safe, summarize, table
from scheduler_svc.sim.runner import simulate
from scheduler_svc.sim.step_model import (
    DEFAULT_FIXED_MS, DEFAULT_PER_PREFILL_TOKEN_MS, DEFAULT_PER_SEQ_MS, StepModel,
)
from scheduler_svc.sim.workload import WorkloadError, load_workload, make_requests


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _policy(text: str) -> str:
    if text not in ("fcfs", "priority"):
        raise ValueError(f"must be fcfs or priority, got {text!r}")
    return text


# flag -> (SchedulerConfig or StepModel field, or "pool" for the block count; type; help)
SWEEPABLE = {
    "max-num-seqs": ("max_num_seqs", int, "most requests running at once"),
    "max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of a step"),
    "max-model-len": ("max_model_len", int, "context length (prompt + output)"),
    "block-size": ("block_size", int, "tokens per KV block"),
    "long-prefill-token-threshold": ("long_prefill_token_threshold", int,
                                     "most tokens one request may take per step (0 = off)"),
    "scheduling-policy": ("policy", _policy, "fcfs or priority"),
    "num-scheduler-steps": ("num_scheduler_steps", int,
                            "multi-step decode: forward passes a step of decodes alone runs"),
    "num-gpu-blocks-override": ("pool", int,
                                "KV blocks in the pool (default: enough for max-num-seqs "
                                "requests of max-model-len, i.e. no memory pressure)"),
    "step-fixed-ms": ("fixed_ms", float, f"step-time model: fixed cost (default {DEFAULT_FIXED_MS})"),
    "step-per-seq-ms": ("per_seq_ms", float,
                        f"step-time model: cost per request in the step (default {DEFAULT_PER_SEQ_MS})"),
    "step-per-prefill-token-ms": ("per_prefill_token_ms", float,
                                  "step-time model: cost per prefill token "
                                  f"(default {DEFAULT_PER_PREFILL_TOKEN_MS})"),
}
BOOLEANS = {
    "enable-chunked-prefill": "enable_chunked_prefill",
    "enable-prefix-caching": "enable_prefix_caching",
    "async-scheduling": "async_scheduling",
    "long-prefill-exempt-lone-request": "long_prefill_exempt_lone_request",
}
STEP_FIELDS = {"fixed_ms", "per_seq_ms", "per_prefill_token_ms"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gapserve sim", description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, metavar="FILE",
                   help='JSON {"groups": [{name, count, arrival_ms, prompt_tokens, '
                        'output_tokens, priority?, shared_prefix_tokens?}]}')
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--target-itl-ms", type=float, metavar="T",
                   help="also print the token budget that keeps a step under T ms")
    p.add_argument("--hash-seed", default="sim", help="prefix-cache hash seed")
    for flag, (_, _, text) in SWEEPABLE.items():
        p.add_argument(f"--{flag}", metavar="V[,V...]", help=text)
    for flag in BOOLEANS:
        p.add_argument(f"--{flag}", nargs="?", const="true", metavar="BOOL[,BOOL...]",
                       help="true/false; a comma list sweeps it")
        p.add_argument(f"--no-{flag}", dest=flag.replace("-", "_"), action="store_const",
                       const="false")
    return p


def parse_sweeps(parser: argparse.ArgumentParser, args) -> dict[str, list]:
    """flag -> list of typed values, for every flag given on the command line."""
    given = {}
    kinds = {flag: kind for flag, (_, kind, _) in SWEEPABLE.items()}
    kinds.update({flag: _bool for flag in BOOLEANS})
    for flag, kind in kinds.items():
        text = getattr(args, flag.replace("-", "_"))
        if text is None:
            continue
        try:
            values = [kind(part.strip()) for part in text.split(",")]
        except ValueError as err:
            parser.error(f"--{flag} {text}: {err}")
        given[flag] = values
    return given


def settings_of(given: dict[str, list]):
    """Every combination of the given values, as {flag: value}."""
    flags = list(given)
    for combo in itertools.product(*(given[f] for f in flags)):
        yield dict(zip(flags, combo))


def configure(setting: dict, hash_seed: str) -> tuple[SchedulerConfig, int, StepModel]:
    # the simulated worker answers each step before the next is scheduled
    cfg = SchedulerConfig(hash_seed=hash_seed, async_scheduling=False)
    model = StepModel()
    pool = None
    for flag, value in setting.items():
        name = SWEEPABLE[flag][0] if flag in SWEEPABLE else BOOLEANS[flag]
        if name == "pool":
            pool = value
        elif name in STEP_FIELDS:
            setattr(model, name, value)
        else:
            setattr(cfg, name, value)
    cfg.validate()
    if pool is None:
        pool = 1 + cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
    return cfg, pool, model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = parse_sweeps(parser, args)
    swept = {f for f, values in given.items() if len(values) > 1}
    fixed = {f: values[0] for f, values in given.items() if f not in swept}
    try:
        groups = load_workload(args.workload)
        plans = []
        for setting in settings_of(given):
            cfg, pool, model = configure(setting, args.hash_seed)
            plans.append(({f: v for f, v in setting.items() if f in swept}, cfg, pool, model))
    except (WorkloadError, ConfigError) as err:
        print(f"gapserve sim: error: {err}", file=sys.stderr)
        return 2

    rows, budgets = [], []
    for shown, cfg, pool, model in plans:
        try:
            result = simulate(cfg, pool, make_requests(groups), model)
        except (ValueError, ConfigError) as err:  # e.g. a prompt longer than max-model-len
            print(f"gapserve sim: error with {shown or fixed}: {err}", file=sys.stderr)
            return 2
        row = summarize(shown, result)
        if args.target_itl_ms is not None:
            row["budget_for_target_itl"] = model.budget_for(args.target_itl_ms)
            budgets.append((shown, model, row["budget_for_target_itl"]))
        rows.append(row)

    if args.json:
        doc = {"results": rows, "fixed": fixed}
        if args.target_itl_ms is not None:
            doc["target_itl_ms"] = args.target_itl_ms
        print(json.dumps(json_safe(doc), indent=2))
        return 0
    if fixed:
        print("fixed: " + " ".join(f"--{f}={v}" for f, v in fixed.items()))
    print(table(rows))
    seen = set()
    for _, model, budget in budgets:
        key = (model.fixed_ms, model.per_prefill_token_ms)
        if key not in seen:
            seen.add(key)
            print(f"target ITL {args.target_itl_ms:g} ms: a step stays under it with "
                  f"--max-num-batched-tokens <= {budget} "
                  f"(({args.target_itl_ms:g} - {model.fixed_ms:g}) / {model.per_prefill_token_ms:g})")
    return 0
