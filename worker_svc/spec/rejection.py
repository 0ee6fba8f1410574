"""Verification of draft tokens (docs/spec_decode.md), batched over requests with
different numbers of drafts, as pure torch functions.

Layout, as vLLM's rejection sampler: request i has `num_drafts[i]` drafts (0 allowed);
`draft_ids` holds them all back to back ([sum n]); the target's rows hold, per request,
its n_i draft positions and then one more (the bonus position) back to back
([sum (n + 1)] rows). The answer is `(tokens [B, max_n + 1], num_tokens [B])`: request
i commits tokens[i, :num_tokens[i]] (1 + accepted drafts; the rest is PAD).

- `greedy_verify`: accept drafts while they equal the target's argmax; then the
  target's own token, or the bonus token when all were accepted. The committed
  tokens are the target's argmax tokens, so the text is token for token what decoding
  without drafts gives.
- `rejection_sample`: Leviathan et al. (2023): accept draft x with probability
  min(1, p(x) / q(x)); on the first rejection emit a token drawn from
  max(p - q, 0) renormalised; after n accepted, a bonus token drawn from p. The
  committed tokens are distributed exactly as sampling the target token by token.
  `draft_probs=None` is a one-hot q (n-gram drafts, a greedy draft model).
- `coupled_verify`: the same rule for a one-hot q with one source of randomness:
  the target is sampled at every verified position with that position's own noise
  (the exponential race of worker_svc/sampler.py), and a draft is accepted while it
  equals that sample. P(accept x) = p(x) = min(1, p(x)/1), and given a rejection the
  race's winner is distributed as p without x, renormalised = max(p - onehot(x), 0)
  normalised: Leviathan's rule exactly. Its use: the committed tokens are the ones
  sampling without drafts gives with the same noise, so a seeded request (whose
  noise is a pure function of seed and output position, `seeded_noise`) gets the
  same tokens with speculation as without, whatever the batch, the draft count of a
  step or the acceptance; only the number of steps changes.

Randomness is an argument (uniforms for acceptance, Exp(1) noise for draws), so each
function is a pure function of its inputs; `seeded_noise` and `seeded_uniforms` give
a seeded request's, from the sampler's counter-based keys.
"""

from __future__ import annotations

import torch

from worker_svc.sampler import _mix64, row_key, seeded_exponential

PAD = -1
# Stream of the acceptance uniforms: a seeded request's (seed, position) key, mixed
# with this, so they are independent of the position's draw noise.
_ACCEPT_STREAM = 0x5BD1E9955BD1E995


def _layout(num_drafts: torch.Tensor):
    """Masks over the padded [B, K] drafts and [B, K + 1] target rows."""
    k = int(num_drafts.max()) if num_drafts.numel() else 0
    cols = torch.arange(k + 1, device=num_drafts.device)
    draft_mask = cols[None, :k] < num_drafts[:, None]
    row_mask = cols[None, :] <= num_drafts[:, None]
    return k, draft_mask, row_mask


def _pad(values: torch.Tensor, mask: torch.Tensor, fill) -> torch.Tensor:
    out = torch.full((*mask.shape, *values.shape[1:]), fill, dtype=values.dtype,
                     device=values.device)
    out[mask] = values  # row-major: request by request, position by position
    return out


def _commit(target: torch.Tensor, accepted_mask: torch.Tensor, row_mask: torch.Tensor):
    """Accepted = leading run of accepted drafts; tokens = target[:, :accepted + 1]."""
    accepted = accepted_mask.to(torch.int64).cumprod(dim=1).sum(dim=1)
    keep = torch.arange(target.shape[1], device=target.device)[None, :] <= accepted[:, None]
    return torch.where(keep & row_mask, target, PAD), accepted + 1


