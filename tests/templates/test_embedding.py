"""embedding (templates/{cpu,cuda}/embedding.*.j2): out[t] = table[ids[t]], bf16 widened exactly."""

import numpy as np
import pytest
from kernel_harness import spec_id
from kernel_reference import embedding_inputs

# hidden 37 (scalar loads), 64 (16-byte loads: 4 floats / 8 bf16), 1000 (CUDA, f32: 250 threads' worth of
# float4 on 256 threads; bf16: 125 x 8)
SPECS = [("embedding", dict(hidden=h, wdtype=wd)) for h in (37, 64, 1000) for wd in ("f32", "bf16")]


@pytest.mark.parametrize("T", [0, 1, 3, 5, 17, 300])
@pytest.mark.parametrize("op,params", SPECS, ids=map(spec_id, SPECS))
def test_embedding_matches_numpy(kernels, op, params, T):
    # vocab 97: the last row (ids[0]) and a repeated id (ids[1] = ids[2]); T = 0 launches nothing
    ids, table, table_f = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=97, seed=T)
    out = np.full((T + 1, params["hidden"]), np.nan, dtype=np.float32)
    kernels(op, params)(ids, T, table, out)
    assert np.array_equal(out[:T], table_f[ids])
    assert np.isnan(out[T:]).all()  # nothing written past the last row
