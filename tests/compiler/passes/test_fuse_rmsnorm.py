import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.common import NO_WEIGHT, bindings, llmc_args, llmc_call, llmc_op_name, prim
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
                R.prim_value(T.float64(1.0)),
                R.const(np.zeros(0, "float32")),
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
    if config.post_norms:  # OLMo 2: each branch norm joins its add (add_normed), the last one the final norm
        assert count_ops(out, "add_normed") == 2 * config.num_layers - 1 and count_ops(out, "add_rms_norm") == 1
        assert count_ops(out, "rsqrt") == 0
        return
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


def _traced_norm(bb, x, w, eps):
    mean_square = bb.emit(relax.op.mean(relax.op.power(x, relax.const(2.0, "float32")), axis=[-1], keepdims=True))
    return bb.emit(
        relax.op.multiply(
            w, relax.op.multiply(x, relax.op.rsqrt(relax.op.add(mean_square, relax.const(eps, "float32"))))
        )
    )


def _branch_module(scale=None, branch_eps=None, extra_reader=False, fused=False):
    """main(a, b, w, wb) -> (x, norm(x) by 1 + w) with x = a + branch, where branch is b, b * scale, norm(b) by wb
    (branch_eps), or norm(b) * scale, as traced; extra_reader: the branch is also an output (a second reader).
    fused: what fuse_rmsnorm makes of it instead (one llmc.add_rms_norm)."""
    n = tvm.tirx.Var("n", "int64")
    ty = relax.TensorType([n, 8], "float32")
    a, b = relax.Var("a", ty), relax.Var("b", ty)
    w, wb = relax.Var("w", relax.TensorType([8], "float32")), relax.Var("wb", relax.TensorType([8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b, w, wb]):
        with bb.dataflow():
            w1 = bb.emit(relax.op.add(w, relax.const(1.0, "float32")))
            if fused:
                eps = prim(float(np.float32(1e-5)))
                args = [
                    a,
                    b,
                    w1,
                    eps,
                    prim(float(np.float32(scale or 1.0))),
                    wb if branch_eps is not None else NO_WEIGHT,
                ]
                call = bb.emit(llmc_call("add_rms_norm", args, relax.TupleType([ty, ty])))
                x, out = bb.emit(relax.TupleGetItem(call, 0)), bb.emit(relax.TupleGetItem(call, 1))
                outputs = [x, out]
            else:
                branch = b if branch_eps is None else _traced_norm(bb, b, wb, branch_eps)
                if scale is not None:
                    branch = bb.emit(relax.op.multiply(branch, relax.const(scale, "float32")))
                x = bb.emit(relax.op.add(a, branch))
                out = _traced_norm(bb, x, w1, 1e-5)
                outputs = [x, out, branch] if extra_reader else [x, out]
            gv = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize(
    "scale,branch_eps",
    [(0.22, None), (None, 1e-5), (1.5, 1e-5)],
    ids=["scaled_branch", "normed_branch", "normed_and_scaled_branch"],
)
def test_the_branch_joins_the_add(scale, branch_eps):
    """Granite's residual_multiplier and Gemma's norm of each branch join the add and the norm after it; the
    computed weight (Gemma's 1 + w) stays the expression the op takes."""
    out, count = apply(fuse_rmsnorm, _branch_module(scale, branch_eps))
    assert count == 1
    expected = _branch_module(scale, branch_eps, fused=True)
    tvm.ir.assert_structural_equal(out["main"], expected["main"])


@pytest.mark.parametrize(
    "scale,branch_eps,extra_reader",
    [(None, 1e-6, False), (0.22, None, True), (None, 1e-5, True)],
    ids=["branch_norm_of_another_eps", "scaled_branch_read_twice", "normed_branch_read_twice"],
)
def test_branch_near_misses_stay_apart(scale, branch_eps, extra_reader):
    """A branch norm of another eps, or a branch something else reads too, keeps its own op: the add fuses with
    the norm after it alone."""
    out, _ = apply(fuse_rmsnorm, _branch_module(scale, branch_eps, extra_reader))
    fused = [b.value for b in bindings(out["main"]) if llmc_op_name(b.value) == "add_rms_norm"]
    assert len(fused) == 1
    args = llmc_args(fused[0])
    assert float(args["residual_scale"].value) == 1.0 and int(args["residual_weight"].ty.shape.values[0]) == 0
    assert count_ops(out, "rms_norm") == (branch_eps is not None)
