import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.fuse_softcap import fuse_softcap
from llmc.compiler.passes.select_logits_rows import select_logits_rows
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module


def _capped(outer: float = 30.0):
    """Logits soft-capped as Gemma 2's model writes them: tanh(x / 30) * outer."""

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 16), "float32")):
            with R.dataflow():
                out = R.multiply(R.tanh(R.divide(x, R.const(30.0, "float32"))), R.const(outer, "float32"))
                R.output(out)
            return out

    return Module


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32")):
        n = T.int64()
        with R.dataflow():
            out = R.call_pure_packed(
                "llmc.softcap", x, R.prim_value(T.float64(30.0)), ty_args=R.Tensor((n, 16), "float32")
            )
            R.output(out)
        return out


def test_tanh_between_one_constant_becomes_softcap():
    out, count = apply(fuse_softcap, _capped())
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


@I.ir_module
class TanhAlone:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32")):
        with R.dataflow():
            out = R.tanh(x)
            R.output(out)
        return out


@pytest.mark.parametrize("near_miss", [_capped(outer=20.0), TanhAlone], ids=["two_constants", "tanh_alone"])
def test_near_miss_is_left_alone(near_miss):
    out, count = apply(fuse_softcap, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


def test_gemma2_final_logits_are_soft_capped_on_the_selected_rows(checkpoint_dir):
    """Gemma 2's lm_head result is soft-capped once, and select_logits_rows keeps the cap last, on the N rows."""
    mod, _ = imported(checkpoint_dir, "gemma2")
    out, count = apply(fuse_softcap, before(mod, fuse_softcap))
    assert count == 1 and count_ops(out, "tanh") == 0
    out, count = apply(select_logits_rows, out)
    assert count == 1
    value = out["main"].body.blocks[-1].bindings[-1].value
    assert "llmc.softcap" in str(value.args[0]) and str(value.ty.shape.values[0]) == "N"


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fuse_softcap, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
