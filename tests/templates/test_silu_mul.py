"""silu_mul (templates/{cpu,cuda}/silu_mul.*.j2): out = silu(gate) * up with gate_up = [gate | up] per row."""

import numpy as np
import pytest
from kernel_harness import spec_id
from kernel_reference import silu_mul_inputs, silu_mul_reference

# inter 37 (scalar), 64, 1100 (float4; on CUDA two blocks per row)
SPECS = [("silu_mul", dict(inter=i)) for i in (37, 64, 1100)]


@pytest.mark.parametrize("T", [0, 1, 3, 17])
@pytest.mark.parametrize("op,params", SPECS, ids=map(spec_id, SPECS))
def test_silu_mul_matches_numpy(kernels, op, params, T):
    gate_up = silu_mul_inputs(T, params["inter"], seed=T)
    out = np.full((T + 1, params["inter"]), np.nan, dtype=np.float32)
    kernels(op, params)(gate_up, out, T)
    np.testing.assert_allclose(out[:T], silu_mul_reference(gate_up), rtol=1e-5, atol=1e-6)
    assert np.isnan(out[T:]).all()  # nothing written past the last row
