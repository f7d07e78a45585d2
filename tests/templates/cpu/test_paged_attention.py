"""templates/cpu/paged_attention.cc.j2 against a float64 numpy reference.

A ragged batch mixes prefill, chunked prefill and decode sequences whose cache blocks are shuffled
and non-contiguous; the cache holds earlier tokens' k/v and garbage elsewhere. q/k/v are column
slices of one fused qkv buffer, as the qkv gemm produces them.
"""

import math

import numpy as np
import pytest
from kernel_reference import MIXED, Batch

from llmc.compiler.codegen.render import kernel_id

# (num_heads, num_kv_heads, head_dim, block_size, sliding_window): GQA ratios 1, 4 and 3 (odd head count);
# windows that start mid-block, span blocks, and cover a single position
CONFIGS = [(4, 4, 16, 4, 0), (8, 2, 64, 16, 0), (9, 3, 8, 8, 0), (4, 1, 16, 1, 0), (4, 2, 16, 4, 5),
           (9, 3, 8, 8, 13), (8, 2, 64, 16, 1)]
SPECS = [("paged_attention", dict(num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
                                  scale=1.0 / math.sqrt(hd), sliding_window=w)) for nh, nkv, hd, bs, w in CONFIGS]
IDS = [kernel_id("cpu", *s) for s in SPECS]


@pytest.mark.parametrize("seqs", [MIXED, [(0, 17)], [(40, 1), (3, 1), (0, 1)]], ids=["mixed", "prefill", "decode"])
@pytest.mark.parametrize("op,params", SPECS, ids=IDS)
def test_paged_attention_matches_numpy(kernels, op, params, seqs):
    batch = Batch(params, seqs, seed=len(seqs))
    k_before, v_before = batch.k_cache.copy(), batch.v_cache.copy()
    out = batch.run(kernels[kernel_id("cpu", op, params)])
    np.testing.assert_allclose(out, batch.reference(), rtol=1e-5, atol=2e-6)

    # this step's k/v went to their slots, and nothing else in the cache changed
    k_want, v_want = batch.cache_after(k_before, v_before)
    assert np.array_equal(batch.k_cache, k_want) and np.array_equal(batch.v_cache, v_want)


@pytest.mark.parametrize("op,params", SPECS, ids=IDS)
def test_paged_attention_sequence_independent_of_batch(kernels, op, params, omp_threads):
    """A sequence's outputs are bit-identical alone and inside a mixed batch, at any thread count."""
    fn = kernels[kernel_id("cpu", op, params)]
    omp_threads(1)
    mixed = Batch(params, MIXED, seed=11)
    cache = mixed.k_cache.copy(), mixed.v_cache.copy()
    out_mixed = mixed.run(fn)
    omp_threads(2)
    for b in range(mixed.B):
        t0, t1 = mixed.qsl[b], mixed.qsl[b + 1]
        assert np.array_equal(mixed.alone(b, cache).run(fn), out_mixed[t0:t1])


def test_paged_attention_rejects_bad_gqa():
    from llmc.compiler.codegen.render import render_kernel
    from llmc.errors import CompileError

    with pytest.raises(CompileError, match="multiple of num_kv_heads"):
        render_kernel("cpu", "paged_attention", name="a", num_heads=9, num_kv_heads=2, head_dim=8, block_size=4,
                      scale=0.35, sliding_window=0)
    with pytest.raises(CompileError, match="sliding_window must be an int >= 0"):
        render_kernel("cpu", "paged_attention", name="a", num_heads=9, num_kv_heads=3, head_dim=8, block_size=4,
                      scale=0.35, sliding_window=-1)
