import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.common import bindings, llmc_args, llmc_op_name
from llmc.compiler.passes.merge_qkv import merge_qkv


@pytest.mark.parametrize("arch", ARCHS)
def test_one_gemm_for_q_k_v(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    start = before(mod, merge_qkv)
    matmuls = count_ops(start, "matmul")
    out, count = apply(merge_qkv, start)
    assert count == config.num_layers
    assert count_ops(out, "matmul") == matmuls - 2 * config.num_layers
    assert count_ops(out, "split") == config.num_layers
    var2val = {b.var: b.value for b in bindings(out["main"])}
    for b in bindings(out["main"]):
        if llmc_op_name(b.value) == "paged_attention":
            q = llmc_args(b.value)["q"]
            assert type(var2val[q]).__name__ == "TupleGetItem"


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(merge_qkv, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
