import pytest

from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.scheduler import Request, RequestStatus, Scheduler


def make(num_blocks=16, block_size=4, budget=32, max_seqs=8, prefix_caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs)


def run_step(sched: Scheduler, token=7):
    """schedule(), cache the computed blocks and append a token to every sequence that samples, as the engine does."""
    out = sched.schedule()
    sched.cache_computed_blocks(out)
    for s in out.scheduled:
        if s.samples:
            sched.append_token(s.req_id, token)
    return out


def chunks(out):
    return [(s.req_id, s.num_computed_tokens, len(s.token_ids), s.samples) for s in out.scheduled]


def test_chunked_prefill_then_decode():
    sched = make(budget=16)
    sched.add_request(Request("a", list(range(40))))
    assert chunks(run_step(sched)) == [("a", 0, 16, False)]
    assert chunks(run_step(sched)) == [("a", 16, 16, False)]
    out = run_step(sched)
    assert chunks(out) == [("a", 32, 8, True)]
    assert out.scheduled[0].token_ids == list(range(32, 40))
    assert chunks(run_step(sched)) == [("a", 40, 1, True)]  # decode: the sampled token
    assert sched.requests["a"].all_token_ids[40:] == [7, 7]


def test_prefill_chunk_mixes_into_running_decodes():
    sched = make(budget=10)
    sched.add_request(Request("a", [1, 2, 3]))
    run_step(sched)  # a prefilled
    sched.add_request(Request("b", list(range(30))))
    assert chunks(run_step(sched)) == [("a", 3, 1, True), ("b", 0, 9, False)]  # b gets what a left
    assert chunks(run_step(sched)) == [("a", 4, 1, True), ("b", 9, 9, False)]


def test_block_table_and_budget_in_output():
    sched = make(block_size=4, budget=32)
    sched.add_request(Request("a", list(range(9))))
    out = run_step(sched)
    assert out.scheduled[0].block_ids == [0, 1, 2] and out.num_scheduled_tokens == 9


def test_fifo_admission_does_not_skip_a_request_that_does_not_fit():
    sched = make(num_blocks=4, block_size=4, budget=64)
    sched.add_request(Request("a", list(range(8))))  # 2 blocks
    sched.add_request(Request("big", list(range(12))))  # 3 blocks: does not fit next to a
    sched.add_request(Request("small", [1]))  # would fit, but must wait its turn
    out = run_step(sched)
    assert [s.req_id for s in out.scheduled] == ["a"]
    assert [r.req_id for r in sched.waiting] == ["big", "small"]
    sched.finish_request("a")
    assert sched.kv_cache.num_free_blocks == 4
    out = run_step(sched)
    assert [s.req_id for s in out.scheduled] == ["big", "small"]


def test_max_num_seqs_limits_running():
    sched = make(max_seqs=2)
    for i in range(4):
        sched.add_request(Request(f"r{i}", [1, 2]))
    out = run_step(sched)
    assert [s.req_id for s in out.scheduled] == ["r0", "r1"] and sched.num_waiting == 2


def test_preemption_recomputes_the_newest_and_keeps_its_tokens():
    sched = make(num_blocks=4, block_size=4, budget=64)
    sched.add_request(Request("old", [1, 2, 3, 4, 5, 6, 7, 8]))  # 2 blocks
    sched.add_request(Request("new", [1, 2, 3, 4, 5, 6, 7, 8]))  # 2 blocks
    run_step(sched)  # both prefilled: cache full, and each one's next token needs a third block
    assert sched.kv_cache.num_free_blocks == 0
    out = run_step(sched)
    assert out.preempted_req_ids == ["new"]
    assert chunks(out) == [("old", 8, 1, True)]  # and no admission in a step that preempted
    new = sched.requests["new"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 7]  # its sampled token is kept
    assert "new" not in sched.kv_cache and sched.waiting[0] is new
    assert sched.num_preemptions == 1
    sched.finish_request("old")
    out = run_step(sched)
    assert chunks(out) == [("new", 0, 9, True)]  # recomputed as if it were prompt


def test_request_preempting_itself_stops_the_running_pass():
    sched = make(num_blocks=3, block_size=4, budget=64)
    sched.add_request(Request("a", [1, 2, 3]))  # 1 block, room for its next token
    sched.add_request(Request("b", list(range(8))))  # 2 blocks, full
    run_step(sched)
    out = run_step(sched)  # b needs a block, none is free, and b is itself the newest
    assert out.preempted_req_ids == ["b"] and chunks(out) == [("a", 3, 1, True)]
    assert sched.kv_cache.num_free_blocks == 2 and sched.waiting[0].req_id == "b"
    sched.finish_request("a")
    assert chunks(run_step(sched)) == [("b", 0, 9, True)]
    assert sched.requests["b"].status is RequestStatus.RUNNING


