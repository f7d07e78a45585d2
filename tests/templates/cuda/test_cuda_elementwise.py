"""templates/cuda embedding, silu_mul and gather_rows under the simulator against numpy."""

import numpy as np
import pytest
from kernel_reference import embedding_inputs, silu_mul_inputs, silu_mul_reference

from llmc.compiler.codegen.render import kernel_id

# embedding: hidden 37 (scalar loads), 64 (16-byte loads: 4 floats / 8 bf16), 1000 (f32: 250 threads'
# worth of float4 on 256 threads; 16-bit: 125 x 8)
EMB = [("embedding", dict(hidden=h, wdtype=wd)) for h in (37, 64, 1000) for wd in ("f32", "bf16")]
# silu_mul: inter 37 (scalar), 64, 1100 (float4, two blocks per row)
SILU = [("silu_mul", dict(inter=i)) for i in (37, 64, 1100)]
# gather_rows: cols 37 (scalar), 64, 1100 (float4, several sweeps)
GATHER = [("gather_rows", dict(cols=c)) for c in (37, 64, 1100)]
SPECS = EMB + SILU + GATHER


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", EMB, ids=[kernel_id("cuda", *s) for s in EMB])
def test_embedding_matches_numpy(kernels, op, params, T):
    # vocab 50: the last row (ids[0]) and a repeated id (ids[1] = ids[2])
    ids, table, tf = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=50, seed=T, repeat=True)
    out = np.full((T, params["hidden"]), np.nan, dtype=np.float32)
    kernels[kernel_id("cuda", op, params)](ids, T, table, out)
    assert np.array_equal(out, tf[ids])


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("op,params", SILU, ids=[kernel_id("cuda", *s) for s in SILU])
def test_silu_mul_matches_numpy(kernels, op, params, T):
    gate_up = silu_mul_inputs(T, params["inter"], seed=T)
    out = np.full((T, params["inter"]), np.nan, dtype=np.float32)
    kernels[kernel_id("cuda", op, params)](gate_up, out, T)
    np.testing.assert_allclose(out, silu_mul_reference(gate_up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("op,params", GATHER, ids=[kernel_id("cuda", *s) for s in GATHER])
def test_gather_rows_matches_numpy(kernels, op, params, n):
    rng = np.random.default_rng(n)
    cols = params["cols"]
    x = rng.standard_normal((20, cols), dtype=np.float32)
    rows = rng.integers(0, 20, size=n, dtype=np.int32)
    rows[-1] = 19
    out = np.full((n, cols), np.nan, dtype=np.float32)
    kernels[kernel_id("cuda", op, params)](x, rows, n, out)
    assert np.array_equal(out, x[rows])


def test_zero_rows_launch_nothing(kernels):
    """T = 0 / n = 0: the launchers return without a (invalid, empty-grid) launch."""
    params = EMB[0][1]
    out = np.full((1, 37), 7.0, dtype=np.float32)
    kernels[kernel_id("cuda", "embedding", params)](np.zeros(1, np.int32), 0, np.zeros((1, 37), np.float32), out)
    kernels[kernel_id("cuda", *SILU[0])](np.zeros((1, 74), np.float32), out, 0)
    kernels[kernel_id("cuda", *GATHER[0])](np.zeros((1, 37), np.float32), np.zeros(1, np.int32), 0, out)
    assert np.all(out == 7.0)
