"""Turns the logits of the rows that sample into tokens, one row per request.

Order follows the reference system (vLLM): logprobs are taken from the raw model
distribution; then penalties, min_tokens suppression, then greedy argmax, or
temperature -> min_p -> top-k -> top-p -> a draw. The draw is the exponential race
(argmax of probs / Exp(1) noise). A seeded request's noise is counter-based: a pure
function of (seed, output position, token id) (seeded_exponential), so its tokens
depend on nothing else: not its neighbours in the batch, how many draws came before,
a preemption, a replaced worker or a restarted scheduler (docs/resilience.md).
"""

from __future__ import annotations

import torch

from shared import stop_rule
from shared.types import TokenLogprobs
from worker_svc.worker_request import WorkerRequest

MIN_TEMPERATURE = 1e-2


def sample(logits: torch.Tensor, states: list[WorkerRequest], eos_token_ids: list[int],
           generator: torch.Generator
           ) -> tuple[torch.Tensor, list[int], list[list[TokenLogprobs] | None]]:
    """logits [len(states), vocab] fp32, modified in place -> (tokens on the device,
    the same as a list, logprobs per row or None)."""
    num_rows = len(states)
    want_logprobs = [s.params.logprobs is not None for s in states]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
    for i, s in enumerate(states):  # OpenAI's logit_bias: added before anything else
        if s.params.logit_bias:
            ids = torch.tensor(list(s.params.logit_bias), device=logits.device)
            bias = torch.tensor(list(s.params.logit_bias.values()), device=logits.device,
                                dtype=logits.dtype)
            logits[i].index_add_(0, ids, bias)
    if any(s.has_penalties for s in states):
        logits = _apply_penalties(logits, states)
    for i, s in enumerate(states):  # min_tokens bans the stop rule's own ids
        if not s.params.min_tokens:  # (a speculative DraftRow is a state here too)
            continue
        banned = stop_rule.banned_ids(s.num_output_tokens,
                                      stop_rule.stop_ids(s.params, eos_token_ids),
                                      s.params.min_tokens)
        if banned:
            logits[i, list(banned)] = float("-inf")

    greedy = [s.params.greedy for s in states]
    tokens = row_argmax(logits)
    random_rows = [i for i in range(num_rows) if not greedy[i]]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        picked = _random_sample(logits[idx], [states[i] for i in random_rows], generator)
        tokens[idx] = picked
    token_list = tokens.tolist()

    logprobs: list[list[TokenLogprobs] | None] = [None] * num_rows
    if raw_logprobs is not None:
        logprobs = _logprobs(raw_logprobs, tokens, states, want_logprobs)
    return tokens, token_list, logprobs


def _random_sample(logits: torch.Tensor, states: list[WorkerRequest],
                   generator: torch.Generator) -> torch.Tensor:
    device = logits.device
    # Like the reference system (vLLM), a temperature in (0, 1e-2) is raised to 1e-2:
    # dividing by a tiny one overflows the logits to inf and the softmax to NaN.
    temperature = torch.tensor([max(s.params.temperature, MIN_TEMPERATURE) for s in states],
                               device=device)
    logits = logits / temperature.unsqueeze(1)
    min_p = [s.params.min_p for s in states]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_k = [s.params.top_k if s.params.top_k > 0 else 0 for s in states]
    top_p = [s.params.top_p for s in states]
    if any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    elif any(k > 0 for k in top_k):
        logits = _top_k(logits, top_k)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    seeded = [i for i, s in enumerate(states) if s.params.seed is not None]
    if seeded:  # their noise replaced by their own (seed, position) draw
        keys = [row_key(states[i].params.seed, output_position(states[i])) for i in seeded]
        idx = torch.tensor(seeded, device=device)
        noise[idx] = seeded_exponential(keys, probs.shape[1], device).to(noise.dtype)
    return row_argmax(probs.div_(noise))


def row_argmax(t: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, as torch.argmax picks (the first of equal maxima,
    a NaN where there is one), through max's indices: its CPU reduction vectorizes,
    3.6 against 14.6 ms over 64 rows of a 262k vocabulary (Gemma 3's) here."""
    return t.max(dim=-1).indices


def output_position(state: WorkerRequest) -> int:
    """Output tokens before the one being sampled, counting those a continuation
    carries in its prompt (SamplingParams.num_output_prefix_tokens)."""
    return state.num_output_tokens + state.params.num_output_prefix_tokens


# SplitMix64 (Steele, Lea, Flood 2014): its output i of state k is mix64(k + i * GOLDEN).
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The key of one seeded draw: a strong mix of the seed and the output position."""
    return _mix64(_mix64(seed) ^ position)


def _int64(x: int) -> int:  # the same 64 bits as a signed int64, for torch
    return x - (1 << 64) if x >> 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def seeded_exponential(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(keys), vocab] fp64 Exp(1) noise: element (r, j) is -log(u) for u the top 53
    bits of SplitMix64 output j+1 of state keys[r]. The hash is exact int64 tensor
    arithmetic (it wraps mod 2**64), the same whatever the thread count; only the
    final log is floating point."""
    j = torch.arange(1, vocab + 1, device=device, dtype=torch.int64).mul_(_int64(_GOLDEN))
    x = torch.tensor([_int64(k) for k in keys], device=device, dtype=torch.int64)[:, None] + j
    x.bitwise_xor_(_srl(x, 30)).mul_(_int64(_M1))
    x.bitwise_xor_(_srl(x, 27)).mul_(_int64(_M2))
    x.bitwise_xor_(_srl(x, 31))
    u = _srl(x, 11).double().add_(0.5).mul_(2.0 ** -53)  # in (0, 1): -log never sees 0
    return u.log_().neg_()


def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    # the k-th largest logit of each row is its threshold
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def _apply_penalties(logits: torch.Tensor, states: list[WorkerRequest]) -> torch.Tensor:
    for i, s in enumerate(states):
        if not s.has_penalties:
            continue
        p, counts = s.params, s.output_counts
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = s.prompt_mask | (counts > 0)
            penalized = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        logits[i] = row
    return logits


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, states: list[WorkerRequest],
              want: list[bool]) -> list[list[TokenLogprobs] | None]:
    sampled = raw.gather(1, tokens.unsqueeze(1))
    ranks = ((raw > sampled).sum(dim=-1) + 1).tolist()
    sampled_list = sampled.squeeze(1).tolist()
    top_n = max(s.params.logprobs or 0 for s in states)
    top_vals, top_ids = (raw.topk(top_n, dim=-1) if top_n else (None, None))
    token_list = tokens.tolist()
    out: list[list[TokenLogprobs] | None] = []
    for i, s in enumerate(states):
        if not want[i]:
            out.append(None)
            continue
        n = s.params.logprobs
        top = []
        if n:
            top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
        out.append([TokenLogprobs(token_id=token_list[i], logprob=sampled_list[i],
                                  rank=ranks[i], top=top)])
    return out
