"""qgemm (templates/cpu/qgemm.cc.j2, llmc_qgemm.h) against dequantize-then-matmul in numpy float64.

The kernel quantizes the activations to int8 per block of 32 of a row (d = amax / 127, q = rint(x * 127 / amax)),
so it is compared twice:
- tightly with `qgemm_reference`, which quantizes x the same way (bit for bit, float32 numpy) and computes
  x_hat @ dequant(w)^T in float64: what is left is float32 rounding of the kernel's per-block scales and sums,
  bounded by 1e-5 x the sum of the magnitudes of the terms it adds;
- with the unquantized x: |x - x_hat| <= d / 2 per element, so |y - x @ w^T| <= sum over k of |w| d / 2
  (plus the rounding above).

CUDA's qgemm has its own test (cuda/test_qgemm_cuda.py). Shapes have n not a multiple of the 2-output tiles or the 8-row decode
tasks, k = 32 / 96 / 160 / 576 (odd numbers of 32-blocks for the int4 pair steps, short last groups), every
scheme of compiler/quant.py; T crosses the decode / prefill switch (4) and the 64-row prefill chunks.
LLMC_TEST_MARCH=haswell / x86-64 run the AVX2 / portable paths; a host with AVX-512 VNNI or AVX-VNNI runs those
under the default -march=native.
"""

import numpy as np
import pytest

from llmc.compiler.codegen.render import render_kernel
from llmc.compiler.quant import IQ4_LEVELS, QuantScheme, dequantize
from llmc.compiler.quant_pack import pack_cpu, unpack_cpu
from llmc.errors import CompileError
from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import assert_softcapped, qgemm_reference, quantized_weight

pytestmark = pytest.mark.targets("cpu")

# (n, k, bits, group_size, asymmetric, scale_bits); group_size == k: one scale per output channel; scale_bits
# 16 (llmc's quantizer, GGUF Q8_0 / Q4_0), 32 (GGUF's K-quants, widened) or 8 (K-quant records: Q4_K / Q5_K's
# asymmetric ones, Q6_K's symmetric ones)
SCHEMES = [
    (37, 32, 8, 16, False, 32),  # GGUF Q6_K
    (53, 96, 8, 32, False, 16),
    (53, 96, 8, 32, False, 32),
    (37, 160, 8, 64, False, 16),  # groups 64, 64, 32
    (53, 576, 8, 128, False, 16),  # 4.5 groups
    (37, 576, 8, 576, False, 16),
    (53, 96, 4, 32, False, 16),  # 3 blocks: one pair step and an odd tail
    (53, 96, 4, 32, False, 32),
    (37, 160, 4, 64, False, 16),
    (53, 576, 4, 128, False, 16),
    (37, 32, 4, 64, False, 16),  # one short group
    (53, 160, 4, 32, True, 32),  # GGUF Q4_K
    (53, 160, 4, 32, True, 16),
    (37, 96, 4, 64, True, 16),
    (53, 576, 4, 128, True, 16),
    (37, 160, 4, 128, True, 32),
    (37, 160, 8, 16, True, 32),  # GGUF Q4_K beside Q6_K in one fused GEMM (quant_widen.common_scheme)
    (53, 96, 8, 32, True, 16),
    (37, 576, 8, 576, True, 16),
    (53, 96, 8, 32, True, 32),  # GGUF Q5_K
    (37, 256, 4, 32, True, 8),  # GGUF Q4_K, its own superblock records (scale_bits 8)
    (53, 768, 4, 32, True, 8),
    (19, 512, 8, 32, True, 8),  # GGUF Q5_K's records, its q widened to int8
    (37, 256, 6, 16, False, 8),  # GGUF Q6_K: int6 under its own records
    (53, 768, 6, 16, False, 8),
    (53, 160, 5, 32, False, 16),  # GGUF Q5_0
    (37, 96, 5, 32, True, 16),  # GGUF Q5_1
    (19, 512, 5, 32, True, 8),  # GGUF Q5_K under its own records
    (37, 256, 3, 16, False, 8),  # GGUF Q3_K: int3 under Q6_K's records
    (53, 768, 3, 16, False, 8),
    (37, 256, 2, 16, True, 8),  # GGUF Q2_K: int2 with mins under its own records
    (53, 512, 2, 16, True, 8),
]


