"""Logits at several rows of one step (StepBatch num_logits / logits_indices) against transformers' full-sequence
forward: shared by the CPU target's parity test and the simulated CUDA one."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from llmc.runtime.batch import StepBatch
from tests.checkpoints import hf_model

REL = 1e-3  # the fp32 parity tolerance: max |logits - reference| over max |reference|, per row


def _assert_rows_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: logits {got.shape}, reference {want.shape}"
    for i, (row, ref) in enumerate(zip(got, want, strict=True)):
        rel = np.abs(row - ref).max() / np.abs(ref).max()
        assert rel <= REL, f"{what}, row {i}: relative logit error {rel:.2e}"


def assert_logits_rows_match_transformers(model, path, long: list[int], short: list[int]) -> None:
    """model: loaded with max_num_logits >= len(long) and max_num_seqs >= 2; len(long) > 3."""
    reference = hf_model(path)
    with torch.no_grad():
        want = {len(ids): reference(torch.tensor([ids])).logits[0].numpy() for ids in (long, short)}
    blocks = list(range(model.num_blocks))[::-1]  # non-trivial block tables
    need = -(-len(long) // model.block_size)
    long_table, short_table = blocks[:need], blocks[need : need + -(-len(short) // model.block_size)]

    # every row of a prefill: the logits of each position, as transformers' forward gives them
    every = StepBatch.build([long], [0], [long_table], model.block_size, num_logits=[len(long)])
    _assert_rows_close(model.step(every), want[len(long)], "every row of a prefill")

    # a mixed step: the long sequence re-runs its last 3 tokens over its cache and asks for all 3 rows (as
    # speculative verification will), the short one is a whole prefill asking for its last row only
    mixed = StepBatch.build(
        [long[-3:], short], [len(long) - 3, 0], [long_table, short_table], model.block_size, num_logits=[3, 1]
    )
    expected = np.concatenate([want[len(long)][-3:], want[len(short)][-1:]])
    _assert_rows_close(model.step(mixed), expected, "3 rows of one sequence, 1 of another")

    # any rows in any order come back in the order asked
    shuffled = dataclasses.replace(mixed, logits_indices=np.array([3 + len(short) - 1, 0, 2, 1, 0], np.int32))
    _assert_rows_close(model.step(shuffled), expected[[3, 0, 2, 1, 0]], "rows in the order asked")
