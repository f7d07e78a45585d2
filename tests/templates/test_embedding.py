"""embedding (templates/{cpu,cuda}/embedding.*.j2): out[t] = table[ids[t]], bf16 widened exactly; on CUDA with
bf16 activations, rounded to bf16 (a bf16 table's bits as they are)."""

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id
from tests.templates.kernel_reference import act_empty, embedding_inputs, to_bf16

# hidden 37 (scalar loads), 64 (16-byte loads: 4 floats / 8 bf16), 1000 (CUDA, f32: 250 threads' worth of
# float4 on 256 threads; bf16: 125 x 8)
F32_SPECS = [("embedding", dict(hidden=h, wdtype=wd)) for h in (37, 64, 1000) for wd in ("f32", "bf16")]
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in F32_SPECS]
SCALED_SPECS = [("embedding", dict(hidden=h, wdtype=wd, scale=8.0)) for h, wd in ((37, "f32"), (64, "bf16"))]
SPECS = F32_SPECS + BF16_SPECS + SCALED_SPECS


@pytest.mark.parametrize("T", [0, 1, 3, 5, 17, 300])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_embedding_matches_numpy(kernels, op, params, T):
    # vocab 97: the last row (ids[0]) and a repeated id (ids[1] = ids[2]); T = 0 launches nothing
    ids, table, table_f = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=97, seed=T)
    out = np.full((T + 1, params["hidden"]), np.nan, dtype=np.float32)
    kernels(op, params)(ids, T, table, out)
    assert np.array_equal(out[:T], table_f[ids])
    assert np.isnan(out[T:]).all()  # nothing written past the last row


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_embedding_bf16_activations(kernels, op, params, T):
    ids, table, table_f = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=97, seed=T)
    out = act_empty((T + 1, params["hidden"]), "bf16")
    kernels(op, params)(ids, T, table, out)
    assert np.array_equal(out[:T], to_bf16(table_f[ids])[0])
    assert (out[T:] == 0x7FC0).all()


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("op,params", SCALED_SPECS, ids=map(spec_id, SCALED_SPECS))
def test_embedding_scaled(kernels, op, params, T):
    """Granite's embedding_multiplier and Gemma's sqrt(hidden): the float32 product, as transformers takes it."""
    ids, table, table_f = embedding_inputs(T, params["hidden"], params["wdtype"], vocab=97, seed=T)
    out = np.empty((T, params["hidden"]), dtype=np.float32)
    kernels(op, params)(ids, T, table, out)
    assert np.array_equal(out, table_f[ids] * np.float32(params["scale"]))
