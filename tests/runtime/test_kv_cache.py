import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmc.runtime.kv_cache import (
    BlockPool,
    KVCacheManager,
    blocks_for_memory,
    hash_block_tokens,
    kv_bytes_per_block,
    kv_cache_budget_bytes,
    mem_available_bytes,
    parse_memory_size,
)


def test_allocate_free_exact_block_ids_and_free_queue_order():
    kv = KVCacheManager(num_blocks=11, block_size=16)
    assert kv.pool.free_block_ids() == list(range(11))

    assert kv.allocate_slots("a", 35)  # 35 tokens: 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.free_block_ids() == list(range(3, 11))
    assert kv.allocate_slots("b", 16)  # exactly one block
    assert kv.block_ids("b") == [3]

    assert kv.allocate_slots("a", 13)  # 48 tokens: still 3 blocks, the last one filled
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 7
    assert kv.allocate_slots("a", 1)  # 49: a 4th block, next in the free queue
    assert kv.block_ids("a") == [0, 1, 2, 4]
    assert kv.allocate_slots("b", 1)
    assert kv.block_ids("b") == [3, 5]

    kv.free("a")  # tail first: 4, 2, 1, 0 go to the back of the queue
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 10, 4, 2, 1, 0]
    assert kv.allocate_slots("c", 16 * 6 + 1)  # 7 blocks: the queue's front
    assert kv.block_ids("c") == [6, 7, 8, 9, 10, 4, 2]
    assert kv.pool.free_block_ids() == [1, 0]
    kv.free("b")
    assert kv.pool.free_block_ids() == [1, 0, 5, 3]
    kv.free("c")
    assert kv.num_free_blocks == 11 and kv.usage == 0.0


def test_allocate_slots_out_of_blocks_returns_false_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 40)  # 3 blocks
    before = kv.pool.free_block_ids()
    assert not kv.allocate_slots("b", 17)  # needs 2, 1 free
    assert "b" not in kv and kv.pool.free_block_ids() == before
    assert not kv.allocate_slots("a", 40)  # 80 tokens = 5 blocks > 4
    assert kv.num_slots("a") == 40 and kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots("a", 24)  # 64 = 4 blocks: the last free one
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots("b", 0)  # an empty table needs no block
    assert kv.block_ids("b") == []


def test_sliding_window_releases_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=6, block_size=4, sliding_window=5)
    assert kv.allocate_slots("a", 10)  # positions 0..9: 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    # the next token (position 10) reads keys 6..10: block 0 (positions 0..3) is behind the window
    assert kv.allocate_slots("a", 1)
    assert kv.block_ids("a") == [0, 1, 2] and kv.pool.free_block_ids() == [3, 4, 5, 0]
    assert kv.allocate_slots("a", 3)  # positions 11..13; position 11 reads keys 7..11, so block 1 stays
    assert kv.block_ids("a") == [0, 1, 2, 3] and kv.pool.free_block_ids() == [4, 5, 0]
    assert kv.allocate_slots("a", 1)  # position 14 reads keys 10..14: block 1 (positions 4..7) goes
    assert kv.block_ids("a") == [0, 0, 2, 3] and kv.pool.free_block_ids() == [4, 5, 0, 1]  # released: 0
    assert kv.slot_mapping("a", 12, 15).tolist() == [12, 13, 14]
    assert kv.num_slots("a") == 15
    kv.free("a")  # only the blocks still held go back
    assert kv.num_free_blocks == 6 and sorted(kv.pool.free_block_ids()) == list(range(6))
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=2, block_size=4, sliding_window=-1)


def test_double_free_and_unknown_request_raise():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    kv.allocate_slots("a", 20)
    kv.free("a")
    with pytest.raises(ValueError, match="already freed"):
        kv.free("a")
    with pytest.raises(ValueError, match="never allocated"):
        kv.free("nobody")
    assert kv.num_free_blocks == 4


