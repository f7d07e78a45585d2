"""templates/cpu/gather_rows.cc.j2: out[i] = x[rows[i]]."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id

SPECS = [("gather_rows", dict(cols=c)) for c in (37, 64)]


@pytest.mark.parametrize("n", [0, 1, 4])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_gather_rows(kernels, op, params, n):
    rng = np.random.default_rng(n)
    cols = params["cols"]
    x = rng.standard_normal((11, cols), dtype=np.float32)
    rows = rng.choice(11, size=n, replace=False).astype(np.int32)
    out = np.full((max(n, 1), cols), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](x, rows, n, out)
    assert np.array_equal(out[:n], x[rows])
