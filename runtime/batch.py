"""StepBatch: one ragged step, field for field the arguments of the C ABI `llmc_step` (docs/contracts.md).

T flattened tokens from B sequences, prefill chunks and decode tokens mixed. The runtime builds it from
the scheduler's output; the compiled module (or a test's fake model) consumes it and returns float32
logits [N, vocab], one row per entry of logits_indices: by default N = B, each sequence's last token; a
sequence under speculative verification asks for its last K+1 rows, prompt scoring for all of them.
Nothing here knows about requests, sampling or the block pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llmc.runtime.kv_cache import slot_id, slot_ids

LONG_ROPE_FLAG = 1 << 30  # the templates' kLongRopeFlag: a position's mark for LongRoPE's long set (docs/contracts.md)


@dataclasses.dataclass(frozen=True)
class StepBatch:
    token_ids: np.ndarray  # int32 [T]: the new tokens of this step, sequence by sequence
    positions: np.ndarray  # int32 [T]: absolute position of each token in its sequence
    slot_mapping: np.ndarray  # int64 [T]: cache slot of the token's k/v = block_id * block_size + offset
    query_start_loc: np.ndarray  # int32 [B+1]: tokens of sequence b are [qsl[b], qsl[b+1])
    seq_lens: np.ndarray  # int32 [B]: context length of sequence b after this step (cached + new)
    block_tables: np.ndarray  # int32 [B, max_blocks]: cache blocks of sequence b in order; unused = 0
    logits_indices: np.ndarray  # int32 [N]: the token rows (of T) whose logits the step returns, in this order
    # Not an ABI array: int32 [B], the tokens each sequence's request holds in all (LongRoPE's switch, which the
    # module marks in the positions it passes: CompiledModel.step); None: seq_lens
    seq_totals: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    @property
    def max_blocks(self) -> int:
        return int(self.block_tables.shape[1])

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_logits: Sequence[int] | None = None,
        seq_totals: Sequence[int] | None = None,
    ) -> StepBatch:
        """Flatten B sequences' new tokens into one step.

        token_ids[b]: the new tokens of sequence b (n_b >= 1), which sit at positions
        num_computed_tokens[b] .. num_computed_tokens[b] + n_b - 1; block_tables[b]: its block ids, covering
        at least seq_len slots. Block tables are padded with 0 to the longest one in the batch.
        num_logits[b] (1..n_b; default 1): the step returns logits for the last num_logits[b] new tokens of
        sequence b, sequence by sequence and in token order. Any other set of rows is a `logits_indices` of
        one's own (dataclasses.replace). seq_totals[b]: the tokens sequence b's request holds in all, when more
        than this step brings it to (a prompt prefilled in chunks; default: seq_lens).
        """
        num_seqs = len(token_ids)
        assert num_seqs == len(num_computed_tokens) == len(block_tables) and num_seqs > 0, "empty or ragged step"
        if all(len(t) == 1 for t in token_ids) and (num_logits is None or all(r == 1 for r in num_logits)):
            batch = cls._decode(token_ids, num_computed_tokens, block_tables, block_size)
        else:
            batch = cls._ragged(token_ids, num_computed_tokens, block_tables, block_size, num_logits)
        if seq_totals is None:
            return batch
        totals = np.asarray(seq_totals, dtype=np.int32)
        assert totals.shape == (num_seqs,) and (totals >= batch.seq_lens).all(), f"seq_totals {totals}"
        return dataclasses.replace(batch, seq_totals=totals)

    @classmethod
    def _ragged(
        cls,
        token_ids: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_logits: Sequence[int] | None,
    ) -> StepBatch:
        """build() for any step, in numpy."""
        num_seqs = len(token_ids)
        n = np.fromiter((len(t) for t in token_ids), dtype=np.int32, count=num_seqs)  # [B]
        assert (n > 0).all(), "every sequence in a step carries at least one new token"
        computed = np.asarray(num_computed_tokens, dtype=np.int32)  # [B]
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(n, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = computed + n
        seq_index = np.repeat(np.arange(num_seqs, dtype=np.int32), n)  # [T]: which sequence owns token t
        positions = (np.arange(num_tokens, dtype=np.int32) - qsl[:-1][seq_index] + computed[seq_index]).astype(np.int32)
        max_blocks = max(1, max(len(bt) for bt in block_tables))
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for b, bt in enumerate(block_tables):
            assert len(bt) * block_size >= seq_lens[b], f"sequence {b}: {len(bt)} blocks < {seq_lens[b]} tokens"
            tables[b, : len(bt)] = bt
        rows = np.ones(num_seqs, dtype=np.int32) if num_logits is None else np.asarray(num_logits, dtype=np.int32)
        assert rows.shape == (num_seqs,) and (rows >= 1).all() and (rows <= n).all(), (
            f"num_logits {rows} for {n} tokens"
        )
        # the last rows[b] token rows of each sequence b, in order: qsl[b+1] - rows[b] .. qsl[b+1] - 1
        from_end = np.repeat(np.cumsum(rows), rows) - np.arange(int(rows.sum()))  # [N]: rows[b] down to 1 in seq b
        logits_indices = np.repeat(qsl[1:], rows) - from_end
        flat_ids = np.fromiter((t for seq in token_ids for t in seq), dtype=np.int32, count=num_tokens)
        return cls(
            token_ids=flat_ids,
            positions=positions,
            slot_mapping=slot_ids(tables, seq_index, positions, block_size),
            query_start_loc=qsl,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=tables,
            logits_indices=logits_indices.astype(np.int32),
        )

    @classmethod
    def _decode(
        cls,
        token_ids: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
    ) -> StepBatch:
        """build() for a decode step (one new token and one logits row per sequence), from plain Python and six
        array constructions. It runs right after a step has streamed the weights through every cache, where each
        numpy call costs microseconds of misses: build()'s twenty-odd took ~280 us a token at batch 1 (SmolLM-135M
        shape, int4, 2-core EPYC), 7% of the step."""
        max_blocks = max(1, max(len(bt) for bt in block_tables))
        slots = []
        for b, (bt, pos) in enumerate(zip(block_tables, num_computed_tokens, strict=True)):
            assert len(bt) * block_size > pos, f"sequence {b}: {len(bt)} blocks < {pos + 1} tokens"
            slots.append(slot_id(bt, pos, block_size))
        rows = np.arange(len(token_ids) + 1, dtype=np.int32)
        return cls(
            token_ids=np.array([t[0] for t in token_ids], dtype=np.int32),
            positions=np.array(num_computed_tokens, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int64),
            query_start_loc=rows,
            seq_lens=np.array([p + 1 for p in num_computed_tokens], dtype=np.int32),
            block_tables=np.array([[*bt, *[0] * (max_blocks - len(bt))] for bt in block_tables], dtype=np.int32),
            logits_indices=rows[:-1],
        )

    def long_rope_positions(self, original: int) -> np.ndarray:
        """positions with LONG_ROPE_FLAG set on the tokens of sequences that hold more than `original` tokens in
        all (seq_totals, else seq_lens): the rows LongRoPE's kernels rotate by its long set."""
        totals = self.seq_lens if self.seq_totals is None else self.seq_totals
        long = np.repeat(totals > original, np.diff(self.query_start_loc))
        return np.where(long, self.positions | LONG_ROPE_FLAG, self.positions).astype(np.int32)

    def validate(self) -> None:
        """Check dtypes, shapes and contiguity against the C ABI; a mismatch would be silent memory corruption."""
        expected = {
            "token_ids": np.int32,
            "positions": np.int32,
            "slot_mapping": np.int64,
            "query_start_loc": np.int32,
            "seq_lens": np.int32,
            "block_tables": np.int32,
            "logits_indices": np.int32,
        }
        for name, dtype in expected.items():
            a = getattr(self, name)
            if a.dtype != dtype or not a.flags.c_contiguous:
                raise ValueError(f"StepBatch.{name}: need C-contiguous {np.dtype(dtype)}, got {a.dtype}")
        t, b = self.num_tokens, self.num_seqs
        if self.positions.shape != (t,) or self.slot_mapping.shape != (t,):
            raise ValueError(f"StepBatch: positions/slot_mapping must be [{t}]")
        if self.query_start_loc.shape != (b + 1,):
            raise ValueError(f"StepBatch: query_start_loc must be [{b + 1}]")
        if self.logits_indices.ndim != 1 or self.num_logits < 1:
            raise ValueError("StepBatch: logits_indices must be [N], N >= 1")
        if self.logits_indices.min() < 0 or self.logits_indices.max() >= t:
            raise ValueError(f"StepBatch: logits_indices must be token rows in 0..{t - 1}")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"StepBatch: block_tables must be [{b}, max_blocks]")
        if self.query_start_loc[0] != 0 or self.query_start_loc[-1] != t:
            raise ValueError("StepBatch: query_start_loc must run from 0 to T")
