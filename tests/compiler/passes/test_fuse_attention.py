import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from llmc.compiler.compile import check_fusion
from llmc.compiler.passes.common import calls, llmc_args, llmc_call, prim
from llmc.compiler.passes.fuse_attention import fuse_attention
from llmc.errors import CompileError
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, before, count_ops, imported, plain_module

INV_FREQ = np.array([1.0, 0.01], dtype="float32")  # head_dim 4
NO_LONG = np.zeros(0, dtype="float32")  # llmc.rope without LongRoPE: no long set, original length 0, factor 1
NO_NORM = np.zeros(0, dtype="float32")
Q_NORM = np.array([1.0, 1.5, 0.5, 2.0], dtype="float32")  # Qwen3's per-head weights, [head_dim]
K_NORM = np.array([0.9, 1.1, 1.2, 0.8], dtype="float32")


def _attention_module(k_inv_freq=INV_FREQ, causal_mask="TopLeft", softcap=None):
    """One GQA layer as fuse_rope leaves it: 2 query heads, 1 KV head, head_dim 4, scale 0.5, window 3; with
    softcap, Gemma 2's soft-capped attention as the import states it."""
    module = _plain_attention_module(k_inv_freq, causal_mask)
    if softcap is None:
        return module

    @relax.expr_functor.mutator
    class SoftCapped(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not calls(call, "relax.nn.attention"):
                return call
            facts = [prim(0.5), prim(int(call.attrs.window_size)), prim(softcap)]
            return llmc_call("softcapped_attention", [*call.args, *facts], call.args[0].ty)

    module["main"] = SoftCapped().visit_expr(module["main"])
    return module


def _plain_attention_module(k_inv_freq, causal_mask):

    @I.ir_module
    class Module:
        @R.function
        def main(
            input_ids: R.Tensor(("n",), "int64"),
            positions: R.Tensor(("n",), "int64"),
            q: R.Tensor(("n", 8), "float32"),
            k: R.Tensor(("n", 4), "float32"),
            v: R.Tensor(("n", 4), "float32"),
        ):
            n = T.int64()
            with R.dataflow():
                q_heads = R.permute_dims(R.reshape(q, R.shape([1, n, 2, 4])), axes=[0, 2, 1, 3])
                k_heads = R.permute_dims(R.reshape(k, R.shape([1, n, 1, 4])), axes=[0, 2, 1, 3])
                v_heads = R.permute_dims(R.reshape(v, R.shape([1, n, 1, 4])), axes=[0, 2, 1, 3])
                q_rot = R.call_pure_packed(
                    "llmc.rope",
                    q_heads,
                    positions,
                    R.const(INV_FREQ),
                    R.const(NO_LONG),
                    R.prim_value(0),
                    R.prim_value(T.float64(1.0)),
                    ty_args=R.Tensor((1, 2, n, 4), "float32"),
                )
                k_rot = R.call_pure_packed(
                    "llmc.rope",
                    k_heads,
                    positions,
                    R.const(k_inv_freq),
                    R.const(NO_LONG),
                    R.prim_value(0),
                    R.prim_value(T.float64(1.0)),
                    ty_args=R.Tensor((1, 1, n, 4), "float32"),
                )
                k_rep = R.reshape(
                    R.broadcast_to(R.expand_dims(k_rot, axis=[2]), R.shape([1, 1, 2, n, 4])), R.shape([1, 2, n, 4])
                )
                v_rep = R.reshape(
                    R.broadcast_to(R.expand_dims(v_heads, axis=[2]), R.shape([1, 1, 2, n, 4])), R.shape([1, 2, n, 4])
                )
                att = R.nn.attention(
                    R.permute_dims(q_rot, axes=[0, 2, 1, 3]),
                    R.permute_dims(k_rep, axes=[0, 2, 1, 3]),
                    R.permute_dims(v_rep, axes=[0, 2, 1, 3]),
                    scale=0.5,
                    causal_mask=causal_mask,
                    window_size=3,
                )
                out = R.reshape(att, R.shape([1, n, 8]))
                R.output(out)
            return out

    return Module


def _expected(softcap=0.0):
    @I.ir_module
    class Expected:
        @R.function
        def main(
            input_ids: R.Tensor(("n",), "int64"),
            positions: R.Tensor(("n",), "int64"),
            seq_lens: R.Tensor(("B",), "int32"),
            query_start_loc: R.Tensor(("B + 1",), "int32"),
            block_tables: R.Tensor(("B", "max_blocks"), "int32"),
            slot_mapping: R.Tensor(("n",), "int64"),
            kv_cache_0: R.Tensor((2, "num_blocks", "block_size", 1, 4), "float32"),
            q: R.Tensor(("n", 8), "float32"),
            k: R.Tensor(("n", 4), "float32"),
            v: R.Tensor(("n", 4), "float32"),
        ):
            n = T.int64()
            with R.dataflow():
                # layer 0, 2 heads, 1 KV head, head_dim 4, scale 0.5, window 3
                paged = R.call_pure_packed(
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
                    R.prim_value(3),
                    R.const(NO_NORM),
                    R.const(NO_NORM),
                    R.prim_value(T.float64(0.0)),
                    R.prim_value(T.float64(softcap)),
                    R.const(NO_LONG),
                    R.prim_value(0),
                    R.prim_value(T.float64(1.0)),
                    ty_args=R.Tensor((n, 8), "float32"),
                )
                att = R.reshape(paged, R.shape([1, n, 2, 4]))
                out = R.reshape(att, R.shape([1, n, 8]))
                R.output(out)
            return out

    return Expected


def test_attention_becomes_paged_attention_carrying_its_facts():
    out, count = apply(fuse_attention, _attention_module())
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], _expected()["main"])


