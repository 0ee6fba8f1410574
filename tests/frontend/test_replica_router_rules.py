"""The data-parallel routing rule and the per-replica prefix index, without a
network (frontend_svc/engine/replica_router.py, kv_index.py, kv_subscriber.feed):
longest prefix wins above the cache threshold, an imbalance sends to the idlest,
round robin takes turns; events that arrive with gaps, twice, from a restarted
publisher or as AllBlocksCleared leave the index as the replica's cache is."""

import msgspec
import pytest

from frontend_svc.engine.kv_index import KvIndex, block_keys
from frontend_svc.engine.kv_subscriber import feed
from shared.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from frontend_svc.engine.replica_router import Candidate, ReplicaRouter, RoutingRule

BS = 4
ENCODE = msgspec.msgpack.Encoder().encode


def batch(*events) -> bytes:
    return ENCODE(KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0))


def stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None)


# ---- the rule

def test_the_longest_cached_prefix_wins_above_the_cache_threshold():
    router = ReplicaRouter(RoutingRule())
    d = router.choose([Candidate(0, load=0, matched_blocks=1), Candidate(1, load=3,
                                                                         matched_blocks=3)],
                      num_prompt_tokens=16, block_size=BS)
    assert (d.index, d.matched_tokens, d.reason) == (1, 12, "prefix")


def test_a_prefix_at_or_below_the_threshold_goes_to_the_least_loaded():
    router = ReplicaRouter(RoutingRule(cache_threshold=0.5))
    d = router.choose([Candidate(0, load=1, matched_blocks=2), Candidate(1, load=0)],
                      num_prompt_tokens=16, block_size=BS)  # 8 of 16 tokens: not > half
    assert (d.index, d.reason) == (1, "least-loaded")


def test_equal_load_without_a_prefix_prefers_the_replica_with_fewer_cached_blocks():
    router = ReplicaRouter()
    d = router.choose([Candidate(0, 0, 0, cached_blocks=50), Candidate(1, 0, 0, cached_blocks=3)],
                      16, BS)
    assert (d.index, d.reason) == (1, "smallest-cache")


def test_a_new_prefix_goes_where_it_fits_without_evicting_even_if_that_replica_is_busier():
    """The decision that split benchmarks/data_parallel.py's runs (22/10, 14/18) at 4
    users in flight, with the numbers it was taken on (tests/frontend/
    test_replica_router_workload.py, seed 2): the first user of the fourth system
    prompt (432 tokens, 27 full blocks; no replica holds any of it), pools of 68
    usable blocks. Replica 1 holds two prompts (57 blocks, room for 11) and had just
    finished a request; replica 0 holds one (40, room for 28). The old rule, by load
    alone, sent it to replica 1, where it evicted a prompt other users were about to
    ask for. The balance rule (64 and 1.5x) cannot fire at 2 vs 1."""
    router = ReplicaRouter()
    seen = [Candidate(0, load=2, matched_blocks=0, cached_blocks=40, room=28),
            Candidate(1, load=1, matched_blocks=0, cached_blocks=57, room=11)]
    d = router.choose(seen, num_prompt_tokens=432, block_size=16)
    assert (d.index, d.reason) == (0, "room")
    # room for it at both (or at neither, or unknown): the load decides, as SGLang's
    for rooms in ((40, 30), (5, 11), (None, None)):
        d = router.choose([Candidate(0, 2, 0, 40, rooms[0]), Candidate(1, 1, 0, 57, rooms[1])],
                          432, 16)
        assert (d.index, d.reason) == (1, "least-loaded"), rooms
    # a short prompt needs no room: many at once spread by load, not onto the emptier
    router = ReplicaRouter()
    loads = [0, 0]
    for _ in range(8):
        d = router.choose([Candidate(0, loads[0], 0, 0, 68), Candidate(1, loads[1], 0, 60, 8)],
                          12, 16)
        loads[d.index] += 1
    assert loads == [4, 4]
    d = router.choose([Candidate(0, 1, 0, 40), Candidate(1, 1, 0, 40)], 432, 16)
    assert d.reason == "tie"


def test_the_defaults_are_the_pinned_sglang_routers_own():
    """sglang-router 0.3.2's launch_router defaults (its router_args.py; the Rust
    Router's docstring still names 0.5 / 32 / 1.0001, which its CLI does not use)."""
    from sglang_router.router_args import RouterArgs

    from shared.config import RoutingFlags, add_flags
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, RoutingFlags)
    args = parser.parse_args([])
    ours = RoutingRule.from_args(args)
    theirs = RouterArgs()
    assert (ours.cache_threshold, ours.balance_abs_threshold, ours.balance_rel_threshold) == \
        (theirs.cache_threshold, theirs.balance_abs_threshold, theirs.balance_rel_threshold) \
        == (RoutingRule().cache_threshold, RoutingRule().balance_abs_threshold,
            RoutingRule().balance_rel_threshold)


