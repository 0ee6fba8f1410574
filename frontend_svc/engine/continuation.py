"""How an open request survives the loss of the scheduler (docs/resilience.md):
its owner (request/choice.py) keeps the prompt, the parameters and every token
streamed so far. When a session to a (restarted) scheduler opens, or under data
parallelism when another replica takes over a lost one's requests
(replicas.py), each open request is re-submitted as a continuation: prompt +
generated tokens as the prompt, the remaining max_tokens, under a fresh wire id
(the old scheduler may still hold the old one for a moment), and num_output_prefix_tokens saying how much
of that prompt is output, so penalties and seeded draws go on where they were.
Greedy and seeded output continue exactly; the client's stream, detokenizer and
usage never see the seam."""

from __future__ import annotations

import dataclasses
import time

from shared.wire.common import sampling_to_proto
from shared.proto import engine_pb2

from frontend_svc.request.choice import Choice


def add_message(choice: Choice) -> engine_pb2.AddRequest:
    """The AddRequest for the current scheduler: the original request, or after a
    scheduler loss its continuation."""
    params, prompt = choice.params, choice.prompt_token_ids
    if choice.generated:
        done = len(choice.generated)
        prompt = prompt + choice.generated
        params = dataclasses.replace(
            params, max_tokens=params.max_tokens - done,
            min_tokens=max(0, params.min_tokens - done),
            num_output_prefix_tokens=params.num_output_prefix_tokens + done)
    add = engine_pb2.AddRequest(
        request_id=choice.wire_id, prompt_token_ids=prompt,
        sampling_params=sampling_to_proto(params), priority=choice.inp.priority,
        arrival_unix_s=time.time(), trace_context=choice.trace_context)
    if choice.cache_salt is not None:
        add.cache_salt = choice.cache_salt
    return add


def next_wire_id(choice: Choice) -> str:
    """A fresh id for a continuation: the old scheduler may still hold the old one."""
    choice.num_resumes += 1
    choice.wire_id = f"{choice.req_id}@resume{choice.num_resumes}"
    return choice.wire_id
