"""KV cache events, as the core records them (no network): which changes of the
prefix cache become BlocksStored / BlocksRemoved / CacheCleared, so that a
subscriber replaying them in order holds exactly the pool's set of hashes."""

from scheduler_svc.core.block_pool import BlocksRemoved, BlocksStored, CacheCleared
from tests.scheduler.helpers import FakeWorker, drive, make_request, make_scheduler


def _replay(events, known=None):
    """The set of hashes a subscriber holds after applying `events` in order."""
    known = set() if known is None else known
    for event in events:
        if isinstance(event, BlocksStored):
            assert not known & set(event.block_hashes), "a hash announced twice"
            known |= set(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            assert set(event.block_hashes) <= known, "a hash removed that was never stored"
            known -= set(event.block_hashes)
        else:
            assert isinstance(event, CacheCleared)
            known.clear()
    return known


def _step(s, w):
    so = s.schedule()
    return s.update_from_output(so, w.execute(so))


def test_nothing_is_recorded_unless_someone_listens():
    s = make_scheduler(block_size=4, max_model_len=64)
    s.add_request(make_request("a", 12, max_tokens=2))
    drive(s, FakeWorker())
    assert s.kv.pool.events is None and s.kv.take_events() == []


def test_a_prefill_stores_its_full_blocks_as_one_chain_with_their_tokens():
    s = make_scheduler(block_size=4, max_model_len=64)
    s.kv.record_events()
    a = make_request("a", 10, max_tokens=1)  # 2 full blocks and 2 tokens
    s.add_request(a)
    _step(s, FakeWorker())
    [event] = s.kv.take_events()
    assert event == BlocksStored(a.block_hashes[:2], None, a.prompt_token_ids[:8])
    assert s.kv.take_events() == []  # taken once


def test_a_block_is_stored_only_when_the_step_that_wrote_it_is_committed():
    s = make_scheduler(block_size=4, max_model_len=64, async_scheduling=True)
    s.kv.record_events()
    a = make_request("a", 8, max_tokens=3)
    s.add_request(a)
    w = FakeWorker()
    first = s.schedule()
    assert s.kv.take_events() == []  # scheduled, not written yet
    s.update_from_output(first, w.execute(first))
    [event] = s.kv.take_events()
    assert event.block_hashes == a.block_hashes[:2]


def test_a_later_block_names_the_block_before_it_as_parent():
    s = make_scheduler(block_size=4, max_model_len=64, max_num_batched_tokens=8,
                       long_prefill_token_threshold=4, long_prefill_exempt_lone_request=False)
    s.kv.record_events()
    a = make_request("a", 13, max_tokens=1)
    s.add_request(a)
    w = FakeWorker()
    events = []
    while s.has_unfinished_requests():
        _step(s, w)
        events += s.kv.take_events()
    assert [e.block_hashes for e in events] == [[h] for h in a.block_hashes[:3]]
    assert [e.parent_block_hash for e in events] == [None, *a.block_hashes[:2]]
    assert [e.token_ids for e in events] == [a.prompt_token_ids[i:i + 4] for i in (0, 4, 8)]


def test_a_block_completed_by_generated_tokens_is_stored_with_them():
    s = make_scheduler(block_size=4, max_model_len=64)
    s.kv.record_events()
    a = make_request("a", 6, max_tokens=6)  # positions 6..11 are generated
    s.add_request(a)
    drive(s, FakeWorker())
    events = s.kv.take_events()
    stored = [t for e in events for t in e.token_ids]
    assert stored == a.all_token_ids[:8]  # the block holding position 11's token waits for it
    assert stored[6:8] == a.output_token_ids[:2]


def test_a_prefix_hit_stores_only_the_blocks_it_adds_with_the_hit_as_parent():
    s = make_scheduler(block_size=4, max_model_len=64)
    s.kv.record_events()
    a = make_request("a", 9, max_tokens=1)
    s.add_request(a)
    drive(s, FakeWorker())
    s.kv.take_events()
    b = make_request("b", a.prompt_token_ids[:8] + [7, 7, 7, 7, 7], max_tokens=1)
    s.add_request(b)
    drive(s, FakeWorker())
    [event] = s.kv.take_events()
    assert event == BlocksStored([b.block_hashes[2]], a.block_hashes[1], [7, 7, 7, 7])


def test_a_hash_another_block_already_holds_is_not_announced_again():
    # Two identical prompts prefilled in the same step: the first block to reach a
    # hash keeps it, the other block stays out of the cache and out of the events.
    s = make_scheduler(block_size=4, max_model_len=64)
    s.kv.record_events()
    prompt = list(range(500, 509))
    s.add_request(make_request("a", prompt, max_tokens=1))
    s.add_request(make_request("b", prompt, max_tokens=1))
    _step(s, FakeWorker())
    events = s.kv.take_events()
    assert len(events) == 1 and _replay(events) == set(s.kv.pool.cached)


def test_reusing_a_cached_block_removes_its_hash_once():
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)  # 4 usable blocks
    s.kv.record_events()
    a = make_request("a", 9, max_tokens=1)
    s.add_request(a)
    drive(s, FakeWorker())
    assert _replay(s.kv.take_events()) == set(a.block_hashes[:2])
    s.add_request(make_request("b", 13, max_tokens=1))  # needs all 4 blocks
    drive(s, FakeWorker())
    events = s.kv.take_events()
    removed = [h for e in events if isinstance(e, BlocksRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(a.block_hashes[:2])


def test_losing_the_workers_clears_every_hash():
    s = make_scheduler(block_size=4, max_model_len=64)
    s.kv.record_events()
    s.add_request(make_request("a", 12, max_tokens=8))
    w = FakeWorker()
    _step(s, w)
    s.requeue_all_for_recompute()
    events = s.kv.take_events()
    assert isinstance(events[-1], CacheCleared) and _replay(events) == set()


def test_replaying_the_events_yields_the_pools_hashes_after_every_step():
    # Requests sharing prefixes in a small pool, two steps in flight: stores, prefix
    # hits and evictions interleave with scheduling ahead.
    s = make_scheduler(num_blocks=12, block_size=4, max_model_len=40,
                       max_num_batched_tokens=24, async_scheduling=True)
    s.kv.record_events()
    shared = list(range(900, 912))
    for i in range(10):
        tail = list(range(1000 * i, 1000 * i + 3 + i % 5))
        s.add_request(make_request(f"r{i}", shared[:4 * (i % 4)] + tail, max_tokens=5 + i % 3))
    known, kinds, w, in_flight = set(), set(), FakeWorker(), []
    while in_flight or s.has_unfinished_requests():
        if len(in_flight) < 2 and s.has_unfinished_requests():
            so = s.schedule()
            in_flight.append((so, w.execute(so)))
            if len(in_flight) < 2:
                continue
        s.update_from_output(*in_flight.pop(0))
        events = s.kv.take_events()  # as the engine drains after each update
        kinds.update(type(e) for e in events)
        assert _replay(events, known) == set(s.kv.pool.cached)
    assert kinds == {BlocksStored, BlocksRemoved}
