"""gemm (templates/{cpu,cuda}/gemm.*.j2) against numpy: y = x @ w.T + bias, w in HF Linear layout [n, k].

On CUDA, T <= 8 runs the warp-per-output GEMV and larger T a tiled kernel: on tensor cores (mma.sync, x rounded
to bf16) for bf16 weights with k % 8 == 0, in fp32 SIMT otherwise; the shapes have tails for every path. On the CPU, T <= 4 runs the GEMV and larger T the register-tiled GEMM (bf16 through a
widened panel, or vdpbf16ps); the ISA is the host's, or LLMC_TEST_MARCH's (haswell: AVX2, x86-64: portable).
"""

import functools
import os
import subprocess

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import act_empty, assert_gemm_close, assert_softcapped, gemm_inputs, to_bf16

# (n, k): 53 / 37 / 23 are no multiple of any vector, warp or tile width (k = 37: scalar weight loads on CUDA);
# k = 64 / 136 take 16-byte loads (136 = 4 full + 1 partial lane sweep for f32); k = 61: a K tail of more than
# one vector after the CPU's bf16 main loop (steps of 2 vectors: 16 or 32); (131, 200): CUDA's mma tiles, 3
# along n (the last 3 wide), 7 k steps of 32 and a zero-filled quarter of the last (k % 8 == 0 needed).
SHAPES = [(53, 37), (23, 64), (70, 136), (19, 61), (131, 200)]
# The tiny model's projection, CPU only: there its outputs split into several chunks over the OpenMP threads;
# under the CUDA simulator a GEMV of 1536 outputs takes about a second, and the shapes above cover its paths.
MODEL_SHAPE = (1536, 576)
# CPU only: a K long enough to be cut into several blocks of the GEMM path (accumulators carried from block to
# block), with a tail after the last (2100 = 4 blocks of 528 fp32 steps + 16 + 4; bf16: 32-element steps).
BLOCKED_SHAPE = (45, 2100)
CPU_ONLY = pytest.mark.targets("cpu")


def _grid(shapes):
    return [
        ("gemm", dict(n=n, k=k, wdtype=wd, has_bias=bias))
        for n, k in shapes
        for wd in ("f32", "bf16")
        for bias in (False, True)
    ]


# CUDA's GEMV splits K between warps where N is small (gemv_split): 2 slices of 512 (k = 1000, the last short),
# 4 slices of 544 on scalar loads (k = 2050 % 4 != 0), and 4 slices of 384 of which the last is empty
# (k = 1100). Both targets run them; T up to 8, the GEMV's.
SPLIT_SHAPES = [(19, 1000), (11, 2050), (7, 1100)]
# CUDA's bf16 activations (x and y bf16): the shapes of every path, and a split GEMV
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in _grid([*SHAPES, SPLIT_SHAPES[0]])]
# Gemma 2's soft-capped lm_head (the plain GEMM of each is in the grids): fp32 GEMV and SIMT tiles with a bias,
# bf16 on the CPU's panel and CUDA's mma tiles, a split-K GEMV; caps 30 (Gemma 2's) and 0.5 (most outputs saturate)
SOFTCAP_SPECS = [
    ("gemm", dict(n=n, k=k, wdtype=wd, has_bias=bias, softcap=cap))
    for n, k, wd, bias, cap in (
        (53, 37, "f32", True, 30.0),
        (131, 200, "bf16", False, 0.5),
        (19, 1000, "bf16", False, 2.0),
    )
]
SPECS = (
    _grid(SHAPES)
    + _grid([MODEL_SHAPE, BLOCKED_SHAPE])
    + _grid(SPLIT_SHAPES)
    + BF16_SPECS
    + SOFTCAP_SPECS
    + [(op, dict(p, adtype="bf16")) for op, p in SOFTCAP_SPECS[1:2]]
)
CASES = [pytest.param(*s, id=spec_id(s)) for s in _grid(SHAPES)] + [
    pytest.param(*s, id=spec_id(s), marks=CPU_ONLY) for s in _grid([MODEL_SHAPE, BLOCKED_SHAPE])
]
ALL_SHAPES = [*SHAPES, pytest.param(*MODEL_SHAPE, marks=CPU_ONLY), pytest.param(*BLOCKED_SHAPE, marks=CPU_ONLY)]
# The T up to which each row is bit-identical whatever else is in the batch: any T on the CPU (GEMV, GEMM, one
# or several row chunks); on CUDA the GEMV range, since the tiled kernel above it sums in another order.
BATCH_INVARIANT_T = {"cpu": (3, 5, 16, 17, 64, 129), "cuda": (8,)}


