import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.fuse_swiglu import fuse_swiglu
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        wg: R.Tensor((6, 8), "float32"),
        wu: R.Tensor((6, 8), "float32"),
    ):
        with R.dataflow():
            out = R.multiply(R.nn.silu(R.matmul(x, R.permute_dims(wg))), R.matmul(x, R.permute_dims(wu)))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        wg: R.Tensor((6, 8), "float32"),
        wu: R.Tensor((6, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            gate_up = R.matmul(x, R.permute_dims(R.concat((wg, wu), axis=0), axes=[1, 0]))
            fused = R.call_pure_packed("llmc.silu_mul", gate_up, ty_args=R.Tensor((n, 6), "float32"))
            out = R.reshape(fused, R.shape([n, 6]))
            R.output(out)
        return out


def test_gate_and_up_become_one_gemm_and_silu_mul():
    out, count = apply(fuse_swiglu, Before)
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


def _gated(act: str):
    """act(gate(x)) * up(x), act one of R.nn's gelu_tanh (Gemma's GeGLU) or gelu (erf: no template has it)."""

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), wg: R.Tensor((6, 8), "float32"), wu: R.Tensor((6, 8), "float32")):
            with R.dataflow():
                gate = R.matmul(x, R.permute_dims(wg))
                activated = R.nn.gelu_tanh(gate) if act == "gelu_tanh" else R.nn.gelu(gate)
                out = R.multiply(activated, R.matmul(x, R.permute_dims(wu)))
                R.output(out)
            return out

    return Module


@I.ir_module
class GegluExpected:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), wg: R.Tensor((6, 8), "float32"), wu: R.Tensor((6, 8), "float32")):
        n = T.int64()
        with R.dataflow():
            gate_up = R.matmul(x, R.permute_dims(R.concat((wg, wu), axis=0), axes=[1, 0]))
            fused = R.call_pure_packed("llmc.gelu_tanh_mul", gate_up, ty_args=R.Tensor((n, 6), "float32"))
            out = R.reshape(fused, R.shape([n, 6]))
            R.output(out)
        return out


def test_geglu_becomes_one_gemm_and_gelu_tanh_mul():
    out, count = apply(fuse_swiglu, _gated("gelu_tanh"))
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], GegluExpected["main"])


def test_erf_gelu_is_left_alone():
    near_miss = _gated("gelu")
    out, count = apply(fuse_swiglu, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@I.ir_module
class UpOfAnotherInput:
    """silu(gate(x)) * up(y): a gated product, but the two Linears read different inputs."""

    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        wg: R.Tensor((6, 8), "float32"),
        wu: R.Tensor((6, 8), "float32"),
    ):
        with R.dataflow():
            out = R.multiply(R.nn.silu(R.matmul(x, R.permute_dims(wg))), R.matmul(y, R.permute_dims(wu)))
            R.output(out)
        return out


def test_near_miss_is_left_alone():
    out, count = apply(fuse_swiglu, UpOfAnotherInput)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], UpOfAnotherInput["main"])


@pytest.mark.parametrize("arch", ARCHS)
def test_gate_up_merged_and_silu_mul_fused(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    start = before(mod, fuse_swiglu)
    matmuls = count_ops(start, "matmul")
    out, count = apply(fuse_swiglu, start)
    assert count == config.num_layers
    assert count_ops(out, "silu_mul" if config.hidden_act == "silu" else "gelu_tanh_mul") == config.num_layers
    assert count_ops(out, "sigmoid") == 0
    assert count_ops(out, "matmul") == matmuls - config.num_layers


def test_leaves_other_graphs_alone():
    # x * sigmoid(x) + x: a SiLU, but no gated product of two Linears.
    mod = plain_module()
    out, count = apply(fuse_swiglu, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
