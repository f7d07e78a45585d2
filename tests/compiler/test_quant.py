"""compiler/quant.py: the quantizer against round-to-nearest and Q4_0, its error bound, and the contract's checks."""

import dataclasses

import numpy as np
import pytest

from llmc.compiler import kquant
from llmc.compiler.quant import (
    IQ4_LEVELS,
    Q6_K,
    QuantConfig,
    QuantizedTensor,
    QuantScheme,
    dequantize,
    more_bits,
    quantize,
)
from llmc.compiler.quant_widen import common_scheme, held_on_cuda, widen_exactly
from llmc.errors import CompileError

SYMMETRIC = [QuantScheme(8, 37), QuantScheme(8, 32), QuantScheme(4, 32), QuantScheme(4, 32, scale_dtype="float32")]
ASYMMETRIC = [QuantScheme(4, 64, asymmetric=True), QuantScheme(4, 64, asymmetric=True, scale_dtype="float32")]


def _ids(s):
    return s.describe().replace(" ", "-")


def _group_errors(w, t) -> np.ndarray:
    """Squared error of each group, [N, groups]."""
    g, k = t.scheme.group_size, w.shape[1]
    e = np.zeros((w.shape[0], -(-k // g) * g), np.float64)
    e[:, :k] = (dequantize(t).astype(np.float64) - w) ** 2
    return e.reshape(w.shape[0], -1, g).sum(axis=2)


def _absmax_rtn(w, scheme) -> QuantizedTensor:
    """The quantizer llmc had before the search: scale = absmax / qmax (fp16 scales rounded up), round to nearest."""
    g, k = scheme.group_size, w.shape[1]
    lo, hi = scheme.qrange
    blocks = np.zeros((w.shape[0], -(-k // g) * g), np.float32)
    blocks[:, :k] = w
    scales = np.abs(blocks.reshape(w.shape[0], -1, g)).max(axis=2) / hi
    if scheme.scale_dtype == "float16":
        h = scales.astype(np.float16)
        h[h < scales] = np.nextafter(h[h < scales], np.float16(np.inf))
        scales = h.astype(np.float32)
    q = np.clip(np.rint(w / np.repeat(np.where(scales > 0, scales, 1), g, axis=1)[:, :k]), lo, hi)
    return QuantizedTensor(q.astype(np.int8), scales, None, dataclasses.replace(scheme, scale_dtype="float32"))


@pytest.mark.parametrize("scheme", SYMMETRIC, ids=_ids)
def test_searched_scales_beat_round_to_nearest(scheme):
    """In all, the error is well under round-to-nearest's with absmax / qmax, and q uses the whole range. At int4
    each group's is at most that (the searched candidates include its rounding); int8's groups' small errors move
    by more with the fp16 rounding of the scale (up to 13% either way on a group)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 100)).astype(np.float32)  # 100: the last group is short for every group size
    t = quantize(w, scheme)
    lo, hi = scheme.qrange
    assert t.q.min() >= lo and t.q.max() <= hi and t.q.min() == lo
    ours, rtn = _group_errors(w, t), _group_errors(w, _absmax_rtn(w, scheme))
    assert scheme.bits == 8 or np.all(ours <= rtn * 1.002 + 1e-12)
    assert ours.sum() < (0.9 if scheme.bits == 8 else 0.75) * rtn.sum()


def test_int4_error_is_below_q4_0s():
    """llama.cpp's Q4_0 (its reference rounding, gguf.quants) on heavy-tailed weights: llmc's int4 g32 errs less."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(3)
    w = (rng.standard_t(5, (256, 512)) * 0.02).astype(np.float32)
    q4_0_type = gguf.GGMLQuantizationType.Q4_0
    q4_0 = gguf.quants.dequantize(gguf.quants.quantize(w, q4_0_type), q4_0_type)
    ours = dequantize(quantize(w, QuantScheme(4, 32)))
    assert np.sum((ours - w) ** 2) < 0.95 * np.sum((q4_0 - w) ** 2)


@pytest.mark.parametrize("scheme", ASYMMETRIC, ids=_ids)
def test_asymmetric_round_to_nearest_is_within_half_a_step(scheme):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 100)).astype(np.float32)
    t = quantize(w, scheme)
    lo, hi = scheme.qrange
    assert t.q.min() >= lo and t.q.max() <= hi
    step = np.repeat(t.scales, scheme.group_size, axis=1)[:, :100]
    assert np.all(np.abs(dequantize(t) - w) <= 0.5 * step * (1 + 1e-5) + 1e-7)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_fp16_scales_are_fp16_values(asymmetric):
    """Scales (and mins) are fp16 values: asymmetric ones no smaller than the fp32 choice (so no element is
    clipped), the searched symmetric ones the nearest to it."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((9, 96)) * np.logspace(-4, 1, 9)[:, None]).astype(np.float32)
    t16 = quantize(w, QuantScheme(4, 32, asymmetric))
    t32 = quantize(w, QuantScheme(4, 32, asymmetric, "float32"))
    for a in (t16.scales, t16.mins):
        assert a is None or np.array_equal(a.astype(np.float16).astype(np.float32), a)
    if asymmetric:
        assert np.all(t16.mins >= t32.mins)
    else:
        assert np.array_equal(t16.scales, t32.scales.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("scheme", SYMMETRIC + ASYMMETRIC, ids=_ids)
def test_quantizing_quantized_values_gives_them_back(scheme):
    """A checkpoint that is already quantized (a dequantized GGUF, a QAT model) loses nothing more when llmc
    quantizes it again to its scheme."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((128, 100)) * np.logspace(-3, 1, 128)[:, None]).astype(np.float32)
    once = dequantize(quantize(w, scheme))
    twice = dequantize(quantize(once, scheme))
    err = np.abs(twice - once).max(axis=1) / np.abs(once).max(axis=1)
    assert err.max() <= 1e-6, f"rows moved by up to {err.max():.2g} of their largest value"


def test_q6_k_is_exact_again_and_finer_than_q4_k():
    """llmc's Q6_K (kquant.quantize_q6k): int8 codes of each superblock's d, q in -32..31, and it errs far less
    than Q4_K. Unlike the other schemes it is not idempotent (nor is llama.cpp's): a group whose largest value
    the superblock's codes keep short of q = -32 is searched again on a grid that maps it to -32; quantizing
    its own values moves them by less than the first quantization's error (rows of tiny weights have
    subnormal fp16 d, where that comes close)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 512)) * np.logspace(-3, 1, 64)[:, None]).astype(np.float32)
    t = quantize(w, Q6_K)
    assert t.q.min() >= -32 and t.q.max() <= 31 and t.records.shape == (64, 36)
    once = dequantize(t)
    twice = dequantize(quantize(once, Q6_K))
    rms = lambda a: np.sqrt(np.mean(a**2, axis=1))  # noqa: E731
    assert np.all(rms(twice - once) <= rms(once - w))
    q4_k = dequantize(quantize(w, QuantScheme(4, 32, True, "kquant")))
    assert np.sqrt(np.mean((once - w) ** 2)) < 0.3 * np.sqrt(np.mean((q4_k - w) ** 2))


def test_q5_k_records_and_error():
    """llmc's Q5_K (kquant.quantize_kquant at nmax 31, llama.cpp's Q5_K grid): q in 0..31 under Q4_K's records,
    and it errs about half as much as Q4_K."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((32, 512)).astype(np.float32)
    t = quantize(w, QuantScheme(5, 32, True, "kquant"))
    assert t.q.min() >= 0 and t.q.max() <= 31 and t.records.shape == (32, 32)
    err = lambda s: np.sqrt(np.mean((dequantize(quantize(w, s)) - w) ** 2))  # noqa: E731
    assert err(t.scheme) < 0.6 * err(QuantScheme(4, 32, True, "kquant"))


def test_scales_past_fp16_are_refused():
    with pytest.raises(CompileError, match="past fp16's range"):
        quantize(np.full((1, 32), 1e6, np.float32), QuantScheme(4, 32))
    with pytest.raises(CompileError, match="past fp16's range"):
        quantize(np.full((1, 256), 1e9, np.float32), QuantScheme(4, 32, asymmetric=True, scale_dtype="kquant"))
    with pytest.raises(CompileError, match="not fp16 values"):
        QuantizedTensor(np.zeros((1, 32), np.int8), np.full((1, 1), 0.1, np.float32), None, QuantScheme(8, 32))


def test_zero_rows_quantize_to_zero():
    t = quantize(np.zeros((2, 64), np.float32), QuantScheme(4, 32))
    assert not t.q.any() and not dequantize(t).any()


def test_shapes_that_do_not_fit_the_scheme_are_refused():
    with pytest.raises(CompileError, match="do not fit"):
        QuantizedTensor(np.zeros((2, 64), np.int8), np.zeros((2, 3), np.float32), None, QuantScheme(8, 32))
    with pytest.raises(CompileError, match="mins"):
        QuantizedTensor(np.zeros((2, 64), np.int8), np.zeros((2, 2), np.float32), None, QuantScheme(4, 32, True))
    with pytest.raises(CompileError, match="bits"):
        QuantScheme(1, 32)
    with pytest.raises(CompileError, match="2-bit weights are Q2_K's"):
        QuantScheme(2, 16)
    with pytest.raises(CompileError, match="3-bit weights are Q3_K's"):
        QuantScheme(3, 32)


@pytest.mark.parametrize(
    "old,new",
    [
        (QuantScheme(4, 32, asymmetric=True), QuantScheme(8, 16, asymmetric=True)),  # Q4_K beside Q6_K
        (QuantScheme(8, 16), QuantScheme(8, 16, asymmetric=True)),  # Q6_K beside Q4_K
        (QuantScheme(4, 32), QuantScheme(8, 32)),  # Q4_0 beside Q8_0
        (QuantScheme(8, 96), QuantScheme(8, 64)),  # per channel (K = 96) into groups, a short last one
        (QuantScheme(4, 64), QuantScheme(8, 32, asymmetric=True)),
        (QuantScheme(8, 32), QuantScheme(8, 32, scale_dtype="float32")),  # fp16 scales widen exactly
    ],
    ids=lambda s: s.describe().replace(" ", "-"),
)
def test_widen_exactly_keeps_every_dequantized_value_bit_for_bit(old, new):
    rng = np.random.default_rng(2)
    t = quantize(rng.standard_normal((5, 96)).astype(np.float32), old)
    r = widen_exactly(t, new)
    assert r.scheme == new and np.array_equal(r.q, t.q)
    assert np.array_equal(dequantize(r).view(np.int32), dequantize(t).view(np.int32))


@pytest.mark.parametrize(
    "old,new",
    [
        (QuantScheme(8, 32), QuantScheme(4, 32)),  # fewer bits
        (QuantScheme(4, 32, asymmetric=True), QuantScheme(8, 32)),  # mins dropped
        (QuantScheme(4, 32), QuantScheme(4, 32, asymmetric=True)),  # q + 8 and a min: not exact in float
        (QuantScheme(8, 32), QuantScheme(8, 64)),  # a wider group
        (QuantScheme(8, 32, scale_dtype="float32"), QuantScheme(8, 32)),  # fp32 scales into fp16
    ],
    ids=lambda s: s.describe().replace(" ", "-"),
)
def test_widen_exactly_refuses_what_it_cannot_hold_exactly(old, new):
    t = quantize(np.ones((2, 128), np.float32), old)
    with pytest.raises(CompileError, match="exactly"):
        widen_exactly(t, new)


def test_common_scheme_of_fused_sources():
    q4k, q6k = QuantScheme(4, 32, True, "float32"), QuantScheme(8, 16, scale_dtype="float32")
    assert common_scheme([q4k, q4k, q6k], 256) == QuantScheme(8, 16, True, "float32")
    assert common_scheme([QuantScheme(4, 32), QuantScheme(4, 32, scale_dtype="float32")], 256) == QuantScheme(
        4, 32, scale_dtype="float32"
    )
    assert common_scheme([QuantScheme(4, 32)] * 3, 256) == QuantScheme(4, 32)
    assert common_scheme([QuantScheme(4, 32), QuantScheme(8, 32)], 256) == QuantScheme(8, 32)


def test_quant_config_defaults_and_refusals():
    assert QuantConfig("int8").scheme(96) == QuantScheme(8, 32)  # as Q8_0
    assert QuantConfig("int8", group_size="channel").scheme(96) == QuantScheme(8, 96)  # one scale per output channel
    assert QuantConfig("int8", group_size="channel").describe() == "int8 per channel"
    assert QuantConfig("int8").describe() == "int8 g32"
    with pytest.raises(CompileError, match="--group-size channel is int8's"):
        QuantConfig("int4", group_size="channel")
    assert QuantConfig("int8", group_size=64).scheme(128) == QuantScheme(8, 64)
    assert QuantConfig("int4").scheme(64) == QuantScheme(4, 32)
    assert QuantConfig("int4").scheme(72) is None  # K not a multiple of 32: stays float
    assert QuantConfig().scheme(64) is None and not QuantConfig().enabled
    assert QuantConfig("int4", 128, lm_head=True).describe() == "int4 g128, lm_head"
    with pytest.raises(CompileError, match="mode 'int3'"):
        QuantConfig("int3")
    with pytest.raises(CompileError, match="group size 48"):
        QuantConfig("int4", group_size=48)
    with pytest.raises(CompileError, match="apply to a quantized build"):
        QuantConfig("none", lm_head=True)


def test_q4_k_takes_kquant_records_where_k_allows():
    kq = QuantScheme(4, 32, asymmetric=True, scale_dtype="kquant")
    assert QuantConfig("q4_k").scheme(512) == kq and kq.scale_bits == 8 and not kq.stores_mins
    assert QuantConfig("q4_k").scheme(704) == QuantScheme(4, 32, asymmetric=True)  # K not a multiple of 256
    assert QuantConfig("q4_k", lm_head=True).describe() == "q4_k, lm_head"
    with pytest.raises(CompileError, match="q4_k chooses its own groups"):
        QuantConfig("q4_k", group_size=64)
    with pytest.raises(CompileError, match="asymmetric groups of 32"):
        QuantScheme(4, 64, asymmetric=True, scale_dtype="kquant")


def test_more_bits_are_llama_cpps_layers():
    """llama.cpp's Q4_K_M widens attn_v and ffn_down on these layers of a 32-layer model (Llama-3-8B's)."""
    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(6) if more_bits(i, 6)] == [2, 5]  # the bundled model: no whole eighth


def test_recipes_choose_per_tensor():
    q4_k, q8_0 = QuantConfig("q4_k").scheme(512), QuantScheme(8, 32)
    recipe = QuantConfig("q4_k_m")
    assert recipe.quantizes_head and recipe.describe() == "q4_k_m"
    assert recipe.tensor_scheme("lm_head.weight", 512, 32) == Q6_K  # as llama.cpp's
    assert recipe.tensor_scheme("lm_head.weight", 288, 32) == q8_0  # K % 256: llama.cpp's fallback for Q6_K
    assert recipe.tensor_scheme("model.embed_tokens.weight", 512, 32) == q4_k  # untied, as llama.cpp's
    for layer, wide in ((0, True), (4, False), (6, True), (31, True)):
        for proj in ("self_attn.v_proj", "mlp.down_proj"):
            want = Q6_K if wide else q4_k
            assert recipe.tensor_scheme(f"model.layers.{layer}.{proj}.weight", 512, 32) == want
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert recipe.tensor_scheme(f"model.layers.{layer}.{proj}.weight", 512, 32) == q4_k
        # CUDA runs q, k and v as one GEMM of one scheme: q and k go with v
        for proj in ("self_attn.q_proj", "self_attn.k_proj"):
            name = f"model.layers.{layer}.{proj}.weight"
            assert recipe.tensor_scheme(name, 512, 32, one_scheme_qkv=True) == (Q6_K if wide else q4_k)
    assert recipe.tensor_scheme("model.layers.5.mlp.gate_proj.weight", 704, 32) == QuantScheme(4, 32, True)
    assert recipe.tensor_scheme("model.layers.0.mlp.down_proj.weight", 100, 32) is None  # K % 32: float
    five = QuantConfig("q5_k_m")  # llama.cpp's Q5_K_M: Q5_K (Q5_1 where K % 256), Q6_K where Q4_K_M has it
    q5_k = QuantScheme(5, 32, True, "kquant")
    assert five.describe() == "q5_k_m" and five.tensor_scheme("lm_head.weight", 512, 32) == Q6_K
    assert five.tensor_scheme("model.layers.0.mlp.down_proj.weight", 512, 32) == Q6_K
    assert five.tensor_scheme("model.layers.4.mlp.down_proj.weight", 512, 32) == q5_k
    assert five.tensor_scheme("model.layers.4.mlp.up_proj.weight", 704, 32) == QuantScheme(5, 32, True)
    everything = QuantConfig("q8_0")
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.4.mlp.gate_proj.weight"):
        assert everything.tensor_scheme(name, 512, 32) == q8_0
    plain = QuantConfig("int4")  # not a recipe: the head only with lm_head, never an untied embedding
    assert plain.tensor_scheme("lm_head.weight", 512, 32) is None
    assert QuantConfig("int4", lm_head=True).tensor_scheme("lm_head.weight", 512, 32) == QuantScheme(4, 32)
    assert QuantConfig("int4", lm_head=True).tensor_scheme("model.embed_tokens.weight", 512, 32) is None
    with pytest.raises(CompileError, match="q4_k_m chooses its own groups"):
        QuantConfig("q4_k_m", group_size=32)
    with pytest.raises(CompileError, match="q8_0 quantizes the lm_head itself"):
        QuantConfig("q8_0", lm_head=True)


def test_tensor_overrides_take_precedence_in_order():
    """--tensor-quant PATTERN=TYPE: the first pattern that matches a tensor's name (re.search) chooses its type,
    over the mode's and the recipe's choice; the rest keep the mode's."""
    q4_k, q8_0 = QuantConfig("q4_k").scheme(512), QuantScheme(8, 32)
    config = QuantConfig(
        "q4_k_m", overrides=((r"layers\.[0-9]+\.mlp\.down_proj", "int8"), ("down_proj", "float"), ("lm_head", "q4_k"))
    )
    assert config.tensor_scheme("model.layers.4.mlp.down_proj.weight", 512, 32) == QuantScheme(8, 32)
    assert config.tensor_scheme("lm_head.weight", 512, 32) == q4_k  # the recipe's Q6_K overridden
    assert not QuantConfig("q8_0", overrides=(("lm_head", "float"),)).quantizes_head  # the manifest's lm_head
    assert QuantConfig("int4", overrides=(("lm_head", "q8_0"),)).quantizes_head
    assert config.tensor_scheme("model.layers.0.self_attn.v_proj.weight", 512, 32) == Q6_K  # the recipe's own
    assert QuantConfig("int4", overrides=(("v_proj", "q6_k"),)).tensor_scheme("v_proj.weight", 288, 32) == q8_0
    assert config.describe() == r"q4_k_m, layers\.[0-9]+\.mlp\.down_proj=int8, down_proj=float, lm_head=q4_k"
    plain = QuantConfig("int4", 64, overrides=(("gate", "float"), ("up_proj", "int4"), ("embed", "q8_0")))
    assert plain.tensor_scheme("model.layers.1.mlp.gate_proj.weight", 512, 32) is None
    assert plain.tensor_scheme("model.layers.1.mlp.up_proj.weight", 512, 32) == QuantScheme(4, 64)  # the mode's g64
    assert plain.tensor_scheme("model.embed_tokens.weight", 512, 32) == q8_0  # untied: only by a pattern
    assert plain.tensor_scheme("model.embed_tokens.weight", 100, 32) is None  # K % 32: float whatever is asked
    with pytest.raises(CompileError, match="no tensor type 'q3_k'"):
        QuantConfig("int4", overrides=(("x", "q3_k"),))
    with pytest.raises(CompileError, match="not a regular expression"):
        QuantConfig("int4", overrides=(("mlp.(", "int8"),))
    with pytest.raises(CompileError, match="add --quant"):
        QuantConfig("none", overrides=(("x", "int8"),))


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(4, 32),
        QuantScheme(8, 32),
        QuantScheme(4, 32, asymmetric=True),
        QuantScheme(4, 32, asymmetric=True, scale_dtype="kquant"),
    ],
    ids=_ids,
)
def test_importance_weighted_rounding_errs_less_where_it_matters(scheme):
    """With each input channel's importance (its mean squared activation), the error that the activations see,
    sum over k of importance * err^2, is below the unweighted rounding's; without, nothing changes."""
    rng = np.random.default_rng(11)
    w = (rng.standard_t(5, (128, 512)) * 0.02).astype(np.float32)
    importance = rng.lognormal(0.0, 1.5, 512).astype(np.float32)  # a few channels carry most of the activations
    plain, weighted = quantize(w, scheme), quantize(w, scheme, importance)

    def seen(t):
        return float(((dequantize(t) - w) ** 2 * importance).sum())

    assert seen(weighted) < 0.97 * seen(plain)
    assert all(np.array_equal(a, b) for a, b in zip(quantize(w, scheme, None).q, plain.q, strict=True))
    with pytest.raises(CompileError, match="importance"):
        quantize(w, scheme, importance[:100])


