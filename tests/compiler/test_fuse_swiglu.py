import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.fuse_swiglu import fuse_swiglu


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_up_merged_and_silu_mul_fused(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    start = before(mod, fuse_swiglu)
    matmuls = count_ops(start, "matmul")
    out, count = apply(fuse_swiglu, start)
    assert count == config.num_layers
    assert count_ops(out, "silu_mul") == config.num_layers
    assert count_ops(out, "sigmoid") == 0
    assert count_ops(out, "matmul") == matmuls - config.num_layers


def test_leaves_other_graphs_alone():
    # x * sigmoid(x) + x: a SiLU, but no gated product of two Linears.
    mod = plain_module()
    out, count = apply(fuse_swiglu, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
