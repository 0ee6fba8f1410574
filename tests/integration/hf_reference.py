"""The transformers reference that greedy outputs are compared against."""

import functools
from pathlib import Path

import torch

from shared.model_files.gguf_model import gguf_source


def load_reference(model_dir):
    """transformers' float32 model of a checkpoint directory, or of the GGUF a view
    directory serves (the default model's: `gguf_file=`, dequantized as we do)."""
    from transformers import AutoModelForCausalLM
    source = gguf_source(Path(model_dir))
    if source is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy choice for n steps, EOS included (as with ignore_eos):
    a plain argmax loop, since generate() would suppress EOS under min_new_tokens."""
    ids, out, cache = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(n):
            step = model(ids if cache is None else ids[:, -1:], cache=cache, use_cache=True)
            cache = step.cache
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


# ---------------------------------------------------------------------------
# recorded references: transformers' greedy ids, computed once per checkpoint and
# library version and kept in tests/data, so the suite does not re-run the same
# reference forward passes in five files (the default model's costs ~20 s to load
# from its GGUF and ~1 s a prompt to decode). A case not recorded, or recorded under
# another checkpoint, transformers or torch version, is computed live: the recording
# can make a test faster, never decide its outcome. To record (after a library bump,
# or for new cases), run the tests that read them once, on one process:
#   GAPSERVE_RECORD_REFERENCES=1 .venv/bin/python -m pytest -p no:xdist \
#       tests/integration/test_openai_api.py tests/spec/test_spec_default_model.py \
#       tests/integration/test_async.py
# tests/worker/test_default_model.py recomputes a sample of what is recorded.

RECORDED = Path(__file__).resolve().parents[1] / "data" / "greedy_references.json"
RECORD_ENV = "GAPSERVE_RECORD_REFERENCES"  # set: misses are computed and added


@functools.cache
def reference_key(model_dir) -> str:
    """What a recorded reference depends on: the weights' bytes and the libraries."""
    import hashlib

    import transformers
    source = gguf_source(Path(model_dir))
    files = [source] if source is not None else sorted(
        p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".json"))
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return f"{digest.hexdigest()[:32]} transformers={transformers.__version__} " \
           f"torch={torch.__version__}"


_live: dict[str, object] = {}


def recorded_reference(model_dir, case: str, compute, usable=lambda ids: True) -> list[int]:
    """The ids recorded for `case` of this checkpoint, or compute(transformers' model)
    (and record them when RECORD_ENV is set). `case` names everything else the ids
    depend on (the prompt, a length, a grammar); usable(ids) may refuse a recording
    (one too short for the length asked)."""
    import json
    import os
    key = str(reference_key(model_dir))
    book = json.loads(RECORDED.read_text()) if RECORDED.is_file() else {}
    recorded = book.get(key, {}).get(case)
    if recorded is not None and usable(recorded):
        return recorded
    if key not in _live:
        _live[key] = load_reference(model_dir)
    ids = compute(_live[key])
    if os.environ.get(RECORD_ENV):
        book.setdefault(key, {})[case] = ids
        RECORDED.write_text(json.dumps(book, indent=0, sort_keys=True) + "\n")
    return ids


def greedy_references(model_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, n tokens, EOS included
    and not stopping (hf_greedy); `until_eos` cuts one where generate() would stop.
    Recorded under the prompt's ids alone (a longer recording serves a shorter n)."""
    return [recorded_reference(model_dir, ",".join(map(str, prompt)),
                               lambda model, prompt=prompt: hf_greedy(model, prompt, n),
                               usable=lambda ids: len(ids) >= n)[:n]
            for prompt in prompts]


def until_eos(ids: list[int], eos) -> list[int]:
    """ids up to and including the first EOS (generate()'s greedy output)."""
    stops = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(ids):
        if t in stops:
            return ids[:i + 1]
    return ids