def test_an_imbalance_beyond_both_thresholds_overrides_the_prefix():
    router = ReplicaRouter(RoutingRule(balance_abs_threshold=4, balance_rel_threshold=1.5))
    hot = [Candidate(0, load=10, matched_blocks=4), Candidate(1, load=5)]
    d = router.choose(hot, 16, BS)
    assert (d.index, d.reason) == (1, "balance")
    # a difference within the absolute threshold keeps the prefix
    d = router.choose([Candidate(0, load=8, matched_blocks=4), Candidate(1, load=5)], 16, BS)
    assert (d.index, d.reason) == (0, "prefix")
    # beyond the absolute one but within the relative one: still the prefix
    router = ReplicaRouter(RoutingRule(balance_abs_threshold=4, balance_rel_threshold=3.0))
    assert router.choose(hot, 16, BS).index == 0


def test_equal_prefixes_go_to_the_less_loaded_holder():
    d = ReplicaRouter().choose([Candidate(0, 2, 4), Candidate(1, 1, 4), Candidate(2, 0, 1)],
                               16, BS)
    assert (d.index, d.reason) == (1, "prefix")


def test_round_robin_takes_the_replicas_in_routing_in_turn():
    router = ReplicaRouter(RoutingRule(policy="round-robin"))
    every = [Candidate(0, 5, 4), Candidate(1, 0), Candidate(2, 0)]
    assert [router.choose(every, 16, BS).index for _ in range(4)] == [0, 1, 2, 0]
    # replica 1 left routing: the turn skips it
    assert [router.choose([every[0], every[2]], 16, BS).index for _ in range(3)] == [2, 0, 2]


def test_no_replica_in_routing_is_no_decision_and_bad_rules_are_refused():
    assert ReplicaRouter().choose([], 16, BS) is None
    with pytest.raises(ValueError, match="policy"):
        RoutingRule(policy="random")
    with pytest.raises(ValueError, match="threshold"):
        RoutingRule(cache_threshold=1.5)


# ---- the index from events

def test_stored_chains_match_a_prompts_leading_blocks_and_removal_shortens_it():
    index = KvIndex(BS)
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    feed(index, 0, batch(stored([11, 12], None, prompt[:8])))
    feed(index, 1, batch(stored([13], 12, prompt[8:12])))
    keys = block_keys(prompt, BS)
    assert len(keys) == 3 and index.match(keys, now=0.0) == 3
    other = block_keys([1, 2, 3, 4] + prompt[4:12], BS)  # same later tokens, other start
    assert index.match(other, now=0.0) == 0
    feed(index, 2, batch(BlockRemoved(block_hashes=[12], medium="GPU")))
    assert index.match(keys, now=0.0) == 1
    assert index.num_blocks == 2


