"""The mixture-of-experts kernels (templates/<target>/moe_*.j2, llmc_moe.h / llmc_moe.cuh) against numpy float64,
on the CPU and under the CUDA simulator.

- moe_route: softmax(x @ router^T), each row's top k (by falling probability) and their weights, renormalized or
  not; ties are far apart here (random logits), so the chosen experts must equal the reference's exactly.
- moe_gemm / moe_qgemm: each (token, slot)'s expert applied to its row; SwiGLU for gate_up. The experts no token
  chose hold NaN weights, so any read of them would show in the output. Each row is bit-identical to the same
  row run alone (the batch-invariance the runtime's batching relies on). On CUDA, a step of more than 8 tokens
  runs the tiled GEMMs as the dense GEMM does (x rounded to bf16 on tensor cores): bit-identical to the same
  rows run alone within either side of that switch, and within the rounding of x across it.
- moe_combine: the routing-weighted sum over slots.

Sizes are tails: hidden 72, 40 intermediate columns, 9 experts with top 2 and 3, T up to 17 rows. The quantized
cases are every scheme family (int8 per 32, int4 symmetric, asymmetric fp16 groups, K-quant records).
"""

import numpy as np
import pytest

from llmc.compiler.quant import QuantScheme, dequantize
from llmc.compiler.quant_pack import pack_cpu, pack_cuda
from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import qgemm_reference, quantized_weight, to_bf16

E = 9
ROUTE = [
    dict(experts=E, hidden=72, top_k=k, norm_topk=norm, wdtype=w)
    for k, norm, w in ((2, True, "f32"), (3, False, "bf16"))
]
GEMM = [
    dict(experts=E, n=2 * 40, k=72, top_k=2, per_slot=False, swiglu=True, wdtype="f32"),
    dict(experts=E, n=72, k=40, top_k=3, per_slot=True, swiglu=False, wdtype="bf16"),
]
# (bits, group_size, asymmetric, scale_bits, k)
QSCHEMES = [(8, 32, False, 16, 96), (4, 32, False, 16, 96), (4, 32, True, 16, 160), (4, 32, True, 8, 256)]
QGEMM = [
    dict(
        experts=E,
        n=n,
        k=k,
        top_k=2,
        per_slot=not swiglu,
        swiglu=swiglu,
        bits=b,
        group_size=g,
        asymmetric=a,
        scale_bits=s,
    )
    for b, g, a, s, k in QSCHEMES
    for n, swiglu in ((2 * 40, True), (72, False))
]
COMBINE = [dict(hidden=72, top_k=2), dict(hidden=40, top_k=3)]
SPECS = (
    [("moe_route", p) for p in ROUTE]
    + [("moe_gemm", p) for p in GEMM]
    + [("moe_qgemm", p) for p in QGEMM]
    + [("moe_combine", p) for p in COMBINE]
)
# a bf16 router: a host with avx512_bf16 meets it with x rounded to bf16 too (vdpbf16ps; test_gemm.py)
BF16_RTOL = 1e-2
UNCHOSEN = (4, 7)  # experts no token chooses in the gemm tests
CUDA_GEMV_MAX_T = (
    8  # above it, CUDA's expert GEMMs are tiled: x rounded to bf16 where the weights are bf16 or quantized
)


def _route(T, top_k, rng):
    """route [T, 2 * top_k]: distinct experts per token (never UNCHOSEN), random weights."""
    free = [e for e in range(E) if e not in UNCHOSEN]
    ids = np.stack([rng.permutation(free)[:top_k] for _ in range(T)]).astype(np.float32)
    return np.ascontiguousarray(np.concatenate([ids, rng.random((T, top_k), dtype=np.float32)], axis=1))


def _slot_rows(x, p, T):
    """x as one row per (token, slot): the token's row, or its slot's (per_slot)."""
    k = p["top_k"]
    return x.reshape(T * k, p["k"]) if p["per_slot"] else np.repeat(x, k, axis=0)


def _activate(y, p):
    """SwiGLU of gate_up rows, or the rows as they are."""
    if not p["swiglu"]:
        return y
    gate, up = np.split(y, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", [pytest.param(*s, id=spec_id(s)) for s in SPECS if s[0] == "moe_route"])
def test_moe_route_picks_top_k(kernels, weights, op, params, T):
    rng = np.random.default_rng(T)
    h, k = params["hidden"], params["top_k"]
    x = rng.standard_normal((T, h), dtype=np.float32)
    router, values = weights(rng.standard_normal((E, h), dtype=np.float32) * 0.3, params["wdtype"])
    route = np.full((T, 2 * k), np.nan, np.float32)
    kernels(op, params)(x, router, route, T)
    logits = x.astype(np.float64) @ values.astype(np.float64).T
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, order, axis=1)
    if params["norm_topk"]:
        top /= top.sum(axis=1, keepdims=True)
    np.testing.assert_array_equal(route[:, :k], order.astype(np.float32))
    np.testing.assert_allclose(route[:, k:], top, rtol=BF16_RTOL if params["wdtype"] == "bf16" else 1e-5)


