"""The HTTP side of scripts/compose-smoke.sh, standard library only (runs on the host,
outside the image):

    compose_smoke_client.py chat BASE_URL
    compose_smoke_client.py stream BASE_URL OUT.json [--started FILE] [--max-tokens N]
    compose_smoke_client.py same OUT.json REFERENCE.json

`stream` sends one greedy chat stream (ignore_eos, so it runs exactly max_tokens),
writes FILE once a few tokens have arrived (the cue to restart the worker), and
records what came back; it fails unless the stream ends with a finish reason and
[DONE] and no error event. `same` checks two recorded streams produced the same text.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.request

PROMPT = "Write a long story about a lighthouse keeper and the sea."
CUE_AFTER_CHUNKS = 8
TIMEOUT_S = 300


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                  headers={"Content-Type": "application/json"})


def chat(base: str) -> int:
    body = {"model": _model(base), "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    with urllib.request.urlopen(_post(f"{base}/chat/completions", body),
                                timeout=TIMEOUT_S) as resp:
        reply = json.load(resp)
    choice = reply["choices"][0]
    print(f"chat: {choice['message']['content']!r} finish_reason={choice['finish_reason']} "
          f"usage={reply['usage']}")
    return 0 if choice["message"]["content"].strip() else 1


def _model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def list_lines(resp):
    """The response's lines as they arrive (a generator, so reading stays lazy)."""
    with resp:
        yield from resp


def stream(base: str, out: str, started: str | None, max_tokens: int) -> int:
    body = {"model": _model(base), "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    text, chunks, finish, done, errors = [], 0, None, False, []
    gaps, last = [], time.monotonic()
    begin = last
    try:
        resp = urllib.request.urlopen(_post(f"{base}/chat/completions", body), timeout=TIMEOUT_S)
        lines = list_lines(resp)
    except (OSError, http.client.HTTPException) as exc:
        lines, errors = iter(()), [f"request failed: {exc}"]
    try:
        for raw in lines:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.monotonic()
                    if chunks:  # between tokens; the first one's wait is the TTFT
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
                    chunks += 1
                    if started and chunks == CUE_AFTER_CHUNKS:
                        open(started, "w").close()
                finish = choice.get("finish_reason") or finish
    except (OSError, http.client.HTTPException) as exc:  # the connection broke mid-stream
        errors.append(f"stream broke after {chunks} chunks: {exc!r}")
    record = {"text": "".join(text), "chunks": chunks, "finish_reason": finish, "done": done,
              "errors": errors, "seconds": round(time.monotonic() - begin, 2),
              "longest_gap_s": round(max(gaps, default=0.0), 2)}
    with open(out, "w") as f:
        json.dump(record, f)
    print(f"stream: {chunks} chunks in {record['seconds']} s, longest gap "
          f"{record['longest_gap_s']} s, finish_reason={finish}, [DONE]={done}, "
          f"errors={errors}")
    return 0 if done and finish == "length" and not errors else 1


def same(out: str, reference: str) -> int:
    got, want = (json.load(open(p)) for p in (out, reference))
    if got["text"] == want["text"]:
        print(f"same: the restarted stream's {got['chunks']} chunks equal the reference's")
        return 0
    k = next((i for i, (a, b) in enumerate(zip(got["text"], want["text"])) if a != b),
             min(len(got["text"]), len(want["text"])))
    print(f"same: the texts differ from character {k}:\n  got  {got['text'][k:k + 80]!r}\n"
          f"  want {want['text'][k:k + 80]!r}")
    return 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("chat").add_argument("base")
    s = sub.add_parser("stream")
    s.add_argument("base")
    s.add_argument("out")
    s.add_argument("--started")
    s.add_argument("--max-tokens", type=int, default=200)
    c = sub.add_parser("same")
    c.add_argument("out")
    c.add_argument("reference")
    args = parser.parse_args(argv)
    if args.cmd == "chat":
        return chat(args.base)
    if args.cmd == "stream":
        return stream(args.base, args.out, args.started, args.max_tokens)
    return same(args.out, args.reference)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
