"""Cost of the wire mapping (shared/wire/) on the hot paths: the Step stream
converts a SchedulerOutput and a ModelRunnerOutput every step, the Session stream a
RequestOutput per request per step. Both directions, CPU time of this thread per
conversion: the best of --repeats runs (on a shared machine the minimum is what the
code costs; a median also counts the neighbours).

    .venv/bin/python benchmarks/wire_convert.py [--reqs 256] [--steps 200] [--outputs 10000]

--baseline FILE times another module with the same function names beside it, runs
interleaved (e.g. the hand-written mapping before shared/wire/:
`git show e24c3d1:shared/proto_convert.py > /tmp/hand.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from types import SimpleNamespace

from shared.wire import engine, worker
from shared import types as t

# the functions timed, by the names a --baseline module has too
OURS = SimpleNamespace(**{name: getattr(module, name) for module, names in (
    (worker, ("scheduler_output_to_proto", "scheduler_output_from_proto",
              "runner_output_to_proto", "runner_output_from_proto")),
    (engine, ("request_output_to_proto", "request_output_from_proto"))) for name in names})


def decode_step(n: int, new: int) -> t.SchedulerOutput:
    """n running decodes (a new block now and then) and `new` fresh prefills."""
    cached = t.CachedRequestData()
    for i in range(n):
        cached.append(f"req-{i}", False, [i] if i % 16 == 0 else [], 300 + i)
    sp = t.SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9, seed=1234,
                          stop_token_ids=[2])
    news = [t.NewRequestData(f"new-{j}", list(range(128)), sp, list(range(8)), 0,
                             {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
            for j in range(new)]
    sched = {f"req-{i}": 1 for i in range(n)} | {f"new-{j}": 128 for j in range(new)}
    return t.SchedulerOutput(step_id=7, scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                             num_scheduled_tokens=sched,
                             total_num_scheduled_tokens=sum(sched.values()),
                             finished_req_ids={"old-1", "old-2"})


def runner_output(n: int) -> t.ModelRunnerOutput:
    return t.ModelRunnerOutput(step_id=7, req_ids=[f"req-{i}" for i in range(n)],
                               sampled_token_ids=[[i] for i in range(n)],
                               logprobs=[None] * n, timings=t.StepTimings(1.0, 2.0, 0.5))


def per_call_us(fn, arg, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        c0 = time.thread_time_ns()
        for _ in range(calls):
            fn(arg)
        runs.append((time.thread_time_ns() - c0) / calls / 1e3)
    return min(runs)


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_convert", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(pc, n: int, k: int, outputs: int) -> list:
    step, prefill = decode_step(n, 4), decode_step(0, n)
    ro = t.RequestOutput("req-1", [42], finish_reason=None, num_cached_tokens=16)
    ro_end = t.RequestOutput("req-1", [2], finish_reason=t.FinishReason.STOP, stop_token_id=2)
    mro = runner_output(n)
    return [
        (f"SchedulerOutput {n} decodes + 4 new  to_proto", pc.scheduler_output_to_proto, step, k),
        (f"SchedulerOutput {n} decodes + 4 new  from_proto", pc.scheduler_output_from_proto,
         pc.scheduler_output_to_proto(step), k),
        (f"SchedulerOutput {n} new requests     to_proto", pc.scheduler_output_to_proto,
         prefill, k),
        (f"SchedulerOutput {n} new requests     from_proto", pc.scheduler_output_from_proto,
         pc.scheduler_output_to_proto(prefill), k),
        (f"ModelRunnerOutput {n} tokens         to_proto", pc.runner_output_to_proto, mro, k),
        (f"ModelRunnerOutput {n} tokens         from_proto", pc.runner_output_from_proto,
         pc.runner_output_to_proto(mro), k),
        ("RequestOutput (running)            to_proto", pc.request_output_to_proto, ro,
         outputs),
        ("RequestOutput (finished)           from_proto", pc.request_output_from_proto,
         pc.request_output_to_proto(ro_end), outputs),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--outputs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="a module file with the same functions")
    args = parser.parse_args()
    ours = cases(OURS, args.reqs, args.steps, args.outputs)
    base = cases(load(args.baseline), args.reqs, args.steps, args.outputs) \
        if args.baseline else [None] * len(ours)
    print(f"{'':52s} {'shared/wire':>14s}" + (f" {'baseline':>14s}" if args.baseline else ""))
    for mine, theirs in zip(ours, base):
        name, fn, arg, calls = mine
        a, b = [], []
        for _ in range(args.repeats):  # interleaved: both see the same machine load
            a.append(per_call_us(fn, arg, calls, 1))
            if theirs:
                b.append(per_call_us(theirs[1], theirs[2], calls, 1))
        line = f"{name:52s} {min(a):10.2f} us"
        if theirs:
            line += f" {min(b):10.2f} us  ({min(a) / min(b):.2f}x)"
        print(line)

if __name__ == "__main__":
    main()