def _params(n, k, bits, g, asym, scale_bits, bias):
    return dict(n=n, k=k, bits=bits, group_size=g, asymmetric=asym, scale_bits=scale_bits, has_bias=bias)


# Gemma 2's soft-capped lm_head: int8, int4 (the row-pair path from 3 rows on), K-quant records with a bias
SOFTCAP_SPECS = [
    ("qgemm", dict(_params(*SCHEMES[i], i == 20), softcap=cap)) for i, cap in ((1, 30.0), (6, 0.5), (20, 2.0))
]
# GGUF IQ4_NL (fp16 scales) and IQ4_XS (its own records, scale_bits 8; or fp32 scales, fused beside IQ4_NL):
# int4's nibbles, each a level's index
IQ4_SPECS = [
    ("qgemm", {**_params(n, k, 4, 32, False, scale_bits, bias), "codebook": True})
    for n, k, scale_bits in ((53, 160, 16), (37, 576, 32), (19, 256, 8), (37, 768, 8))
    for bias in (False, True)
]
SPECS = [("qgemm", _params(*s, bias)) for s in SCHEMES for bias in (False, True)] + SOFTCAP_SPECS + IQ4_SPECS
CASES = [pytest.param(*spec, id=spec_id(spec)) for spec in SPECS if not {"softcap", "codebook"} & set(spec[1])]
IQ4_CASES = [pytest.param(*spec, id=spec_id(spec)) for spec in IQ4_SPECS]
# the decode GEMV with 4 outputs in flight (qgemm.tune.toml gemv_cols; the default is 2): int8, int4 with an odd
# tail, asymmetric int4. A CPU tunable, so not in SPECS, which every target's harness builds.
COLS4 = [_params(*SCHEMES[i], True) for i in (1, 6, 13)]
COLS4_SPECS = [("qgemm", {**p, "gemv_cols": 4}) for p in COLS4]


def qgemm_inputs(params, T, seed):
    """x [T, k] (with a few large values, so blocks have different scales), the QuantizedTensor of a random
    w [n, k], the packed (qweight, scales, mins) and the bias (or None)."""
    n, k = params["n"], params["k"]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, k), dtype=np.float32)
    x[rng.random((T, k)) < 0.02] *= 20
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.1 + (0.05 if params["asymmetric"] else 0.0)
    t = quantized_weight(w, QuantScheme.of_kernel(params), rng)
    bias = rng.standard_normal(n, dtype=np.float32) if params["has_bias"] else None
    return x, t, pack_cpu(t), bias


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 17, 64, 129])
@pytest.mark.parametrize("op,params", CASES + IQ4_CASES)
def test_qgemm_matches_dequantized_matmul(kernels, op, params, T):
    x, t, (qweight, scales, mins), bias = qgemm_inputs(params, T, seed=T)
    y = np.full((T, params["n"]), np.nan, dtype=np.float32)
    kernels(op, params)(x, qweight, scales, mins, bias, y, T)
    ref, rounding, quant_err = qgemm_reference(x, t, bias)
    assert np.all(np.abs(y - ref) <= rounding), f"max excess {np.max(np.abs(y - ref) - rounding)}"
    exact = x.astype(np.float64) @ dequantize(t).astype(np.float64).T + (0 if bias is None else bias)
    assert np.all(np.abs(y - exact) <= quant_err * 1.001 + rounding)


@pytest.mark.parametrize("T", [1, 3, 5, 70])
@pytest.mark.parametrize("op,params", SOFTCAP_SPECS, ids=map(spec_id, SOFTCAP_SPECS))
def test_softcapped_qgemm_is_the_qgemm_soft_capped(kernels, op, params, T):
    x, _, (qweight, scales, mins), bias = qgemm_inputs(params, T, seed=T)
    y, capped = (np.full((T, params["n"]), np.nan, dtype=np.float32) for _ in range(2))
    kernels(op, {key: v for key, v in params.items() if key != "softcap"})(x, qweight, scales, mins, bias, y, T)
    kernels(op, params)(x, qweight, scales, mins, bias, capped, T)
    assert_softcapped(capped, y, params["softcap"])


