"""Write tests/data/gemma3_270m_reference.json: transformers' own greedy token ids for
Gemma 3 270M Q4_K_M (AutoModelForCausalLM.from_pretrained(dir, gguf_file=...),
dequantized, float32), for each prompt as plain text (the file is the base model and
carries no chat template), BOS first as its tokenizer adds it. The e2e test
(tests/integration/test_gemma3_gguf.py) compares gapserve's served tokens to them.

    GAPSERVE_GEMMA3_WHEELS=... python tests/data/make_gemma3_reference.py
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared.model_files.gemma3_270m import ensure_gemma3_270m  # noqa: E402

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):",
           "The three primary colors are"]
MAX_TOKENS = 24
OUT = Path(__file__).with_name("gemma3_270m_reference.json")


def main() -> None:
    path = ensure_gemma3_270m()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=None)
        completion = out[0, len(ids):].tolist()
        cases.append({"prompt": prompt, "prompt_ids": ids, "completion_ids": completion,
                      "completion_text": tok.decode(completion)})
    OUT.write_text(json.dumps({"model": path.name, "max_tokens": MAX_TOKENS,
                               "cases": cases}, indent=1) + "\n")
    print(OUT)


if __name__ == "__main__":
    main()