def test_kquant_records_hold_the_scales_and_beat_round_to_nearest():
    """llmc's Q4_K: the records decode to exactly the scales and mins q was rounded against (6-bit codes,
    fp16 d / dmin, as llama.cpp's layout: encode and decode are inverse), q uses 0..15, and the searched
    scales and mins err less than min / max round-to-nearest with fp16 scales."""
    rng = np.random.default_rng(5)
    w = (rng.standard_t(5, (64, 512)) * 0.02).astype(np.float32)
    t = quantize(w, QuantScheme(4, 32, asymmetric=True, scale_dtype="kquant"))
    assert t.records.shape == (64, 32) and t.q.min() == 0 and t.q.max() == 15
    assert all(np.array_equal(a, b) for a, b in zip(kquant.decode(t.records), (t.scales, t.mins), strict=True))
    r = t.records.reshape(64, 2, 16)
    d, dmin = (r[..., a : a + 2].copy().view(np.float16)[..., 0] for a in (0, 2))
    sc, m = kquant.scale_min_codes(r[..., 4:16])
    assert np.array_equal(kquant.encode(d, dmin, sc, m), t.records)
    rtn = quantize(w, QuantScheme(4, 32, asymmetric=True))
    assert np.sum((dequantize(t) - w) ** 2) < 0.9 * np.sum((dequantize(rtn) - w) ** 2)
    with pytest.raises(CompileError, match="do not hold its scales"):
        QuantizedTensor(t.q, t.scales * 2, t.mins, t.scheme, t.records)


