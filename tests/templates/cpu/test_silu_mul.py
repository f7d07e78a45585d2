"""templates/cpu/silu_mul.cc.j2: out = silu(gate) * up with gate_up = [gate | up] per row."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id

SPECS = [("silu_mul", dict(inter=i)) for i in (37, 64)]


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels(SPECS)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_silu_mul_matches_numpy(kernels, op, params, T):
    rng = np.random.default_rng(T)
    inter = params["inter"]
    gate_up = (rng.standard_normal((T, 2 * inter), dtype=np.float32) * 4).astype(np.float32)
    gate_up[0, :4] = [-100.0, 100.0, 0.0, -0.0]  # exp overflow / saturation / zero
    out = np.full((T, inter), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](gate_up, out, T)
    g, u = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    ref = g / (1.0 + np.exp(-g)) * u
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
