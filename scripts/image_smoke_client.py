"""The inside half of scripts/image-smoke.sh: run in the container (`docker exec -i
NAME python - TIMEOUT < this file`), standard library only.

Waits until the frontend answers /health (its scheduler and worker ready) within
TIMEOUT seconds, then sends one greedy chat completion twice: the answer must name
Paris, end with a finish reason, and be the same both times (greedy). Exit 1 otherwise.
Then prints each gapserve process's resident memory (VmRSS).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
import urllib.error
import urllib.request

BASE = "http://127.0.0.1:8000"
QUESTION = "What is the capital of France?"


def ready(deadline: float) -> None:
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(BASE + "/health", timeout=10) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            last = e
        time.sleep(1)  # polling a server that is starting; nothing to wait on
    raise SystemExit(f"not ready within the timeout (last error: {last})")


def chat() -> tuple[str, str, dict]:
    with urllib.request.urlopen(BASE + "/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = {"model": model, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": QUESTION}]}
    req = urllib.request.Request(BASE + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        reply = json.load(resp)
    choice = reply["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], reply["usage"]


def resident() -> None:
    for proc in sorted(pathlib.Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().split()
            rss = [line for line in (proc / "status").read_text().splitlines()
                   if line.startswith("VmRSS:")]
        except OSError:
            continue
        at = [i for i, word in enumerate(cmd[:3]) if word.endswith("gapserve")]
        if rss and at and len(cmd) > at[0] + 1:  # `gapserve SERVICE ...`
            print(f"{int(rss[0].split()[1]) / 1024:7.0f} MiB  {cmd[at[0] + 1]}")


def main() -> int:
    start = time.monotonic()
    ready(start + float(sys.argv[1]))
    print(f"ready after {time.monotonic() - start:.0f} s of polling")
    text, finish, usage = chat()
    print(f"chat: {text!r} finish_reason={finish} usage={usage}")
    again, _, _ = chat()
    if "Paris" not in text or finish not in ("stop", "length"):
        print("the answer does not name Paris")
        return 1
    if again != text:
        print(f"a second greedy request answered differently: {again!r}")
        return 1
    resident()
    return 0


if __name__ == "__main__":
    sys.exit(main())
