"""worker.proto <-> shared/types.py: the Step stream between scheduler and workers,
converted every step (scheduler_svc/worker_group.py, worker_svc/server.py)."""

from __future__ import annotations

from shared import types as t
from shared.proto import worker_pb2
from shared.wire.common import LOGPROBS
from shared.wire.mapper import columns, pair, tuple_shape, unwrap_shape

unwrap_shape(worker_pb2.BlockIds)  # proto has no list of lists: new_block_ids[i]
tuple_shape(worker_pb2.TokenCheck)  # (num_tokens, checksum)

NEW_REQUEST = pair(t.NewRequestData, worker_pb2.NewRequestData)
CACHED_REQUESTS = pair(t.CachedRequestData, worker_pb2.CachedRequestData)
TIMINGS = pair(t.StepTimings, worker_pb2.StepTimings)

# The core's dict {req_id: tokens} travels as two columns (proto maps have no order,
# and the worker batches in the scheduler's order).
SCHEDULER_OUTPUT = pair(
    t.SchedulerOutput, worker_pb2.SchedulerOutput,
    hand_to={"scheduled_req_ids": lambda o: list(o.num_scheduled_tokens),
             "num_scheduled_tokens": lambda o: list(o.num_scheduled_tokens.values()),
             "num_draft_slots": lambda o: [o.num_draft_slots.get(r, 0)
                                           for r in o.num_scheduled_tokens]
             if o.num_draft_slots else []},
    hand_from={"num_scheduled_tokens":
               lambda m: dict(zip(m.scheduled_req_ids, m.num_scheduled_tokens)),
               "num_steps": lambda m: max(m.num_steps, 1),  # 0 (unset) is one pass
               "num_draft_slots": lambda m: {r: d for r, d in zip(m.scheduled_req_ids,
                                                                  m.num_draft_slots) if d}})


def _sampled(o: t.ModelRunnerOutput) -> list[worker_pb2.SampledTokens]:
    logprobs = o.logprobs or [None] * len(o.req_ids)
    drafts = o.num_draft_tokens or [0] * len(o.req_ids)
    to = LOGPROBS.to_proto
    return [worker_pb2.SampledTokens(token_ids=ids, has_logprobs=lps is not None,
                                     logprobs=[to(x) for x in lps or ()],
                                     num_draft_tokens=nd)
            for ids, lps, nd in zip(o.sampled_token_ids, logprobs, drafts)]


def _columns(m: worker_pb2.ModelRunnerOutput) -> tuple[list, list, list]:
    """sampled_token_ids, logprobs, num_draft_tokens: one pass over the rows (each
    access to m.sampled wraps its elements anew)."""
    fr, ids, lps, drafts = LOGPROBS.from_proto, [], [], []
    for s in m.sampled:
        ids.append(list(s.token_ids))
        lps.append([fr(x) for x in s.logprobs] if s.has_logprobs else None)
        drafts.append(s.num_draft_tokens)
    return ids, lps, drafts if any(drafts) else []


# Column-wise in the core (req_ids[i], sampled_token_ids[i], logprobs[i]), row-wise on
# the wire (SampledTokens), where has_logprobs keeps "not asked" apart from "none".
RUNNER_OUTPUT = pair(
    t.ModelRunnerOutput, worker_pb2.ModelRunnerOutput, hand_to={"sampled": _sampled},
    hand_from=columns(_columns, "sampled_token_ids", "logprobs", "num_draft_tokens"))

scheduler_output_to_proto = SCHEDULER_OUTPUT.to_proto
scheduler_output_from_proto = SCHEDULER_OUTPUT.from_proto
timings_to_proto = TIMINGS.to_proto
timings_from_proto = TIMINGS.from_proto
runner_output_to_proto = RUNNER_OUTPUT.to_proto
runner_output_from_proto = RUNNER_OUTPUT.from_proto

UNPAIRED = {
    "HandshakeRequest": "two numbers read in place by worker_svc/server.py",
    "HandshakeResponse": "its ModelInfo is paired; rank and size are filled by name from "
                         "the worker's servicer (shared/wire/readout.py) and read in "
                         "place by scheduler_svc/worker_group.py",
    "SampledTokens": "the row-wise form of ModelRunnerOutput's columns: hand code above",
}
