"""softcap (templates/{cpu,cuda}/softcap.*.j2): x = cap * tanh(x / cap) in place, Gemma 2's final logits."""

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import to_bf16

# cols 37 (a SIMD tail), 64, 1100 (several CUDA chunks); caps 30 (Gemma 2's) and 0.5 (most values saturate)
F32_SPECS = [("softcap", dict(cols=c, cap=cap)) for c, cap in ((37, 30.0), (64, 0.5), (1100, 30.0))]
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in F32_SPECS]
SPECS = F32_SPECS + BF16_SPECS


def _logits(n, cols, seed):
    """Logits of std 20, the first row starting -1e4, 1e4, 0, -0 (saturation both ways, and zero)."""
    x = (np.random.default_rng(seed).standard_normal((n + 1, cols), dtype=np.float32) * 20).astype(np.float32)
    x[:1, :4] = [-1e4, 1e4, 0.0, -0.0]
    return x


@pytest.mark.parametrize("n", [0, 1, 3, 17])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_softcap_matches_numpy(kernels, op, params, n):
    x = _logits(n, params["cols"], seed=n)
    want = params["cap"] * np.tanh(x[:n].astype(np.float64) / params["cap"])
    last = x[n].copy()
    kernels(op, params)(x, n)
    np.testing.assert_allclose(x[:n], want, rtol=1e-6, atol=1e-6 * params["cap"])
    assert np.abs(x[:n]).max(initial=0.0) <= params["cap"]
    assert np.array_equal(x[n], last)  # nothing written past the last row


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_softcap_bf16(kernels, op, params):
    """bf16 logits: the float32 kernel's result over the same values, rounded once."""
    bits, values = to_bf16(_logits(5, params["cols"], seed=7))
    want = values.copy()
    kernels(op, dict(params, adtype="f32"))(want, 5)
    kernels(op, params)(bits, 5)
    assert np.array_equal(bits[:5], to_bf16(want[:5])[0])
