"""A request with a structured output or tools is visible where an operator looks:
a counter by kind (and by tool_choice), one log line, and its span's attributes."""

from __future__ import annotations

from frontend_svc.request.choice import Choice
from frontend_svc.telemetry.observe import Observer
from frontend_svc.structured.response_format import Constraint
from frontend_svc.structured.tools import ToolPlan
from frontend_svc.request.translate import GenerationInput
from shared.structured.spec import StructuredOutputSpec
from shared.types import FinishReason, SamplingParams
from tests.observability.helpers import sample


def test_a_constrained_request_is_counted_logged_and_named_on_its_span(captured):
    cap = captured("frontend")
    spec = StructuredOutputSpec("json", '{"type": "array"}')
    inp = GenerationInput([1, 2, 3], SamplingParams(structured_output=spec),
                          constraint=Constraint(spec, "tools", "tool_choice"),
                          tool_plan=ToolPlan("required"), compile_s=0.0042)
    kinds = {"model_name": "m", "kind": "json", "source": "tool_choice"}
    before = sample("gapserve:structured_output_requests_total", **kinds)
    tools_before = sample("gapserve:tool_choice_requests_total", model_name="m",
                          tool_choice="required")
    observer = Observer("m")
    observer.constrained("chatcmpl-1", inp)
    observer.start(Choice("chatcmpl-1-0", inp, inp.params, operation="chat")).finish(
        FinishReason.STOP)
    assert sample("gapserve:structured_output_requests_total", **kinds) == before + 1
    assert sample("gapserve:tool_choice_requests_total", model_name="m",
                  tool_choice="required") == tools_before + 1
    [line] = [r for r in cap.logs() if r.get("event") == "constrained request"]
    assert (line["structured_output"], line["source"], line["tool_choice"],
            line["compile_ms"]) == ("json", "tool_choice", "required", 4.2)
    [span] = cap.spans()
    assert span.attributes["gapserve.request.structured_output"] == "json"
    assert span.attributes["gapserve.request.tool_choice"] == "required"


def test_a_plain_request_adds_nothing(captured):
    cap = captured("frontend")
    inp = GenerationInput([1], SamplingParams())
    Observer("m").constrained("cmpl-2", inp)
    Observer("m").start(Choice("cmpl-2-0", inp, inp.params)).finish(FinishReason.STOP)
    assert not [r for r in cap.logs() if r.get("event") == "constrained request"]
    assert "gapserve.request.structured_output" not in cap.spans()[0].attributes