def test_softcapped_attention_becomes_paged_attention_carrying_the_cap():
    out, count = apply(fuse_attention, _attention_module(softcap=50.0))
    assert count == 1
    tvm.ir.assert_structural_equal(out["main"], _expected(softcap=50.0)["main"])


@pytest.mark.parametrize(
    "near_miss",
    [
        _attention_module(k_inv_freq=INV_FREQ * 2),  # q and k rotated differently: one op cannot carry both
        _attention_module(causal_mask=None),  # bidirectional
        _attention_module(k_inv_freq=INV_FREQ * 2, softcap=50.0),  # soft-capped, k rotated differently
    ],
    ids=["k_rotated_differently", "not_causal", "softcapped_k_rotated_differently"],
)
def test_near_misses_are_left_alone(near_miss):
    out, count = apply(fuse_attention, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


def _qk_norm_module(k_norm=K_NORM, k_eps=1e-6):
    """One layer as Qwen3's reaches fuse_attention: each head of q and k through llmc.rms_norm ([head_dim]
    weights) between the head split and RoPE; 2 query heads, 1 KV head (no GQA repeat needed for the match)."""

    @I.ir_module
    class Module:
        @R.function
        def main(
            input_ids: R.Tensor(("n",), "int64"),
            positions: R.Tensor(("n",), "int64"),
            q: R.Tensor(("n", 8), "float32"),
            k: R.Tensor(("n", 4), "float32"),
            v: R.Tensor(("n", 4), "float32"),
        ):
            n = T.int64()
            with R.dataflow():
                q_split = R.reshape(q, R.shape([1, n, 2, 4]))
                k_split = R.reshape(k, R.shape([1, n, 1, 4]))
                q_normed = R.call_pure_packed(
                    "llmc.rms_norm", q_split, R.const(Q_NORM), R.prim_value(T.float64(1e-6)),
                    ty_args=R.Tensor((1, n, 2, 4), "float32"),
                )  # fmt: skip
                k_normed = R.call_pure_packed(
                    "llmc.rms_norm", k_split, R.const(k_norm), R.prim_value(T.float64(k_eps)),
                    ty_args=R.Tensor((1, n, 1, 4), "float32"),
                )  # fmt: skip
                q_rot = R.call_pure_packed(
                    "llmc.rope", R.permute_dims(q_normed, axes=[0, 2, 1, 3]), positions, R.const(INV_FREQ),
                    R.const(NO_LONG), R.prim_value(0), R.prim_value(T.float64(1.0)), ty_args=R.Tensor((1, 2, n, 4), "float32"),
                )  # fmt: skip
                k_rot = R.call_pure_packed(
                    "llmc.rope", R.permute_dims(k_normed, axes=[0, 2, 1, 3]), positions, R.const(INV_FREQ),
                    R.const(NO_LONG), R.prim_value(0), R.prim_value(T.float64(1.0)), ty_args=R.Tensor((1, 1, n, 4), "float32"),
                )  # fmt: skip
                k_rep = R.reshape(
                    R.broadcast_to(R.expand_dims(k_rot, axis=[2]), R.shape([1, 1, 2, n, 4])), R.shape([1, 2, n, 4])
                )
                v_rep = R.reshape(
                    R.broadcast_to(
                        R.expand_dims(R.permute_dims(R.reshape(v, R.shape([1, n, 1, 4])), axes=[0, 2, 1, 3]), axis=[2]),
                        R.shape([1, 1, 2, n, 4]),
                    ),
                    R.shape([1, 2, n, 4]),
                )
                att = R.nn.attention(
                    R.permute_dims(q_rot, axes=[0, 2, 1, 3]),
                    R.permute_dims(k_rep, axes=[0, 2, 1, 3]),
                    R.permute_dims(v_rep, axes=[0, 2, 1, 3]),
                    causal_mask="TopLeft",
                )
                out = R.reshape(att, R.shape([1, n, 8]))
                R.output(out)
            return out

    return Module


def test_qwen3_head_norms_join_paged_attention():
    out, count = apply(fuse_attention, _qk_norm_module())
    assert count == 1 and count_ops(out, "rms_norm") == 0 and count_ops(out, "rope") == 0
    (call,) = [b.value for b in out["main"].body.blocks[0].bindings if "paged_attention" in str(b.value.args[0])]
    args = llmc_args(call)
    assert [args[n].name for n in ("q", "k", "v")] == ["q", "k", "v"]  # straight from the projections, norms and all
    assert np.array_equal(args["q_norm"].value.numpy(), Q_NORM) and np.array_equal(args["k_norm"].value.numpy(), K_NORM)
    assert float(args["norm_eps"].value) == 1e-6


@pytest.mark.parametrize(
    "near_miss",
    [_qk_norm_module(k_eps=1e-5), _qk_norm_module(k_norm=np.ones(2, dtype="float32"))],
    ids=["q_and_k_norms_of_two_epsilons", "k_norm_not_over_each_head"],
)
def test_head_norm_near_misses_are_left_alone(near_miss):
    out, count = apply(fuse_attention, near_miss)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], near_miss["main"])