def greedy_verify(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [sum (n + 1)]: the target's argmax at each verified position."""
    k, draft_mask, row_mask = _layout(num_drafts)
    target = _pad(target_ids, row_mask, PAD)
    drafts = _pad(draft_ids, draft_mask, PAD)
    return _commit(target, (drafts == target[:, :k]) & draft_mask, row_mask)


def coupled_verify(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                   num_drafts: torch.Tensor, noise: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan's rule for one-hot drafts, realised by the exponential race: the
    target sample at each verified row is argmax(p / noise) (noise [rows, V], Exp(1)),
    then the drafts are verified against those samples as greedy drafts are."""
    return greedy_verify(target_probs.div(noise).argmax(dim=-1), draft_ids, num_drafts)


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor,
                     draft_probs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s rule. target_probs [sum (n + 1), V] (the sampler's processed
    distribution at each verified position); draft_probs [sum n, V], None = one-hot at
    the drafts; uniforms [sum n] in [0, 1); noise [sum (n + 1), V] Exp(1) for the draw
    at the first rejected row or the bonus row. Works on the flat rows: the vocabulary
    is touched once per draft (p(x), q(x)) and once per request (its one draw), so
    memory is O(rows + requests * V), never [requests, max drafts, V]."""
    k, draft_mask, row_mask = _layout(num_drafts)
    first_row = torch.cumsum(num_drafts + 1, dim=0) - (num_drafts + 1)  # [B]
    first_draft = first_row - torch.arange(num_drafts.shape[0], device=num_drafts.device)
    draft_index = torch.arange(draft_ids.shape[0], device=draft_ids.device)
    owner = torch.repeat_interleave(torch.arange(num_drafts.shape[0], device=num_drafts.device),
                                    num_drafts)
    draft_row = first_row[owner] + draft_index - first_draft[owner]  # target row of each draft
    p_x = target_probs[draft_row, draft_ids]
    q_x = draft_probs[draft_index, draft_ids] if draft_probs is not None \
        else torch.ones_like(p_x)
    accepted = _pad(uniforms * q_x < p_x, draft_mask, False)  # u < p/q, no division
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    # One draw a request, at its first rejected row (from max(p - q, 0) renormalised)
    # or, all accepted, at its bonus row (from p). A residual of no mass (p == q) is
    # never drawn from: that draft is accepted surely.
    row = first_row + num_accepted
    rejected = num_accepted < num_drafts
    p = target_probs[row]
    at = (first_draft + num_accepted).clamp(max=max(draft_ids.shape[0] - 1, 0))
    if draft_probs is not None:
        q = draft_probs[at] if draft_ids.shape[0] else torch.zeros_like(p)
    else:
        q = torch.zeros_like(p)
        if draft_ids.shape[0]:
            q.scatter_(1, draft_ids[at][:, None], 1.0)
    residual = torch.where(rejected[:, None], (p - q).clamp_(min=0.0), p)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    drawn = residual.div_(noise[row]).argmax(dim=1)  # [B]
    # Committed: the accepted drafts, then the draw.
    drafts = _pad(draft_ids, draft_mask, 0)
    target = torch.cat([drafts, drafts.new_zeros((drafts.shape[0], 1))], dim=1)
    target.scatter_(1, num_accepted[:, None], drawn[:, None])
    return _commit(target, accepted, row_mask)


# ---------------------------------------------------------------- seeded randomness

def seeded_noise(seed: int, first_position: int, num_rows: int, vocab: int,
                 device: torch.device | str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """[num_rows, vocab] Exp(1) noise of a seeded request's verified rows: row j is
    the noise worker_svc/sampler.py draws for output position first_position + j
    (cast to the probabilities' dtype as the sampler casts it), so the exponential
    race at that row picks the token sampling without drafts would pick."""
    keys = [row_key(seed, first_position + j) for j in range(num_rows)]
    return seeded_exponential(keys, vocab, torch.device(device)).to(dtype)


def seeded_uniforms(seed: int, first_position: int, num_drafts: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_drafts] acceptance uniforms of a seeded request's drafts, in (0, 1): a pure
    function of (seed, output position), from a stream apart from the draw noise."""
    bits = [_mix64(row_key(seed, first_position + j) ^ _ACCEPT_STREAM) >> 11
            for j in range(num_drafts)]
    return (torch.tensor(bits, dtype=torch.float64, device=device) + 0.5) * 2.0 ** -53
