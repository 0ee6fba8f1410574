"""A block's hash enters the prefix cache only when the step that writes its KV is
committed, so a prefix hit can never serve KV the worker did not write (issue 13:
a priority victim refunded in the step that allocated its blocks)."""

from tests.scheduler.helpers import FakeWorker, KVWorker, check_invariants, \
    check_prefix_cache_holds_written_kv, drive_async, make_request, make_scheduler


def step(s, w):
    so = s.schedule()
    check_invariants(s, so)
    outs = s.update_from_output(so, w.execute(so))
    check_invariants(s)
    return so, outs


def test_refunded_priority_victim_leaves_no_hash_of_its_refunded_chunk():
    # 9 usable blocks of 4 tokens; the long-prefill cap (8) applies once two compete.
    s = make_scheduler(num_blocks=10, block_size=4, max_model_len=37,
                       max_num_batched_tokens=16, max_num_seqs=2,
                       long_prefill_token_threshold=8, policy="priority")
    w = KVWorker()
    w.block_size = 4
    low = make_request("low", 32, max_tokens=4, priority=5, arrival=0.0)
    prompt = list(low.prompt_token_ids)
    s.add_request(low)
    step(s, w)  # low alone: positions 0..15 (4 blocks)
    s.add_request(make_request("high", 4, max_tokens=4, priority=0, arrival=1.0))
    step(s, w)  # low 16..23 (2 blocks), high admitted (1 block): 2 blocks free
    so = s.schedule()  # low takes the last 2 blocks for 24..31, then high needs one
    check_invariants(s, so)
    assert so.preempted_req_ids == {"low"} and "low" not in so.num_scheduled_tokens
    refunded = low.block_hashes[6:8]  # the chunk 24..31: allocated, never computed
    assert not any(h in s.kv.pool.cached for h in refunded)
    s.update_from_output(so, w.execute(so))
    check_prefix_cache_holds_written_kv(s, w)
    same = make_request("same", prompt, max_tokens=4)
    s.add_request(same)
    hit, num_hit = s.kv.get_computed_blocks(same)
    assert num_hit == 24  # exactly what committed steps computed, not the refunded 32


def test_no_block_is_hit_before_the_step_that_writes_it_is_committed():
    s = make_scheduler(num_blocks=32, block_size=4, max_model_len=64, async_scheduling=True)
    w = FakeWorker()
    s.add_request(make_request("a", 12, max_tokens=2))
    so1 = s.schedule()
    assert not s.kv.pool.cached  # allocated and scheduled: not written yet
    twin = make_request("twin", list(s.requests["a"].prompt_token_ids), max_tokens=2)
    s.add_request(twin)
    so2 = s.schedule()  # twin is admitted while a's step is in flight: no hit
    assert so2.scheduled_new_reqs[0].num_computed_tokens == 0
    s.update_from_output(so1, w.execute(so1))
    assert len(s.kv.pool.cached) == 3


def test_prefix_hits_after_commit_serve_written_kv_under_async_preemption():
    s = make_scheduler(num_blocks=12, block_size=4, max_model_len=40, async_scheduling=True,
                       max_num_seqs=4)
    w = KVWorker()
    w.block_size = 4
    base = list(range(500, 524))
    for i in range(4):
        s.add_request(make_request(f"r{i}", base + [600 + i] * 3, max_tokens=9,
                                   arrival=float(i)))
    outs = drive_async(s, w)
    assert s.stats().num_preemptions_total > 0  # the pool is tight on purpose
    assert all(o[-1].finished for o in outs.values())
    check_prefix_cache_holds_written_kv(s, w)
