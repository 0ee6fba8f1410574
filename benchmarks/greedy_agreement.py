"""How closely a server's greedy output follows transformers' fp32 greedy output.

    python benchmarks/greedy_agreement.py --base-url http://127.0.0.1:8000/v1 [--prompts 8]

The reference is transformers' `generate` (do_sample off, float32) on the chat-templated
essay prompts (`--endpoint completions`: the plain prompts, for a model without a chat
template), run once and cached as JSON (`--reference-cache`). For a GGUF view directory
(gapserve's, holding gguf_source.json) the reference model is transformers'
`from_pretrained(dir, gguf_file=...)` load of that file, dequantized to float32. Each server answers
the same chat requests at temperature 0 with the same max_tokens; both texts are
tokenized with the checkpoint's tokenizer and compared token by token. Reported: how
many answers are identical, and the share of reference tokens matched before the first
difference (averaged over prompts). A lower-precision model (bf16 weights, a Q8_0 GGUF)
typically follows the reference for a while and then takes another near-tied token;
the prefix share says how long "a while" is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx

PROMPT = "Write an extremely detailed essay about the number {i}."


def prompts(n: int) -> list[str]:
    return [PROMPT.format(i=i) for i in range(n)]


def load_model(model_dir: str):
    """transformers' float32 model of a checkpoint directory, or of the GGUF a view
    directory reads its weights from (dequantized, as gapserve's exact path does)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
    from shared.model_files.gguf_model import gguf_source

    source = gguf_source(Path(model_dir))
    if source is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                dtype=torch.float32).eval()


def prompt_ids(tok, text: str, endpoint: str = "chat") -> list[int]:
    """The prompt's token ids as the servers build them: the chat template with the
    generation prompt, or the plain text with the tokenizer's special tokens."""
    if endpoint == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True)
    else:
        ids = tok(text)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def reference(model_dir: str, texts: list[str], max_tokens: int,
              endpoint: str = "chat") -> list[str]:
    """transformers' greedy answers in float32 (EOS ends an answer, as for the servers)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([prompt_ids(tok, text, endpoint)])
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
            out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def cached_reference(model_dir: str, texts: list[str], max_tokens: int,
                     cache: Path | None, endpoint: str = "chat") -> list[str]:
    key = {"model": str(Path(model_dir).resolve()), "prompts": texts, "max_tokens": max_tokens}
    if endpoint != "chat":  # keys of chat references recorded before stay valid
        key["endpoint"] = endpoint
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["answers"]
    answers = reference(model_dir, texts, max_tokens, endpoint)
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "answers": answers}, indent=1) + "\n")
    return answers


def server_answers(base_url: str, texts: list[str], max_tokens: int,
                   endpoint: str = "chat") -> list[str]:
    model = httpx.get(base_url + "/models", timeout=30).json()["data"][0]["id"]
    out = []
    for text in texts:
        if endpoint == "chat":
            reply = httpx.post(base_url + "/chat/completions", timeout=300, json={
                "model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0})
            reply.raise_for_status()
            out.append(reply.json()["choices"][0]["message"]["content"] or "")
        else:
            reply = httpx.post(base_url + "/completions", timeout=300, json={
                "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0})
            reply.raise_for_status()
            out.append(reply.json()["choices"][0]["text"] or "")
    return out


def compare(model_dir: str, ref: list[str], got: list[str]) -> dict:
    """identical answers, and the mean share of reference tokens before the first
    difference (1.0 when identical)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    shares, identical = [], 0
    for r, g in zip(ref, got):
        a = tok.encode(r, add_special_tokens=False).ids
        b = tok.encode(g, add_special_tokens=False).ids
        same = 0
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
        identical += a == b
        shares.append(1.0 if a == b else same / max(len(a), 1))
    return {"prompts": len(ref), "identical": identical,
            "prefix_share": statistics.fmean(shares) if shares else None}


def measure(base_url: str, model_dir: str, n: int, max_tokens: int,
            cache: Path | None, endpoint: str = "chat") -> dict:
    texts = prompts(n)
    ref = cached_reference(model_dir, texts, max_tokens, cache, endpoint)
    result = compare(model_dir, ref, server_answers(base_url, texts, max_tokens, endpoint))
    result["max_tokens"] = max_tokens
    result["endpoint"] = endpoint
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="the server to compare (OpenAI API)")
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"),
                   help="a checkpoint directory, or gapserve's view directory of a GGUF")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="completions: the essay prompts as plain text (no chat template)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reference-cache", type=Path, default=None)
    p.add_argument("--reference-only", action="store_true",
                   help="only compute (and cache) transformers' answers")
    args = p.parse_args(argv)
    if args.reference_only:
        cached_reference(args.model, prompts(args.prompts), args.max_tokens,
                         args.reference_cache, args.endpoint)
        return 0
    if args.base_url is None:
        p.error("--base-url is needed unless --reference-only")
    result = measure(args.base_url, args.model, args.prompts, args.max_tokens,
                     args.reference_cache, args.endpoint)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
