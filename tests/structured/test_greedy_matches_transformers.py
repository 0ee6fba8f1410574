"""Greedy constrained output on the real default model equals transformers' greedy
output with the same grammar applied as a logits processor (tests/structured/
reference.py), for a JSON schema, any JSON object, a regex, a choice and a Lark
grammar, with async scheduling on and off and with multi-step decode, while long
unconstrained requests force preemptions in a small KV pool. Each constrained
request ends with finish reason STOP on the grammar's EOS and parses."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from dataclasses import dataclass, field

import jsonschema
import pytest

from shared import proto_convert as pc
from shared import structured_output as so
from shared.proto import common_pb2, generate_pb2
from shared.structured_output import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.integration.hf_reference import hf_greedy
from tests.structured.reference import GrammarLogitsProcessor, hf_constrained_greedy

# 13 usable blocks of 16 tokens: two long requests (~125 tokens each) cannot run at
# once, so each mode preempts (as tests/integration/test_async.py).
STACK_FLAGS = ["--max-model-len", "128", "--num-gpu-blocks-override", "14"]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
LARK = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'


@dataclass(slots=True)
class Case:
    name: str
    question: str
    spec: Spec | None = None
    max_tokens: int = 40
    prompt_ids: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)


CASES = [
    Case("json-alice", "Give me a JSON object for a person named Alice who is 30.",
         Spec("json", json.dumps(PERSON))),
    Case("json-bob", "Describe Bob, aged 41, as JSON.",
         Spec("json", json.dumps(PERSON), disable_any_whitespace=True)),
    Case("json-object", "Describe the colour blue as a JSON object.", Spec("json_object")),
    Case("regex-phone", "Make up a US phone number.", Spec("regex", PHONE)),
    Case("choice", "Is the review 'I love this movie' positive, negative or neutral?",
         Spec("choice", '["positive", "negative", "neutral"]')),
    Case("lark", "What is 2+2?", Spec("grammar", LARK)),
    Case("long-story", "Tell me a story.", max_tokens=88),
    Case("long-ocean", "Describe the ocean.", max_tokens=88),
    Case("long-moon", "Describe the moon.", max_tokens=88),
]


@pytest.fixture(scope="module")
def workload():
    """Prompt ids and the transformers references, computed before any stack runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.default_model import ensure_default_model

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    vocab = so.grammar_vocab(model_dir, model.config.vocab_size, sorted(eos_ids))
    for case in CASES:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": case.question}],
                                            add_generation_prompt=True)
        case.prompt_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if case.spec is None:
            case.reference = hf_greedy(model, case.prompt_ids, case.max_tokens)
        else:
            case.reference = hf_constrained_greedy(
                model, case.prompt_ids, case.max_tokens,
                GrammarLogitsProcessor(case.spec, vocab), eos_ids)
    return model_dir, eos_ids, tokenizer


def run_case(stub, case: Case):
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                            ignore_eos=case.spec is None, structured_output=case.spec)
    request = generate_pb2.GenerateRequest(
        request_id=f"{case.name}-{time.monotonic_ns()}",
        token_ids=generate_pb2.TokenIds(ids=case.prompt_ids),
        sampling_params=pc.sampling_to_proto(params))
    tokens = []
    for msg in stub.Generate(request, timeout=600):
        tokens.extend(msg.token_ids)
        if msg.HasField("final"):
            return tokens, msg.final
    raise AssertionError(f"{case.name}: no final message")


def check_parses(case: Case, text: str) -> None:
    kind = case.spec.kind
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in ("positive", "negative", "neutral")
    else:
        assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text


@pytest.mark.e2e
def test_constrained_greedy_equals_transformers_async_sync_multistep_under_preemption(
        workload, start_stack_factory):
    model_dir, eos_ids, tokenizer = workload
    finished = [c for c in CASES if c.spec is not None and c.reference[-1] in eos_ids]
    assert len(finished) >= 4, "the grammars should end most constrained cases"
    for case in finished:
        check_parses(case, tokenizer.decode(case.reference[:-1]))
    outputs = {}
    for mode, flags in (("async", ["--async-scheduling"]), ("sync", ["--no-async-scheduling"]),
                        ("multi-step", ["--async-scheduling", "--num-scheduler-steps", "4"])):
        stack = start_stack_factory(model_dir, flags=STACK_FLAGS + flags)
        stub = stack.generation_stub()
        with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
            results = list(pool.map(lambda c: run_case(stub, c), CASES))
        for case, (tokens, final) in zip(CASES, results):
            assert tokens == case.reference, (mode, case.name)
            stopped = case.spec is not None and tokens[-1] in eos_ids
            assert final.finish_reason == (common_pb2.FINISH_REASON_STOP if stopped
                                           else common_pb2.FINISH_REASON_LENGTH), case.name
        outputs[mode] = [tokens for tokens, _ in results]
        status = stack.engine_status()
        assert status.num_preemptions_total > 0, mode
        stack.stop()
    assert outputs["async"] == outputs["sync"] == outputs["multi-step"]
