import tvm_ffi
from pass_helpers import apply, count_ops, imported, plain_module

from llmc.compiler.passes.common import bindings, calls
from llmc.compiler.passes.fold import fold
from llmc.compiler.passes.pipeline import PASSES


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
