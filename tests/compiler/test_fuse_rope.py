import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.fuse_rope import fuse_rope


@pytest.mark.parametrize("arch", ARCHS)
def test_fuses_rope_on_q_and_k(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_rope, before(mod, fuse_rope))
    assert count == 2 * config.num_layers
    assert count_ops(out, "rope") == 2 * config.num_layers
    # the cos/sin tables and the rotate-half slices are gone with the pattern
    assert count_ops(out, "cos") == count_ops(out, "sin") == count_ops(out, "negative") == 0


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fuse_rope, mod)
    assert count == 0
    assert tvm_ffi.structural_equal(out["main"], mod["main"])
