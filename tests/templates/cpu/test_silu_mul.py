"""templates/cpu/silu_mul.cc.j2: out = silu(gate) * up with gate_up = [gate | up] per row."""

import numpy as np
import pytest
from kernel_reference import silu_mul_inputs, silu_mul_reference

from llmc.compiler.codegen.render import kernel_id

SPECS = [("silu_mul", dict(inter=i)) for i in (37, 64)]


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_silu_mul_matches_numpy(kernels, op, params, T):
    gate_up = silu_mul_inputs(T, params["inter"], seed=T)
    out = np.full((T, params["inter"]), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](gate_up, out, T)
    np.testing.assert_allclose(out, silu_mul_reference(gate_up), rtol=1e-5, atol=1e-6)
