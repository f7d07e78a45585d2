"""rmsnorm (templates/{cpu,cuda}/rmsnorm.*.j2): y = w * (h / sqrt(mean(h^2) + eps)),
h = x (+ residual_in -> residual_out), the added branch optionally scaled (Granite) or normed first (Gemma). On CUDA with bf16 activations, as transformers' bf16 LlamaRMSNorm
rounds: the residual sum to bf16, and the normalized row before its weight multiplies it."""

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import act_empty, bf16_bits_of, rmsnorm_inputs, rmsnorm_reference, to_bf16

# hidden 37 (on CUDA one partial warp), 64, 576 (576 / 96 threads), 4100 (512 threads x 9 elements, a
# partial tail)
SPECS = [
    ("rmsnorm", dict(hidden=h, eps=eps, wdtype=wd, add_residual=res))
    for h, eps in ((37, 1e-6), (64, 1e-5), (576, 1e-5))
    for wd in ("f32", "bf16")
    for res in (False, True)
]
SPECS.append(("rmsnorm", dict(hidden=4100, eps=1e-5, wdtype="bf16", add_residual=True)))
F32_SPECS = list(SPECS)
BF16_SPECS = [
    ("rmsnorm", dict(hidden=h, eps=1e-5, wdtype="bf16", add_residual=res, adtype="bf16"))
    for h in (37, 576, 4100)
    for res in (False, True)
]
SPECS += BF16_SPECS
# Granite's scaled branch, Gemma's normed branch, both; hidden 37 and 4100 (partial tails)
BRANCH_SPECS = [
    ("rmsnorm", dict(hidden=h, eps=1e-6, wdtype=wd, add_residual=True, **branch))
    for h, wd in ((37, "f32"), (4100, "bf16"))
    for branch in (dict(residual_scale=0.22), dict(residual_norm=True), dict(residual_scale=1.5, residual_norm=True))
]
SPECS += BRANCH_SPECS


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_rmsnorm_matches_numpy(kernels, op, params, T):
    add = params["add_residual"]
    x, w, wf, res_in, res_out, y = rmsnorm_inputs(T, params["hidden"], params["wdtype"], add, seed=T)
    kernels(op, params)(x, res_in, res_out, w, y, T, None)
    h = x
    if add:
        h = x + res_in  # float32 add, as transformers does
        assert np.array_equal(res_out, h)
    np.testing.assert_allclose(y, rmsnorm_reference(h, wf, params["eps"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alias", ["residual_in", "x"])
@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
def test_rmsnorm_residual_in_place(kernels, weights, wdtype, alias):
    """residual_out may alias residual_in (the residual stream updated in place) or x."""
    params = dict(hidden=576, eps=1e-5, wdtype=wdtype, add_residual=True)
    rng = np.random.default_rng(5)
    T = 9
    x = rng.standard_normal((T, 576), dtype=np.float32)
    res = rng.standard_normal((T, 576), dtype=np.float32)
    w, wf = weights(rng.standard_normal(576, dtype=np.float32), wdtype)
    expect_res = x + res
    y = np.empty_like(x)
    out = res if alias == "residual_in" else x
    kernels("rmsnorm", params)(x, res, out, w, y, T, None)
    assert np.array_equal(out, expect_res)
    np.testing.assert_allclose(y, rmsnorm_reference(expect_res, wf, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden,add", [(576, False), (4100, True)])
def test_rmsnorm_row_independent_of_batch_and_schedule(kernels, weights, schedules, hidden, add):
    """Each row is bit-identical alone (T = 1) and in a batch of 5, in every schedule."""
    fn = kernels("rmsnorm", dict(hidden=hidden, eps=1e-5, wdtype="bf16", add_residual=add))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, hidden), dtype=np.float32)
    r = rng.standard_normal((5, hidden), dtype=np.float32) if add else None
    w, _ = weights(rng.standard_normal(hidden, dtype=np.float32), "bf16")
    outs = []
    for schedule in schedules:
        schedule()
        y = np.empty_like(x)
        fn(x, r, np.empty_like(x) if add else None, w, y, 5, None)
        outs.append(y)
    assert all(np.array_equal(o, outs[0]) for o in outs)
    for t in (0, 4):
        alone = np.empty((1, hidden), dtype=np.float32)
        r_t = np.ascontiguousarray(r[t : t + 1]) if add else None
        fn(np.ascontiguousarray(x[t : t + 1]), r_t, np.empty_like(alone) if add else None, w, alone, 1, None)
        assert np.array_equal(alone[0], outs[0][t])


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_rmsnorm_bf16_activations(kernels, op, params, T):
    hidden, add = params["hidden"], params["add_residual"]
    x, w, wf, res_in, _, _ = rmsnorm_inputs(T, hidden, "bf16", add, seed=T)
    xb, h = to_bf16(x)
    rb, res_out = None, None
    if add:
        rb, rv = to_bf16(res_in)
        res_out = act_empty((T, hidden), "bf16")
        h = to_bf16(h + rv)[1]  # the float32 sum, rounded
    y = act_empty((T, hidden), "bf16")
    kernels(op, params)(xb, rb, res_out, w, y, T, None)
    if add:
        assert np.array_equal(bf16_bits_of(res_out), h)
    normed = to_bf16(rmsnorm_reference(h, np.ones(hidden, np.float32), params["eps"]).astype(np.float32))[1]
    # the normalized row may round to the other neighbour (its float32 value differs from float64's), then the
    # product with the weight rounds once more: 1.5 bf16 ulps at most
    np.testing.assert_allclose(bf16_bits_of(y), wf * normed.astype(np.float64), rtol=2.0**-6, atol=0)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", BRANCH_SPECS, ids=map(spec_id, BRANCH_SPECS))
def test_rmsnorm_scaled_and_normed_branch(kernels, weights, op, params, T):
    hidden, eps = params["hidden"], params["eps"]
    x, w, wf, res_in, res_out, y = rmsnorm_inputs(T, hidden, params["wdtype"], True, seed=T)
    rng = np.random.default_rng(T + 100)
    rw, rwf = weights(rng.standard_normal(hidden, dtype=np.float32), params["wdtype"])
    branch = res_in.astype(np.float64)
    if params.get("residual_norm"):
        branch = rmsnorm_reference(res_in, rwf, eps)
    h = x + params.get("residual_scale", 1.0) * branch
    kernels(op, params)(x, res_in, res_out, w, y, T, rw if params.get("residual_norm") else None)
    np.testing.assert_allclose(res_out, h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, rmsnorm_reference(res_out, wf, eps), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alias", ["residual_in", "x"])
def test_rmsnorm_normed_branch_in_place(kernels, weights, alias):
    """With the branch normed first, residual_out may still alias residual_in or x."""
    params = BRANCH_SPECS[1][1]
    rng = np.random.default_rng(8)
    T, hidden = 5, params["hidden"]
    x = rng.standard_normal((T, hidden), dtype=np.float32)
    res = rng.standard_normal((T, hidden), dtype=np.float32)
    w, _ = weights(rng.standard_normal(hidden, dtype=np.float32), params["wdtype"])
    rw, rwf = weights(rng.standard_normal(hidden, dtype=np.float32), params["wdtype"])
    expect = x + rmsnorm_reference(res, rwf, params["eps"])
    out = res if alias == "residual_in" else x
    kernels("rmsnorm", params)(x, res, out, w, np.empty_like(x), T, rw)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)
