"""paged_attention (templates/{cpu,cuda}/paged_attention.*.j2) against a float64 numpy reference.

A ragged batch mixes prefill, chunked prefill and decode sequences whose cache blocks are shuffled
and non-contiguous; the cache holds earlier tokens' k/v and garbage elsewhere. q/k/v are column
slices of one fused qkv buffer, as the qkv gemm produces them. Context lengths cross CUDA's 32-position
chunks (33, 70 + new tokens).
"""

import math

import numpy as np
import pytest
from kernel_harness import spec_id
from kernel_reference import MIXED, Batch

from llmc.compiler.codegen.render import render_kernel
from llmc.errors import CompileError

# (num_heads, num_kv_heads, head_dim, block_size, sliding_window): GQA ratios 1, 4, 3 (9 heads / 3 kv heads)
# and 4 (one kv head); head_dim 16 / 64 / 8 / 128; windows that start mid-block (5), span blocks (13), cross
# a 32-lane chunk (37) and cover a single position (1)
CONFIGS = [
    (4, 4, 16, 4, 0),
    (8, 2, 64, 16, 0),
    (9, 3, 8, 8, 0),
    (4, 1, 16, 1, 0),
    (4, 1, 128, 1, 0),
    (4, 2, 16, 4, 5),
    (9, 3, 8, 8, 13),
    (9, 3, 8, 8, 37),
    (8, 2, 64, 16, 1),
]
SPECS = [
    (
        "paged_attention",
        dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs, scale=1.0 / math.sqrt(hd), sliding_window=w),
    )
    for nh, nkv, hd, bs, w in CONFIGS
]
IDS = [spec_id(s) for s in SPECS]
# Under the CUDA simulator, where a mixed batch takes ~60 ms, the batch and schedule test runs GQA 4 and 3 and
# the window across a chunk only.
ON_CUDA_TOO = {1, 2, 7}
INDEPENDENCE_CASES = [
    pytest.param(*s, id=IDS[i], marks=[] if i in ON_CUDA_TOO else [pytest.mark.targets("cpu")])
    for i, s in enumerate(SPECS)
]


@pytest.mark.parametrize("seqs", [MIXED, [(0, 17)], [(40, 1), (3, 1), (0, 1)]], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("op,params", SPECS, ids=IDS)
def test_paged_attention_matches_numpy(kernels, op, params, seqs):
    batch = Batch(params, seqs, seed=len(seqs))
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    out = batch.run(kernels(op, params))
    np.testing.assert_allclose(out, batch.reference(), rtol=1e-5, atol=2e-6)

    # this step's k/v went to their slots, and nothing else in the cache changed
    k_want, v_want = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want) and np.array_equal(batch.v_cache, v_want)


def test_paged_attention_skips_padding_slots(kernels):
    """A negative slot (padding token) writes nothing to the cache."""
    op, params = SPECS[2]
    batch = Batch(params, [(5, 3), (2, 1)], seed=9)
    batch.slots[1] = -1
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    batch.run(kernels(op, params))
    k_want, v_want = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want) and np.array_equal(batch.v_cache, v_want)


@pytest.mark.parametrize("op,params", INDEPENDENCE_CASES)
def test_paged_attention_independent_of_batch_and_schedule(kernels, schedules, op, params):
    """Outputs and caches are bit-identical in every schedule, and each sequence's outputs are the same alone
    (in the last schedule) as inside the mixed batch (in the first)."""
    fn = kernels(op, params)
    results = []
    for schedule in schedules:
        schedule()
        mixed = Batch(params, MIXED, seed=11)
        cache = mixed.k_cache.copy(), mixed.v_cache.copy()
        results.append((mixed.run(fn), mixed.k_cache, mixed.v_cache))
    for result in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(result, results[0], strict=True))
    out = results[0][0]
    for b in range(mixed.B):
        assert np.array_equal(mixed.alone(b, cache).run(fn), out[mixed.qsl[b] : mixed.qsl[b + 1]])


def test_paged_attention_rejects_bad_parameters(target):
    with pytest.raises(CompileError, match="multiple of num_kv_heads"):
        render_kernel(
            target,
            "paged_attention",
            name="a",
            num_heads=9,
            num_kv_heads=2,
            head_dim=8,
            block_size=4,
            scale=0.35,
            sliding_window=0,
        )
    with pytest.raises(CompileError, match="sliding_window must be an int >= 0"):
        render_kernel(
            target,
            "paged_attention",
            name="a",
            num_heads=9,
            num_kv_heads=3,
            head_dim=8,
            block_size=4,
            scale=0.35,
            sliding_window=-1,
        )