@pytest.mark.parametrize("op,params", CASES[1::2] + IQ4_CASES[::2])
def test_qgemm_row_independent_of_batch(kernels, op, params):
    """Each row of any batch is bit-identical to the same row computed alone (T = 1)."""
    fn = kernels(op, params)
    x, _, (qweight, scales, mins), bias = qgemm_inputs(params, 129, seed=7)
    alone = np.empty((129, params["n"]), dtype=np.float32)
    for t in range(129):
        fn(np.ascontiguousarray(x[t : t + 1]), qweight, scales, mins, bias, alone[t : t + 1], 1)
    for T in (2, 3, 4, 5, 17, 64, 129):
        batch = np.empty((T, params["n"]), dtype=np.float32)
        fn(np.ascontiguousarray(x[:T]), qweight, scales, mins, bias, batch, T)
        assert np.array_equal(batch, alone[:T]), T


@pytest.mark.parametrize("T", [1, 4, 17, 129])
@pytest.mark.parametrize(
    "op,params", [CASES[5], CASES[-19], CASES[-17], CASES[-13], CASES[-9], CASES[-5], CASES[-1], IQ4_CASES[2]]
)
def test_qgemm_independent_of_schedule(kernels, schedules, op, params, T):
    """Thread counts 1, 2 and 3 give bit-identical results."""
    fn = kernels(op, params)
    x, _, (qweight, scales, mins), bias = qgemm_inputs(params, T, seed=3)
    outs = []
    for schedule in schedules:
        schedule()
        y = np.full((T, params["n"]), np.nan, dtype=np.float32)
        fn(x, qweight, scales, mins, bias, y, T)
        outs.append(y)
    assert all(np.array_equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize(
    "bits,g,asym,codebook",
    [
        (8, 16, False, False),
        (8, 96, False, False),
        (4, 32, False, False),
        (4, 64, True, False),
        (6, 16, False, False),
        (5, 32, False, False),
        (4, 32, False, True),
        (3, 16, False, False),
        (2, 16, True, False),
    ],
)
def test_pack_cpu_layout(bits, g, asym, codebook):
    """pack_cpu writes the contract's layout: int8 as u = q + 128; int4's chunk c byte j = u[32c + j] |
    u[32c + j + 16] << 4; int6's 24-byte chunk: those nibbles of u = q + 32, then byte 16 + j holding element
    32c + j + 8i's top 2 bits at bits 2i; int5's 20-byte chunk: the nibbles of u = q + 16, then 4 bytes of the
    fifth bits, element 32c + 4i + r's at bit i of byte r; IQ4: int4's nibbles of u, the index of q among
    IQ4_LEVELS; int3's 12-byte chunk: the low 2 bits of u = q + 4 as int6's top bits, then the third bits as
    int5's fifth."""
    rng = np.random.default_rng(0)
    k = 256 if bits in (2, 3, 6) else 96
    scheme = QuantScheme(bits, g, asym, "kquant" if bits in (2, 3, 6) else "float16", codebook)
    t = quantized_weight(rng.standard_normal((5, k), dtype=np.float32), scheme, rng)
    qweight, scales, mins = pack_cpu(t)
    if bits in (2, 3, 6):
        assert np.array_equal(scales, t.records)
    else:
        assert qweight.dtype == np.uint8 and scales.dtype == np.float16 and np.array_equal(scales, t.scales)
    assert (mins is None) == (not scheme.stores_mins)
    assert np.array_equal(unpack_cpu(qweight, t.shape, bits, asym, codebook), t.q)
    if bits == 8:
        assert np.array_equal(qweight.astype(np.int64), t.q.astype(np.int64) + 128)
        return
    if codebook:
        assert len(np.unique(t.q)) > 8  # the levels in use, not a few
        u = np.searchsorted(IQ4_LEVELS, t.q).astype(np.int64)
        assert np.array_equal(IQ4_LEVELS[u], t.q)
    else:
        u = t.q.astype(np.int64) + {4: 0 if asym else 8, 6: 32, 5: 16, 3: 4, 2: 0}[bits]
    if bits in (2, 3):
        for n, c, j in [(0, 0, 0), (4, 2, 7), (2, 7, 3)]:
            chunk = 4 * bits
            assert qweight[n, chunk * c + j] == sum((u[n, 32 * c + j + 8 * i] & 3) << (2 * i) for i in range(4))
            if bits == 2:
                continue
            for r in range(4):
                third = sum(int(u[n, 32 * c + 4 * i + r] >> 2) << i for i in range(8))
                assert qweight[n, 12 * c + 8 + r] == third
        return
    chunk = {6: 24, 5: 20, 4: 16}[bits]
    for n, c, j in [(0, 0, 0), (4, 2, 15), (2, 1, 7)]:
        assert qweight[n, chunk * c + j] == (u[n, 32 * c + j] & 15) | ((u[n, 32 * c + j + 16] & 15) << 4)
    if bits == 6:
        for n, c, j in [(0, 0, 0), (4, 2, 7), (2, 7, 3)]:
            top = sum((u[n, 32 * c + j + 8 * i] >> 4) << (2 * i) for i in range(4))
            assert qweight[n, 24 * c + 16 + j] == top
    if bits == 5:
        for n, c, r in [(0, 0, 0), (4, 2, 3), (2, 1, 1)]:
            assert qweight[n, 20 * c + 16 + r] == sum(int(u[n, 32 * c + 4 * i + r] >> 4) << i for i in range(8))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(k=100), "multiple of 32"),
        (dict(bits=4, group_size=16), "group_size must be one of"),
        (dict(group_size=48), "group_size must be one of"),
        (dict(bits=7), "bits must be 8, 6, 5, 3, 2 or 4"),
        (dict(bits=2, group_size=16, asymmetric=True), "int2 weights are Q2_K's"),  # fp16 scales
        (dict(bits=3, group_size=16), "int6 and int3 weights"),  # fp16 scales
        (dict(bits=5, group_size=64), "group_size must be one of"),
        (dict(bits=6, group_size=16), "int6 and int3 weights"),  # fp16 scales
        (dict(bits=6, group_size=16, scale_bits=8, k=256, asymmetric=True), "under Q2_K's records"),
        (dict(scale_bits=12), "scale_bits must be 16"),
        (dict(scale_bits=8), "K-quant scales"),  # int8 g32 symmetric, K = 96
        (dict(codebook=True), "codebook"),  # 8 bits
        (dict(bits=4, asymmetric=True, codebook=True), "codebook"),
    ],
)
def test_qgemm_render_refuses_other_schemes(change, message):
    params = {**_params(37, 96, 8, 32, False, 16, False), **change}
    with pytest.raises(CompileError, match=message):
        render_kernel("cpu", "qgemm", name="k", **params)


