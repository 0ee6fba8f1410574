"""Verification of drafts (worker_svc/spec/rejection.py): greedy verification is exact;
the sampling rule keeps the target's distribution (seeded chi-square tests on a tiny
vocabulary, one-hot and dense drafts, over whole generated sequences, with a broken
rule shown to fail the same test); a seeded request's tokens with speculation equal
the sampler's without it."""

import itertools

import pytest
import torch

from shared.types import SamplingParams
from worker_svc.sampler import sample
from worker_svc.spec.rejection import (PAD, coupled_verify, greedy_verify, rejection_sample,
                                       seeded_noise, seeded_uniforms)
from worker_svc.worker_request import WorkerRequest

# chi-square 0.999 quantile, 26 degrees of freedom (27 sequences of 3 tokens over 3 ids)
CHI2_26_999 = 54.05


def flat(rows: list[list]) -> torch.Tensor:
    return torch.tensor([x for r in rows for x in r], dtype=torch.int64)


# ------------------------------------------------------------------ greedy

def test_greedy_verify_commits_the_target_tokens_up_to_the_first_mismatch():
    num = torch.tensor([2, 0, 3, 1])
    target = flat([[5, 6, 7], [8], [1, 2, 3, 4], [9, 9]])
    drafts = flat([[5, 9], [], [1, 2, 3], [4]])
    tokens, count = greedy_verify(target, drafts, num)
    assert count.tolist() == [2, 1, 4, 1]
    assert tokens.tolist() == [[5, 6, PAD, PAD], [8, PAD, PAD, PAD], [1, 2, 3, 4],
                               [9, PAD, PAD, PAD]]


def test_greedy_verify_of_random_batches_matches_the_rule_row_by_row():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        num = torch.randint(0, 6, (7,), generator=g)
        target = [torch.randint(0, 4, (int(n) + 1,), generator=g).tolist() for n in num]
        drafts = [[t if torch.rand(1, generator=g) < 0.7 else 9 for t in row[:-1]]
                  for row in target]
        tokens, count = greedy_verify(flat(target), flat(drafts), num)
        for i, (t, d) in enumerate(zip(target, drafts)):
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            assert count[i] == a + 1 and tokens[i, :a + 1].tolist() == t[:a + 1]
            assert (tokens[i, a + 1:] == PAD).all()


