"""templates/cuda/paged_attention.cu.j2 under the simulator against a float64 numpy reference.

A ragged batch mixes prefill, chunked prefill and decode sequences whose cache blocks are shuffled
and non-contiguous; the cache holds earlier tokens' k/v and garbage elsewhere. q/k/v are column
slices of one fused qkv buffer, as the qkv gemm produces them. Context lengths cross the kernel's
32-position chunks (33, 70 + new tokens).
"""

import math

import numpy as np
import pytest
from kernel_reference import MIXED, Batch

from llmc.compiler.codegen.render import kernel_id, render_kernel
from llmc.errors import CompileError

# (num_heads, num_kv_heads, head_dim, block_size, sliding_window): GQA ratios 1, 4, 3 (9 heads / 3 kv heads)
# and 4 (one kv head); head_dim 16 / 64 / 8 / 128; windows of 5 and 37 positions (across a 32-lane chunk)
CONFIGS = [(4, 4, 16, 4, 0), (8, 2, 64, 16, 0), (9, 3, 8, 8, 0), (4, 1, 128, 1, 0), (4, 2, 16, 4, 5),
           (9, 3, 8, 8, 37)]
SPECS = [("paged_attention", dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
                                  scale=1.0 / math.sqrt(hd), sliding_window=w)) for nh, nkv, hd, bs, w in CONFIGS]
IDS = [kernel_id("cuda", *s) for s in SPECS]


@pytest.mark.parametrize("seqs", [MIXED, [(0, 17)], [(40, 1), (3, 1), (0, 1)]], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("op,params", SPECS, ids=IDS)
def test_paged_attention_matches_numpy(kernels, op, params, seqs):
    batch = Batch(params, seqs, seed=len(seqs))
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    out = batch.run(kernels[kernel_id("cuda", op, params)])
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
    batch.run(kernels[kernel_id("cuda", op, params)])
    k_want, _ = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want)


def test_paged_attention_sequence_independent_of_batch(kernels):
    """A sequence's outputs are bit-identical alone and inside a mixed batch."""
    op, params = SPECS[2]  # 9 heads / 3 kv heads
    fn = kernels[kernel_id("cuda", op, params)]
    mixed = Batch(params, MIXED, seed=11)
    cache = mixed.k_cache.copy(), mixed.v_cache.copy()
    out_mixed = mixed.run(fn)
    for b in (0, 5, 6):
        t0, t1 = mixed.qsl[b], mixed.qsl[b + 1]
        assert np.array_equal(mixed.alone(b, cache).run(fn), out_mixed[t0:t1])


@pytest.mark.parametrize("op,params", [SPECS[1], SPECS[2]], ids=[IDS[1], IDS[2]])
def test_paged_attention_independent_of_thread_order(kernels, sim_seed, op, params):
    """Two scheduling seeds (thread and block order) give bit-identical outputs and caches."""
    fn = kernels[kernel_id("cuda", op, params)]
    results = []
    for seed in (1, 2):
        sim_seed(seed)
        batch = Batch(params, MIXED, seed=4)
        results.append((batch.run(fn), batch.k_cache, batch.v_cache))
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_paged_attention_rejects_bad_gqa():
    with pytest.raises(CompileError, match="multiple of num_kv_heads"):
        render_kernel("cuda", "paged_attention", name="a", num_heads=9, num_kv_heads=2, head_dim=8, block_size=4,
                      scale=0.35, sliding_window=0)