@functools.cache
def cpu_bf16_dot() -> bool:
    """Whether the CPU kernels are built with avx512_bf16: bf16 weights then meet x rounded to bf16 (vdpbf16ps)
    over k < k // 32 * 32, the main loop; the tail stays float32."""
    march = os.environ.get("LLMC_TEST_MARCH") or "native"
    cmd = ["g++", f"-march={march}", "-dM", "-E", "-x", "c++", os.devnull]
    return "__AVX512BF16__" in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def expected_x(x, k, wdtype, target, T=1):
    """x as the kernel multiplies it by the weights."""
    if target == "cuda" and wdtype == "bf16" and k % 8 == 0 and T > 8:  # the mma tiled kernel
        return to_bf16(x)[1]
    if target != "cpu" or wdtype != "bf16" or not cpu_bf16_dot():
        return x
    main = k // 32 * 32
    xr = x.copy()
    xr[:, :main] = to_bf16(x[:, :main])[1]
    return xr


# T: 1-5 the CPU's GEMV row counts and its first GEMM, 8 / 9 either side of CUDA's GEMV limit, 17, 64 and 129
# partial row tiles (129 on the CPU: several row chunks at k = 576)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 129])
@pytest.mark.parametrize("op,params", CASES)
def test_gemm_matches_numpy(kernels, weights, target, op, params, T):
    n, k = params["n"], params["k"]
    x, w, wf, b, bf = gemm_inputs(n, k, T, params["wdtype"], params["has_bias"], weights, seed=T)
    y = np.full((T, n), np.nan, dtype=np.float32)
    kernels(op, params)(x, w, b, y, T)
    assert_gemm_close(y, expected_x(x, k, params["wdtype"], target, T), wf, bf)


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [1, 5, 9, 17, 70])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_gemm_bf16_activations(kernels, weights, op, params, T):
    """bf16 x and y: the float32-activation kernel's y over the same bf16 x, rounded once (the same sums: the
    mma path rounds a float32 x to bf16 anyway)."""
    x, w, _, b, _ = gemm_inputs(params["n"], params["k"], T, params["wdtype"], params["has_bias"], weights, seed=T)
    bits, values = to_bf16(x)
    want = np.empty((T, params["n"]), np.float32)
    kernels(op, dict(params, adtype="f32"))(values, w, b, want, T)
    y = act_empty((T, params["n"]), "bf16")
    kernels(op, params)(bits, w, b, y, T)
    assert np.array_equal(y, to_bf16(want)[0])


@pytest.mark.parametrize("T", [1, 5, 9, 17, 70])
@pytest.mark.parametrize("op,params", SOFTCAP_SPECS, ids=map(spec_id, SOFTCAP_SPECS))
def test_softcapped_gemm_is_the_gemm_soft_capped(kernels, weights, op, params, T):
    plain = {key: v for key, v in params.items() if key != "softcap"}
    x, w, _, b, _ = gemm_inputs(params["n"], params["k"], T, params["wdtype"], params["has_bias"], weights, seed=T)
    y, capped = (np.full((T, params["n"]), np.nan, dtype=np.float32) for _ in range(2))
    kernels(op, plain)(x, w, b, y, T)
    kernels(op, params)(x, w, b, capped, T)
    assert_softcapped(capped, y, params["softcap"])


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [5, 17])
def test_softcapped_gemm_bf16_activations(kernels, weights, T):
    """bf16 y: the float32-activation kernel's capped y over the same bf16 x, rounded once (after the cap)."""
    op, params = SOFTCAP_SPECS[1]
    x, w, _, b, _ = gemm_inputs(params["n"], params["k"], T, params["wdtype"], params["has_bias"], weights, seed=T)
    bits, values = to_bf16(x)
    want = np.empty((T, params["n"]), np.float32)
    kernels(op, params)(values, w, b, want, T)
    y = act_empty((T, params["n"]), "bf16")
    kernels(op, dict(params, adtype="bf16"))(bits, w, b, y, T)
    assert np.array_equal(y, to_bf16(want)[0])


