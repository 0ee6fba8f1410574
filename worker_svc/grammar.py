"""Structured outputs at the worker: rank 0 owns each request's grammar matcher,
masks its logits before sampling and advances it on the token it just sampled
(docs/structured_outputs.md, docs/async.md).

Why here and not in the scheduler (as vLLM does): the worker samples, so the token
a mask needs next is already in this process when step N+1 runs; no bitmask crosses
the wire and sampling never waits for the scheduler, so async scheduling keeps its
overlap. Rank 0 alone samples under tensor parallelism, so it alone holds matchers.

The matcher follows the worker's token ids, which are the committed ones: it is
built from the prompt's tail of earlier output (a continuation after a scheduler
loss, num_output_prefix_tokens) and any output a resent request brings (a worker
loss), and it survives a preemption with the token ids it matches (the scheduler
checks those on resume). A spec travels inside SamplingParams; the compile goes
through shared/structured/compile_cache.py, announced ahead by the scheduler; the
matcher is the backend interface's (shared/structured/backend.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from shared.config import DEFAULT_COMPILE_TIMEOUT_S
from shared.structured import compile_cache as so
from shared.structured.backend import GrammarMatcher, GrammarVocab
from shared.structured.spec import StructuredOutputError, StructuredOutputSpec
from shared.telemetry import get_logger
from shared.types import SamplingParams

log = get_logger(service="worker")

# How long rank 0 holds an empty step (the scheduler's poll while only deferred
# requests are left) waiting for a compile to end: short, since a request arriving
# meanwhile waits behind it.
POLL_HOLD_S = 0.05


class GrammarState:
    """One request's matcher, at the state after its output tokens so far."""

    __slots__ = ("matcher", "failed", "words")

    def __init__(self, matcher: GrammarMatcher, vocab_size: int = 0) -> None:
        self.matcher = matcher
        self.failed = False
        self.words = (vocab_size + 31) // 32  # of a bitmask row over the model's logits

    def advance(self, token_id: int) -> None:
        """Consume a sampled (committed) token. A token the grammar refuses cannot
        be sampled (it was masked); if the matcher errs anyway, the request is
        driven to EOS rather than left unconstrained."""
        if self.failed or self.matcher.is_terminated():
            return  # the EOS that ends it, or after an error
        if not self.matcher.accept(token_id):
            self.failed = True
            log.error("grammar_rejected_token", token_id=token_id,
                      error=self.matcher.error())

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's allowed set into one int32 bitmask row."""
        self.matcher.fill_bitmask(row.ctypes.data, row.nbytes)

    # -- speculative decoding (worker_svc/spec/): drafts are consumed ahead, then
    # rolled back, so the matcher always ends at the committed tokens

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows from here."""
        if self.failed or self.matcher.is_terminated():
            return 0
        return self.matcher.validate(drafts)

    def consume_draft(self, token_id: int) -> bool:
        return not self.failed and not self.matcher.is_terminated() \
            and self.matcher.accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)


class GrammarRuntime:
    """Rank 0's compiles and matchers. The backend's vocabulary (0.2 to 1.5 s for this
    tokenizer) is built in the background from the start: llguidance holds the GIL
    while it builds it, so built on the first grammar it would stall every stream's
    step for that long (tests/structured/test_grpc_structured.py saw a 1 s gap);
    at start-up it stalls nothing that serves."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int],
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._vocab: Future = Future()
        self._vocab_started = False
        self._pending: dict[str, tuple[Future, float]] = {}  # req_id -> (compile, started)
        if (Path(model_dir) / "tokenizer.json").is_file():  # else every grammar fails
            self._ensure_vocab()

    def _ensure_vocab(self) -> None:
        if not self._vocab_started:
            self._vocab_started = True
            threading.Thread(target=self._build_vocab, name="grammar-vocab",
                             daemon=True).start()

    def _build_vocab(self) -> None:
        try:
            self._vocab.set_result(so.grammar_vocab(self.model_dir, self.vocab_size,
                                                    self.eos_token_ids))
        except BaseException as e:  # noqa: BLE001 - every request with a grammar reports it
            self._vocab.set_exception(e)

    def vocab(self) -> GrammarVocab:
        self._ensure_vocab()
        return self._vocab.result()

    # ------------------------------------------------------------ compiles

    def announce(self, specs: dict[str, StructuredOutputSpec]) -> None:
        """Start compiling grammars the scheduler holds requests back for."""
        for req_id, spec in specs.items():
            self._pending[req_id] = (self._submit(spec), time.monotonic())

    def _submit(self, spec: StructuredOutputSpec) -> Future:
        self._ensure_vocab()
        if self._vocab.done():
            return so.CACHE.submit(spec, self._vocab.result())
        future: Future = Future()  # the vocabulary first, then the compile, both off-thread

        def chain(vocab_future: Future) -> None:
            try:
                inner = so.CACHE.submit(spec, vocab_future.result())
            except BaseException as e:  # noqa: BLE001
                future.set_exception(e)
                return
            inner.add_done_callback(lambda f: _copy_outcome(f, future))
        self._vocab.add_done_callback(chain)
        return future

    def take_done(self, hold: bool = False) -> tuple[list[str], dict[str, str]]:
        """Announced grammars that compiled or failed since the last call. hold: an
        empty step, wait up to POLL_HOLD_S for one to end (the scheduler's poll)."""
        if hold and self._pending and not any(f.done() for f, _ in self._pending.values()):
            _wait_any([f for f, _ in self._pending.values()], POLL_HOLD_S)
        ready, errors = [], {}
        now = time.monotonic()
        for req_id, (future, started) in list(self._pending.items()):
            if future.done():
                del self._pending[req_id]
                error = future.exception()
                if error is None:
                    ready.append(req_id)
                else:
                    errors[req_id] = _message(error)
            elif now - started > self.compile_timeout_s:
                del self._pending[req_id]
                errors[req_id] = (f"the grammar did not compile within "
                                  f"{self.compile_timeout_s:g} s; simplify it")
        for req_id, message in errors.items():  # where an operator looks for a refusal
            log.warning("grammar_failed", req_id=req_id, error=message)
        return ready, errors

    # ------------------------------------------------------------ requests

    def start(self, params: SamplingParams, replay: list[int]) -> GrammarState:
        """A request's matcher, advanced over `replay` (its output so far). Compiles
        here only if the grammar was not compiled ahead (a fresh worker)."""
        compiled = so.compile_spec(params.structured_output, self.vocab(),
                                   self.compile_timeout_s)
        state = GrammarState(compiled.new_matcher(), self.vocab_size)
        for token_id in replay:
            state.advance(token_id)
        return state


