import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.common import bindings, calls
from llmc.compiler.passes.fold import fold
from llmc.compiler.passes.pipeline import PASSES
from tests.compiler.passes.pass_helpers import apply, count_ops, imported, plain_module


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), ids: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            same = R.astype(x, "float32")
            rows = R.reshape(same, R.shape([1, n, 8]))
            heads = R.reshape(rows, R.shape([n, 2, 4]))
            swapped = R.permute_dims(heads, axes=[1, 0, 2])
            back = R.permute_dims(swapped, axes=[1, 0, 2])
            out = R.take(back, R.astype(ids, "int32"), axis=0)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), ids: R.Tensor(("n",), "int64")):
        n = T.int64()
        with R.dataflow():
            heads = R.reshape(x, R.shape([n, 2, 4]))
            out = R.take(heads, R.astype(ids, "int32"), axis=0)
            R.output(out)
        return out


def test_folds_casts_reshape_chains_and_transposes_that_undo():
    out, count = apply(fold, Before)
    assert count == 4  # the cast, the reshape chain (both reshapes), the permute pair
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


@I.ir_module
class NearMiss:
    """A reshape that changes the shape, two transposes that do not undo each other, a real cast."""

    @R.function
    def main(x: R.Tensor(("n", 8), "float32")):
        n = T.int64()
        with R.dataflow():
            heads = R.reshape(x, R.shape([n, 2, 4]))
            out = R.astype(R.permute_dims(R.permute_dims(heads, axes=[1, 0, 2]), axes=[0, 2, 1]), "float16")
            R.output(out)
        return out


def test_near_misses_are_left_alone():
    out, count = apply(fold, NearMiss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], NearMiss["main"])


def test_removes_noop_casts_of_the_imported_graph(checkpoint_dir):
    mod, _ = imported(checkpoint_dir, "llama")
    out, count = apply(fold, mod)
    assert count > 0 and count_ops(out, "astype") < count_ops(mod, "astype")
    for b in bindings(out["main"]):
        if calls(b.value, "relax.astype"):  # what stays is a real conversion (the int64 token ids, positions)
            assert b.value.args[0].ty.dtype != b.var.ty.dtype


def test_removes_layout_noops_left_by_fusion(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "qwen2")
    assert PASSES[0] is fold and PASSES[-1] is fold
    start = mod
    for p in PASSES[:-1]:
        start = p(start)
    out, count = apply(fold, start)
    assert count > 0
    assert count_ops(out, "reshape") < count_ops(start, "reshape")
    # only the weight transposes (2-D) remain
    for b in bindings(out["main"]):
        if getattr(b.value, "op", None) is not None and getattr(b.value.op, "name", "") == "relax.permute_dims":
            assert len(b.value.args[0].ty.shape.values) == 2


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fold, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
