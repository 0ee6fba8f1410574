"""A model whose every layer has a sliding window: the KV manager frees the blocks
wholly behind a running request's window (shared/kv_window.py), keeps its table's
length with null entries, never hashes a block it freed before its step committed,
and a prefix hit needs only the blocks the window of its end reaches."""

from __future__ import annotations

import pytest

from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.config import ConfigError
from scheduler_svc.core.scheduler import Scheduler
from tests.scheduler.helpers import (FakeWorker, check_invariants, drive, make_request,
                                     make_scheduler)

WINDOW = 20  # the next token at position p reads p - 19 .. p


def step(s, worker):
    so = s.schedule()
    check_invariants(s, so)
    s.update_from_output(so, worker.execute(so))
    check_invariants(s)
    return so


def test_blocks_wholly_behind_the_window_become_null_and_go_back_to_the_pool():
    s = make_scheduler(num_blocks=8, sliding_window=WINDOW, max_num_batched_tokens=16)
    s.add_request(make_request("a", 64, max_tokens=40))
    worker = FakeWorker()
    for _ in range(4):  # the prompt in four chunks of 16
        step(s, worker)
    blocks = s.kv.req_to_blocks["a"]
    # 64 computed: the next token (64) reads from 45 on; blocks 0 and 1 (0..31) are
    # behind, block 2 (32..47) is not; freed at the next allocation
    step(s, worker)
    null = s.kv.pool.null_block
    assert [b is null for b in blocks[:3]] == [True, True, False]
    assert s.stats().num_window_freed_blocks_total == 2
    drive(s, worker)
    assert s.num_free_blocks == s.num_total_blocks - 1


def test_a_model_with_a_full_attention_layer_frees_nothing():
    s = make_scheduler(num_blocks=17, max_num_batched_tokens=16)
    s.add_request(make_request("a", 64, max_tokens=40))
    drive(s, FakeWorker())
    assert s.stats().num_window_freed_blocks_total == 0


def test_a_block_freed_before_its_step_committed_never_enters_the_prefix_cache():
    """Async: the step computing a block may still be in flight when the next one frees
    it; its KV is not known to be written, and it may have a new owner already."""
    s = make_scheduler(num_blocks=8, sliding_window=WINDOW, max_num_batched_tokens=64,
                       async_scheduling=True)
    s.add_request(make_request("a", 64, max_tokens=4))
    worker = FakeWorker()
    first = s.schedule()  # all 64 tokens: blocks 0..3
    first_out = worker.execute(first)
    blocks = list(s.kv.req_to_blocks["a"])
    second = s.schedule()  # its allocation frees blocks 0 and 1 behind the window
    assert s.kv.req_to_blocks["a"][0] is s.kv.pool.null_block
    s.update_from_output(first, first_out)  # the first step commits now
    assert blocks[0].block_hash is None and blocks[1].block_hash is None
    assert blocks[2].block_hash is not None  # still held: cached as usual
    s.update_from_output(second, worker.execute(second))
    check_invariants(s)


def test_a_windowed_prefix_hit_holds_only_the_blocks_its_window_reaches():
    s = make_scheduler(num_blocks=12, sliding_window=WINDOW, max_num_batched_tokens=128)
    prompt = list(range(100, 180))  # 80 tokens: 5 full blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    drive(s, FakeWorker())
    # "a"'s blocks behind the window of its last token were freed; hashed ones stay
    # cached until handed out again
    b = make_request("b", prompt + [7, 8], max_tokens=1)
    s.add_request(b)
    hit, num_hit = s.kv.get_computed_blocks(b)
    assert num_hit == 80  # five blocks: the next token (80) reads 61..80
    null = s.kv.pool.null_block
    assert [x is null for x in hit] == [True, True, True, False, False]
    held_before = s.num_total_blocks - 1 - s.num_free_blocks
    so = s.schedule()
    assert so.scheduled_new_reqs[0].block_ids[:3] == [0, 0, 0]
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    # it holds blocks 3, 4 (the hit's window) and one new for tokens 80, 81
    assert s.num_total_blocks - 1 - s.num_free_blocks - held_before == 3
    check_invariants(s, so)


def test_the_pool_needs_one_window_and_one_chunk_not_max_model_len():
    cfg = dict(max_model_len=4096, max_num_batched_tokens=64, max_num_seqs=4,
               hash_seed="t")
    # 4096 tokens would need 256 blocks; a window of 20 and a chunk of 64: 7
    Scheduler(SchedulerConfig(sliding_window=WINDOW, **cfg), 8)
    with pytest.raises(ConfigError, match="window"):
        Scheduler(SchedulerConfig(sliding_window=WINDOW, **cfg), 7)
    with pytest.raises(ConfigError, match="needs 256 KV blocks"):
        Scheduler(SchedulerConfig(**cfg), 8)


@pytest.mark.parametrize("table, window, ok", [
    ([0, 0, 0, 5, 6, 7], WINDOW, True),  # 80 computed: 0..60 behind, blocks 0..2
    ([0, 0, 0, 0, 6, 7], WINDOW, False),  # block 3 (48..63) is still read
    ([0, 0, 0, 5, 6, 7], 0, False),  # no window: every key is read
    ([4, 0, 0, 5, 6, 7], WINDOW, False),  # nulls only lead
])
def test_the_worker_accepts_null_entries_only_where_the_window_left_them(table, window, ok):
    from shared.types import NewRequestData, SamplingParams, SchedulerOutput
    from worker_svc.step_check import StepError, check_step
    new = NewRequestData("r", list(range(3, 85)), SamplingParams(max_tokens=1), table, 80)
    step = SchedulerOutput(step_id=0, scheduled_new_reqs=[new], num_scheduled_tokens={"r": 2},
                           total_num_scheduled_tokens=2)
    check = lambda: check_step(step, {}, vocab_size=1000, max_model_len=256,  # noqa: E731
                               num_blocks=16, block_size=16, sliding_window=window)
    if ok:
        check()
    else:
        with pytest.raises(StepError, match="block id"):
            check()
