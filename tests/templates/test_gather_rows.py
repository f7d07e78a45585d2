"""gather_rows (templates/{cpu,cuda}/gather_rows.*.j2): out[i] = x[rows[i]], of float32 or (CUDA) bf16 rows."""

import numpy as np
import pytest

from tests.templates.kernel_harness import spec_id

# cols 37 (scalar), 64, 1100 (float4; on CUDA several sweeps of the block); bf16 rows: 16-byte pieces where
# cols % 8 == 0 (64), else one element at a time
F32_SPECS = [("gather_rows", dict(cols=c)) for c in (37, 64, 1100)]
BF16_SPECS = [(op, dict(p, adtype="bf16")) for op, p in F32_SPECS]
SPECS = F32_SPECS + BF16_SPECS


@pytest.mark.parametrize("n", [0, 1, 3, 4, 17])
@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_gather_rows_matches_numpy(kernels, op, params, n):
    rng = np.random.default_rng(n)
    cols = params["cols"]
    x = rng.standard_normal((20, cols), dtype=np.float32)
    rows = rng.integers(0, 20, size=n, dtype=np.int32)  # repeats allowed
    rows[-1:] = 19  # the last row of x
    out = np.full((n + 1, cols), np.nan, dtype=np.float32)
    kernels(op, params)(x, rows, n, out)
    assert np.array_equal(out[:n], x[rows])
    assert np.isnan(out[n:]).all()  # nothing written past the last row


@pytest.mark.parametrize("op,params", F32_SPECS, ids=map(spec_id, F32_SPECS))
def test_gather_rows_takes_every_row_in_any_order(kernels, op, params):
    """Scoring asks for every row of a prefill; any order is kept (the logits come back in the order asked)."""
    x = np.random.default_rng(1).standard_normal((20, params["cols"]), dtype=np.float32)
    for rows in (np.arange(20, dtype=np.int32), np.arange(20, dtype=np.int32)[::-1].copy()):
        out = np.full_like(x, np.nan)
        kernels(op, params)(x, rows, 20, out)
        assert np.array_equal(out, x[rows])


@pytest.mark.targets("cuda")
@pytest.mark.parametrize("n", [1, 17])
@pytest.mark.parametrize("op,params", BF16_SPECS, ids=map(spec_id, BF16_SPECS))
def test_gather_rows_bf16(kernels, op, params, n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 1 << 16, size=(20, params["cols"]), dtype=np.uint16)  # any bits, NaNs too: a copy
    rows = rng.integers(0, 20, size=n, dtype=np.int32)
    out = np.zeros((n + 1, params["cols"]), np.uint16)
    kernels(op, params)(x, rows, n, out)
    assert np.array_equal(out[:n], x[rows])
    assert not out[n:].any()
