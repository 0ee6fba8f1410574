"""Async scheduling on the real three-process stack and the real default model: a
concurrent workload with EOS stops, a stop token id, max_tokens, an abort
mid-stream, structured outputs (a JSON schema, any JSON object, a regex, a choice, a
Lark grammar), prefix-cache hits and preemptions forced by a small KV pool gives the
same greedy tokens with async scheduling on and off and with multi-step decode, and
the same as transformers for each prompt alone (a constrained one: with its grammar
as a logits processor, tests/structured/reference.py); each constrained request ends
with STOP on its grammar's end and parses; usage is exact and the KV pool ends fully
free. One worker serves the three modes in turn (a scheduler and frontend each):
the worker forgets every request when a scheduler's Step stream closes, so the next
scheduler starts from nothing, as after a scheduler restart."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from dataclasses import dataclass, field

import jsonschema
import pytest

from shared.wire.common import sampling_to_proto
from shared.structured import compile_cache as so
from shared.proto import common_pb2, engine_pb2, generate_pb2
from shared.structured.spec import StructuredOutputSpec as Spec
from shared.types import SamplingParams
from tests.integration.conftest import EXACT
from tests.integration.hf_reference import greedy_references, recorded_reference
from tests.structured.reference import GrammarLogitsProcessor, hf_constrained_greedy

# 13 usable blocks of 16 tokens. Preemption must not hang on arrival timing: the three
# "long" requests ignore EOS and each grow to ~123 tokens (8 blocks), so any two of them
# running at once need 16 blocks less the 2 shared system-prompt blocks, past the 13
# there are; only if each arrived after the others finished (about 88 steps apart) could
# they avoid preempting. The chat template's system prompt is a full block every prompt
# shares: prefix-cache hits.
STACK_FLAGS = ["--max-model-len", "128", "--num-gpu-blocks-override", "14", *EXACT]
ABORT_AFTER = 4  # tokens the aborted request streams before its client aborts it
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
LARK = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'


@dataclass(slots=True)
class Case:
    name: str
    question: str
    max_tokens: int = 24
    ignore_eos: bool = False
    stop_at: int | None = None  # stop on the greedy token at this index (a stop token id)
    abort: bool = False
    spec: Spec | None = None  # structured output: the reference applies it too
    prompt_ids: list[int] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)  # transformers greedy, alone
    stop_token_ids: list[int] = field(default_factory=list)


CASES = [
    Case("eos-math", "What is 2+2? Reply with just the number."),
    Case("eos-capital", "What is the capital of France?"),
    Case("stop-token", "Say hello.", stop_at=5),
    Case("length-haiku", "Write a haiku about rain."),
    Case("length-count", "Count from 1 to 5.", max_tokens=20),
    Case("length-water", "Is water wet? Answer yes or no."),
    Case("length-fruit", "Name a fruit. One word only.", max_tokens=16),
    Case("long-story", "Tell me a story.", max_tokens=88, ignore_eos=True),
    Case("long-ocean", "Describe the ocean.", max_tokens=88, ignore_eos=True),
    Case("long-moon", "Describe the moon.", max_tokens=88, ignore_eos=True),
    Case("abort", "What colour is the sky? One word.", max_tokens=64, ignore_eos=True,
         abort=True),
    Case("json-alice", "Give me a JSON object for a person named Alice who is 30.",
         max_tokens=40, spec=Spec("json", json.dumps(PERSON))),
    Case("json-bob", "Describe Bob, aged 41, as JSON.", max_tokens=40,
         spec=Spec("json", json.dumps(PERSON), disable_any_whitespace=True)),
    Case("json-object", "Describe the colour blue as a JSON object.", max_tokens=40,
         spec=Spec("json_object")),
    Case("regex-phone", "Make up a US phone number.", max_tokens=40, spec=Spec("regex", PHONE)),
    Case("choice", "Is the review 'I love this movie' positive, negative or neutral?",
         max_tokens=40, spec=Spec("choice", '["positive", "negative", "neutral"]')),
    Case("lark", "What is 2+2?", max_tokens=40, spec=Spec("grammar", LARK)),
]



@pytest.fixture(scope="module")
def workload():
    """Prompt ids and the transformers reference of every case, computed once, before
    any stack runs (so the reference has the cores to itself)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from shared.model_files.default_model import ensure_default_model

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    vocab = so.grammar_vocab(model_dir, AutoConfig.from_pretrained(str(model_dir)).vocab_size,
                             sorted(eos_ids))
    for case in CASES:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": case.question}],
                                            add_generation_prompt=True)
        case.prompt_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if case.spec is None:
            case.reference = greedy_references(model_dir, [case.prompt_ids],
                                               case.max_tokens)[0]
        else:  # recorded under the grammar and the length too
            spec = json.dumps(case.spec.key())
            case.reference = recorded_reference(
                model_dir, f"constrained {case.max_tokens} {spec} "
                + ",".join(map(str, case.prompt_ids)),
                lambda model, case=case: hf_constrained_greedy(
                    model, case.prompt_ids, case.max_tokens,
                    GrammarLogitsProcessor(case.spec, vocab), eos_ids))
        if case.stop_at is not None:
            token = case.reference[case.stop_at]
            case.stop_token_ids = [token]
    return model_dir, eos_ids, tokenizer


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