def test_a_codebook_scheme_holds_iq4_levels():
    """IQ4_NL / IQ4_XS: q holds the levels themselves; an int8 scheme holds them exactly (the CUDA build's), int4
    does not, and a value that is no level is refused."""
    scheme = QuantScheme(4, 32, codebook=True)
    assert scheme.describe() == "iq4 g32" and scheme.kernel_params()["codebook"] is True
    assert QuantScheme.of_kernel(scheme.kernel_params()) == scheme
    assert "codebook" not in QuantScheme(4, 32).kernel_params()
    t = quantize(np.random.default_rng(0).standard_normal((6, 96), dtype=np.float32), scheme)
    assert set(np.unique(t.q)) <= set(IQ4_LEVELS.tolist())
    wide = widen_exactly(t, held_on_cuda(scheme))
    assert wide.scheme == QuantScheme(8, 32) and np.array_equal(dequantize(wide), dequantize(t))
    with pytest.raises(CompileError, match="cannot be stored exactly"):
        widen_exactly(t, QuantScheme(4, 32))
    with pytest.raises(CompileError, match="codebook weights are IQ4's"):
        QuantScheme(4, 32, asymmetric=True, codebook=True)
    q = t.q.copy()
    q[0, 0] = 2
    with pytest.raises(CompileError, match="none of IQ4's levels"):
        QuantizedTensor(q, t.scales, None, scheme)


@pytest.mark.parametrize(
    "scheme,bound", [(QuantScheme(3, 16, scale_dtype="kquant"), 0.2), (QuantScheme(2, 16, True, "kquant"), 0.4)]
)
def test_q3_k_and_q2_k_quantize_under_their_records(scheme, bound):
    """llmc's Q3_K and Q2_K (for the kernels' tests and the tuner): q in range, the records hold the scales (and
    mins), and the error is about the types'."""
    w = np.random.default_rng(1).standard_normal((5, 512), dtype=np.float32)
    t = quantize(w, scheme)
    lo, hi = scheme.qrange
    assert t.q.min() >= lo and t.q.max() <= hi and len(np.unique(t.q)) == hi - lo + 1
    held = kquant.decode_records(t.records, scheme.group_size, scheme.asymmetric)
    assert all(a is b or np.array_equal(a, b) for a, b in zip(held, (t.scales, t.mins), strict=True))
    assert np.sqrt(np.mean((dequantize(t) - w) ** 2) / np.mean(w**2)) < bound
