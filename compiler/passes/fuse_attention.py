"""fuse_attention: causal attention over the sequence becomes paged-KV attention over the cache.

Matches, per layer, `R.nn.attention(q, k, v, scale=s, causal_mask="TopLeft", window_size=w)` (or Gemma 2's
`llmc.softcapped_attention(q, k, v, s, w, softcap)`, as the import states it) whose inputs
come from the q/k/v projections through the head split ([T, H*D] -> [1, H, T, D]), `llmc.rope` on q and k
(by the same positions and inverse frequencies), and for GQA transformers' repeat_kv (expand_dims,
broadcast_to, reshape); in SmolLM3's NoPE layers neither q nor k is rotated, and the op's inv_freq is empty.
Qwen3 normalizes each head of q and of k (llmc.rms_norm with a [head_dim] weight)
between the head split and RoPE, OLMo 2 the whole projection before the head split (a [heads * head_dim]
weight): the norm joins the op, which applies it with RoPE (its weight's length says which). It rewrites the
whole chain into

    llmc.paged_attention(q2d, k2d, v2d, positions, inv_freq, kv_cache_<layer>, slot_mapping, query_start_loc,
                         seq_lens, block_tables, layer, num_heads, num_kv_heads, head_dim, scale,
                         sliding_window, q_norm, k_norm, norm_eps, softcap, long_inv_freq, original_max,
                         attention_factor)  -> [T, H*D]

which applies RoPE, writes this step's k/v into the cache through slot_mapping, and attends over each
sequence's cached context. The op carries what the graph states: the scale (head_dim^-0.5 when the graph
gives none), the window (0 for none), and the head counts, read off the matched shapes. The GQA repeat
disappears (the kernel maps heads to KV heads). main gains the batch-state parameters of the C ABI and one
KV cache per layer, [2, num_blocks, block_size, kv_heads, head_dim] (docs/contracts.md).

Runs after fuse_rope. A model whose attention does not match keeps R.nn.attention, which no target
lowers: compile then fails, rather than serve a model without its cache. Not covered: attention with a
bias, bidirectional attention, attention sinks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .common import (
    NO_WEIGHT,
    bindings,
    calls,
    llmc_args,
    llmc_call,
    llmc_op_name,
    main_function,
    prim,
    prim_value,
    rewrite,
    source_of,
)

_LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.expand_dims", "relax.broadcast_to")


def _strip_layout(expr: relax.Expr, var2val) -> relax.Expr:
    """Follow layout-only ops (head split, transposes, repeat_kv) back to their source."""
    return source_of(expr, var2val, through=_LAYOUT_OPS)


@dataclasses.dataclass
class _Attention:
    """One matched layer: its binding, the [T, cols] q/k/v before the head split, and the facts it states."""

    binding: relax.VarBinding
    q: relax.Expr
    k: relax.Expr
    v: relax.Expr
    positions: relax.Expr
    rope: dict  # inv_freq and the LongRoPE facts (_ROPE_FACTS), as llmc.rope carries them
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int
    q_norm: relax.Expr  # the norm weights: [head_dim] (Qwen3: each head), [heads * head_dim] (OLMo 2); or empty
    k_norm: relax.Expr
    norm_eps: float  # 0: no per-head norm
    softcap: float  # 0: none


_NO_ROPE = relax.const(np.zeros(0, dtype="float32"))  # inv_freq of a layer without RoPE
_NO_LONGROPE = {"long_inv_freq": NO_WEIGHT, "original_max": prim(0), "attention_factor": prim(1.0)}
_ROPE_FACTS = ("inv_freq", *_NO_LONGROPE)  # what q's and k's rotations must share


def _qk_norm(expr: relax.Expr, var2val, head_dim: int) -> tuple[relax.Expr, relax.Expr, float] | None:
    """(x, weight, eps) if `expr` (q or k with its head split stripped) is llmc.rms_norm over each head (a
    [head_dim] weight, on [1, T, heads, head_dim]) or over the whole projection (a [columns] weight, on
    [1, T, columns]), else None."""
    value = var2val.get(expr)
    if llmc_op_name(value) != "rms_norm":
        return None
    args = llmc_args(value)
    shape = args["weight"].ty.shape
    if shape is None or [int(d) for d in shape.values] not in ([head_dim], [_columns(expr)]):
        return None
    return args["x"], args["weight"], float(prim_value(args["eps"]))


def _through_rope(expr: relax.Expr, var2val) -> relax.Call | None:
    """The llmc.rope call `expr` views (through the head split and repeat_kv), else None."""
    call = var2val.get(_strip_layout(expr, var2val))
    return call if llmc_op_name(call) == "rope" else None


def _columns(expr: relax.Expr) -> int | None:
    shape = expr.ty.shape
    if shape is None or len(shape.values) not in (2, 3):
        return None
    last = shape.values[-1]
    return int(last) if isinstance(last, tvm.tirx.IntImm) else None


def _attention_facts(value: relax.Expr):
    """((q, k, v), scale or None, window, softcap) of causal attention without a bias: R.nn.attention with
    causal_mask="TopLeft", or llmc.softcapped_attention (Gemma 2); else None."""
    if llmc_op_name(value) == "softcapped_attention":
        args = llmc_args(value)
        scale, softcap = (float(prim_value(args[n])) for n in ("scale", "softcap"))
        return (args["q"], args["k"], args["v"]), scale, int(prim_value(args["sliding_window"])), softcap
    if not calls(value, "relax.nn.attention") or value.attrs.causal_mask != "TopLeft" or len(value.args) != 3:
        return None
    attrs = value.attrs
    scale = None if attrs.scale is None else float(attrs.scale.value)
    return tuple(value.args), scale, 0 if attrs.window_size is None else int(attrs.window_size), 0.0


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
        facts = _attention_facts(b.value)
        if facts is None:
            continue
        (q_in, k_in, v_in), scale, window, softcap = facts
        q_rope, k_rope = _through_rope(q_in, var2val), _through_rope(k_in, var2val)
        if (q_rope is None) != (k_rope is None):
            continue
        if q_rope is None:  # a NoPE layer (SmolLM3): neither is rotated
            q_args = k_args = {"positions": func.params[1], "inv_freq": _NO_ROPE, **_NO_LONGROPE}
            q_args, k_args = {**q_args, "x": q_in}, {**k_args, "x": k_in}
        else:
            q_args, k_args = llmc_args(q_rope), llmc_args(k_rope)
        if not q_args["positions"].same_as(k_args["positions"]) or not all(
            tvm_ffi.structural_equal(q_args[n], k_args[n]) for n in _ROPE_FACTS
        ):
            continue
        heads, head_dim = (int(d) for d in b.var.ty.shape.values[2:])  # attention out: [1, T, heads, head_dim]
        q2, k2 = (_strip_layout(a["x"], var2val) for a in (q_args, k_args))
        q_norm, k_norm = (_qk_norm(x, var2val, head_dim) for x in (q2, k2))
        if (q_norm is None) != (k_norm is None) or (q_norm and q_norm[2] != k_norm[2]):
            continue  # a norm on one of them only, or two epsilons: not Qwen3's or OLMo 2's attention
        if q_norm is not None:
            q2, k2 = (_strip_layout(n[0], var2val) for n in (q_norm, k_norm))
        v2 = _strip_layout(v_in, var2val)
        if _columns(q2) != heads * head_dim or _columns(k2) != _columns(v2):
            continue
        matches.append(
            _Attention(
                b,
                q2,
                k2,
                v2,
                q_args["positions"],
                {n: q_args[n] for n in _ROPE_FACTS},
                heads,
                _columns(k2) // head_dim,
                head_dim,
                head_dim**-0.5 if scale is None else scale,
                window,
                NO_WEIGHT if q_norm is None else q_norm[1],
                NO_WEIGHT if k_norm is None else k_norm[1],
                0.0 if q_norm is None else q_norm[2],
                softcap,
            )
        )
    if not matches:
        return rewrite(mod, {}, pass_name="fuse_attention", count=0)

    seq_lens, qsl, block_tables, slot_mapping, caches = batch_state_params(
        func, len(matches), matches[0].num_kv_heads, matches[0].head_dim
    )
    edits = {}
    for layer, m in enumerate(matches):
        shape = m.binding.var.ty.shape.values
        out_ty = relax.TensorType([shape[1], shape[2] * shape[3]], "float32")
        call = llmc_call(
            "paged_attention",
            [
                m.q,
                m.k,
                m.v,
                m.positions,
                m.rope["inv_freq"],
                caches[layer],
                slot_mapping,
                qsl,
                seq_lens,
                block_tables,
                prim(layer),
                prim(m.num_heads),
                prim(m.num_kv_heads),
                prim(m.head_dim),
                prim(m.scale),
                prim(m.sliding_window),
                m.q_norm,
                m.k_norm,
                prim(m.norm_eps),
                prim(m.softcap),
                m.rope["long_inv_freq"],
                m.rope["original_max"],
                m.rope["attention_factor"],
            ],
            out_ty,
        )
        edits[m.binding.var] = relax.op.reshape(call, m.binding.var.ty.shape)
    params = [*func.params[:2], seq_lens, qsl, block_tables, slot_mapping, *caches, *func.params[2:]]
    return rewrite(mod, edits, pass_name="fuse_attention", count=len(matches), params=params)