def expected_tokens(case: Case, eos_ids: set[int]) -> list[int]:
    """The greedy tokens up to and including the first EOS or stop token id."""
    out = []
    for token in case.reference[:case.max_tokens]:
        out.append(token)
        if (token in eos_ids and not case.ignore_eos) or token in case.stop_token_ids:
            break
    return out


def run_case(stub, case: Case) -> tuple[list[int], generate_pb2.GenerateFinal]:
    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                            ignore_eos=case.ignore_eos, stop_token_ids=case.stop_token_ids,
                            structured_output=case.spec)
    request = generate_pb2.GenerateRequest(
        request_id=f"{case.name}-{time.monotonic_ns()}",
        token_ids=generate_pb2.TokenIds(ids=case.prompt_ids),
        sampling_params=sampling_to_proto(params))
    tokens: list[int] = []
    aborted = False
    for msg in stub.Generate(request, timeout=600):
        tokens.extend(msg.token_ids)
        if msg.HasField("final"):
            return tokens, msg.final
        if case.abort and not aborted and len(tokens) >= ABORT_AFTER:
            stub.Abort(generate_pb2.AbortRequest(request_ids=[request.request_id]), timeout=30)
            aborted = True
    raise AssertionError(f"{case.name}: the stream ended without a final message")


def run_workload(stack, eos_ids: set[int]) -> dict[str, list[int]]:
    """All cases at once; checks each one's tokens, finish and usage; returns the tokens."""
    stub = stack.generation_stub()
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        results = list(pool.map(lambda c: run_case(stub, c), CASES))
    outputs = {}
    for case, (tokens, final) in zip(CASES, results):
        usage = final.usage
        assert usage.prompt_tokens == len(case.prompt_ids), case.name
        assert usage.completion_tokens == len(tokens), case.name
        assert usage.total_tokens == len(case.prompt_ids) + len(tokens), case.name
        if case.abort:
            assert final.finish_reason == common_pb2.FINISH_REASON_ABORT, case.name
            assert ABORT_AFTER <= len(tokens) < case.max_tokens, case.name
            assert tokens == case.reference[:len(tokens)], case.name
            continue
        expected = expected_tokens(case, eos_ids)
        assert tokens == expected, case.name
        stopped = ((expected[-1] in eos_ids and not case.ignore_eos)
                   or expected[-1] in case.stop_token_ids)
        assert final.finish_reason == (common_pb2.FINISH_REASON_STOP if stopped
                                       else common_pb2.FINISH_REASON_LENGTH), case.name
        if case.stop_token_ids:
            assert final.stop_token_id == case.stop_token_ids[0], case.name
        outputs[case.name] = tokens
    return outputs


def wait_pool_free(stack, timeout_s: float = 30.0) -> engine_pb2.EngineStatus:
    deadline = time.monotonic() + timeout_s
    while True:  # an abort frees its blocks on the scheduler's loop, just after the reply
        status = stack.engine_status()
        if status.num_free_blocks == status.num_kv_blocks - 1 and not status.num_running:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"the KV pool is not fully free: {status}")
        time.sleep(0.05)


@pytest.mark.e2e
def test_async_and_sync_scheduling_give_transformers_greedy_outputs_under_preemption(
        workload, start_stack_factory):
    model_dir, eos_ids, tokenizer = workload
    # the workload really has what it claims: EOS stops, a stop id, lengths, grammars
    # that end (and whose references parse)
    kinds = {c.name: expected_tokens(c, eos_ids)[-1] for c in CASES if not c.abort}
    assert sum(t in eos_ids for t in kinds.values()) >= 2
    finished = [c for c in CASES if c.spec is not None and c.reference[-1] in eos_ids]
    assert len(finished) >= 4, "the grammars should end most constrained cases"
    for case in finished:
        check_parses(case, tokenizer.decode(case.reference[:-1]))
    worker = start_stack_factory(model_dir, services=("worker",), flags=STACK_FLAGS)
    outputs = {}
    for mode, flags in (("async", ["--async-scheduling"]), ("sync", ["--no-async-scheduling"]),
                        ("multi-step", ["--async-scheduling", "--num-scheduler-steps", "4"])):
        stack = start_stack_factory(model_dir, services=("scheduler", "frontend"),
                                    flags=[*STACK_FLAGS, *flags,
                                           "--worker-port", str(worker.worker_port)])
        outputs[mode] = run_workload(stack, eos_ids)
        status = wait_pool_free(stack)
        assert status.num_preemptions_total > 0, mode
        assert status.prefix_cache_hits > 0, mode
        multi = status.num_forward_passes_total > status.num_steps_total
        assert multi == (mode == "multi-step"), (mode, status)
        stack.stop()
    assert outputs["async"] == outputs["sync"] == outputs["multi-step"]