def apply_masks(logits: torch.Tensor, states, eos_token_ids) -> float:
    """Set the logits of the tokens each row's grammar forbids to -inf, in place
    (rows whose state has no grammar are untouched). Returns the seconds it took.
    The bitmask (one bit a token, llguidance's layout) is unpacked by numpy in one
    call: ~10 us a row, where torch's shift-and-mask took a millisecond."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return 0.0
    t0 = time.perf_counter()
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = np.zeros((len(rows), words), dtype=np.int32)
    for j, i in enumerate(rows):
        grammar = states[i].grammar
        if grammar.failed:  # only EOS: end it
            for t in eos_token_ids:
                bitmask[j, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else \
                    np.int32(-(1 << 31))
        else:
            grammar.fill(bitmask[j])
    # one byte a token, 1 where forbidden: inverted before unpacking, read as bool
    bits = np.unpackbits(~bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    forbidden = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool).to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one pass
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        for j, i in enumerate(rows):
            logits[i].masked_fill_(forbidden[j], float("-inf"))
    return time.perf_counter() - t0


def _wait_any(futures: list[Future], timeout: float) -> None:
    event = threading.Event()
    for f in futures:
        f.add_done_callback(lambda _f: event.set())
    event.wait(timeout)


def _copy_outcome(src: Future, dst: Future) -> None:
    error = src.exception()
    if error is None:
        dst.set_result(src.result())
    else:
        dst.set_exception(error)


def _message(error: BaseException) -> str:
    return error.message if isinstance(error, StructuredOutputError) else \
        f"the grammar could not be compiled: {error}"