def test_greedy_decoding_with_drafts_equals_greedy_decoding_without():
    """A deterministic target (argmax of a fixed function of the prefix): steps of
    greedy verification with random drafts give the argmax chain, token for token."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 50, generator=g)

    def argmax_after(prefix):
        return int(table[prefix[-1] % 50].add(len(prefix) * 0.37).sin().argmax())

    want = [3]
    while len(want) < 60:
        want.append(argmax_after(want))
    got = [3]
    while len(got) < 60:
        n = int(torch.randint(0, 6, (1,), generator=g))
        drafts = []
        for _ in range(n):  # right with probability 0.6, else a wrong id
            right = argmax_after(got + drafts)
            drafts.append(right if torch.rand(1, generator=g) < 0.6 else (right + 1) % 50)
        targets = [argmax_after(got + drafts[:i]) for i in range(n + 1)]
        tokens, count = greedy_verify(torch.tensor(targets), torch.tensor(drafts, dtype=torch.int64),
                                      torch.tensor([n]))
        got += tokens[0, :int(count[0])].tolist()
    assert got[:60] == want


# ------------------------------------------------------------------ the distribution

V = 3
START = 0
P = torch.tensor([[0.5, 0.3, 0.2], [0.15, 0.25, 0.6], [0.35, 0.45, 0.2]])  # target P[prev]
Q = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])  # a different draft


def sequence_probs(length=3) -> torch.Tensor:
    """Exact distribution of the first `length` tokens after START: [V] * length."""
    probs = torch.zeros([V] * length)
    for seq in itertools.product(range(V), repeat=length):
        p, prev = 1.0, START
        for token in seq:
            p, prev = p * float(P[prev, token]), token
        probs[seq] = p
    return probs


def generate(verify, draft, num_seqs=40_000, length=3, seed=0) -> torch.Tensor:
    """Sequences of `length` tokens from START, by steps of speculative decoding with
    1 to 3 drafts a sequence (different per sequence and step). Returns [V] * length
    counts of the sequences produced."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.full((num_seqs, length), -1, dtype=torch.int64)
    filled = torch.zeros(num_seqs, dtype=torch.int64)
    last = torch.full((num_seqs,), START, dtype=torch.int64)
    while (filled < length).any():
        num = torch.randint(1, 4, (num_seqs,), generator=g)
        padded, q_padded = draft(last, g)  # [B, 3] drafts and their q rows (or None)
        mask = torch.arange(3)[None] < num[:, None]
        drafts = padded[mask]
        q_rows = None if q_padded is None else q_padded[mask]
        # the target's rows: P after the last token, then after each draft
        prev = torch.cat([last[:, None], padded], dim=1)[torch.arange(4)[None] <= num[:, None]]
        tokens, count = verify(P[prev], drafts, num, q_rows, g)
        for j in range(tokens.shape[1]):
            rows = ((j < count) & (filled < length)).nonzero().squeeze(1)
            seqs[rows, filled[rows]] = tokens[rows, j]
            filled[rows] += 1
        last = tokens.gather(1, (count - 1)[:, None]).squeeze(1)
    codes = (seqs * torch.tensor([V ** (length - 1 - i) for i in range(length)])).sum(1)
    return torch.bincount(codes, minlength=V ** length).reshape([V] * length)


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def dense_draft(last, g):
    """Three drafts a sequence sampled from Q token after token, with their rows of Q."""
    drafts, rows, prev = [], [], last
    for _ in range(3):
        rows.append(Q[prev])
        prev = torch.multinomial(Q[prev], 1, generator=g).squeeze(1)
        drafts.append(prev)
    return torch.stack(drafts, dim=1), torch.stack(rows, dim=1)


def onehot_draft(last, g):
    """Greedy drafts (argmax of Q, as an n-gram or a greedy draft model): q is one-hot."""
    drafts, prev = [], last
    for _ in range(3):
        prev = Q[prev].argmax(dim=1)
        drafts.append(prev)
    return torch.stack(drafts, dim=1), None


def leviathan(probs, drafts, num, q_rows, g):
    u = torch.rand(drafts.shape[0], generator=g, dtype=torch.float64)
    noise = torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=g)
    return rejection_sample(probs, drafts, num, u, noise, q_rows)


def coupled(probs, drafts, num, q_rows, g):
    assert q_rows is None
    return coupled_verify(probs, drafts, num,
                          torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=g))


def resample_from_p(probs, drafts, num, q_rows, g):
    """A broken rule: the right acceptance test, but a rejection draws from p instead
    of the residual max(p - q, 0), which favours the rejected draft."""
    tokens, count = leviathan(probs, drafts, num, q_rows, g)
    k = int(num.max())
    rows = torch.zeros(num.shape[0], k + 1, V)
    rows[torch.arange(k + 1)[None] <= num[:, None]] = probs
    redraw = rows.div(torch.empty(rows.shape).exponential_(generator=g)).argmax(2)
    last = (count - 1)[:, None]  # the first rejected row, where count <= num
    fixed = tokens.clone()
    fixed.scatter_(1, last, torch.where((count <= num)[:, None], redraw.gather(1, last),
                                        tokens.gather(1, last)))
    return fixed, count


@pytest.mark.parametrize("verify, draft", [(leviathan, dense_draft), (leviathan, onehot_draft),
                                           (coupled, onehot_draft)],
                         ids=["dense q", "one-hot q", "one-hot q, coupled"])
def test_speculative_sampling_keeps_the_target_distribution(verify, draft):
    counts = generate(verify, draft)
    assert counts.sum() == 40_000
    assert chi2(counts, sequence_probs()) < CHI2_26_999