@pytest.mark.parametrize("T", [1, 5, 8])
@pytest.mark.parametrize("op,params", [pytest.param(*s, id=spec_id(s)) for s in _grid(SPLIT_SHAPES)])
def test_gemm_split_k_gemv_matches_numpy(kernels, weights, target, op, params, T):
    test_gemm_matches_numpy(kernels, weights, target, op, params, T)


@pytest.mark.parametrize("wdtype", ["f32", "bf16"])
@pytest.mark.parametrize("n,k", [*ALL_SHAPES, SPLIT_SHAPES[0]])
def test_gemm_row_independent_of_batch(kernels, weights, target, wdtype, n, k):
    """Each row of a batch is bit-identical to the same row computed alone (T = 1)."""
    fn = kernels("gemm", dict(n=n, k=k, wdtype=wdtype, has_bias=True))
    sizes = BATCH_INVARIANT_T[target]
    x, w, _, b, _ = gemm_inputs(n, k, max(sizes), wdtype, True, weights, seed=1)
    alone = np.empty((max(sizes), n), dtype=np.float32)
    for t in range(max(sizes)):
        fn(np.ascontiguousarray(x[t : t + 1]), w, b, alone[t : t + 1], 1)
    for T in sizes:
        batch = np.empty((T, n), dtype=np.float32)
        fn(np.ascontiguousarray(x[:T]), w, b, batch, T)
        assert np.array_equal(batch, alone[:T])


@pytest.mark.parametrize("T", [1, 3, 17, 70])
@pytest.mark.parametrize("n,k", [(70, 136), pytest.param(*MODEL_SHAPE, marks=CPU_ONLY)])
def test_gemm_independent_of_schedule(kernels, weights, schedules, n, k, T):
    """Every schedule (thread count, or thread and block order) gives bit-identical results."""
    fn = kernels("gemm", dict(n=n, k=k, wdtype="bf16", has_bias=False))
    x, w, _, _, _ = gemm_inputs(n, k, T, "bf16", False, weights, seed=3)
    outs = []
    for schedule in schedules:
        schedule()
        y = np.full((T, n), np.nan, dtype=np.float32)
        fn(x, w, None, y, T)
        outs.append(y)
    assert all(np.array_equal(o, outs[0]) for o in outs)


@CPU_ONLY
@pytest.mark.parametrize("mode", ["dot", "fma"])
@pytest.mark.parametrize("n,k", [MODEL_SHAPE, BLOCKED_SHAPE, (19, 61)])
def test_cpu_bf16_gemm_paths(kernels, weights, target, monkeypatch, mode, n, k):
    """On an avx512_bf16 host the GEMM path runs bf16 weights with vdpbf16ps, or as two FMAs per instruction
    over widened panels where the CPU computes the same numbers (llmc_gemm.h, bf16_gemm_emulates_dot);
    LLMC_CPU_BF16_GEMM forces each. Both match numpy and give every row bit-identical to the GEMV's."""
    if not cpu_bf16_dot():
        pytest.skip("the host's kernels have no bf16 dot: one bf16 GEMM path")
    monkeypatch.setenv("LLMC_CPU_BF16_GEMM", mode)
    fn = kernels("gemm", dict(n=n, k=k, wdtype="bf16", has_bias=True))
    T = 70
    x, w, wf, b, bf = gemm_inputs(n, k, T, "bf16", True, weights, seed=5)
    batch = np.full((T, n), np.nan, dtype=np.float32)
    fn(x, w, b, batch, T)
    assert_gemm_close(batch, expected_x(x, k, "bf16", target), wf, bf)
    alone = np.empty_like(batch)
    for t in range(T):
        fn(np.ascontiguousarray(x[t : t + 1]), w, b, alone[t : t + 1], 1)
    assert np.array_equal(batch, alone)


