import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.fuse_rope import fuse_rope
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module

INV_FREQ = np.array([1.0, 0.01], dtype="float32")  # head_dim 4
NO_LONG = np.zeros(0, dtype="float32")  # llmc.rope without LongRoPE: no long set, original length 0, factor 1


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
        with R.dataflow():
            freqs = R.multiply(
                R.expand_dims(R.astype(positions, "float32"), axis=[1]), R.expand_dims(R.const(INV_FREQ), axis=[0])
            )
            emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
            rotated = R.concat(
                (R.negative(R.strided_slice(x, (3,), (2,), (4,), (1,))), R.strided_slice(x, (3,), (0,), (2,), (1,))),
                axis=-1,
            )
            out = R.add(R.multiply(x, R.cos(emb)), R.multiply(rotated, R.sin(emb)))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            out = R.call_pure_packed(
                "llmc.rope",
                x,
                positions,
                R.const(INV_FREQ),
                R.const(NO_LONG),
                R.prim_value(0),
                R.prim_value(T.float64(1.0)),
                ty_args=R.Tensor((1, 2, n, 4), "float32"),
            )
            R.output(out)
        return out


def test_rope_becomes_one_op_carrying_its_inverse_frequencies():
    out, count = apply(fuse_rope, Before)
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


def _partial(pass_from: int = 2):
    """Phi-4-mini's partial rotary: RoPE on dims [0, 2) of head_dim 4 (one frequency), dims [pass_from, 4) passed."""

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
            with R.dataflow():
                freqs = R.multiply(
                    R.expand_dims(R.astype(positions, "float32"), axis=[1]),
                    R.expand_dims(R.const(INV_FREQ[:1]), axis=[0]),
                )
                emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
                rot = R.strided_slice(x, (3,), (0,), (2,), (1,))
                rotated = R.concat(
                    (
                        R.negative(R.strided_slice(rot, (3,), (1,), (2,), (1,))),
                        R.strided_slice(rot, (3,), (0,), (1,), (1,)),
                    ),
                    axis=-1,
                )
                roped = R.add(R.multiply(rot, R.cos(emb)), R.multiply(rotated, R.sin(emb)))
                out = R.concat((roped, R.strided_slice(x, (3,), (pass_from,), (4,), (1,))), axis=-1)
                R.output(out)
            return out

    return Module


@I.ir_module
class PartialExpected:
    @R.function
    def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            out = R.call_pure_packed(
                "llmc.rope",
                x,
                positions,
                R.const(INV_FREQ[:1]),
                R.const(NO_LONG),
                R.prim_value(0),
                R.prim_value(T.float64(1.0)),
                ty_args=R.Tensor((1, 2, n, 4), "float32"),
            )
            R.output(out)
        return out


def test_partial_rotary_becomes_one_op_over_the_whole_head():
    out, count = apply(fuse_rope, _partial())
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], PartialExpected["main"])


def test_partial_rotary_with_a_gap_keeps_its_concat():
    """Dims [0, 2) rotated and [3, 4) passed: no rope of the whole head; the rotated part alone is fused."""
    out, count = apply(fuse_rope, _partial(pass_from=3))
    assert count == 1 and count_ops(out, "concat") == 1


LONG = np.array([0.5, 0.001], dtype="float32")


def _longrope(sin_factor: float = 1.25):
    """Phi-3's LongRoPE as traced: where(max(positions) + 1 > 32, long, short) frequencies, cos and sin times 1.25."""

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
            with R.dataflow():
                past = R.greater(R.add(R.max(positions), R.const(1, "int64")), R.const(32, "int64"))
                inv_freq = R.where(past, R.const(LONG), R.const(INV_FREQ))
                freqs = R.multiply(
                    R.expand_dims(R.astype(positions, "float32"), axis=[1]), R.expand_dims(inv_freq, axis=[0])
                )
                emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
                rotated = R.concat(
                    (
                        R.negative(R.strided_slice(x, (3,), (2,), (4,), (1,))),
                        R.strided_slice(x, (3,), (0,), (2,), (1,)),
                    ),
                    axis=-1,
                )
                cos = R.multiply(R.cos(emb), R.const(1.25, "float32"))
                sin = R.multiply(R.sin(emb), R.const(sin_factor, "float32"))
                out = R.add(R.multiply(x, cos), R.multiply(rotated, sin))
                R.output(out)
            return out

    return Module


