"""What the frontend keeps of each open request so it survives the loss of the
scheduler (docs/resilience.md): the prompt, the parameters and every token
streamed so far. When a session to a (restarted) scheduler opens, or under data
parallelism when another replica takes over a lost one's requests
(replicas.py), each open request is re-submitted as a continuation: prompt +
generated tokens as the prompt, the remaining max_tokens, under a fresh wire id
(the old scheduler may still hold the old one for a moment), and num_output_prefix_tokens saying how much
of that prompt is output, so penalties and seeded draws go on where they were.
Greedy and seeded output continue exactly; the client's stream, detokenizer and
usage never see the seam."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from shared.wire.common import sampling_to_proto
from shared.proto import engine_pb2
from shared.types import RequestOutput, SamplingParams


@dataclass(slots=True)
class OpenRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)
    cache_salt: str | None = None
    generated: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # as the first scheduler reported it
    wire_id: str = ""  # the id the current scheduler knows it by
    num_resumes: int = 0

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.req_id

    def seen(self, out: RequestOutput) -> RequestOutput:
        """Record an output's tokens; report it under the client's id and counts."""
        self.generated.extend(out.new_token_ids)
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        out.req_id = self.req_id
        out.num_cached_tokens = self.num_cached_tokens  # of the client's own prompt
        return out

    def add_message(self) -> engine_pb2.AddRequest:
        """The AddRequest for the current scheduler: the original request, or after a
        scheduler loss its continuation."""
        params, prompt = self.params, self.prompt_token_ids
        if self.generated:
            done = len(self.generated)
            prompt = prompt + self.generated
            params = dataclasses.replace(
                params, max_tokens=params.max_tokens - done,
                min_tokens=max(0, params.min_tokens - done),
                num_output_prefix_tokens=params.num_output_prefix_tokens + done)
        add = engine_pb2.AddRequest(
            request_id=self.wire_id, prompt_token_ids=prompt,
            sampling_params=sampling_to_proto(params), priority=self.priority,
            arrival_unix_s=time.time(), trace_context=self.trace_context)
        if self.cache_salt is not None:
            add.cache_salt = self.cache_salt
        return add

    def next_wire_id(self) -> str:
        self.num_resumes += 1
        self.wire_id = f"{self.req_id}@resume{self.num_resumes}"
        return self.wire_id
