"""Sampling rules: each filter keeps exactly the tokens it should, a seeded draw is a
function of (seed, output position) only, whatever the batch or the draws before,
penalties and min_tokens change the right logits, and logprobs are the model's own."""

import dataclasses
import math

import torch

from shared import stop_rule
from shared.types import SamplingParams
from worker_svc.worker_request import WorkerRequest
from worker_svc.sampler import row_argmax, row_key, sample, seeded_exponential

VOCAB = 50
EOS = 2


def _state(params: SamplingParams, prompt=(5, 6, 7), output=(), req_id="r") -> WorkerRequest:
    s = WorkerRequest(req_id=req_id, token_ids=list(prompt) + list(output),
                     num_prompt_tokens=len(prompt), block_ids=[], num_computed_tokens=0,
                     params=params, row=0)
    if s.has_penalties:
        s.prompt_mask = torch.zeros(VOCAB, dtype=torch.bool)
        s.prompt_mask[list(prompt)] = True
        s.output_counts = torch.bincount(torch.tensor(list(output), dtype=torch.long),
                                         minlength=VOCAB)
    return s


def _logits(seed=0, rows=1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [sample(logits.clone(), [_state(params)], [EOS], g)[1][0] for _ in range(n)]


def test_greedy_picks_the_argmax():
    logits = _logits()
    assert _draws(logits, SamplingParams(temperature=0.0), 1) == [int(logits.argmax())]


def test_row_argmax_picks_as_torch_argmax_does_on_ties_nans_and_wide_rows():
    """The sampler's argmax (max's indices, faster on CPU) picks argmax's index: the
    first of equal maxima, the first NaN, and so over rows as wide as Gemma's vocab."""
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        t = torch.randint(0, 4, (5, 262144 if trial % 8 == 0 else 3001), generator=g).float()
        if trial % 3 == 0:
            t[trial % 5, torch.randint(0, t.shape[1], (2,), generator=g)] = float("nan")
        if trial % 4 == 0:
            t[:, ::3] = float("-inf")
        assert torch.equal(row_argmax(t), t.argmax(dim=-1)), trial
    assert row_argmax(torch.full((2, 9), float("-inf"))).tolist() == [0, 0]


def test_top_k_never_picks_outside_the_top_k():
    logits = _logits(1)
    allowed = set(logits[0].topk(4).indices.tolist())
    draws = _draws(logits, SamplingParams(temperature=5.0, top_k=4), 400)
    assert set(draws) == allowed  # all of them reachable, nothing else


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.05] + [0.0] * (VOCAB - 6))
    logits = probs.clamp_min(1e-12).log().unsqueeze(0)
    # 0.4 + 0.25 = 0.65 < 0.7 so the third token (mass before it 0.65) is still needed
    draws = _draws(logits, SamplingParams(top_p=0.7), 600)
    assert set(draws) == {0, 1, 2}
    assert set(_draws(logits, SamplingParams(top_p=0.65), 300)) == {0, 1}


def test_min_p_drops_tokens_below_the_scaled_maximum():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08] + [0.0] * (VOCAB - 4))
    logits = probs.clamp_min(1e-12).log().unsqueeze(0)
    assert set(_draws(logits, SamplingParams(min_p=0.2), 400)) == {0, 1, 2}


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    logits = _logits(3, rows=3)
    logits[2] = logits[0]  # the seeded request sees the same logits in both batches
    seeded = SamplingParams(temperature=1.5, seed=77)

    def run(batch_params, row, batch_seed):  # output positions 0..29
        g = torch.Generator().manual_seed(batch_seed)
        return [sample(logits[:len(batch_params)].clone(),
                       [_state(p, output=[9] * k, req_id=str(i))
                        for i, p in enumerate(batch_params)], [EOS], g)[1][row]
                for k in range(30)]

    alone = run([seeded], 0, batch_seed=1)
    crowded = run([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                   seeded], 2, batch_seed=2)
    assert crowded == alone
    assert run([SamplingParams(temperature=1.5, seed=78)], 0, batch_seed=1) != alone


def test_a_seeded_draw_is_a_function_of_seed_and_output_position_only():
    logits = _logits(4, rows=4)
    logits[1] = logits[3] = logits[0]
    seeded = SamplingParams(temperature=0.8, seed=2024)

    def at(position, neighbours=(), draws_before=0, shared_seed=0):
        g = torch.Generator().manual_seed(shared_seed)
        states = [_state(seeded, output=[9] * position), *neighbours]
        for _ in range(draws_before):  # a long history of draws changes nothing
            sample(logits[:len(states)].clone(), states, [EOS], g)
        return sample(logits[:len(states)].clone(), states, [EOS], g)[1][0]

    want = [at(k) for k in range(40)]
    assert [at(k, draws_before=3, shared_seed=9) for k in range(40)] == want
    crowd = (_state(SamplingParams(temperature=1.0)), _state(SamplingParams(seed=5)),
             _state(SamplingParams(temperature=0.0)))
    assert [at(k, neighbours=crowd) for k in range(40)] == want
    assert len(set(want)) >= 3  # the position does change the draw
    # a continuation whose prompt holds k outputs draws as the original at position k
    tail = _state(dataclasses.replace(seeded, num_output_prefix_tokens=7), output=[9] * 3)
    assert sample(logits[:1].clone(), [tail], [EOS], torch.Generator())[1][0] == want[10]


