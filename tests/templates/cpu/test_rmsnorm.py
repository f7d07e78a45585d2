"""templates/cpu/rmsnorm.cc.j2: y = w * (h / sqrt(mean(h^2) + eps)), h = x (+ residual_in -> residual_out)."""

import numpy as np
import pytest
from kernel_reference import rmsnorm_inputs, rmsnorm_reference

from llmc.compiler.codegen.render import kernel_id

SPECS = [("rmsnorm", dict(hidden=h, eps=eps, wdtype=wd, add_residual=res))
         for h, eps in ((37, 1e-6), (64, 1e-5), (576, 1e-5)) for wd in ("f32", "bf16") for res in (False, True)]


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_rmsnorm_matches_numpy(kernels, op, params, T):
    add = params["add_residual"]
    x, w, wf, res_in, res_out, y = rmsnorm_inputs(T, params["hidden"], params["wdtype"], add, seed=T)
    kernels[kernel_id("cpu", op, params)](x, res_in, res_out, w, y, T)
    h = x
    if add:
        h = x + res_in  # float32 add, as transformers does
        assert np.array_equal(res_out, h)
    np.testing.assert_allclose(y, rmsnorm_reference(h, wf, params["eps"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rmsnorm_residual_in_place(kernels, weights, wdtype):
    """residual_out may alias residual_in (the residual stream is updated in place)."""
    params = dict(hidden=576, eps=1e-5, wdtype=wdtype, add_residual=True)
    rng = np.random.default_rng(5)
    T = 9
    x = rng.standard_normal((T, 576), dtype=np.float32)
    res = rng.standard_normal((T, 576), dtype=np.float32)
    w, wf = weights(rng.standard_normal(576, dtype=np.float32), wdtype)
    expect_res = x + res
    y = np.empty_like(x)
    kernels[kernel_id("cpu", "rmsnorm", params)](x, res, res, w, y, T)
    assert np.array_equal(res, expect_res)
    np.testing.assert_allclose(y, rmsnorm_reference(expect_res, wf, 1e-5), rtol=1e-5, atol=1e-6)


def test_rmsnorm_row_independent_of_batch(kernels, weights):
    params = dict(hidden=576, eps=1e-5, wdtype="bf16", add_residual=False)
    fn = kernels[kernel_id("cpu", "rmsnorm", params)]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((17, 576), dtype=np.float32)
    w, _ = weights(rng.standard_normal(576, dtype=np.float32), "bf16")
    batch = np.empty_like(x)
    fn(x, None, None, w, batch, 17)
    for t in (0, 16):
        alone = np.empty((1, 576), dtype=np.float32)
        fn(np.ascontiguousarray(x[t:t + 1]), None, None, w, alone, 1)
        assert np.array_equal(alone[0], batch[t])