@I.ir_module
class LongropeExpected:
    @R.function
    def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            out = R.call_pure_packed(
                "llmc.rope",
                x,
                positions,
                R.const(INV_FREQ),
                R.const(LONG),
                R.prim_value(32),
                R.prim_value(T.float64(1.25)),
                ty_args=R.Tensor((1, 2, n, 4), "float32"),
            )
            R.output(out)
        return out


def test_longrope_becomes_one_op_carrying_both_sets_and_the_factor():
    out, count = apply(fuse_rope, _longrope())
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], LongropeExpected["main"])


def test_cos_and_sin_scaled_differently_is_left_alone():
    near_miss = _longrope(sin_factor=1.5)
    out, count = apply(fuse_rope, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@I.ir_module
class FrequenciesComputedInTheGraph:
    """inv_freq is a parameter, not a constant: the op could not carry it, so nothing is rewritten."""

    @R.function
    def main(
        x: R.Tensor((1, 2, "n", 4), "float32"),
        positions: R.Tensor(("n",), "int64"),
        inv_freq: R.Tensor((2,), "float32"),
    ):
        with R.dataflow():
            freqs = R.multiply(
                R.expand_dims(R.astype(positions, "float32"), axis=[1]), R.expand_dims(inv_freq, axis=[0])
            )
            emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
            rotated = R.concat(
                (R.negative(R.strided_slice(x, (3,), (2,), (4,), (1,))), R.strided_slice(x, (3,), (0,), (2,), (1,))),
                axis=-1,
            )
            out = R.add(R.multiply(x, R.cos(emb)), R.multiply(rotated, R.sin(emb)))
            R.output(out)
        return out


@I.ir_module
class SinOfOtherAngles:
    """cos and sin of different angles: not a rotation."""

    @R.function
    def main(x: R.Tensor((1, 2, "n", 4), "float32"), positions: R.Tensor(("n",), "int64")):
        with R.dataflow():
            freqs = R.multiply(
                R.expand_dims(R.astype(positions, "float32"), axis=[1]), R.expand_dims(R.const(INV_FREQ), axis=[0])
            )
            emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
            rotated = R.concat(
                (R.negative(R.strided_slice(x, (3,), (2,), (4,), (1,))), R.strided_slice(x, (3,), (0,), (2,), (1,))),
                axis=-1,
            )
            out = R.add(R.multiply(x, R.cos(emb)), R.multiply(rotated, R.sin(R.add(emb, emb))))
            R.output(out)
        return out


@I.ir_module
class RotatesAnotherTensor:
    """x * cos + rotate_half(y) * sin: the rotated tensor is not x."""

    @R.function
    def main(
        x: R.Tensor((1, 2, "n", 4), "float32"),
        y: R.Tensor((1, 2, "n", 4), "float32"),
        positions: R.Tensor(("n",), "int64"),
    ):
        with R.dataflow():
            freqs = R.multiply(
                R.expand_dims(R.astype(positions, "float32"), axis=[1]), R.expand_dims(R.const(INV_FREQ), axis=[0])
            )
            emb = R.expand_dims(R.concat((freqs, freqs), axis=-1), axis=[0, 1])
            rotated = R.concat(
                (R.negative(R.strided_slice(y, (3,), (2,), (4,), (1,))), R.strided_slice(y, (3,), (0,), (2,), (1,))),
                axis=-1,
            )
            out = R.add(R.multiply(x, R.cos(emb)), R.multiply(rotated, R.sin(emb)))
            R.output(out)
        return out


@pytest.mark.parametrize(
    "near_miss", [FrequenciesComputedInTheGraph, SinOfOtherAngles, RotatesAnotherTensor], ids=lambda m: m.__name__
)
def test_near_misses_are_left_alone(near_miss):
    out, count = apply(fuse_rope, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@pytest.mark.parametrize("arch", ARCHS)
def test_fuses_rope_on_q_and_k(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_rope, before(mod, fuse_rope))
    rotated = config.num_layers - len(config.nope_layers)  # SmolLM3's NoPE layers have none
    assert count == 2 * rotated
    assert count_ops(out, "rope") == 2 * rotated
    # the cos/sin tables and the rotate-half slices are gone with the pattern
    assert count_ops(out, "cos") == count_ops(out, "sin") == count_ops(out, "negative") == 0


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fuse_rope, mod)
    assert count == 0
    assert tvm_ffi.structural_equal(out["main"], mod["main"])
