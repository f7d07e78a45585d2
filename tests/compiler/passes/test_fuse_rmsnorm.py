import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.fuse_rmsnorm import fuse_rmsnorm
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module


def _norm_of_sum(exponent=2.0, axis=-1):
    """x = a + b; (x, w * (x * rsqrt(mean(x ** exponent, axis) + 1e-5)))."""

    @I.ir_module
    class Module:
        @R.function
        def main(a: R.Tensor(("n", 8), "float32"), b: R.Tensor(("n", 8), "float32"), w: R.Tensor((8,), "float32")):
            with R.dataflow():
                x = R.add(a, b)
                mean_square = R.mean(R.power(x, R.const(exponent, "float32")), axis=[axis], keepdims=True)
                out = R.multiply(w, R.multiply(x, R.rsqrt(R.add(mean_square, R.const(1e-5, "float32")))))
                R.output(x, out)
            return (x, out)

    return Module


@I.ir_module
class Expected:
    @R.function
    def main(a: R.Tensor(("n", 8), "float32"), b: R.Tensor(("n", 8), "float32"), w: R.Tensor((8,), "float32")):
        n = T.int64()
        with R.dataflow():
            fused = R.call_pure_packed(
                "llmc.add_rms_norm",
                a,
                b,
                w,
                R.prim_value(T.float64(float(np.float32(1e-5)))),
                ty_args=R.Tuple(R.Tensor((n, 8), "float32"), R.Tensor((n, 8), "float32")),
            )
            x = fused[0]
            out = fused[1]
            R.output(x, out)
        return (x, out)


def test_norm_and_its_residual_add_become_one_op():
    out, count = apply(fuse_rmsnorm, _norm_of_sum())
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


@pytest.mark.parametrize(
    "near_miss", [_norm_of_sum(exponent=3.0), _norm_of_sum(axis=0)], ids=["mean_of_cubes", "mean_over_tokens"]
)
def test_near_misses_are_left_alone(near_miss):
    out, count = apply(fuse_rmsnorm, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@pytest.mark.parametrize("arch", ARCHS)
def test_fuses_every_norm_and_residual(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_rmsnorm, before(mod, fuse_rmsnorm))
    head_norms = 2 * config.num_layers if config.qk_norm else 0  # Qwen3's q and k norms, per head
    # each layer's two norms and the final norm
    assert count == 2 * config.num_layers + 1 + head_norms
    # every norm but the first (whose input is the embedding) takes the residual add with it
    assert count_ops(out, "add_rms_norm") == 2 * config.num_layers
    assert count_ops(out, "rms_norm") == 1 + head_norms
    assert count_ops(out, "rsqrt") == 0


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(fuse_rmsnorm, mod)
    assert count == 0
    assert tvm_ffi.structural_equal(out["main"], mod["main"])
