"""templates/cuda/rope.cu.j2 under the simulator against transformers' Llama rotary embedding (rotate-half),
computed in torch float32."""

import re

import numpy as np
import pytest
import torch

from llmc.compiler.codegen.render import kernel_id, render_kernel


def _inv_freq(head_dim, theta):
    """As transformers' default rope init computes it (float32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


# (num_heads, head_dim, theta): 9 heads x 32 pairs (288 > 256 threads: a second sweep), 3 x 8, 2 x 4
CASES = [(9, 64, 10000.0), (3, 16, 500000.0), (2, 8, 10000.0)]
SPECS = [("rope", dict(num_heads=nh, head_dim=hd, inv_freq=_inv_freq(hd, th).tolist())) for nh, hd, th in CASES]


@pytest.fixture(scope="module")
def kernels(cuda_kernels):
    return cuda_kernels(SPECS)


def _reference(x, positions, inv_freq):
    """transformers.models.llama: LlamaRotaryEmbedding.forward + apply_rotary_pos_emb, float32."""
    inv = torch.tensor(inv_freq, dtype=torch.float32)
    pos = torch.from_numpy(positions)[None, :].float()
    freqs = (inv[None, :, None] @ pos[:, None, :]).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[0, :, None, :], emb.sin()[0, :, None, :]  # [T, 1, D]
    q = torch.from_numpy(x)
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return ((q * cos) + (rotated * sin)).numpy()


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("extra_cols", [0, 40])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cuda", *s) for s in SPECS])
def test_rope_matches_transformers(kernels, op, params, T, extra_cols):
    """Rotates heads [0, num_heads) of each row in place; the rest of the row (k, v) is untouched."""
    rng = np.random.default_rng(T + extra_cols)
    nh, hd = params["num_heads"], params["head_dim"]
    stride = nh * hd + extra_cols
    x = rng.standard_normal((T, stride), dtype=np.float32)
    positions = rng.integers(0, 8192, size=T, dtype=np.int32)
    positions[0] = 0
    if T > 2:
        positions[-1] = 131071  # large angles
    orig = x.copy()
    kernels[kernel_id("cuda", op, params)](x, stride, positions, T)
    ref = _reference(orig[:, :nh * hd].reshape(T, nh, hd), positions, params["inv_freq"]).reshape(T, nh * hd)
    np.testing.assert_allclose(x[:, :nh * hd], ref, rtol=1e-5, atol=1e-5)
    assert np.array_equal(x[:, nh * hd:], orig[:, nh * hd:])


def test_rope_inv_freq_round_trips_float32():
    """The emitted device table holds exactly the float32 values transformers uses."""
    freqs = _inv_freq(64, 10000.0)
    src = render_kernel("cuda", "rope", name="k", num_heads=1, head_dim=64, inv_freq=freqs.tolist())
    body = src[src.index("{", src.index("k_inv_freq[")) + 1:src.index("};")]
    emitted = np.array([float(v) for v in re.findall(r"([-+0-9.eE]+)f", body)], dtype=np.float32)
    assert np.array_equal(emitted, freqs.numpy())
