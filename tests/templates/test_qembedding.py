"""qembedding (templates/{cpu,cuda}/qembedding.*.j2): out[t] = dequant(table)[ids[t]], read from the target's
packed layout (compiler/quant_pack.py: pack_cpu, pack_cuda), equal bit for bit to compiler/quant.py's dequantize
(the values a GGUF file's table holds); on CUDA with bf16 activations, those rounded to bf16."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import render_kernel
from llmc.compiler.quant import QuantScheme, dequantize
from llmc.compiler.quant_pack import pack_cpu, pack_cuda
from llmc.errors import CompileError
from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import act_empty, quantized_weight, to_bf16

# (hidden, bits, group_size, asymmetric, scale_bits): hidden 96 / 160 / 576 leave CUDA's last 128- or 64-k block
# short (int4: 3, 1 and 2 of its 4 units); the GGUF schemes (Q8_0, Q4_0, Q4_K, Q6_K, Q5_K) and llmc's own
SCHEMES = [
    (96, 8, 32, False, 16),  # Q8_0
    (160, 4, 32, False, 16),  # Q4_0
    (160, 4, 32, True, 32),  # Q4_K
    (96, 8, 16, False, 32),  # Q6_K
    (576, 8, 32, True, 32),  # Q5_K
    (576, 4, 64, True, 16),
    (160, 4, 128, False, 16),  # a short last group
    (96, 8, 96, False, 16),  # one scale per row
    (256, 4, 32, True, 8),  # Q4_K's own superblock records
    (512, 8, 32, True, 8),  # Q5_K's records, its q widened to int8
    (768, 6, 16, False, 8),  # Q6_K: int6 under its own records (the CPU's; CUDA holds it widened to int8)
    (160, 5, 32, False, 16),  # Q5_0 (the CPU's, as int6)
    (96, 5, 32, True, 16),  # Q5_1
    (512, 5, 32, True, 8),  # Q5_K
    (768, 3, 16, False, 8),  # Q3_K: int3 under Q6_K's records (the CPU's)
    (512, 2, 16, True, 8),  # Q2_K: int2 under its own records
]


def _params(hidden, bits, g, asym, scale_bits, **extra):
    return dict(hidden=hidden, bits=bits, group_size=g, asymmetric=asym, scale_bits=scale_bits, **extra)


# IQ4_NL and IQ4_XS (the CPU's): int4's nibbles, each a level's index
IQ4_SPECS = [
    ("qembedding", _params(hidden, 4, 32, False, scale_bits, codebook=True))
    for hidden, scale_bits in ((160, 16), (96, 32), (512, 8))
]
F32_SPECS = [("qembedding", _params(*s)) for s in SCHEMES] + IQ4_SPECS
BF16_SPECS = [("qembedding", _params(*SCHEMES[i], adtype="bf16")) for i in (1, 2)]
SCALED_SPECS = [("qembedding", _params(*SCHEMES[i], scale=8.0)) for i in (0, 2)]
SPECS = F32_SPECS + BF16_SPECS + SCALED_SPECS
VOCAB = 61


def _inputs(target, params, T, seed):
    """ids (the last row, and a repeated id), the packed table's parts as the target stores them, and the
    dequantized table."""
    rng = np.random.default_rng(seed)
    scheme = QuantScheme.of_kernel(params)
    w = rng.standard_normal((VOCAB, params["hidden"]), dtype=np.float32) * 0.1 + (0.03 if scheme.asymmetric else 0)
    t = quantized_weight(w, scheme, rng)
    qweight, scales, mins = (pack_cpu if target == "cpu" else pack_cuda)(t)
    ids = rng.integers(0, VOCAB, max(T, 3)).astype(np.int32)
    ids[0], ids[2] = VOCAB - 1, ids[1]
    return ids[:T].copy(), qweight, scales, mins, dequantize(t)


F32_CASES = [
    pytest.param(
        *spec,
        id=spec_id(spec),
        marks=[pytest.mark.targets("cpu")] if spec[1]["bits"] in (2, 3, 5, 6) or "codebook" in spec[1] else [],
    )
    for spec in F32_SPECS
]


@pytest.mark.parametrize("T", [0, 1, 3, 17])
@pytest.mark.parametrize("op,params", F32_CASES)
def test_qembedding_equals_the_dequantized_rows(kernels, target, op, params, T):
    ids, qweight, scales, mins, table = _inputs(target, params, T, seed=T)
    out = np.full((T + 1, params["hidden"]), np.nan, dtype=np.float32)
    kernels(op, params)(ids, T, qweight, scales, mins, out)
    assert np.array_equal(out[:T], table[ids])
    assert np.isnan(out[T:]).all()  # nothing written past the last row


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_qembedding_bf16_activations(kernels, target, op, params):
    ids, qweight, scales, mins, table = _inputs(target, params, 5, seed=1)
    out = act_empty((6, params["hidden"]), "bf16")
    kernels(op, params)(ids, 5, qweight, scales, mins, out)
    assert np.array_equal(out[:5], to_bf16(table[ids])[0])
    assert (out[5:] == 0x7FC0).all()


@pytest.mark.parametrize("op,params", SCALED_SPECS, ids=map(spec_id, SCALED_SPECS))
def test_qembedding_scaled(kernels, target, op, params):
    """Gemma's sqrt(hidden) and Granite's multiplier: the float32 product, after the row's dequantization."""
    ids, qweight, scales, mins, table = _inputs(target, params, 5, seed=2)
    out = np.empty((5, params["hidden"]), dtype=np.float32)
    kernels(op, params)(ids, 5, qweight, scales, mins, out)
    assert np.array_equal(out, table[ids] * np.float32(params["scale"]))


def test_qembedding_render_refuses_what_no_layout_holds():
    with pytest.raises(CompileError, match="multiple of 32"):
        render_kernel("cpu", "qembedding", name="e", **_params(100, 8, 32, False, 16))
    with pytest.raises(CompileError, match="group_size"):
        render_kernel("cpu", "qembedding", name="e", **_params(96, 4, 16, False, 16))
    with pytest.raises(CompileError, match="bits must be 8 or 4 on target cuda"):
        render_kernel("cuda", "qembedding", name="e", adtype="f32", **_params(768, 6, 16, False, 8))