@I.ir_module
class NoPE:
    """A layer of SmolLM3 without RoPE: the head-split q and k reach attention unrotated (no GQA repeat: 2 / 2)."""

    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        q: R.Tensor(("n", 8), "float32"),
        k: R.Tensor(("n", 8), "float32"),
        v: R.Tensor(("n", 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            att = R.nn.attention(
                R.reshape(q, R.shape([1, n, 2, 4])),
                R.reshape(k, R.shape([1, n, 2, 4])),
                R.reshape(v, R.shape([1, n, 2, 4])),
                causal_mask="TopLeft",
            )
            out = R.reshape(att, R.shape([1, n, 8]))
            R.output(out)
        return out


def test_a_layer_without_rope_becomes_paged_attention_with_no_inverse_frequencies():
    out, count = apply(fuse_attention, NoPE)
    assert count == 1
    (call,) = [b.value for b in out["main"].body.blocks[0].bindings if "paged_attention" in str(b.value.args[0])]
    q, k, v, positions, inv_freq = call.args[1:6]
    assert [p.name for p in (q, k, v, positions)] == ["q", "k", "v", "positions"]
    assert inv_freq.value.numpy().shape == (0,)


@I.ir_module
class RopeOnQAlone:
    @R.function
    def main(
        input_ids: R.Tensor(("n",), "int64"),
        positions: R.Tensor(("n",), "int64"),
        q: R.Tensor(("n", 8), "float32"),
        k: R.Tensor(("n", 8), "float32"),
        v: R.Tensor(("n", 8), "float32"),
    ):
        n = T.int64()
        with R.dataflow():
            q_rot = R.call_pure_packed(
                "llmc.rope", R.permute_dims(R.reshape(q, R.shape([1, n, 2, 4])), axes=[0, 2, 1, 3]), positions,
                R.const(INV_FREQ), R.const(NO_LONG), R.prim_value(0), R.prim_value(T.float64(1.0)), ty_args=R.Tensor((1, 2, n, 4), "float32"),
            )  # fmt: skip
            att = R.nn.attention(
                R.permute_dims(q_rot, axes=[0, 2, 1, 3]),
                R.reshape(k, R.shape([1, n, 2, 4])),
                R.reshape(v, R.shape([1, n, 2, 4])),
                causal_mask="TopLeft",
            )
            out = R.reshape(att, R.shape([1, n, 8]))
            R.output(out)
        return out


def test_rope_on_q_alone_is_left_alone():
    """A rotated q against an unrotated k is no attention the kernels compute: the layer keeps R.nn.attention."""
    out, count = apply(fuse_attention, RopeOnQAlone)
    assert count == 0
    tvm.ir.assert_structural_equal(out["main"], RopeOnQAlone["main"])


@pytest.mark.parametrize("arch", ARCHS)
def test_rewrites_causal_attention_to_paged(arch, checkpoint_dir):
    mod, config = imported(checkpoint_dir, arch)
    out, count = apply(fuse_attention, before(mod, fuse_attention))
    assert count == config.num_layers
    assert count_ops(out, "paged_attention") == config.num_layers
    assert count_ops(out, "nn.attention") == 0
    assert count_ops(out, "rope") == 0  # folded into paged attention
    assert count_ops(out, "broadcast_to") == 0  # the GQA repeat is gone: the kernel maps heads
    names = [p.name for p in out["main"].params]
    for name in ("seq_lens", "query_start_loc", "block_tables", "slot_mapping"):
        assert name in names
    caches = [p for p in out["main"].params if p.name.startswith("kv_cache_")]
    assert len(caches) == config.num_layers
    shape = caches[0].ty.shape.values
    assert (int(shape[0]), int(shape[3]), int(shape[4])) == (2, config.num_kv_heads, config.head_dim)


def test_leaves_other_graphs_alone_and_compile_refuses():
    mod = plain_module()
    out, count = apply(fuse_attention, mod)
    assert count == 0 and tvm_ffi.structural_equal(out["main"], mod["main"])
    with pytest.raises(CompileError, match="fuse_attention rewrote 0 of 2"):
        check_fusion(out, num_layers=2)


def test_unfused_rope_blocks_the_rewrite(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "llama")
    out, count = apply(fuse_attention, mod)  # no fuse_rope before it
    assert count == 0
    assert count_ops(out, "nn.attention") == config.num_layers
    with pytest.raises(CompileError):
        check_fusion(out, config.num_layers)
