"""CUDA qgemm (templates/cuda/qgemm.cu.j2, llmc_qgemm.cuh) under the simulator, against dequantize-then-matmul
in numpy float64, and pack_cuda's layout (compiler/quant_pack.py) against the formulas it documents.

- T <= 8 runs the GEMV: fp32 dequantization and accumulation, so y is within 1e-5 x the magnitude of its terms
  (sum over k of |x| (|q s| + |m|), + |bias|) of x @ dequant(w)^T.
- Larger T runs the tensor-core GEMM: x is rounded to bf16 (nearest even) in shared memory, q is exact in bf16
  and the scales and mins apply in fp32, so y is within the same 1e-5 bound of x_bf16 @ dequant(w)^T, and
  within 2^-9 |x| @ |dequant(w)|^T more of the unrounded product (bf16's relative rounding error).

Shapes: n not a multiple of the 8-row n tiles or 64-column blocks, k with a short last 64-byte row block (int4:
96, 160; int8: 96, 160) and without (576), long rows that split the GEMV across warps (int8 k = 1056, int4
k = 2080: 16 full blocks, 2 warps; int8 k = 4128: 8 warps), short last groups (int8 g128 at k = 160, int4 g128 at k = 160 / 2080); T crosses the
GEMV / GEMM switch (8) and the 64-row (32 asymmetric) tiles.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import render_kernel
from llmc.compiler.quant import QuantScheme, dequantize, quantize
from llmc.compiler.quant_pack import pack_cuda, unpack_cuda
from llmc.errors import CompileError
from tests.templates.kernel_harness import kernels_source, spec_id
from tests.templates.kernel_reference import assert_softcapped, quantized_weight, to_bf16

ROOT = Path(__file__).resolve().parents[3]  # the repository: the child imports tests.templates.*

# (n, k, bits, group_size, asymmetric, scale_bits); group_size == k: one scale per output channel; scale_bits
# 16 (llmc's quantizer, GGUF Q8_0 / Q4_0), 32 (GGUF's K-quants, widened) or 8 (K-quant records)
SCHEMES = [
    (37, 96, 8, 96, False, 16),
    (53, 160, 8, 32, False, 16),
    (37, 160, 8, 16, False, 32),  # GGUF Q6_K
    (70, 160, 8, 128, False, 16),  # groups 128, 32
    (19, 1056, 8, 1056, False, 32),  # GEMV split over 2 warps, a 32-k tail block
    (11, 4128, 8, 32, False, 16),  # GEMV split over 8 warps (the most)
    (53, 96, 4, 32, False, 16),  # no full 128-k block: the tail alone
    (37, 160, 4, 128, False, 32),
    (70, 576, 4, 32, False, 16),
    (19, 2080, 4, 128, False, 16),
    (53, 160, 4, 32, True, 32),  # GGUF Q4_K
    (37, 576, 4, 128, True, 16),
    (70, 160, 4, 128, True, 32),
    (37, 160, 8, 16, True, 32),  # GGUF Q4_K beside Q6_K in one fused GEMM (quant_widen.common_scheme)
    (19, 1056, 8, 32, True, 16),  # GGUF Q5_1
    (53, 160, 4, 32, True, 16),  # GGUF Q4_1
    (37, 160, 8, 32, True, 32),  # GGUF Q5_K
    (53, 96, 8, 32, False, 32),  # GGUF IQ4_XS
    (37, 256, 4, 32, True, 8),  # GGUF Q4_K, its own superblock records (scale_bits 8)
    (53, 768, 4, 32, True, 8),
    (19, 512, 8, 32, True, 8),  # GGUF Q5_K's records, its q widened to int8
]
TS = [1, 3, 8, 9, 17, 70]
# tail blocks and clamped weight rows read exactly-sized numpy buffers: int4 asym, int8 g16, int4 without a full block
ASAN_SCHEMES = [SCHEMES[12], SCHEMES[2], SCHEMES[6]]


def _params(n, k, bits, g, asym, scale_bits, bias, adtype="f32"):
    return dict(n=n, k=k, bits=bits, group_size=g, asymmetric=asym, scale_bits=scale_bits, has_bias=bias, adtype=adtype)


F32_SPECS = [("qgemm", _params(*s, bias)) for s in SCHEMES for bias in (False, True)]
CASES = [pytest.param(*spec, id=spec_id(spec)) for spec in F32_SPECS]
# bf16 activations: int8 and int4, asymmetric, a split GEMV, short groups
BF16_SPECS = [("qgemm", _params(*SCHEMES[i], True, "bf16")) for i in (3, 4, 9, 11)]
# Gemma 2's soft-capped lm_head: int8 split GEMV, int4 asymmetric, K-quant records with a bias, bf16 activations
SOFTCAP_SPECS = [
    ("qgemm", dict(_params(*SCHEMES[i], i == 18, adtype), softcap=cap))
    for i, cap, adtype in ((4, 30.0, "f32"), (12, 0.5, "f32"), (18, 2.0, "f32"), (12, 0.5, "bf16"))
]
SPECS = F32_SPECS + BF16_SPECS + SOFTCAP_SPECS


@pytest.fixture(scope="module")
def cuda(harnesses):
    harness = harnesses["cuda"]
    harness.build(SPECS)
    return harness


def qgemm_inputs(params, T, seed):
    """x [T, k] (a few large values), the QuantizedTensor of a random w [n, k], pack_cuda's parts, bias or None."""
    n, k = params["n"], params["k"]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, k), dtype=np.float32)
    x[rng.random((T, k)) < 0.02] *= 20
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.1 + (0.05 if params["asymmetric"] else 0.0)
    t = quantized_weight(w, QuantScheme.of_kernel(params), rng)
    bias = rng.standard_normal(n, dtype=np.float32) if params["has_bias"] else None
    return x, t, pack_cuda(t), bias