def test_block_pool_checks_each_free():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="twice"):
        pool.free([blocks[0], blocks[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([2])  # never allocated
    with pytest.raises(ValueError, match="not in the pool"):
        pool.free([7])
    assert pool.num_free_blocks == 2  # failed frees changed nothing
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks[:1])


def prefix_cache(num_blocks=8, block_size=4, sliding_window=0):
    return KVCacheManager(num_blocks, block_size, sliding_window=sliding_window, enable_prefix_caching=True)


def computed(kv, req_id, tokens):
    """Allocate for `tokens` (sharing what is cached) and cache the blocks, as a successful step does."""
    blocks = kv.get_computed_blocks(tokens)
    assert kv.allocate_slots(req_id, len(tokens) - len(blocks) * kv.block_size, blocks)
    kv.cache_blocks(req_id, tokens, len(tokens))
    return blocks


def test_prefix_cache_shares_full_blocks_by_chain_hash_and_counts_holders():
    kv = prefix_cache()
    a = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert computed(kv, "a", a) == [] and kv.block_ids("a") == [0, 1, 2]
    assert kv.pool.num_cached_blocks == 2  # only full blocks are cached
    # b starts like a: it shares a's two full blocks and computes the rest in a block of its own
    b = a[:8] + [50, 51, 52]
    assert kv.get_computed_blocks(b) == [0, 1]
    assert computed(kv, "b", b) == [0, 1] and kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    # the chain: an equal second block after a different first one is a different block
    assert kv.get_computed_blocks([9, 9, 9, 9] + a[4:8] + [1]) == []
    assert kv.get_computed_blocks(a[:4] + [9] * 5) == [0]
    assert hash_block_tokens(b"", [1, 2]) != hash_block_tokens(hash_block_tokens(b"", [0]), [1, 2])
    kv.free("a")  # b still holds 0 and 1: only a's own block 2 goes back
    assert kv.pool.free_block_ids()[-1:] == [2] and [kv.pool.ref_count(i) for i in range(3)] == [1, 1, 0]
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.pool.num_cached_blocks == 2  # free, still cached


def test_prefix_cache_never_covers_the_whole_prompt():
    kv = prefix_cache()
    computed(kv, "a", list(range(8)))
    assert kv.get_computed_blocks(list(range(8))) == [0]  # the last token must be computed to get logits
    assert kv.get_computed_blocks(list(range(9))) == [0, 1]
    assert kv.get_computed_blocks([0]) == [] and kv.get_computed_blocks([]) == []


def test_free_cached_blocks_are_revived_or_evicted_least_recently_freed_first():
    kv = prefix_cache(num_blocks=4)
    computed(kv, "a", list(range(8)) + [0])  # blocks 0, 1 cached, 2 partial
    kv.free("a")  # tail first: the queue is 3, 2, 1, 0
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    computed(kv, "c", [7] * 5)  # a fresh block from the front: 3, then 2 (neither cached)
    assert kv.block_ids("c") == [3, 2] and kv.pool.num_cached_blocks == 3  # c's [7, 7, 7, 7] is cached too
    kv.free("c")  # queue: 1, 0, 2, 3
    # a hit takes its blocks out of the middle of the free queue, and they are not counted as free twice
    assert kv.get_computed_blocks(list(range(8)) + [5]) == [0, 1]
    assert not kv.allocate_slots("d", 4 * 4 - 7, [0, 1])  # 2 shared + 3 new > 4 blocks: nothing changes
    assert "d" not in kv and kv.pool.free_block_ids() == [1, 0, 2, 3]
    assert kv.allocate_slots("d", 4 * 4 - 8, [0, 1])  # 2 shared + 2 new: evicts 2 ... then 3, both free
    assert kv.block_ids("d") == [0, 1, 2, 3] and kv.num_free_blocks == 0
    assert kv.get_computed_blocks([7] * 5) == []  # c's block 3 was evicted for d
    assert kv.pool.num_cached_blocks == 2


def test_a_block_computed_twice_side_by_side_is_cached_once():
    kv = prefix_cache()
    tokens = list(range(5))
    assert kv.allocate_slots("a", 5) and kv.allocate_slots("b", 5)  # both before either step ran
    kv.cache_blocks("a", tokens, 5)
    kv.cache_blocks("b", tokens, 5)
    assert kv.get_computed_blocks(tokens) == [0] and kv.pool.num_cached_blocks == 1
    kv.free("a")
    kv.free("b")  # b's copy (block 2) is a plain free block; a's block 0 stays cached
    assert kv.get_computed_blocks(tokens) == [0]


def test_prefix_cache_off_finds_nothing():
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("a", 9)
    kv.cache_blocks("a", list(range(9)), 9)
    assert kv.get_computed_blocks(list(range(9))) == [] and kv.pool.num_cached_blocks == 0


def test_sliding_window_with_shared_blocks():
    kv = prefix_cache(num_blocks=8, block_size=4, sliding_window=5)
    a = list(range(13))
    assert kv.allocate_slots("a", 12)
    kv.cache_blocks("a", a, 12)  # blocks 0, 1, 2 cached
    # b hits all 3 blocks (12 tokens); its next token (position 12) reads 8..12, so block 0 and 1 are never held
    assert kv.get_computed_blocks(a) == [0, 1, 2]
    assert kv.allocate_slots("b", 1, [0, 1, 2])
    assert kv.block_ids("b") == [0, 0, 2, 3]  # released entries read 0
    assert [kv.pool.ref_count(i) for i in range(4)] == [1, 1, 2, 1]
    assert kv.allocate_slots("a", 1)  # a moves on too: position 12's window drops blocks 0 and 1
    assert [kv.pool.ref_count(i) for i in range(3)] == [0, 0, 2]
    assert kv.get_computed_blocks(a) == [0, 1, 2]  # released blocks stay cached while free
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8


def test_slot_mapping_follows_the_block_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("x", 3)  # block 0
    kv.allocate_slots("y", 4)  # block 1
    kv.allocate_slots("x", 6)  # 9 tokens: blocks 0, 2, 3
    assert kv.block_ids("x") == [0, 2, 3]
    np.testing.assert_array_equal(kv.slot_mapping("x", 0, 9), [0, 1, 2, 3, 8, 9, 10, 11, 12])
    np.testing.assert_array_equal(kv.slot_mapping("x", 7, 9), [11, 12])
    assert kv.slot_mapping("x", 0, 9).dtype == np.int64
    with pytest.raises(AssertionError):
        kv.slot_mapping("x", 0, 10)


def test_sizing_helpers(tmp_path):
    per_block = kv_bytes_per_block(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, kv_dtype="float32")
    assert per_block == 2 * 2 * 16 * 4 * 8 * 4
    assert blocks_for_memory(10 * per_block + per_block - 1, per_block) == 10
    assert blocks_for_memory(per_block - 1, per_block) == 0
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("512MB") == 512 * 10**6
    assert parse_memory_size("1.5g") == 1_500_000_000
    assert parse_memory_size("1024") == 1024
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size("lots")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   2000000 kB\n")
    assert mem_available_bytes(str(meminfo)) == 2000000 * 1024
    assert kv_cache_budget_bytes("1GiB") == 2**30
    assert kv_cache_budget_bytes(None, memory_fraction=0.25, free_bytes=4000) == 1000
    assert kv_cache_budget_bytes(None, 0.5) > 0  # reads this machine's /proc/meminfo
    with pytest.raises(ValueError):
        kv_cache_budget_bytes(None, memory_fraction=1.5, free_bytes=1)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_prefix_cache_under_random_operations_never_hands_out_wrong_tokens(data):
    """Random requests over a 3-token alphabet (so prefixes collide often), growing and freed in random order, in
    a small pool, with and without a sliding window. The test writes each token into its slot, as a step does, and
    checks that every block the cache offers holds exactly the tokens asked for, and that the reference counts,
    the free queue and the hash map always agree with the block tables."""
    block_size = 2
    num_blocks = data.draw(st.integers(2, 8))
    window = data.draw(st.sampled_from([0, 3, 5]))
    kv = KVCacheManager(num_blocks, block_size, sliding_window=window, enable_prefix_caching=True)
    slots = np.full(num_blocks * block_size, -1)
    live: dict[str, list[int]] = {}

    def compute(req_id, tokens, start):
        slots[kv.slot_mapping(req_id, start, len(tokens))] = tokens[start:]
        kv.cache_blocks(req_id, tokens, len(tokens))
        live[req_id] = tokens

    for step in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["new", "grow", "free"]))
        if op == "new":
            tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
            blocks = kv.get_computed_blocks(tokens)
            assert len(blocks) * block_size < len(tokens)
            for i, b in enumerate(blocks):
                held_tokens = slots[b * block_size : (b + 1) * block_size].tolist()
                assert held_tokens == tokens[i * block_size : (i + 1) * block_size]
            if kv.allocate_slots(f"r{step}", len(tokens) - len(blocks) * block_size, blocks):
                compute(f"r{step}", tokens, len(blocks) * block_size)
        elif live:
            req_id = data.draw(st.sampled_from(sorted(live)))
            if op == "free":
                kv.free(req_id)
                del live[req_id]
            elif kv.allocate_slots(req_id, 1):
                compute(req_id, live[req_id] + [data.draw(st.integers(0, 2))], len(live[req_id]))
        held = [b for table in kv._blocks.values() for b in table if b >= 0]
        assert all(kv.pool.ref_count(b) == held.count(b) for b in range(num_blocks))
        assert sorted(kv.pool.free_block_ids()) == [b for b in range(num_blocks) if b not in held]
        assert kv.pool.num_cached_blocks <= num_blocks
    for req_id in list(live):
        kv.free(req_id)
    assert kv.num_free_blocks == num_blocks