@pytest.mark.parametrize("params", COLS4, ids=[spec_id(("qgemm", p)) for p in COLS4])
def test_gemv_cols_change_no_number(kernels, harnesses, params):
    """A tunable: the decode GEMV's outputs in flight change its speed, never its numbers."""
    harnesses["cpu"].build(COLS4_SPECS)
    by_cols = {2: kernels("qgemm", params), 4: harnesses["cpu"]("qgemm", {**params, "gemv_cols": 4})}
    for T in (1, 2, 5):
        x, _, (qweight, scales, mins), bias = qgemm_inputs(params, T, seed=4)
        ys = []
        for fn in by_cols.values():
            ys.append(np.full((T, params["n"]), np.nan, dtype=np.float32))
            fn(x, qweight, scales, mins, bias, ys[-1], T)
        assert np.array_equal(ys[0], ys[1]) and not np.isnan(ys[0]).any(), T


# The lm_head's int8 activations in two passes (act_passes 2, CPU): int8, int4 with an odd tail, asymmetric
# int4, K-quant records with a bias, Q6_K (a Q4_K_M file's head), Q5_K, and one soft-capped
TWO_PASS = [_params(*SCHEMES[i], i in (13, 20)) for i in (1, 6, 13, 20, 23, 27)] + [dict(SOFTCAP_SPECS[1][1])]
TWO_PASS_SPECS = [("qgemm", {**p, "act_passes": 2}) for p in TWO_PASS]