# The SwiGLU GEMM (CUDA: gemm_swiglu.cu.j2), its weight's gate and up rows interleaved as the packer lays them
# out: (inter, k) = (40, 200): 5 groups of 8 outputs, so the 64-row mma tiles' last holds one group and zero-fills
# the rest, 7 k steps of 32 and a zero-filled quarter; (24, 1000): a GEMV split over K (gemv_split) with the
# last slice short; (136, 64): 17 groups, 16-byte rows of whole k16 steps. Built by the CUDA harness alone.
SWIGLU_SHAPES = [(40, 200), (24, 1000), (136, 64)]
SWIGLU_SPECS = [
    spec
    for i, k in SWIGLU_SHAPES
    for a in ("f32", "bf16")
    for spec in (
        ("gemm_swiglu", dict(inter=i, k=k, wdtype="bf16", adtype=a)),
        ("gemm", dict(n=2 * i, k=k, wdtype="bf16", has_bias=False, adtype=a)),
        ("silu_mul", dict(inter=i, adtype=a)),
    )
]
# GeGLU's: the same GEMM with gelu_tanh as the epilogue (Gemma)
SWIGLU_SPECS += [
    (op, dict(p, activation="gelu_tanh")) for op, p in SWIGLU_SPECS if op != "gemm" and p["adtype"] == "bf16"
]


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("adtype", ["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 8, 9, 17, 70])
@pytest.mark.parametrize("inter,k", SWIGLU_SHAPES)
def test_swiglu_gemm_is_gemm_then_silu_mul(harnesses, weights, target, inter, k, T, adtype):
    """silu(x @ gate^T) * (x @ up^T) equals the unfused gemm and silu_mul bit for bit (the same sums in the same
    order, rounded as the unfused GEMM stores them, the same epilogue), and, with float32 activations, numpy's
    within the sums' float32 error."""
    from llmc.compiler.weights import SWIGLU_INTERLEAVE, interleave_rows

    cuda = harnesses["cuda"]
    cuda.build(SWIGLU_SPECS)
    x, w, wf, _, _ = gemm_inputs(2 * inter, k, T, "bf16", False, weights, seed=T)
    xa = x if adtype == "f32" else to_bf16(x)[0]
    fused = act_empty((T, inter), adtype)
    w_interleaved = interleave_rows(w[:inter], w[inter:], SWIGLU_INTERLEAVE)
    cuda("gemm_swiglu", dict(inter=inter, k=k, wdtype="bf16", adtype=adtype))(xa, w_interleaved, None, fused, T)
    gate_up = act_empty((T, 2 * inter), adtype)
    cuda("gemm", dict(n=2 * inter, k=k, wdtype="bf16", has_bias=False, adtype=adtype))(xa, w, None, gate_up, T)
    unfused = act_empty((T, inter), adtype)
    cuda("silu_mul", dict(inter=inter, adtype=adtype))(gate_up, unfused, T)
    assert np.array_equal(fused, unfused)
    if adtype == "bf16":
        return
    xr = expected_x(x, k, "bf16", target, T).astype(np.float64)
    g, u = xr @ wf[:inter].astype(np.float64).T, xr @ wf[inter:].astype(np.float64).T
    mg, mu = (np.abs(xr) @ np.abs(wf[h].astype(np.float64)).T for h in (slice(0, inter), slice(inter, None)))
    ref = g / (1 + np.exp(-g)) * u
    # d(silu(g) u) = silu'(g) u dg + silu(g) du, |silu'| < 1.1, |silu(g)| <= |g|; dg, du within 1e-5 of mg, mu
    assert np.all(np.abs(fused - ref) <= 1e-5 * (1.1 * np.abs(u) * mg + np.abs(g) * mu) + 1e-6)


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("inter,k", SWIGLU_SHAPES[:2])
def test_geglu_gemm_is_gemm_then_gelu_tanh_mul(harnesses, weights, target, inter, k, T):
    """With activation="gelu_tanh" the fused GEMM equals the unfused gemm and silu_mul's GeGLU bit for bit."""
    from llmc.compiler.weights import SWIGLU_INTERLEAVE, interleave_rows

    cuda = harnesses["cuda"]
    cuda.build(SWIGLU_SPECS)
    x, w, _, _, _ = gemm_inputs(2 * inter, k, T, "bf16", False, weights, seed=T)
    xa = to_bf16(x)[0]
    fused = act_empty((T, inter), "bf16")
    w_interleaved = interleave_rows(w[:inter], w[inter:], SWIGLU_INTERLEAVE)
    geglu = dict(inter=inter, k=k, wdtype="bf16", adtype="bf16", activation="gelu_tanh")
    cuda("gemm_swiglu", geglu)(xa, w_interleaved, None, fused, T)
    gate_up = act_empty((T, 2 * inter), "bf16")
    cuda("gemm", dict(n=2 * inter, k=k, wdtype="bf16", has_bias=False, adtype="bf16"))(xa, w, None, gate_up, T)
    unfused = act_empty((T, inter), "bf16")
    cuda("silu_mul", dict(inter=inter, adtype="bf16", activation="gelu_tanh"))(gate_up, unfused, T)
    assert np.array_equal(fused, unfused)
