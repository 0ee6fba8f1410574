"""A quantized path's numerical cost: how far a server's chosen tokens' logprobs sit
from the exact float32 model's, on the server's own greedy answers.

    python benchmarks/logprob_gap.py --base-url http://127.0.0.1:8000/v1 \
        --model DIR_OR_GGUF_VIEW [--prompts 8] [--max-tokens 64]

Each server answers the greedy_agreement prompts at temperature 0 with `logprobs`
(both gapserve and llama-server report them from the raw logits: a log-softmax over
the whole vocabulary, before any sampling setting). The reference, transformers'
float32 model (the dequantized GGUF for a GGUF view: greedy_agreement.load_model),
then reads the same prompt followed by the server's own answer in one forward pass,
so every position compares the two models in the same context, also after their
greedy answers have parted. Reported over all answered tokens: the mean and max
absolute difference of the chosen token's logprob, and top-1 agreement (the share of
positions where the reference's most likely token is the one the server chose).

Greedy agreement (greedy_agreement.py) says where two answers part; this says how
large the numerical difference is that made them part, and stays meaningful after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import greedy_agreement  # noqa: E402


def server_logprobs(base_url: str, texts: list[str], max_tokens: int,
                    endpoint: str = "chat") -> list[list[dict]]:
    """Per prompt, the greedy answer's tokens: {"token", "id" (None where the server
    gives none), "logprob"}. Asks for vLLM's `return_tokens_as_token_ids` (gapserve
    and vLLM name each token "token_id:<id>" then; llama-server ignores the field and
    gives its `id`), so no token is matched by its text."""
    model = httpx.get(base_url + "/models", timeout=30).json()["data"][0]["id"]
    out = []
    for text in texts:
        if endpoint == "chat":
            body = {"messages": [{"role": "user", "content": text}], "logprobs": True,
                    "top_logprobs": 1}
            path = "/chat/completions"
        else:
            body, path = {"prompt": text, "logprobs": 1}, "/completions"
        reply = httpx.post(base_url + path, timeout=300, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0,
            "return_tokens_as_token_ids": True, **body})
        reply.raise_for_status()
        out.append(parse_logprobs(reply.json()["choices"][0].get("logprobs")))
    return out


def parse_logprobs(logprobs: dict | None) -> list[dict]:
    """A choice's logprobs in either OpenAI shape: chat's `content` list (llama-server
    uses it for completions too, with the token `id`) or completions' legacy columns."""
    if not logprobs:
        return []
    if "content" in logprobs:
        return [{"token": e["token"], "id": e.get("id", _named_id(e["token"])),
                 "logprob": e["logprob"]} for e in logprobs["content"] or []]
    return [{"token": t, "id": _named_id(t), "logprob": lp}
            for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]


def _named_id(token: str) -> int | None:
    """The id in a "token_id:<id>" name (return_tokens_as_token_ids), else None."""
    name, _, digits = token.partition("token_id:")
    return int(digits) if not name and digits.isdigit() else None


def token_ids(tokenizer, answer: list[dict]) -> list[int]:
    """The answer's token ids: the server's own where given, else the one id whose
    text alone is the token's (as gapserve's logprobs write it: decode of one id);
    stops at the first token no single id matches (a partial UTF-8 byte's U+FFFD)."""
    by_text = _ids_by_text(tokenizer)
    ids = []
    for entry in answer:
        token_id = entry["id"] if entry["id"] is not None else by_text.get(entry["token"])
        if token_id is None:
            break
        ids.append(token_id)
    return ids


_BY_TEXT: dict[int, dict[str, int]] = {}


def _ids_by_text(tokenizer) -> dict[str, int]:
    """text of one token -> its id, for the texts exactly one id decodes to."""
    if id(tokenizer) not in _BY_TEXT:
        seen: dict[str, int | None] = {}
        for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
            text = tokenizer.decode([i], skip_special_tokens=False)
            seen[text] = None if text in seen else i
        _BY_TEXT[id(tokenizer)] = {t: i for t, i in seen.items() if i is not None}
    return _BY_TEXT[id(tokenizer)]


def reference_logprobs(model, prompt_ids: list[int], answer_ids: list[int]
                       ) -> tuple[list[float], list[int]]:
    """The reference model's logprob of each answer token after the prompt and the
    answer before it, and its own most likely token there (one forward pass)."""
    import torch

    if not answer_ids:
        return [], []
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    # position p predicts token p + 1: the answer's tokens are predicted from p - 1 on
    at = logits[len(prompt_ids) - 1:-1].log_softmax(-1)
    chosen = torch.tensor(answer_ids)
    return (at.gather(1, chosen[:, None])[:, 0].tolist(), at.argmax(-1).tolist())


def gap(answers: list[tuple[list[float], list[int], list[float], list[int]]]) -> dict:
    """Over every token of every answer (server logprobs, server ids, reference
    logprobs, reference top-1 ids): mean and max |server - reference| logprob, and
    the share of tokens whose reference top-1 is the server's choice."""
    diffs, agree = [], 0
    for lps, ids, ref_lps, ref_top in answers:
        diffs += [abs(a - b) for a, b in zip(lps, ref_lps)]
        agree += sum(a == b for a, b in zip(ids, ref_top))
    if not diffs:
        return {"tokens": 0, "mean_abs_diff": None, "max_abs_diff": None,
                "top1_agreement": None}
    return {"tokens": len(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "max_abs_diff": max(diffs), "top1_agreement": agree / len(diffs)}


def score(model_dir: str, texts: list[str], endpoint: str,
          servers: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Each server's answers (server_logprobs) against the reference: name -> gap."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    fast = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = greedy_agreement.load_model(model_dir)
    prompt_ids = [greedy_agreement.prompt_ids(tok, t, endpoint) for t in texts]
    out = {}
    for name, answers in servers.items():
        rows = []
        for prompt, answer in zip(prompt_ids, answers):
            ids = token_ids(fast, answer)
            ref_lps, ref_top = reference_logprobs(model, prompt, ids)
            rows.append(([e["logprob"] for e in answer[:len(ids)]], ids, ref_lps, ref_top))
        result = gap(rows)
        result["unmatched_tokens"] = sum(len(a) for a in answers) - result["tokens"]
        out[name] = result
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="the server to measure (OpenAI API)")
    p.add_argument("--model", default=str(Path.home() / ".cache/gapserve/SmolLM2-135M-Instruct"),
                   help="a checkpoint directory, or gapserve's view directory of a GGUF")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--score", type=Path, default=None, metavar="ANSWERS_JSON",
                   help="score saved answers instead ({name: server_logprobs output}); "
                        "prints {name: gap}")
    args = p.parse_args(argv)
    texts = greedy_agreement.prompts(args.prompts)
    if args.score is not None:
        servers = json.loads(args.score.read_text())
    elif args.base_url is not None:
        servers = {args.base_url: server_logprobs(args.base_url, texts, args.max_tokens,
                                                  args.endpoint)}
    else:
        p.error("--base-url or --score is needed")
    json.dump(score(args.model, texts, args.endpoint, servers), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