def _run(kernel, params, x, packed, bias):
    T = x.shape[0]
    y = np.full((T, params["n"]), np.nan, dtype=np.float32)
    kernel(x, *packed, bias, y, T)
    return y


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("op,params", CASES)
def test_qgemm_cuda_matches_dequantized_matmul(cuda, op, params, T):
    x, t, packed, bias = qgemm_inputs(params, T, seed=T)
    y = _run(cuda(op, params), params, x, packed, bias)
    k, g = t.shape[1], t.scheme.group_size
    qs = t.q.astype(np.float64) * np.repeat(t.scales, g, axis=1)[:, :k]
    m = np.zeros_like(qs) if t.mins is None else np.repeat(t.mins, g, axis=1)[:, :k].astype(np.float64)
    b = 0.0 if bias is None else bias.astype(np.float64)
    xr = x if T <= 8 else to_bf16(x)[1]  # what the kernel multiplies: x, or x rounded to bf16 for the GEMM
    magnitude = np.abs(xr).astype(np.float64) @ (np.abs(qs) + np.abs(m)).T + np.abs(b)
    ref = xr.astype(np.float64) @ (qs - m).T + b
    assert np.all(np.abs(y - ref) <= 1e-5 * magnitude), f"max excess {np.max(np.abs(y - ref) - 1e-5 * magnitude)}"
    exact = x.astype(np.float64) @ dequantize(t).astype(np.float64).T + b
    bound = 1e-5 * magnitude + (0.0 if T <= 8 else 2.0**-9 * np.abs(x) @ np.abs(dequantize(t)).T)
    assert np.all(np.abs(y - exact) <= bound)


@pytest.mark.parametrize("T", [3, 17])
@pytest.mark.parametrize("op,params", [CASES[9], CASES[21]])
def test_qgemm_cuda_independent_of_schedule(cuda, op, params, T):
    """Scheduling seeds (thread order between barriers, block order) give bit-identical results."""
    x, _, packed, bias = qgemm_inputs(params, T, seed=5)
    outs = []
    try:
        for schedule in cuda.schedules():
            schedule()
            outs.append(_run(cuda(op, params), params, x, packed, bias))
    finally:
        cuda.reset_schedule()
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("T", [3, 17])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_qgemm_cuda_bf16_activations(cuda, op, params, T):
    """bf16 x and y: the float32-activation kernel's y over the same bf16 x, rounded once."""
    x, _, packed, bias = qgemm_inputs(params, T, seed=T)
    bits, values = to_bf16(x)
    want = _run(cuda(op, dict(params, adtype="f32")), params, values, packed, bias)
    y = np.full((T, params["n"]), 0x7FC0, np.uint16)
    cuda(op, params)(bits, *packed, bias, y, T)
    assert np.array_equal(y, to_bf16(want)[0])


