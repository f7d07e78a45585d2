"""rope (templates/{cpu,cuda}/rope.*.j2) against transformers' Llama rotary embedding (rotate-half), in torch
float32; on CUDA with bf16 activations, the float32 rotation of the bf16 values, rounded once. With norm_eps,
each head first goes through Qwen3's q_norm / k_norm (transformers' RMSNorm over head_dim), as its attention
does before RoPE. With LongRoPE (Phi-3), a token whose position carries the long flag rotates by the long
frequencies, the others by the short ones, cos and sin scaled by the attention factor."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id, render_kernel
from tests.templates.kernel_harness import spec_id, target_params
from tests.templates.kernel_reference import emitted_floats, rope_inputs, rope_inv_freq, rope_reference, to_bf16

# (num_heads, head_dim, rotated dims, theta): 9 heads is the odd GQA case (on CUDA 9 x 32 pairs > 256 threads: a
# second sweep), head_dim 8 / 16 / 64; partial rotaries (Phi-4-mini's 3/4) of 18 of 24 dims and 96 of 128
CASES = [(9, 64, 64, 10000.0), (3, 16, 16, 500000.0), (2, 8, 8, 10000.0), (3, 24, 18, 10000.0), (4, 128, 96, 1e4)]
F32_SPECS = [
    ("rope", dict(num_heads=nh, head_dim=hd, inv_freq=rope_inv_freq(r, th).tolist())) for nh, hd, r, th in CASES
]
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in F32_SPECS]
SPECS = F32_SPECS + BF16_SPECS


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("extra_cols", [0, 40])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_rope_matches_transformers(kernels, op, params, T, extra_cols):
    """Rotates heads [0, num_heads) of each row in place; the rest of the row (k, v) is untouched."""
    nh, hd = params["num_heads"], params["head_dim"]
    stride = nh * hd + extra_cols
    x, positions = rope_inputs(T, stride, seed=T + extra_cols)
    orig = x.copy()
    kernels(op, params)(x, stride, positions, T, None)
    ref = rope_reference(orig[:, : nh * hd].reshape(T, nh, hd), positions, params["inv_freq"]).reshape(T, nh * hd)
    np.testing.assert_allclose(x[:, : nh * hd], ref, rtol=1e-5, atol=1e-5)
    assert np.array_equal(x[:, nh * hd :], orig[:, nh * hd :])


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [3, 17])  # positions[0] = 0: T = 1 would rotate nothing
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_rope_bf16_activations(kernels, op, params, T):
    stride = params["num_heads"] * params["head_dim"] + 40
    x, positions = rope_inputs(T, stride, seed=T)
    bits, values = to_bf16(x)
    kernels(op, dict(params, adtype="f32"))(values, stride, positions, T, None)
    orig = bits.copy()
    kernels(op, params)(bits, stride, positions, T, None)
    assert np.array_equal(bits, to_bf16(values)[0])  # k and v columns: untouched, as the float32 kernel leaves them
    assert not np.array_equal(bits, orig)


def test_rope_inv_freq_round_trips_float32(target):
    """The emitted table holds exactly the float32 values transformers uses."""
    freqs = rope_inv_freq(64, 10000.0)
    src = render_kernel(
        target, "rope", name="k", **target_params(target, dict(num_heads=1, head_dim=64, inv_freq=freqs.tolist()))
    )
    assert np.array_equal(emitted_floats(src, "inv_freq["), freqs.numpy())


def test_rope_kernel_id_hashes_inv_freq():
    a = dict(num_heads=9, head_dim=64, inv_freq=rope_inv_freq(64, 10000.0).tolist())
    b = dict(a, inv_freq=rope_inv_freq(64, 500000.0).tolist())
    ida, idb = kernel_id("cpu", "rope", a), kernel_id("cpu", "rope", b)
    assert ida.startswith("cpu_rope_qh9_d64_if32x") and ida != idb
    assert ida == kernel_id("cpu", "rope", dict(a, inv_freq=tuple(np.float32(v) for v in a["inv_freq"])))


# Qwen3's shapes: head_dim 128 (and a tail head_dim, 24), 16 / 3 heads
NORM_SPECS = [
    ("rope", dict(num_heads=nh, head_dim=hd, inv_freq=rope_inv_freq(hd, 1e6).tolist(), norm_eps=1e-6))
    for nh, hd in [(16, 128), (3, 24)]
]
SPECS += NORM_SPECS


def _rms_norm_heads(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """transformers' RMSNorm over the last axis, in torch float32."""
    import torch

    h = torch.from_numpy(x)
    return (torch.from_numpy(w) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).numpy()


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("op,params", NORM_SPECS, ids=map(spec_id, NORM_SPECS))
def test_rope_with_per_head_norm_matches_qwen3(kernels, op, params, T):
    nh, hd = params["num_heads"], params["head_dim"]
    stride = nh * hd + 40
    x, positions = rope_inputs(T, stride, seed=T + nh)
    x *= 7.0  # far from unit RMS: the norm has work to do
    w = (1.0 + 0.3 * np.random.default_rng(T).standard_normal(hd)).astype(np.float32)
    orig = x.copy()
    kernels(op, params)(x, stride, positions, T, w)
    normed = _rms_norm_heads(orig[:, : nh * hd].reshape(T, nh, hd), w, params["norm_eps"])
    ref = rope_reference(normed, positions, params["inv_freq"]).reshape(T, nh * hd)
    np.testing.assert_allclose(x[:, : nh * hd], ref, rtol=2e-5, atol=2e-5)
    assert np.array_equal(x[:, nh * hd :], orig[:, nh * hd :])