@pytest.mark.parametrize("draft", [dense_draft, onehot_draft], ids=["dense q", "one-hot q"])
def test_the_same_test_rejects_a_rule_that_resamples_from_p(draft):
    counts = generate(resample_from_p, draft)
    assert chi2(counts, sequence_probs()) > 4 * CHI2_26_999


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    """Leviathan's rule accepts a draft x ~ q with probability sum_x min(p, q)."""
    g = torch.Generator().manual_seed(3)
    n = 50_000
    num = torch.ones(n, dtype=torch.int64)
    drafts = torch.multinomial(Q[0], n, replacement=True, generator=g)
    probs = torch.stack([P[0], P[0]]).repeat(n, 1)  # the draft row and the bonus row
    u = torch.rand(n, generator=g, dtype=torch.float64)
    noise = torch.empty(2 * n, V).exponential_(generator=g)
    _, count = rejection_sample(probs, drafts, num, u, noise, Q[0].repeat(n, 1))
    rate = float((count == 2).float().mean())
    assert abs(rate - float(torch.minimum(P[0], Q[0]).sum())) < 0.01


# ------------------------------------------------------------------ seeded sampling

def _state(seed: int, tokens: list[int]) -> WorkerRequest:
    return WorkerRequest("r", list(tokens), 1, [], 0,
                         SamplingParams(temperature=0.8, top_k=0, seed=seed), 0)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_a_seeded_request_gets_the_samplers_tokens_with_any_drafts(seed):
    """The sampler without drafts (worker_svc/sampler.py's sample, one token a step)
    and coupled verification with the same seeded noise, random draft counts and
    random drafts, give the same tokens: speculation changes steps, not text."""
    g = torch.Generator().manual_seed(seed % 1000)
    vocab = 11
    table = torch.randn(vocab, vocab, generator=g) * 2

    def logits_after(prev: int) -> torch.Tensor:
        return table[prev].clone()[None]

    plain = [4]
    while len(plain) < 41:
        _, toks, _ = sample(logits_after(plain[-1]), [_state(seed, plain)], [], g)
        plain.append(toks[0])
    spec = [4]
    while len(spec) < 41:
        n = int(torch.randint(0, 5, (1,), generator=g))
        drafts = torch.randint(0, vocab, (n,), generator=g)
        prev = [spec[-1], *drafts.tolist()]
        probs = torch.cat([(logits_after(t) / 0.8).softmax(dim=-1) for t in prev])
        noise = seeded_noise(seed, len(spec) - 1, n + 1, vocab)  # output positions
        tokens, count = coupled_verify(probs, drafts, torch.tensor([n]), noise)
        spec += tokens[0, :int(count[0])].tolist()
    assert spec[:41] == plain


def test_seeded_randomness_is_a_function_of_seed_and_position():
    a = seeded_uniforms(5, 10, 4)
    assert torch.equal(a, seeded_uniforms(5, 10, 4))
    assert torch.equal(a[2:], seeded_uniforms(5, 12, 2))  # position, not the call
    assert not torch.equal(a, seeded_uniforms(6, 10, 4))
    assert ((a > 0) & (a < 1)).all()
    many = seeded_uniforms(1, 0, 20_000)
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005
    assert torch.equal(seeded_noise(5, 11, 1, 9), seeded_noise(5, 10, 2, 9)[1:])


def test_a_request_with_fewer_drafts_than_the_batch_draws_its_bonus_from_p():
    """All drafts accepted (p(x) = 1): the bonus row of every request, however many
    drafts it had, is drawn from p there (mostly token 0; noise 1 makes the race pick
    the likeliest), not from a residual without token 0."""
    num = torch.tensor([1, 3, 0])
    drafts = flat([[2], [1, 1, 2], []])
    sure = {1: [0.0, 1.0, 0.0], 2: [0.0, 0.0, 1.0]}
    bonus = [0.6, 0.4, 0.0]
    rows = [sure[2], bonus, sure[1], sure[1], sure[2], bonus, bonus]
    probs = torch.tensor(rows)
    noise = torch.ones(7, 3)
    for q in (None, torch.nn.functional.one_hot(drafts, 3).float()):
        tokens, count = rejection_sample(probs, drafts, num, torch.full((4,), 0.99), noise, q)
        assert count.tolist() == [2, 4, 1]
        assert tokens.tolist() == [[2, 0, PAD, PAD], [1, 1, 2, 0], [0, PAD, PAD, PAD]]
