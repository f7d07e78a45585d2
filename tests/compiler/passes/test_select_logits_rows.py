import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.select_logits_rows import select_logits_rows
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module


@I.ir_module
class Before:
    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            normed = R.call_pure_packed(
                "llmc.rms_norm", h, w, R.prim_value(T.float64(1e-5)), ty_args=R.Tensor((1, n, 8), "float32")
            )
            out = R.reshape(R.matmul(normed, R.permute_dims(head)), R.shape([n, 16]))
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        logits_indices: R.Tensor(("N",), "int32"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        N = T.int64()
        with R.dataflow():
            rows = R.take(h, logits_indices, axis=1)
            normed = R.call_pure_packed(
                "llmc.rms_norm", rows, w, R.prim_value(T.float64(1e-5)), ty_args=R.Tensor((1, N, 8), "float32")
            )
            out = R.matmul(R.reshape(normed, R.shape([N, 8])), R.permute_dims(head, axes=[1, 0]))
            R.output(out)
        return out


def test_final_norm_and_lm_head_move_behind_the_row_gather():
    out, count = apply(select_logits_rows, Before)
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


@I.ir_module
class ScaledLogits:
    """Granite: the logits divided by logits_scaling (4), then multiplied by 0.5 (a near-miss elsewhere)."""

    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            normed = R.call_pure_packed(
                "llmc.rms_norm", h, w, R.prim_value(T.float64(1e-5)), ty_args=R.Tensor((1, n, 8), "float32")
            )
            logits = R.reshape(R.matmul(normed, R.permute_dims(head)), R.shape([n, 16]))
            out = R.multiply(R.divide(logits, R.const(4.0, "float32")), R.const(0.5, "float32"))
            R.output(out)
        return out


@I.ir_module
class ScaledExpected:
    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        logits_indices: R.Tensor(("N",), "int32"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        N = T.int64()
        with R.dataflow():
            rows = R.take(h, logits_indices, axis=1)
            normed = R.call_pure_packed(
                "llmc.rms_norm",
                rows,
                R.multiply(w, R.const(0.125, "float32")),
                R.prim_value(T.float64(1e-5)),
                ty_args=R.Tensor((1, N, 8), "float32"),
            )
            out = R.matmul(R.reshape(normed, R.shape([N, 8])), R.permute_dims(head, axes=[1, 0]))
            R.output(out)
        return out


def test_a_logits_scale_moves_onto_the_final_norm_weight():
    out, count = apply(select_logits_rows, ScaledLogits)
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], ScaledExpected["main"])


@I.ir_module
class HeadWithoutNorm:
    """An lm_head reading the hidden states directly: no fused final norm to move the gather in front of."""

    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            out = R.reshape(R.matmul(h, R.permute_dims(head)), R.shape([n, 16]))
            R.output(out)
        return out


@I.ir_module
class ShiftedLogits:
    """Logits plus a constant: not a scale, so nothing moves onto the norm."""

    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        h: R.Tensor((1, "n", 8), "float32"),
        w: R.Tensor((8,), "float32"),
        head: R.Tensor((16, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            normed = R.call_pure_packed(
                "llmc.rms_norm", h, w, R.prim_value(T.float64(1e-5)), ty_args=R.Tensor((1, n, 8), "float32")
            )
            logits = R.reshape(R.matmul(normed, R.permute_dims(head)), R.shape([n, 16]))
            out = R.add(logits, R.const(4.0, "float32"))
            R.output(out)
        return out


@pytest.mark.parametrize("near_miss", [HeadWithoutNorm, ShiftedLogits], ids=["head_without_norm", "shifted_logits"])
def test_near_miss_is_left_alone(near_miss):
    out, count = apply(select_logits_rows, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@pytest.mark.parametrize("arch", ARCHS)
def test_final_norm_and_lm_head_run_on_selected_rows(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(select_logits_rows, before(mod, select_logits_rows))
    assert count == 1
    main = out["main"]
    assert "logits_indices" in [p.name for p in main.params]
    rows, vocab = main.ret_ty.shape.values
    # N logits rows, a count of its own: neither the tokens T nor the sequences B of seq_lens
    assert str(rows) == "N" and int(vocab) == config.vocab_size
    indices = next(p for p in main.params if p.name == "logits_indices")
    assert indices.ty.shape.values[0].same_as(rows)
    assert all(not d.same_as(rows) for p in main.params if p.name != "logits_indices" for d in p.ty.shape.values)
    assert count_ops(out, "take") == 3  # the embedding, and the rows of both residual-add operands


def test_leaves_other_graphs_alone():
    mod = plain_module()
    out, count = apply(select_logits_rows, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
