"""fuse_attention: causal attention over the sequence becomes paged-KV attention over the cache.

Matches, per layer, `R.nn.attention(q, k, v, causal_mask="TopLeft")` whose inputs come from the q/k/v
projections through the head split ([T, H*D] -> [1, H, T, D]), `llmc.rope` on q and k, and for GQA
transformers' repeat_kv (expand_dims, broadcast_to, reshape). It rewrites the whole chain into

    llmc.paged_attention(q2d, k2d, v2d, positions, kv_cache_<layer>, slot_mapping, query_start_loc,
                         seq_lens, block_tables, layer)  -> [T, H*D]

which applies RoPE, writes this step's k/v into the cache through slot_mapping, and attends over each
sequence's cached context. The GQA repeat disappears (the kernel maps heads to KV heads). main gains
the batch-state parameters of the C ABI and one KV cache per layer, [2, num_blocks, block_size,
kv_heads, head_dim] (docs/contracts.md).

Runs after fuse_rope. A model whose attention does not match keeps R.nn.attention, which no target
lowers: compile then fails, rather than serve a model without its cache. The traced graph is plainly
causal even for sliding-window layers: lowering takes each layer's window from the config
(ModelConfig.attention_window). Not covered: attention sinks, non-default scales.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .common import bindings, calls, llmc_call, llmc_op_name, main_function, prim, rewrite, source_of

_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.expand_dims", "relax.broadcast_to")


def _strip_layout(expr: relax.Expr, var2val) -> relax.Expr:
    """Follow layout-only ops (head split, transposes, repeat_kv) back to their source."""
    return source_of(expr, var2val, through=_LAYOUT_OPS)


def _through_rope(expr: relax.Expr, var2val) -> relax.Expr | None:
    source = _strip_layout(expr, var2val)
    call = var2val.get(source)
    if llmc_op_name(call) != "rope":
        return None
    return _strip_layout(call.args[1], var2val)


def _columns(expr: relax.Expr) -> int | None:
    shape = expr.ty.shape
    if shape is None or len(shape.values) not in (2, 3):
        return None
    last = shape.values[-1]
    return int(last) if isinstance(last, tvm.tirx.IntImm) else None


def batch_state_params(func: relax.Function, num_layers: int, num_kv_heads: int, head_dim: int):
    """New main parameters: (seq_lens, query_start_loc, block_tables, slot_mapping, kv caches)."""
    tokens = func.params[0].ty.shape.values[0]
    batch = tvm.tirx.Var("B", "int64")
    max_blocks = tvm.tirx.Var("max_blocks", "int64")
    num_blocks = tvm.tirx.Var("num_blocks", "int64")
    block_size = tvm.tirx.Var("block_size", "int64")
    seq_lens = relax.Var("seq_lens", relax.TensorType([batch], "int32"))
    query_start_loc = relax.Var("query_start_loc", relax.TensorType([batch + 1], "int32"))
    block_tables = relax.Var("block_tables", relax.TensorType([batch, max_blocks], "int32"))
    slot_mapping = relax.Var("slot_mapping", relax.TensorType([tokens], "int64"))
    caches = [
        relax.Var(f"kv_cache_{i}", relax.TensorType([2, num_blocks, block_size, num_kv_heads, head_dim], "float32"))
        for i in range(num_layers)
    ]
    return seq_lens, query_start_loc, block_tables, slot_mapping, caches


def fuse_attention(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    matches = []
    for b in bindings(func):
        if not calls(b.value, "relax.nn.attention") or b.value.attrs.causal_mask != "TopLeft":
            continue
        if b.value.attrs.scale is not None or len(b.value.args) != 3:
            continue
        q_in, k_in, v_in = b.value.args
        q2, k2 = _through_rope(q_in, var2val), _through_rope(k_in, var2val)
        v2 = _strip_layout(v_in, var2val)
        if q2 is None or k2 is None:
            continue
        _, _, heads, head_dim = b.var.ty.shape.values
        if _columns(q2) != int(heads) * int(head_dim) or _columns(k2) != _columns(v2):
            continue
        matches.append((b, q2, k2, v2, int(head_dim), _columns(k2) // int(head_dim)))
    if not matches:
        return rewrite(mod, {}, pass_name="fuse_attention", count=0)

    head_dim, kv_heads = matches[0][4], matches[0][5]
    seq_lens, qsl, block_tables, slot_mapping, caches = batch_state_params(func, len(matches), kv_heads, head_dim)
    positions = func.params[1]
    edits = {}
    for layer, (b, q2, k2, v2, _, _) in enumerate(matches):
        shape = b.var.ty.shape.values
        out_ty = relax.TensorType([shape[1], shape[2] * shape[3]], "float32")
        call = llmc_call("paged_attention", [q2, k2, v2, positions, caches[layer], slot_mapping, qsl, seq_lens,
                                             block_tables, prim(layer)], out_ty)
        edits[b.var] = relax.op.reshape(call, b.var.ty.shape)
    params = [*func.params[:2], seq_lens, qsl, block_tables, slot_mapping, *caches, *func.params[2:]]
    return rewrite(mod, edits, pass_name="fuse_attention", count=len(matches), params=params)
