"""templates/cuda/gemm.cu.j2 under the simulator against numpy: y = x @ w.T + bias, w [n, k].

T <= 8 runs the warp-per-output GEMV, larger T the shared-memory tiled kernel; shapes have tails for
both (k = 37: scalar weight loads, n = 53 / 23: partial warps and tiles, T = 70 / 130: partial row tiles).
"""

import numpy as np
import pytest
from kernel_reference import gemm_inputs

from llmc.compiler.codegen.render import kernel_id

# (n, k): k = 37 takes the scalar path; k = 64 / 136 the 16-byte path (136 = 4 full + 1 partial lane sweep
# for f32); n = 53, 23, 70 are no multiple of the 4-warp block or the 64-wide tile.
SHAPES = [(53, 37), (23, 64), (70, 136)]
SPECS = [("gemm", dict(n=n, k=k, wdtype=wd, has_bias=bias))
         for n, k in SHAPES for wd in ("f32", "bf16") for bias in (False, True)]


def _check(y, x, wf, bf):
    ref = x.astype(np.float64) @ wf.astype(np.float64).T + bf
    # float32 accumulation error bound, relative to the magnitude of the terms summed
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T + np.abs(bf)
    err = np.abs(y - ref)
    assert np.all(err <= 1e-5 * mag + 1e-7), f"max rel err {np.max(err / (mag + 1e-30)):.3g}"


@pytest.mark.parametrize("T", [1, 3, 8, 9, 17, 70])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cuda", *s) for s in SPECS])
def test_gemm_matches_numpy(kernels, weights, op, params, T):
    n, k = params["n"], params["k"]
    x, w, wf, b, bf = gemm_inputs(n, k, T, params["wdtype"], params["has_bias"], weights, seed=T)
    y = np.full((T, n), np.nan, dtype=np.float32)
    kernels[kernel_id("cuda", op, params)](x, w, b, y, T)
    _check(y, x, wf, bf)


@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_gemm_three_row_tiles(kernels, weights, wdtype):
    """T = 130: two full 64-row tiles and a 2-row tail."""
    params = dict(n=70, k=136, wdtype=wdtype, has_bias=True)
    x, w, wf, b, bf = gemm_inputs(70, 136, 130, wdtype, True, weights, seed=5)
    y = np.full((130, 70), np.nan, dtype=np.float32)
    kernels[kernel_id("cuda", "gemm", params)](x, w, b, y, 130)
    _check(y, x, wf, bf)


@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_row_independent_of_batch(kernels, weights, n, k):
    """In the GEMV range each row is bit-identical whether it runs alone or with others."""
    params = dict(n=n, k=k, wdtype="bf16", has_bias=True)
    fn = kernels[kernel_id("cuda", "gemm", params)]
    x, w, _, b, _ = gemm_inputs(n, k, 8, "bf16", True, weights, seed=1)
    batch = np.empty((8, n), dtype=np.float32)
    fn(x, w, b, batch, 8)
    for t in (0, 5, 7):
        alone = np.empty((1, n), dtype=np.float32)
        fn(np.ascontiguousarray(x[t:t + 1]), w, b, alone, 1)
        assert np.array_equal(alone[0], batch[t])


@pytest.mark.parametrize("T", [3, 70])
def test_gemm_independent_of_thread_order(kernels, weights, sim_seed, T):
    """Two scheduling seeds give bit-identical results (no race on the shared-memory tiles)."""
    params = dict(n=70, k=136, wdtype="bf16", has_bias=False)
    fn = kernels[kernel_id("cuda", "gemm", params)]
    x, w, _, _, _ = gemm_inputs(70, 136, T, "bf16", False, weights, seed=3)
    outs = []
    for seed in (1, 2):
        sim_seed(seed)
        y = np.full((T, 70), np.nan, dtype=np.float32)
        fn(x, w, None, y, T)
        outs.append(y)
    assert np.array_equal(outs[0], outs[1])
