"""templates/cpu/embedding.cc.j2: out[t] = table[ids[t]], bf16 widened exactly."""

import numpy as np
import pytest
from kernel_reference import embedding_inputs

from llmc.compiler.codegen.render import kernel_id

SPECS = [("embedding", dict(hidden=h, wdtype=wd)) for h in (37, 64) for wd in ("f32", "bf16")]


@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cpu", *s) for s in SPECS])
def test_embedding_matches_numpy(kernels, op, params, T):
    # vocab 97: the last row (ids[0]), and repeats
    ids, table, table_f = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=97, seed=T)
    out = np.full((T, params["hidden"]), np.nan, dtype=np.float32)
    kernels[kernel_id("cpu", op, params)](ids, T, table, out)
    assert np.array_equal(out, table_f[ids])
