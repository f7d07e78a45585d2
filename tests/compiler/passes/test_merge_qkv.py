import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.passes.common import bindings, llmc_args, llmc_op_name
from llmc.compiler.passes.merge_qkv import merge_qkv
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module

INV_FREQ = np.array([1.0, 0.01], dtype="float32")
NO_NORM = np.zeros(0, dtype="float32")  # paged attention without per-head norms


@I.ir_module
class Before:
    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        query_start_loc: R.Tensor(("B + 1",), "int32"),
        block_tables: R.Tensor(("B", "max_blocks"), "int32"),
        slot_mapping: R.Tensor(("n",), "int64"),
        kv_cache_0: R.Tensor((2, "num_blocks", "block_size", 1, 4), "float32"),
        wq: R.Tensor((8, 8), "float32"),
        wk: R.Tensor((4, 8), "float32"),
        wv: R.Tensor((4, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            q = R.matmul(x, R.permute_dims(wq))
            k = R.matmul(x, R.permute_dims(wk))
            v = R.matmul(x, R.permute_dims(wv))
            out = R.call_pure_packed(
                "llmc.paged_attention",
                q,
                k,
                v,
                positions,
                R.const(INV_FREQ),
                kv_cache_0,
                slot_mapping,
                query_start_loc,
                seq_lens,
                block_tables,
                R.prim_value(0),
                R.prim_value(2),
                R.prim_value(1),
                R.prim_value(4),
                R.prim_value(T.float64(0.5)),
                R.prim_value(0),
                R.const(NO_NORM),
                R.const(NO_NORM),
                R.prim_value(T.float64(0.0)),
                R.prim_value(T.float64(0.0)),
                R.const(NO_NORM),
                R.prim_value(0),
                R.prim_value(T.float64(1.0)),
                ty_args=R.Tensor((n, 8), "float32"),
            )
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        query_start_loc: R.Tensor(("B + 1",), "int32"),
        block_tables: R.Tensor(("B", "max_blocks"), "int32"),
        slot_mapping: R.Tensor(("n",), "int64"),
        kv_cache_0: R.Tensor((2, "num_blocks", "block_size", 1, 4), "float32"),
        wq: R.Tensor((8, 8), "float32"),
        wk: R.Tensor((4, 8), "float32"),
        wv: R.Tensor((4, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            qkv = R.split(R.matmul(x, R.permute_dims(R.concat((wq, wk, wv), axis=0), axes=[1, 0])), [8, 12], axis=-1)
            q = qkv[0]
            k = qkv[1]
            v = qkv[2]
            out = R.call_pure_packed(
                "llmc.paged_attention",
                q,
                k,
                v,
                positions,
                R.const(INV_FREQ),
                kv_cache_0,
                slot_mapping,
                query_start_loc,
                seq_lens,
                block_tables,
                R.prim_value(0),
                R.prim_value(2),
                R.prim_value(1),
                R.prim_value(4),
                R.prim_value(T.float64(0.5)),
                R.prim_value(0),
                R.const(NO_NORM),
                R.const(NO_NORM),
                R.prim_value(T.float64(0.0)),
                R.prim_value(T.float64(0.0)),
                R.const(NO_NORM),
                R.prim_value(0),
                R.prim_value(T.float64(1.0)),
                ty_args=R.Tensor((n, 8), "float32"),
            )
            R.output(out)
        return out


def test_q_k_v_of_one_input_become_one_gemm_and_a_split():
    out, count = apply(merge_qkv, Before)
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], Expected["main"])


@I.ir_module
class KeysOfAnotherInput:
    """As Before, but k projects y: cross-attention, not one GEMM."""

    @R.function
    def main(
        x: R.Tensor(("n", 8), "float32"),
        y: R.Tensor(("n", 8), "float32"),
        positions: R.Tensor(("n",), "int64"),
        seq_lens: R.Tensor(("B",), "int32"),
        query_start_loc: R.Tensor(("B + 1",), "int32"),
        block_tables: R.Tensor(("B", "max_blocks"), "int32"),
        slot_mapping: R.Tensor(("n",), "int64"),
        kv_cache_0: R.Tensor((2, "num_blocks", "block_size", 1, 4), "float32"),
        wq: R.Tensor((8, 8), "float32"),
        wk: R.Tensor((4, 8), "float32"),
        wv: R.Tensor((4, 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            q = R.matmul(x, R.permute_dims(wq))
            k = R.matmul(y, R.permute_dims(wk))
            v = R.matmul(x, R.permute_dims(wv))
            out = R.call_pure_packed(
                "llmc.paged_attention",
                q,
                k,
                v,
                positions,
                R.const(INV_FREQ),
                kv_cache_0,
                slot_mapping,
                query_start_loc,
                seq_lens,
                block_tables,
                R.prim_value(0),
                R.prim_value(2),
                R.prim_value(1),
                R.prim_value(4),
                R.prim_value(T.float64(0.5)),
                R.prim_value(0),
                R.const(NO_NORM),
                R.const(NO_NORM),
                R.prim_value(T.float64(0.0)),
                R.prim_value(T.float64(0.0)),
                R.const(NO_NORM),
                R.prim_value(0),
                R.prim_value(T.float64(1.0)),
                ty_args=R.Tensor((n, 8), "float32"),
            )
            R.output(out)
        return out


def test_near_miss_is_left_alone():
    out, count = apply(merge_qkv, KeysOfAnotherInput)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], KeysOfAnotherInput["main"])


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
