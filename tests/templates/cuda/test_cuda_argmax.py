"""templates/cuda/argmax.cu.j2 under the simulator against numpy.argmax (ties -> lowest index, NaN first)."""

import numpy as np
import pytest

from llmc.compiler.codegen.render import kernel_id

# vocab 37 (one warp), 1000 (128 threads), 32003 (1024 threads, 32 elements each, a ragged tail)
SPECS = [("argmax", dict(vocab=v)) for v in (37, 1000, 32003)]


@pytest.mark.parametrize("B", [1, 3, 9])
@pytest.mark.parametrize("op,params", SPECS, ids=[kernel_id("cuda", *s) for s in SPECS])
def test_argmax_matches_numpy(kernels, op, params, B):
    vocab = params["vocab"]
    rng = np.random.default_rng(B + vocab)
    logits = rng.standard_normal((B, vocab), dtype=np.float32)
    if B >= 3:
        logits[1, :] = -np.inf  # all equal: index 0
        logits[2, [5, vocab - 1, 17]] = 1e30  # a tie: the lowest index
    if B >= 9:
        logits[3, :] = 0.0
        logits[4, vocab - 1] = np.nan  # NaN wins, as in numpy
        logits[5, [vocab // 2, 3]] = np.nan  # the first NaN
        logits[6, :] = np.float32(-3.0)
        logits[6, vocab - 1] = -2.5  # the max is the last element
        logits[7, 0] = 50.0  # the first element
        logits[8, :] = -0.0
        logits[8, 7] = 0.0  # -0.0 == 0.0: index 0
    out = np.full(B, -1, dtype=np.int32)
    kernels[kernel_id("cuda", op, params)](logits, B, out)
    assert np.array_equal(out, np.argmax(logits, axis=1))
