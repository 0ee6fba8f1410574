import pytest

from scheduler_svc.core.block_hash import BlockHasher
from scheduler_svc.core.block_pool import BlockPool
from tests.scheduler.helpers import make_request


def free_ids(pool):
    return [b.block_id for b in pool.free_queue]


def test_block_zero_is_reserved_and_never_handed_out():
    pool = BlockPool(5)
    assert free_ids(pool) == [1, 2, 3, 4]
    got = pool.get_new_blocks(4)
    assert 0 not in [b.block_id for b in got]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)


def test_usage_is_one_minus_free_over_total_less_null_block():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    pool.get_new_blocks(1)
    assert pool.usage == pytest.approx(0.25)


def test_allocation_takes_from_the_head_of_the_free_queue():
    pool = BlockPool(5)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]


def test_freed_block_without_hash_goes_to_head_with_hash_to_tail():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h" * 32)
    pool.free_blocks([a, b])
    assert free_ids(pool) == [b.block_id, 3, 4, 5, a.block_id]


def test_cached_block_is_evicted_lazily_when_handed_out_again():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h" * 32)
    pool.free_blocks([a])
    assert pool.get_cached_block(b"h" * 32) is a  # still a hit while free
    pool.free_blocks([b])
    pool.get_new_blocks(1)  # b, from the head
    assert pool.get_cached_block(b"h" * 32) is a
    (again,) = pool.get_new_blocks(1)
    assert again is a and a.block_hash is None
    assert pool.get_cached_block(b"h" * 32) is None


def test_prefix_hit_takes_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]) * 32)
    pool.free_blocks(blocks)
    middle = blocks[2]
    pool.touch([middle])
    assert middle.ref_cnt == 1
    assert middle.block_id not in free_ids(pool)
    assert pool.num_free_blocks == 4


def test_reference_counts_free_a_shared_block_only_when_last_holder_frees():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.free_blocks([a])
    assert pool.num_free_blocks == 1 and a.ref_cnt == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_hash_chain_covers_only_full_blocks_and_extends_as_tokens_are_appended():
    hasher = BlockHasher(4, "seed")
    req = make_request("a", list(range(10)))
    hasher(req)
    assert len(req.block_hashes) == 2
    req.block_hasher = hasher
    req.append_output_token(7)
    assert len(req.block_hashes) == 2
    first_two = list(req.block_hashes)
    req.append_output_token(8)
    assert len(req.block_hashes) == 3 and req.block_hashes[:2] == first_two


def test_hash_depends_on_parent_so_equal_blocks_at_different_depths_differ():
    hasher = BlockHasher(2, "seed")
    req = make_request("a", [5, 5, 5, 5])
    hasher(req)
    assert req.block_hashes[0] != req.block_hashes[1]


def test_hash_differs_by_cache_salt_and_by_deployment_seed():
    def first_hash(seed, salt):
        req = make_request("a", [1, 2, 3, 4], salt=salt)
        BlockHasher(4, seed)(req)
        return req.block_hashes[0]

    assert first_hash("s", None) == first_hash("s", None)
    assert first_hash("s", None) != first_hash("s", "tenant-a")
    assert first_hash("s", "tenant-a") != first_hash("s", "tenant-b")
    assert first_hash("s", None) != first_hash("t", None)


def test_hash_is_sha256_sized():
    req = make_request("a", [1, 2, 3, 4])
    BlockHasher(4, "s")(req)
    assert len(req.block_hashes[0]) == 32