def test_one_token_chain_under_two_salts_is_held_until_both_are_removed():
    index = KvIndex(BS)
    feed(index, 0, batch(stored([1], None, [5, 6, 7, 8]), stored([2], None, [5, 6, 7, 8])))
    keys = block_keys([5, 6, 7, 8], BS)
    feed(index, 1, batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert index.match(keys, 0.0) == 1
    feed(index, 2, batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert index.match(keys, 0.0) == 0


def test_all_blocks_cleared_empties_the_index():
    index = KvIndex(BS)
    feed(index, 0, batch(stored([1, 2], None, list(range(8)))))
    feed(index, 1, batch(AllBlocksCleared()))
    assert index.num_blocks == 0 and index.match(block_keys(list(range(8)), BS), 0.0) == 0


def test_a_gap_filled_by_replay_is_applied_in_order():
    index = KvIndex(BS)
    feed(index, 0, batch(stored([1], None, [1, 2, 3, 4])))
    missing = (1, batch(stored([2], 1, [5, 6, 7, 8])))
    state = feed(index, 2, batch(stored([3], 2, [9, 10, 11, 12])), replayed=[missing])
    assert state == "applied" and index.last_seq == 2
    assert index.match(block_keys(list(range(1, 13)), BS), 0.0) == 3


def test_a_gap_nothing_fills_resets_the_index_and_keeps_what_follows():
    index = KvIndex(BS)
    feed(index, 0, batch(stored([1], None, [1, 2, 3, 4])))
    state = feed(index, 5, batch(stored([9], None, [7, 7, 7, 7])), replayed=None)
    assert state == "reset" and index.last_seq == 5
    assert index.match(block_keys([1, 2, 3, 4], BS), 0.0) == 0  # may be gone: forgotten
    assert index.match(block_keys([7, 7, 7, 7], BS), 0.0) == 1
    # a block whose parent was in the lost batches cannot be placed
    feed(index, 6, batch(stored([10], 4242, [8, 8, 8, 8])))
    assert index.num_unplaced == 1


def test_a_repeated_batch_is_skipped_and_a_restarted_publisher_clears_the_index():
    index = KvIndex(BS)
    feed(index, 0, batch(stored([1], None, [1, 2, 3, 4])))
    feed(index, 1, batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert feed(index, 1, batch(stored([1], None, [1, 2, 3, 4]))) == "repeat"
    assert index.num_blocks == 0
    feed(index, 2, batch(stored([5], None, [4, 4, 4, 4])))
    assert feed(index, 0, batch(stored([6], None, [3, 3, 3, 3]))) == "restart"
    assert index.match(block_keys([4, 4, 4, 4], BS), 0.0) == 0
    assert index.match(block_keys([3, 3, 3, 3], BS), 0.0) == 1


def test_a_late_joiner_without_replay_starts_from_what_it_receives():
    index = KvIndex(BS)
    assert feed(index, 7, batch(stored([1], None, [1, 2, 3, 4]))) == "reset"
    assert index.match(block_keys([1, 2, 3, 4], BS), 0.0) == 1


def test_events_of_another_block_size_are_not_indexed():
    index = KvIndex(BS)
    feed(index, 0, batch(BlockStored(block_hashes=[1], parent_block_hash=None,
                                     token_ids=list(range(8)), block_size=8, lora_id=None,
                                     medium="GPU", lora_name=None)))
    assert index.num_blocks == 0 and index.num_unplaced == 1


def test_a_routed_prefix_is_held_while_its_request_is_open_and_a_grace_after():
    """No clock runs out on a request still open there (a first prefill can take
    longer than any fixed hold on a loaded machine); once it ended, its blocks wait
    GRACE_S for their events, then are no longer assumed."""
    from frontend_svc.engine.kv_index import GRACE_S

    index = KvIndex(BS)
    keys = block_keys(list(range(12)), BS)
    index.expect(keys)
    assert index.match(keys, now=100.0) == 3 and index.size(100.0) == 3
    assert index.match(keys, now=1e6) == 3  # still open: still held
    index.expect(keys[:2])  # a second request with the first two blocks
    index.settle(keys, now=1e6)
    assert index.match(keys, now=1e6 + GRACE_S + 1) == 2  # the other request holds two
    index.settle(keys[:2], now=2e6)
    assert index.match(keys, now=2e6 + GRACE_S - 1) == 3 - 1  # third block: expired
    assert index.match(keys, now=2e6 + GRACE_S) == 0 and index.size(2e6 + GRACE_S) == 0
    index.expect(keys)
    feed(index, 0, batch(stored([1, 2, 3], None, list(range(12)))))
    assert not index.expected and index.match(keys, now=1e9) == 3  # confirmed
    index.settle(keys, now=1e9)
    assert index.match(keys, now=1e10) == 3 and index.size(1e10) == 3


def test_a_cleared_index_still_expects_the_prompts_of_requests_open_there():
    index = KvIndex(BS)
    keys = block_keys(list(range(8)), BS)
    feed(index, 0, batch(stored([1], None, list(range(4)))))
    index.expect(keys)
    feed(index, 1, batch(AllBlocksCleared()))
    assert index.match(keys, now=0.0) == 2  # recomputed there: its request is open


def test_the_frontend_refuses_kv_endpoints_that_do_not_pair_with_the_schedulers(capsys):
    from frontend_svc import server
    with pytest.raises(SystemExit) as exc:
        server.main(["--scheduler-addresses", "127.0.0.1:1,127.0.0.1:2",
                     "--kv-events-endpoints", "tcp://127.0.0.1:5557"])
    assert exc.value.code == 2
    assert "--kv-events-endpoints: 1 given for 2 scheduler address(es)" in capsys.readouterr().err


def test_a_late_subscriber_replays_from_the_real_publisher_what_it_missed(tmp_path):
    """The scheduler's own publisher (scheduler_svc/kv_events.py) on ipc sockets: the
    subscriber joins after three batches, sees a gap at its first one, and fills it
    from the replay socket."""
    import asyncio

    from frontend_svc.engine.kv_subscriber import KvSubscriber
    from scheduler_svc.core.block_pool import BlocksStored
    from scheduler_svc.kv_events import KVEventsConfig, ZmqEventPublisher

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                         replay_endpoint=f"ipc://{tmp_path}/replay")
    publisher = ZmqEventPublisher(cfg, block_size=BS).start()
    digest = [bytes([i]) * 32 for i in range(1, 4)]
    chain = list(range(200, 212))
    for i in range(3):  # one block of the chain per batch, before anyone listens
        publisher.publish([BlocksStored([digest[i]], digest[i - 1] if i else None,
                                        chain[i * BS:(i + 1) * BS])])

    async def body():
        subscriber = KvSubscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay",
                                  KvIndex(BS), name="0")
        task = asyncio.ensure_future(subscriber.run())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        n = 0
        while subscriber.index.last_seq is None:  # the SUB may miss the first sends
            assert loop.time() < deadline, "no batch ever arrived"
            n += 1
            publisher.publish([BlocksStored([bytes([100 + n]) * 32], None, [n] * BS)])
            await asyncio.sleep(0.05)  # a poll period, not a synchronization
        task.cancel()
        return subscriber

    try:
        subscriber = asyncio.run(body())
    finally:
        publisher.close()
    assert subscriber.index.match(block_keys(chain, BS), 0.0) == 3  # replayed
    assert subscriber.num_resets == 0


def test_full_ties_go_round_so_one_request_at_a_time_spreads():
    router = ReplicaRouter()
    idle = [Candidate(0, 0), Candidate(1, 0), Candidate(2, 0)]
    assert [router.choose(idle, 4, BS).index for _ in range(4)] == [0, 1, 2, 0]