@pytest.mark.parametrize("params", TWO_PASS, ids=[spec_id(("qgemm", p)) for p in TWO_PASS])
def test_two_pass_activations_err_far_less(kernels, harnesses, params):
    """x and its int8 rounding's residual as two rows: y within the quantized weights' float result by 1/100 of
    the one-pass bound (the residual's own rounding errs 1/254 as much), and each row's result whatever T (T
    crosses the 32-row chunks)."""
    harnesses["cpu"].build(TWO_PASS_SPECS)
    two = harnesses["cpu"]("qgemm", {**params, "act_passes": 2})
    one = kernels("qgemm", params)
    x, t, (qweight, scales, mins), bias = qgemm_inputs(params, 70, seed=5)
    y1, y2 = (np.full((70, params["n"]), np.nan, dtype=np.float32) for _ in range(2))
    one(x, qweight, scales, mins, bias, y1, 70)
    two(x, qweight, scales, mins, bias, y2, 70)
    exact = x.astype(np.float64) @ dequantize(t).astype(np.float64).T + (0 if bias is None else bias)
    _, rounding, quant_err = qgemm_reference(x, t, bias)
    cap = params.get("softcap")
    if cap is not None:  # compare before the cap: tanh is 1-Lipschitz, so the bounds hold after it too
        exact = cap * np.tanh(exact / cap)
    assert np.all(np.abs(y1 - exact) <= quant_err * 1.001 + rounding)
    assert np.all(np.abs(y2 - exact) <= quant_err / 100 + 2 * rounding)
    assert np.abs(y2 - exact).mean() < np.abs(y1 - exact).mean() / 20
    for T in (1, 3, 33):
        alone = np.full((T, params["n"]), np.nan, dtype=np.float32)
        two(np.ascontiguousarray(x[:T]), qweight, scales, mins, bias, alone, T)
        assert np.array_equal(alone, y2[:T]), T


# A fused q / k / v whose parts have different schemes (quantize_linear's split_mixed, CPU) runs one qgemm a
# scheme, each writing its columns of one output (ldy): int4 with an odd tail, Q4_K records with a bias, Q6_K,
# and a two-pass int8 one
LDY = [_params(*SCHEMES[i], i == 20) for i in (6, 20, 23)] + [{**_params(*SCHEMES[1], False), "act_passes": 2}]
LDY_SPECS = [("qgemm", {**p, "ldy": p["n"] + 13}) for p in LDY]


@pytest.mark.parametrize("params", LDY, ids=[spec_id(("qgemm", p)) for p in LDY])
def test_ldy_writes_its_columns_of_a_wider_output(kernels, harnesses, params):
    """With ldy, y's rows are ldy apart: columns [0, n) get the unstrided kernel's numbers, the rest stay."""
    harnesses["cpu"].build(LDY_SPECS + [("qgemm", p) for p in LDY if "act_passes" in p])
    n, ldy = params["n"], params["n"] + 13
    plain, strided = harnesses["cpu"]("qgemm", params), harnesses["cpu"]("qgemm", {**params, "ldy": ldy})
    for T in (1, 2, 5, 70):
        x, _, (qweight, scales, mins), bias = qgemm_inputs(params, T, seed=T)
        y = np.full((T, n), np.nan, dtype=np.float32)
        wide = np.full((T, ldy), 7.0, dtype=np.float32)
        plain(x, qweight, scales, mins, bias, y, T)
        strided(x, qweight, scales, mins, bias, wide, T)
        assert np.array_equal(wide[:, :n], y) and np.all(wide[:, n:] == 7.0), T


def test_qgemm_render_refuses_a_row_stride_below_n():
    with pytest.raises(CompileError, match="ldy must be an int > n"):
        render_kernel("cpu", "qgemm", name="k", **_params(37, 96, 8, 32, False, 16, False), ldy=37)