def test_a_per_head_norm_changes_the_kernel_id():
    a = dict(num_heads=4, head_dim=24, inv_freq=rope_inv_freq(24, 1e6).tolist())
    assert kernel_id("cpu", "rope", a) != kernel_id("cpu", "rope", dict(a, norm_eps=1e-6))
    assert "normeps1em06" in kernel_id("cpu", "rope", dict(a, norm_eps=1e-6))


# Phi-4-mini's shape (96 of 128 dims rotated, 24 heads) and a tail (18 of 24)
LONGROPE_SPECS = [
    (
        "rope",
        dict(
            num_heads=nh,
            head_dim=hd,
            inv_freq=(rope_inv_freq(r, 1e4) / 1.3).tolist(),
            long_inv_freq=(rope_inv_freq(r, 1e4) / np.linspace(1.0, 30.0, r // 2, dtype=np.float32)).tolist(),
            attention_factor=1.19,
        ),
    )
    for nh, hd, r in [(24, 128, 96), (3, 24, 18)]
]
SPECS += LONGROPE_SPECS
LONG_ROPE_FLAG = 1 << 30  # kLongRopeFlag: StepBatch marks the positions of a sequence past the original length


@pytest.mark.parametrize("op,params", LONGROPE_SPECS, ids=map(spec_id, LONGROPE_SPECS))
def test_longrope_rotates_flagged_tokens_by_the_long_frequencies(kernels, op, params):
    """Rows whose position carries the flag rotate by long_inv_freq, the others by inv_freq; both scaled by the
    attention factor (the rotated dims only: cos and sin carry it, the passed dims stay)."""
    nh, hd = params["num_heads"], params["head_dim"]
    T, stride = 9, nh * hd + 40
    x, positions = rope_inputs(T, stride, seed=3)
    long = np.arange(T) % 3 == 1
    flagged = positions | np.where(long, LONG_ROPE_FLAG, 0).astype(np.int32)
    orig = x.copy()
    kernels(op, params)(x, stride, flagged, T, None)
    heads = orig[:, : nh * hd].reshape(T, nh, hd)
    want = np.empty_like(heads)
    for t in range(T):
        freqs = params["long_inv_freq"] if long[t] else params["inv_freq"]
        r = 2 * len(freqs)
        rotated = rope_reference(heads[t : t + 1], positions[t : t + 1], freqs)
        want[t] = np.concatenate([rotated[0, :, :r] * params["attention_factor"], heads[t, :, r:]], axis=-1)
    np.testing.assert_allclose(x[:, : nh * hd], want.reshape(T, nh * hd), rtol=2e-5, atol=2e-5)
    assert np.array_equal(x[:, nh * hd :], orig[:, nh * hd :])
