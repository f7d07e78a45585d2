"""templates/cpu/embedding.cc.j2: out[t] = table[ids[t]], bf16 widened exactly."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id

SPECS = [("embedding", dict(hidden=h, wdtype=wd)) for h in (37, 64) for wd in ("f32", "bf16")]


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels(SPECS)


@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_embedding_matches_numpy(kernels, weights, op, params, T):
    rng = np.random.default_rng(T)
    vocab, hidden = 97, params["hidden"]
    table, table_f = weights(rng.standard_normal((vocab, hidden), dtype=np.float32), params["wdtype"])
    ids = rng.integers(0, vocab, size=T, dtype=np.int32)
    ids[0] = vocab - 1  # the last row, and repeats
    out = np.full((T, hidden), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](ids, T, table, out)
    assert np.array_equal(out, table_f[ids])