@pytest.mark.parametrize("T", [3, 17])
@pytest.mark.parametrize("op,params", SOFTCAP_SPECS, ids=map(spec_id, SOFTCAP_SPECS))
def test_softcapped_qgemm_cuda_is_the_qgemm_soft_capped(cuda, op, params, T):
    """float32 y: the plain kernel's (the same sums) soft-capped; bf16 y: the float32 kernel's capped y over the same
    bf16 x, rounded once."""
    x, _, packed, bias = qgemm_inputs(params, T, seed=T)
    f32 = dict(params, adtype="f32")
    if params["adtype"] == "bf16":
        bits, values = to_bf16(x)
        want = _run(cuda(op, f32), params, values, packed, bias)
        y = np.full((T, params["n"]), 0x7FC0, np.uint16)
        cuda(op, params)(bits, *packed, bias, y, T)
        assert np.array_equal(y, to_bf16(want)[0])
        return
    plain = {key: v for key, v in params.items() if key != "softcap"}
    assert_softcapped(
        _run(cuda(op, params), params, x, packed, bias),
        _run(cuda(op, plain), params, x, packed, bias),
        params["softcap"],
    )


@pytest.mark.parametrize("bits,asym,k", [(8, False, 96), (8, False, 160), (4, False, 96), (4, True, 416)])
def test_pack_cuda_layout(bits, asym, k):
    """Lane t of row block b finds its word w at byte 64 b + 4 (t nw + w); register j of its step s (the pair
    j = 2 s' + r) is `(word >> bits j) & mask`, halves u at k = KW (4 b + w) + 16 s' + 8 r + 2 t + {0, 1}."""
    n = 5
    rng = np.random.default_rng(1)
    t = quantize(rng.standard_normal((n, k), dtype=np.float32), QuantScheme(bits, 32, asym))
    qweight, scales, mins = pack_cuda(t)
    assert qweight.dtype == np.uint8 and qweight.shape == (n, k * bits // 8)
    assert np.array_equal(scales, t.scales) and (mins is None) == (not asym)
    assert np.array_equal(unpack_cuda(qweight, t.shape, bits, asym), t.q)
    stored = t.q.astype(np.int64) - t.scheme.qrange[0]  # the biased values u
    kw, mask = (32, 0x000F000F) if bits == 4 else (16, 0x00FF00FF)
    units = k // kw
    words = qweight.view("<u4")  # [n, row words]
    for row in range(n):
        for u in range(units):
            b, w = divmod(u, 4)
            nw = min(4, units - 4 * b)
            for lane in range(4):
                word = int(words[row, 16 * b + lane * nw + w])
                for j in range(kw // 8):
                    pair = (word >> (bits * j)) & mask
                    kk = kw * u + 16 * (j >> 1) + 8 * (j & 1) + 2 * lane
                    assert pair & 0xFFFF == stored[row, kk] and pair >> 16 == stored[row, kk + 1]


# Runs in an AddressSanitizer subprocess: each ASAN_SCHEMES kernel on both paths, checked loosely (the tight
# checks are above); an out-of-bounds access ends the process with ASan's report.
ASAN_CHILD = r"""
import ctypes, sys
import numpy as np
sys.path[:0] = [{root!r}]
from tests.templates.kernel_harness import CudaKernel
from llmc.compiler.codegen.render import kernel_id
from llmc.compiler.quant import dequantize
from tests.templates.cuda.test_qgemm_cuda import ASAN_SCHEMES, _params, _run, qgemm_inputs
lib = ctypes.CDLL({so!r})
for s in ASAN_SCHEMES:
    p = _params(*s, True)
    fn = CudaKernel(getattr(lib, "test_" + kernel_id("cuda", "qgemm", p)), "qgemm", p)
    for T in (3, 17):
        x, t, packed, bias = qgemm_inputs(p, T, seed=T)
        y = _run(fn, p, x, packed, bias)
        w = dequantize(t).astype(np.float64)
        ref = x.astype(np.float64) @ w.T + bias
        assert np.all(np.abs(y - ref) <= 2.0**-8 * (np.abs(x) @ np.abs(w).T + np.abs(bias))), (s, T)
print("ok")
"""


@pytest.mark.slow
def test_qgemm_cuda_asan_clean(tmp_path):
    (source,), _ = kernels_source("cuda", [("qgemm", _params(*s, True)) for s in ASAN_SCHEMES])
    so = simulator.build_simulated(source, tmp_path / "qgemm_asan.so", asan=True)
    code = ASAN_CHILD.format(root=str(ROOT), so=str(so))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=simulator.asan_env(), cwd=ROOT
    )
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


@pytest.mark.parametrize(
    "change,message",
    [(dict(k=100), "multiple of 32"), (dict(bits=4, group_size=16), "group_size must be one of")],
)
def test_qgemm_cuda_render_refuses_what_pack_cuda_cannot_hold(change, message):
    with pytest.raises(CompileError, match=message):
        render_kernel("cuda", "qgemm", name="k", **{**_params(37, 96, 8, 32, False, 16, False), **change})