def test_abort_frees_blocks_at_once_in_any_state():
    sched = make(num_blocks=8, block_size=4)
    sched.add_request(Request("run", list(range(10))))
    run_step(sched)
    sched.add_request(Request("wait", [1]))
    assert sched.kv_cache.num_free_blocks == 5
    assert sched.abort("run") and sched.kv_cache.num_free_blocks == 8
    assert sched.abort("wait") and not sched.waiting
    assert not sched.abort("run") and not sched.has_unfinished()


def test_duplicate_request_id_is_rejected():
    sched = make()
    sched.add_request(Request("a", [1]))
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request(Request("a", [2]))


def test_admission_takes_the_cached_prefix_and_prefills_only_the_rest_in_chunks():
    sched = make(num_blocks=16, block_size=4, budget=6, prefix_caching=True)
    sched.add_request(Request("a", list(range(10))))
    assert chunks(run_step(sched)) == [("a", 0, 6, False)]
    assert chunks(run_step(sched)) == [("a", 6, 4, True)]  # a's blocks 0 and 1 (tokens 0..7) are cached now
    sched.finish_request("a")
    sched.add_request(Request("b", list(range(8)) + [40, 41, 42, 43, 44, 45, 46, 47]))
    out = run_step(sched)
    assert chunks(out) == [("b", 8, 6, False)]  # 8 tokens found; the budget goes to the 8 missing ones, chunked
    assert out.scheduled[0].block_ids[:2] == [0, 1] and out.scheduled[0].token_ids == [40, 41, 42, 43, 44, 45]
    assert chunks(run_step(sched)) == [("b", 14, 2, True)]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 16, 8)


def test_preempted_request_finds_its_own_blocks_again():
    sched = make(num_blocks=4, block_size=4, budget=64, prefix_caching=True)
    sched.add_request(Request("old", [1, 2, 3, 4, 5, 6, 7, 8]))
    sched.add_request(Request("new", [9, 10, 11, 12, 13, 14, 15, 16]))
    run_step(sched)
    out = run_step(sched)  # the cache is full: new is preempted; its blocks stay cached while free
    assert out.preempted_req_ids == ["new"]
    # old's third block is new's last one (a request's tail blocks are evicted first); its first one stays
    assert sched.kv_cache.block_ids("old") == [0, 1, 3] and sched.kv_cache.pool.num_cached_blocks == 3
    sched.finish_request("old")
    out = run_step(sched)
    assert chunks(out) == [("new", 4, 5, True)]  # its first block is found; the rest and its sampled token computed
    assert sched.requests["new"].num_preemptions == 1


def test_longrope_recomputes_a_request_the_step_it_passes_the_original_length():
    """LongRoPE (original length 10): a request of 9 prompt tokens decodes with the short set until it holds 11
    tokens; that step computes all 11 again (its short-rotated k/v dropped), and decoding goes on from there."""
    kv = KVCacheManager(16, 4)
    sched = Scheduler(kv, max_num_batched_tokens=32, max_num_seqs=4, long_rope=10)
    sched.add_request(Request("a", list(range(9))))
    assert chunks(run_step(sched)) == [("a", 0, 9, True)]  # 10 tokens now: not past the original length
    assert chunks(run_step(sched)) == [("a", 9, 1, True)]  # computes the 10th; 11 tokens now
    out = run_step(sched)
    assert chunks(out) == [("a", 0, 11, True)] and out.scheduled[0].token_ids == sched.requests["a"].all_token_ids[:11]
    assert chunks(run_step(sched)) == [("a", 11, 1, True)]


def test_longrope_keeps_short_and_long_blocks_apart_in_the_prefix_cache():
    """Blocks computed with the short set are never found by a request past the original length (the k/v differ),
    while one past it finds another long request's."""
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, long_rope=10)
    sched.add_request(Request("short", list(range(9))))
    run_step(sched)
    sched.finish_request("short")
    sched.add_request(Request("long", list(range(20))))
    assert chunks(run_step(sched)) == [("long", 0, 20, True)]  # the short request's blocks 0..1 are not its
    sched.finish_request("long")
    sched.add_request(Request("long2", list(range(16)) + [99, 98, 97, 96]))
    assert chunks(run_step(sched)) == [("long2", 16, 4, True)]  # the long request's 4 full blocks are
