from scheduler_svc.core.block_hash import BlockHasher
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from tests.scheduler.helpers import make_request

BS = 4


def manager(num_blocks=16, **kw):
    return KVCacheManager(num_blocks, BS, max_model_len=64, **kw)


def hashed(req_id, prompt):
    req = make_request(req_id, prompt)
    req.block_hasher = BlockHasher(BS, "seed")
    req.block_hasher(req)
    return req


def compute(kv, req, n):
    """Allocate for n tokens, then commit them as a finished step does."""
    blocks = kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req, req.num_computed_tokens)
    return blocks


def test_allocates_blocks_for_new_tokens_only_when_a_block_fills():
    kv = manager()
    req = hashed("a", list(range(6)))
    assert len(kv.allocate_slots(req, 6)) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) == []  # positions 6, 7 fit block 2
    req.num_computed_tokens = 8
    assert len(kv.allocate_slots(req, 1)) == 1


def test_lookahead_tokens_get_slots_too():
    kv = manager()
    req = hashed("a", list(range(4)))
    assert len(kv.allocate_slots(req, 4, num_lookahead_tokens=1)) == 2


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = manager(num_blocks=3)
    req = hashed("a", list(range(12)))
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2 and "a" not in kv.req_to_blocks


def test_prefix_hit_is_longest_chain_of_cached_full_blocks():
    kv = manager()
    a = hashed("a", list(range(10)))
    compute(kv, a, 10)  # blocks 0, 1 full and cached
    b = hashed("b", list(range(8)) + [99, 98, 97])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and blocks == kv.req_to_blocks["a"][:2]
    c = hashed("c", [0, 1, 2, 99] + list(range(4, 12)))
    assert kv.get_computed_blocks(c)[1] == 0  # the chain breaks at the first miss


def test_prefix_hit_never_covers_the_last_token():
    kv = manager()
    a = hashed("a", list(range(9)))
    compute(kv, a, 9)
    same = hashed("b", list(range(8)))  # exactly two full cached blocks
    assert kv.get_computed_blocks(same)[1] == 4


def test_no_prefix_hits_when_prefix_caching_is_disabled():
    kv = manager(enable_prefix_caching=False)
    a = hashed("a", list(range(9)))
    kv.allocate_slots(a, 9)
    assert not kv.pool.cached
    assert kv.get_computed_blocks(hashed("b", list(range(9))))[1] == 0


def test_prefix_hit_on_free_cached_blocks_takes_them_back():
    kv = manager(num_blocks=5)
    a = hashed("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    b = hashed("b", list(range(9)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    b.num_computed_tokens = 0
    new = kv.allocate_slots(b, 1, hit)
    assert len(new) == 1 and kv.req_to_blocks["b"][:2] == hit
    assert all(block.ref_cnt == 1 for block in kv.req_to_blocks["b"])
    assert kv.num_free_blocks == 1


def test_evictable_hit_blocks_count_against_free_blocks():
    kv = manager(num_blocks=4)  # 3 usable
    a = hashed("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    b = hashed("b", list(range(8)) + list(range(50, 55)))  # hit 2 (free), needs 2 more
    hit, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, hit) is None
    assert kv.num_free_blocks == 3


def test_free_releases_deepest_blocks_first():
    kv = manager(num_blocks=8)
    a = hashed("a", list(range(12)))
    compute(kv, a, 12)
    ids = kv.get_block_ids("a")
    kv.free(a)
    queue = [b.block_id for b in kv.pool.free_queue]
    assert queue[-3:] == [ids[2], ids[1], ids[0]]  # shallowest evicted last


def test_allocation_alone_registers_no_block():
    kv = manager()
    a = hashed("a", list(range(9)))
    kv.allocate_slots(a, 9)  # scheduled, not computed: its KV may never be written
    assert not kv.pool.cached
    assert kv.get_computed_blocks(hashed("b", list(range(9))))[1] == 0


def test_only_blocks_of_committed_tokens_are_cached():
    kv = manager()
    a = hashed("a", list(range(7)))
    compute(kv, a, 7)
    assert len(kv.pool.cached) == 1
    compute(kv, a, 1)  # a placeholder at position 7 fills block 1: not hashed yet
    assert len(kv.pool.cached) == 1
    a.append_output_token(50)  # its token is committed: the block's hash exists now
    compute(kv, a, 1)  # the next committed step catches up
    assert len(kv.pool.cached) == 2