def _moe_case(kernels, weights, op, params, T, seed, target):
    """(the kernel's output for T rows, the float64 reference, the kernel run one row at a time, and for float
    weights sum |x| |w| of each output)."""
    rng = np.random.default_rng(seed)
    n, k, top_k = params["n"], params["k"], params["top_k"]
    out_cols = n // 2 if params["swiglu"] else n
    x = rng.standard_normal((T, top_k * k if params["per_slot"] else k), dtype=np.float32)
    route = _route(T, top_k, rng)
    w = rng.standard_normal((E, n, k), dtype=np.float32) / np.sqrt(k)
    if op == "moe_gemm":
        w[list(UNCHOSEN)] = np.nan
        packed, values = weights(w.reshape(E * n, k), params["wdtype"])
        args = [packed]

        def expert(e, rows):
            return rows.astype(np.float64) @ values[e * n : (e + 1) * n].T

        def magnitude(e, rows):
            return np.abs(rows.astype(np.float64)) @ np.abs(values[e * n : (e + 1) * n].T)
    else:
        scheme = QuantScheme.of_kernel(params)
        experts = [quantized_weight(w[e], scheme, rng) for e in range(E)]
        parts = [(pack_cuda if target == "cuda" else pack_cpu)(t) for t in experts]
        parts = [p if e not in UNCHOSEN else tuple(_poisoned(a) for a in p) for e, p in enumerate(parts)]
        args = [np.concatenate(a) if a[0] is not None else None for a in zip(*parts, strict=True)]

        def expert(e, rows):
            if target == "cpu":  # int8 activations
                return qgemm_reference(np.ascontiguousarray(rows), experts[e], None)[0]
            x64 = (to_bf16(rows)[1] if T > CUDA_GEMV_MAX_T else rows).astype(np.float64)
            return x64 @ dequantize(experts[e]).astype(np.float64).T

        magnitude = None

    kernel = kernels(op, params)
    out = np.full((T, top_k * out_cols), np.nan, np.float32)
    kernel(x, route, *args, out, T)
    rows = _slot_rows(x, params, T)
    ids = route[:, :top_k].reshape(-1).astype(int)
    ref = np.stack([expert(e, rows[i : i + 1])[0] for i, e in enumerate(ids)])
    size = None if magnitude is None else np.stack([magnitude(e, rows[i : i + 1])[0] for i, e in enumerate(ids)])
    alone = np.full_like(out, np.nan)
    for t in range(T):
        kernel(np.ascontiguousarray(x[t : t + 1]), np.ascontiguousarray(route[t : t + 1]), *args, alone[t : t + 1], 1)
    return out, _activate(ref, params).reshape(T, -1), alone, None if size is None else size.reshape(T, -1)


def _poisoned(a):
    """A packed part of an expert no token chose: all ones bits (NaN scales where they are floats)."""
    if a is None:
        return None
    return np.full_like(a, np.nan) if a.dtype.kind == "f" else np.full_like(a, 0xFF)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", [pytest.param(*s, id=spec_id(s)) for s in SPECS if s[0] == "moe_gemm"])
def test_moe_gemm_matches_each_tokens_experts(kernels, weights, target, op, params, T):
    out, ref, alone, size = _moe_case(kernels, weights, op, params, T, seed=T, target=target)
    if params["wdtype"] == "bf16":  # x rounded to bf16 (vdpbf16ps, mma): each term within 2^-8 of its size
        assert not params["swiglu"]
        assert (np.abs(out - ref) <= 2**-8 * size + 1e-6).all()
    else:
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    _assert_alone(out, alone, target, T)


def _assert_alone(out, alone, target, T):
    if target == "cuda" and T > CUDA_GEMV_MAX_T:
        np.testing.assert_allclose(out, alone, rtol=2e-2, atol=2e-2)
    else:
        np.testing.assert_array_equal(out, alone)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", [pytest.param(*s, id=spec_id(s)) for s in SPECS if s[0] == "moe_qgemm"])
def test_moe_qgemm_matches_each_tokens_dequantized_experts(kernels, weights, target, op, params, T):
    out, ref, alone, _ = _moe_case(kernels, weights, op, params, T, seed=100 + T, target=target)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    _assert_alone(out, alone, target, T)


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("op,params", [pytest.param(*s, id=spec_id(s)) for s in SPECS if s[0] == "moe_combine"])
def test_moe_combine_weights_each_slot(kernels, op, params, T):
    rng = np.random.default_rng(T)
    h, k = params["hidden"], params["top_k"]
    y = rng.standard_normal((T, k * h), dtype=np.float32)
    route = _route(T, k, rng)
    out = np.full((T, h), np.nan, np.float32)
    kernels(op, params)(y, route, out, T)
    ref = np.einsum("tj,tjh->th", route[:, k:].astype(np.float64), y.reshape(T, k, h).astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
