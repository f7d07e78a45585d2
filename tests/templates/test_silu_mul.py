"""silu_mul (templates/{cpu,cuda}/silu_mul.*.j2): out = silu(gate) * up with gate_up = [gate | up] per row, or
gelu_tanh(gate) * up (activation="gelu_tanh", Gemma's GeGLU, against torch's gelu(approximate="tanh")).
On CUDA with bf16 activations, the float32 result over the bf16 inputs, rounded once."""

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import act_empty, silu_mul_inputs, silu_mul_reference, to_bf16

# inter 37 (scalar), 64, 1100 (float4; on CUDA two blocks per row)
F32_SPECS = [("silu_mul", dict(inter=i)) for i in (37, 64, 1100)]
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in F32_SPECS]
GELU_SPECS = [("silu_mul", dict(inter=i, activation="gelu_tanh")) for i in (37, 1100)]
SPECS = F32_SPECS + BF16_SPECS + GELU_SPECS + [(op, dict(p, adtype="bf16")) for op, p in GELU_SPECS]


@pytest.mark.parametrize("T", [0, 1, 3, 17])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_silu_mul_matches_numpy(kernels, op, params, T):
    gate_up = silu_mul_inputs(T, params["inter"], seed=T)
    out = np.full((T + 1, params["inter"]), np.nan, dtype=np.float32)
    kernels(op, params)(gate_up, out, T)
    np.testing.assert_allclose(out[:T], silu_mul_reference(gate_up), rtol=1e-5, atol=1e-6)
    assert np.isnan(out[T:]).all()  # nothing written past the last row


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_silu_mul_bf16_activations(kernels, op, params, T):
    bits, values = to_bf16(silu_mul_inputs(T, params["inter"], seed=T))
    want = np.empty((T, params["inter"]), np.float32)
    kernels(op, dict(params, adtype="f32"))(values, want, T)
    out = act_empty((T + 1, params["inter"]), "bf16")
    kernels(op, params)(bits, out, T)
    assert np.array_equal(out[:T], to_bf16(want)[0])
    assert (out[T:] == 0x7FC0).all()


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", GELU_SPECS, ids=map(spec_id, GELU_SPECS))
def test_gelu_tanh_mul_matches_torch(kernels, op, params, T):
    import torch

    gate_up = silu_mul_inputs(T, params["inter"], seed=T)
    out = np.full((T + 1, params["inter"]), np.nan, dtype=np.float32)
    kernels(op, params)(gate_up, out, T)
    g, u = torch.from_numpy(gate_up).chunk(2, dim=-1)
    want = (torch.nn.functional.gelu(g, approximate="tanh") * u).numpy()
    np.testing.assert_allclose(out[:T], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(out[T:]).all()


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("op,params", GELU_SPECS, ids=map(spec_id, GELU_SPECS))
def test_gelu_tanh_mul_bf16_activations(kernels, op, params):
    T = 3
    bits, values = to_bf16(silu_mul_inputs(T, params["inter"], seed=T))
    want = np.empty((T, params["inter"]), np.float32)
    kernels(op, params)(values, want, T)
    out = act_empty((T, params["inter"]), "bf16")
    kernels(op, dict(params, adtype="bf16"))(bits, out, T)
    assert np.array_equal(out, to_bf16(want)[0])
