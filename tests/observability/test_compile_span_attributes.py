"""Issue 30: what compiling a request's grammar cost at the frontend is on its
request span and its `constrained request` log line: the milliseconds and whether
the compiled-grammar cache had it. A real compile (the tiny model's vocabulary,
llguidance), through the route's own last step (translate.check_constraints)."""

from __future__ import annotations

import functools
import json
import uuid

from frontend_svc.request.choice import Choice
from frontend_svc.telemetry.observe import Observer
from frontend_svc.structured.response_format import Constraint
from frontend_svc.request.translate import GenerationInput, ModelLimits, check_constraints
from shared.structured.compile_cache import grammar_vocab
from shared.structured.spec import StructuredOutputSpec
from shared.types import FinishReason, SamplingParams
from tests.integration.tiny_model import tiny_llama_dir

COMPILE_MS = "gapserve.request.structured_output.compile_ms"
CACHE_HIT = "gapserve.request.structured_output.cache_hit"


def constrained_input(spec: StructuredOutputSpec) -> GenerationInput:
    return GenerationInput([1, 2, 3], SamplingParams(structured_output=spec),
                           constraint=Constraint(spec, "structured_outputs.json",
                                                 "structured_outputs"))


def test_compile_time_and_cache_hit_are_on_the_span_and_the_log_line(captured):
    cap = captured("frontend")
    limits = ModelLimits(512, 1024, grammar_vocab=functools.partial(grammar_vocab,
                                                                    tiny_llama_dir()))
    schema = {"type": "object", "required": [f"k{i}" for i in range(300)],
              "properties": {f"k{i}": {"type": "string", "pattern": f"^{uuid.uuid4().hex}$"}
                             for i in range(300)}}  # a miss: no cache has seen it
    spec = StructuredOutputSpec("json", json.dumps(schema))
    observer = Observer("m")
    for resp_id in ("cmpl-first", "cmpl-again"):
        [inp] = check_constraints([constrained_input(spec)], limits)
        observer.constrained(resp_id, inp)
        observer.start(Choice(f"{resp_id}-0", inp, inp.params)).finish(FinishReason.STOP)
    first, again = cap.spans()
    assert first.attributes[CACHE_HIT] is False and again.attributes[CACHE_HIT] is True
    assert first.attributes[COMPILE_MS] > 1.0  # 300 patterns: milliseconds at least
    assert again.attributes[COMPILE_MS] < first.attributes[COMPILE_MS]
    lines = {r["request_id"]: r for r in cap.logs() if r.get("event") == "constrained request"}
    assert (lines["cmpl-first"]["cache_hit"], lines["cmpl-again"]["cache_hit"]) == (False, True)
    assert abs(lines["cmpl-first"]["compile_ms"] - first.attributes[COMPILE_MS]) <= 0.01


def test_an_unconstrained_request_has_no_compile_attributes(captured):
    cap = captured("frontend")
    inp = GenerationInput([1], SamplingParams())
    Observer("m").start(Choice("cmpl-plain-0", inp, inp.params)).finish(FinishReason.STOP)
    assert COMPILE_MS not in cap.spans()[0].attributes
    assert CACHE_HIT not in cap.spans()[0].attributes