def test_seeded_noise_is_splitmix64_bit_for_bit_and_exponential():
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def splitmix64(x):  # the reference, in exact Python integers
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    keys = [row_key(seed, pos) for seed, pos in [(0, 0), (-1, 5), (2**63 - 1, 10**6), (7, 3)]]
    noise = seeded_exponential(keys, 300, torch.device("cpu"))
    for r, key in enumerate(keys):
        for j in (0, 1, 150, 299):
            u = ((splitmix64((key + (j + 1) * golden) & mask) >> 11) + 0.5) * 2.0 ** -53
            assert noise[r, j].item() == -math.log(u)
    big = seeded_exponential(list(range(8)), 20_000, torch.device("cpu"))
    assert abs(big.mean().item() - 1.0) < 0.01 and abs(big.var().item() - 1.0) < 0.03
    assert row_key(1, 0) != row_key(0, 1) != row_key(1, 1)


def test_repetition_penalty_demotes_seen_tokens_both_signs():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 9], logits[0, 11] = 3.0, 2.0, -1.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    state = _state(params, prompt=(5, 11))
    out = logits.clone()
    sample(out, [state], [EOS], torch.Generator())
    assert out[0, 5] == 1.5 and out[0, 11] == -2.0 and out[0, 9] == 2.0
    assert sample(logits.clone(), [state], [EOS], torch.Generator())[1] == [9]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    state = _state(params, prompt=(5,), output=(7, 7, 8))
    sample(logits, [state], [EOS], torch.Generator())
    assert logits[0, 7] == -1.25 and logits[0, 8] == -0.75 and logits[0, 5] == 0.0


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 30], logits[0, 4] = 9.0, 8.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[30])
    early = _state(params, output=(4,))
    assert sample(logits.clone(), [early], [EOS], torch.Generator())[1] == [4]
    done = _state(params, output=(4, 4))
    assert sample(logits.clone(), [done], [EOS], torch.Generator())[1] == [EOS]


def test_min_tokens_under_ignore_eos_bans_only_what_the_stop_rule_would_stop_on():
    # ignore_eos drops EOS from the stop ids (shared/stop_rule.py), so min_tokens has no
    # reason to ban it: EOS stays sampleable, the request's own stop ids stay banned
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 30], logits[0, 4] = 9.0, 8.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[30],
                            ignore_eos=True)
    assert sample(logits.clone(), [_state(params, output=(4,))], [EOS],
                  torch.Generator())[1] == [EOS]
    no_eos = logits.clone()
    no_eos[0, EOS] = 0.0
    assert sample(no_eos, [_state(params, output=(4,))], [EOS], torch.Generator())[1] == [4]


def test_min_tokens_ban_equals_transformers_min_new_tokens_over_the_rule_stop_ids():
    # transformers' MinNewTokensLengthLogitsProcessor bans its eos_token_id list until
    # min_new_tokens are out; given the rule's stop ids it must mask what we mask
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor
    prompt = (5, 6, 7)
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[30, 31],
                                ignore_eos=ignore_eos)
        ids = sorted(stop_rule.stop_ids(params, [EOS, 3]))
        for n_out in range(4):
            output = (4,) * n_out
            ours = _logits(n_out)
            theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 2, ids)(
                torch.tensor([list(prompt + output)]), ours.clone())
            state = _state(params, prompt=prompt, output=output)
            sample(ours, [state], [EOS, 3], torch.Generator())
            assert torch.equal(ours, theirs), (ignore_eos, n_out)


def test_logprobs_are_the_raw_model_logprobs_with_rank_and_top_n():
    logits = _logits(5)
    want = torch.log_softmax(logits[0], -1)
    params = SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5)
    state = _state(params, prompt=(int(logits.argmax()),))  # penalty moves the pick
    _, tokens, logprobs = sample(logits.clone(), [state], [EOS], torch.Generator())
    lp = logprobs[0][0]
    assert lp.token_id == tokens[0]
    assert math.isclose(lp.logprob, float(want[tokens[0]]), abs_tol=1e-6)
    assert lp.rank == int((want > want[tokens[0]]).sum()) + 1 and lp.rank > 1
    top_ids = want.topk(3).indices.tolist()
    assert [t for t, _ in lp.top] == top_ids


def test_a_temperature_below_1e_2_is_raised_to_it_instead_of_sampling_nan():
    # dividing by 1e-45 overflows every logit to +-inf and the softmax to NaN, whose
    # argmax is row 0's first NaN, not the model's choice; vLLM raises it to 1e-2
    logits = torch.zeros(1, VOCAB)
    logits[0, 17] = 1.0  # at T = 1e-2 the other tokens have probability ~e^-100
    draws = _draws(logits, SamplingParams(temperature=1e-45), 50)
    assert draws == [17] * 50


def test_logit_bias_is_added_before_greedy_and_random_choices():
    logits = _logits(seed=3)
    top = int(logits.argmax())
    assert _draws(logits, SamplingParams(temperature=0.0, logit_bias={top: -100.0}), 1)[0] != top
    assert _draws(logits, SamplingParams(temperature=0.0, logit_bias={7: 100.0}), 1) == [7]
    assert set(_draws(logits, SamplingParams(temperature=1.0, logit_bias={9: 100.0}), 20)) == {9}
