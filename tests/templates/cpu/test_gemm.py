"""templates/cpu/gemm.cc.j2 against numpy: y = x @ w.T + bias, w in HF Linear layout [n, k]."""

import numpy as np
import pytest
from kernel_reference import gemm_inputs as _inputs

from llmc.compiler.codegen.render import kernel_id

# (n, k): tails everywhere (37, 53, 23 are no multiple of any vector or tile width), a tile-aligned
# one, and the tiny model's projection size.
SHAPES = [(53, 37), (23, 64), (1536, 576)]
SPECS = [("gemm", dict(n=n, k=k, wdtype=wd, has_bias=bias))
         for n, k in SHAPES for wd in ("f32", "bf16") for bias in (False, True)]


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels(SPECS)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 17, 70])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_gemm_matches_numpy(kernels, weights, op, params, T):
    n, k = params["n"], params["k"]
    x, w, wf, b, bf = _inputs(n, k, T, params["wdtype"], params["has_bias"], weights, seed=T)
    y = np.full((T, n), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](x, w, b, y, T)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T + bf
    # float32 accumulation error bound, relative to the magnitude of the terms summed
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T + np.abs(bf)
    err = np.abs(y - ref)
    assert np.all(err <= 1e-5 * mag + 1e-7), f"max rel err {np.max(err / (mag + 1e-30)):.3g}"


@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_row_independent_of_batch(kernels, weights, wdtype, n, k):
    """Each row of a T=7 (and T=70) batch is bit-identical to the same row computed alone (T=1)."""
    params = dict(n=n, k=k, wdtype=wdtype, has_bias=True)
    fn = kernels[kernel_id("cpu", "gemm", params)]
    x, w, _, b, _ = _inputs(n, k, 70, wdtype, True, weights, seed=1)
    alone = np.empty((70, n), dtype=np.float32)
    for t in range(70):
        fn(np.ascontiguousarray(x[t:t + 1]), w, b, alone[t:t + 1], 1)
    for T in (7, 70):
        batch = np.empty((T, n), dtype=np.float32)
        fn(np.ascontiguousarray(x[:T]), w, b, batch, T)
        assert np.array_equal(batch, alone[:T])


def test_gemm_independent_of_thread_count(kernels, weights, omp_threads):
    n, k = 1536, 576
    params = dict(n=n, k=k, wdtype="bf16", has_bias=False)
    fn = kernels[kernel_id("cpu", "gemm", params)]
    x, w, _, _, _ = _inputs(n, k, 17, "bf16", False, weights, seed=2)
    outs = []
    for threads in (1, 2, 3):
        omp_threads(threads)
        for T in (1, 17):
            y = np.empty((T, n), dtype=np.float32)
            fn(np.ascontiguousarray(x[:T]), w, None, y, T)
            outs.append(y[0])
    assert all(np.array_equal(o, outs[0]) for o in outs)
