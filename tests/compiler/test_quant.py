"""compiler/quant.py: the round-to-nearest quantizer against its error bound, and the contract's checks."""

import numpy as np
import pytest

from llmc.compiler.quant import QuantizedTensor, QuantScheme, dequantize, quantize
from llmc.errors import CompileError


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(8, 37), QuantScheme(8, 32), QuantScheme(4, 32), QuantScheme(4, 64, asymmetric=True)],
    ids=lambda s: s.describe().replace(" ", "-"),
)
def test_round_to_nearest_is_within_half_a_step(scheme):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 100)).astype(np.float32)  # 100: the last group is short for every group size
    t = quantize(w, scheme)
    lo, hi = scheme.qrange
    assert t.q.min() >= lo and t.q.max() <= hi
    step = np.repeat(t.scales, scheme.group_size, axis=1)[:, :100]
    assert np.all(np.abs(dequantize(t) - w) <= 0.5 * step * (1 + 1e-5) + 1e-7)


def test_zero_rows_quantize_to_zero():
    t = quantize(np.zeros((2, 64), np.float32), QuantScheme(4, 32))
    assert not t.q.any() and not dequantize(t).any()


def test_shapes_that_do_not_fit_the_scheme_are_refused():
    with pytest.raises(CompileError, match="do not fit"):
        QuantizedTensor(np.zeros((2, 64), np.int8), np.zeros((2, 3), np.float32), None, QuantScheme(8, 32))
    with pytest.raises(CompileError, match="mins"):
        QuantizedTensor(np.zeros((2, 64), np.int8), np.zeros((2, 2), np.float32), None, QuantScheme(4, 32, True))
    with pytest.raises(CompileError, match="bits"):
        QuantScheme(3, 32)
