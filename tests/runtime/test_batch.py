import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmc.runtime.batch import StepBatch


def test_build_flattens_prefill_chunk_and_decodes():
    # seq 0: a 5-token prefill chunk at positions 3..7 (blocks 2, 0); seq 1: one decode token at position 9
    batch = StepBatch.build([[10, 11, 12, 13, 14], [20]], [3, 9], [[2, 0], [1, 3, 5]], block_size=4)
    batch.validate()
    np.testing.assert_array_equal(batch.token_ids, [10, 11, 12, 13, 14, 20])
    np.testing.assert_array_equal(batch.positions, [3, 4, 5, 6, 7, 9])
    np.testing.assert_array_equal(batch.slot_mapping, [2 * 4 + 3, 0, 1, 2, 3, 5 * 4 + 1])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 5, 6])
    np.testing.assert_array_equal(batch.seq_lens, [8, 10])
    np.testing.assert_array_equal(batch.block_tables, [[2, 0, 0], [1, 3, 5]])
    np.testing.assert_array_equal(batch.logits_indices, [4, 5])
    assert (batch.num_tokens, batch.num_seqs, batch.num_logits, batch.max_blocks) == (6, 2, 2, 3)
    for name, dtype in [("token_ids", np.int32), ("slot_mapping", np.int64), ("block_tables", np.int32)]:
        assert getattr(batch, name).dtype == dtype


def test_build_asks_for_the_last_rows_of_each_sequence():
    # seq 0 verifies 3 rows of its 5-token chunk, seq 1 decodes (1 row), seq 2 scores both of its tokens
    batch = StepBatch.build(
        [[10, 11, 12, 13, 14], [20], [30, 31]], [3, 9, 0], [[2, 0], [1, 3, 5], [4]], block_size=4, num_logits=[3, 1, 2]
    )
    batch.validate()
    np.testing.assert_array_equal(batch.logits_indices, [2, 3, 4, 5, 6, 7])
    assert batch.logits_indices.dtype == np.int32 and batch.num_logits == 6
    with pytest.raises(AssertionError, match="num_logits"):
        StepBatch.build([[1, 2]], [0], [[0]], block_size=4, num_logits=[3])  # more rows than new tokens


@given(st.lists(st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))), min_size=1, max_size=5))
def test_build_asks_for_each_sequences_last_rows_in_order(lens_and_rows):
    """logits_indices is the concatenation, sequence by sequence, of each one's last num_logits token rows."""
    tokens = [list(range(n)) for n, _ in lens_and_rows]
    batch = StepBatch.build(
        tokens,
        [0] * len(tokens),
        [[i] for i in range(len(tokens))],
        block_size=8,
        num_logits=[r for _, r in lens_and_rows],
    )
    batch.validate()
    ends = batch.query_start_loc[1:]
    want = [t for end, (_, r) in zip(ends, lens_and_rows, strict=True) for t in range(end - r, end)]
    assert batch.logits_indices.tolist() == want and batch.num_logits == len(want)


def test_build_rejects_a_block_table_too_short():
    with pytest.raises(AssertionError, match="blocks"):
        StepBatch.build([[1, 2, 3]], [14], [[0, 1, 2, 3]], block_size=4)  # 17 tokens need 5 blocks
    with pytest.raises(AssertionError, match="blocks"):
        StepBatch.build([[1], [2]], [3, 8], [[5], [0, 1]], block_size=4)  # decode: position 8 needs 3 blocks


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(0, 999)), min_size=1, max_size=6),
    st.sampled_from([1, 4, 16]),
)
def test_decode_steps_build_as_the_general_path_does(seqs, block_size):
    """A decode step (one token and one logits row per sequence) takes build()'s short path, which gives what the
    general one does: the same arrays, dtypes and contiguity."""
    rng = np.random.default_rng(len(seqs) * 1000 + block_size)
    tokens = [[tok] for _, _, tok in seqs]
    computed = [pos for pos, _, _ in seqs]
    tables = [rng.permutation(64)[: pos // block_size + 1 + spare].tolist() for pos, spare, _ in seqs]
    fast = StepBatch.build(tokens, computed, tables, block_size, num_logits=[1] * len(seqs))
    general = StepBatch._ragged(tokens, computed, tables, block_size, None)
    fast.validate()
    for field in dataclasses.fields(StepBatch):
        a, b = getattr(fast, field.name), getattr(general, field.name)
        if field.name == "seq_totals":  # not an ABI array: None unless given
            assert a is b is None
            continue
        assert a.dtype == b.dtype and a.flags.c_contiguous, field.name
        np.testing.assert_array_equal(a, b, err_msg=field.name)


def test_validate_catches_abi_mismatches():
    batch = StepBatch.build([[1, 2]], [0], [[0]], block_size=4)
    with pytest.raises(ValueError, match="slot_mapping"):
        dataclasses.replace(batch, slot_mapping=batch.slot_mapping.astype(np.int32)).validate()
    with pytest.raises(ValueError, match="C-contiguous"):
        dataclasses.replace(batch, block_tables=np.zeros((4, 2), np.int32)[::2]).validate()
    with pytest.raises(ValueError, match="query_start_loc"):
        dataclasses.replace(batch, query_start_loc=np.array([0, 1], np.int32)).validate()
    with pytest.raises(ValueError, match="token rows in 0..1"):
        dataclasses.replace(batch, logits_indices=np.array([0, 2], np.int32)).validate()
    with pytest.raises(ValueError, match="N >= 1"):
        dataclasses.replace(batch, logits_indices=np.zeros(0, np.int32)).validate()
    # any rows, in any order, repeated or not, make a valid step
    dataclasses.replace(batch, logits_indices=np.array([1, 0, 1], np.int32)).validate()


def test_long_rope_positions_mark_the_sequences_past_the_original_length():
    """A sequence is long by the tokens its request holds (seq_totals), or by seq_lens without them: a prompt
    prefilled in chunks is long from its first chunk."""
    from llmc.runtime.batch import LONG_ROPE_FLAG

    tables = [[0], list(range(1, 12)), [12, 13, 14]]
    batch = StepBatch.build([[1, 2, 3], [4], [5, 6]], [0, 40, 7], tables, 4)
    flag = LONG_ROPE_FLAG
    assert batch.long_rope_positions(32).tolist() == [0, 1, 2, 40 | flag, 7, 8]
    chunked = StepBatch.build([[1, 2, 3], [4], [5, 6]], [0, 40, 7], tables, 4, seq_totals=[100, 41, 9])
    assert chunked.long_rope_positions(32).tolist() == [flag, 1 | flag, 2 | flag, 40 | flag, 7, 8]
    assert chunked.positions.tolist() == [0, 1, 2, 40, 7, 8]  # the ABI positions stay as they are
