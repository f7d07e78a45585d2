import tvm_ffi
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.common import bindings
from llmc.compiler.passes.fold import fold


def test_removes_layout_noops_left_by_fusion(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "qwen2")
    start = before(mod, fold)
    out, count = apply(fold, start)
    assert count > 0
    assert count_ops(out, "reshape") < count_ops(start, "reshape")
    # the head transposes around attention cancel; only the weight transposes (2-D) remain
    assert count_ops(out, "permute_dims") < count_ops(start, "permute_dims")
    for b in bindings(out["main"]):
        if getattr(b.value, "op", None) is not None and getattr(b.value.op, "name", "") == "relax.permute_dims":
            assert len(b.value.args[0].ty.shape.values) == 2


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fold, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
