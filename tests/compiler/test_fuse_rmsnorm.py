import pytest
import tvm_ffi
from checkpoints import ARCHS
from pass_helpers import apply, before, count_ops, imported, plain_module

from llmc.compiler.passes.fuse_rmsnorm import fuse_rmsnorm


@pytest.mark.parametrize("arch", ARCHS)
def test_fuses_every_norm_and_residual(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_rmsnorm, before(mod, fuse_rmsnorm))
    # each layer's two norms and the final norm
    assert count == 2 * config.num_layers + 1
    # every norm but the first (whose input is the embedding) takes the residual add with it
    assert count_ops(out, "add_rms_norm") == 2 * config.num_layers
    assert count_ops(out, "rms_norm") == 1
    assert count_ops(out, "rsqrt") == 0


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fuse_rmsnorm, mod)
    assert count == 0
    assert tvm_ffi.structural_equal(out["main"], mod["main"])
