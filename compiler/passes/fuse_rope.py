"""fuse_rope: the rotate-half RoPE on q and k becomes `llmc.rope(x, positions, inv_freq)`.

Matches transformers' `x * cos + rotate_half(x) * sin` with
`rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2])`, where cos and sin are taken in the graph of the
same angles `concat(f, f)`, `f = positions[:, None] * inv_freq[None, :]`, and inv_freq is a float32
constant (the model's inverse frequencies, scaling included, as the frontend traced them). The op carries
that constant, so the cos/sin subgraph becomes dead and is removed.

Runs after the first fold (which drops the no-op casts around cos and sin) and before fuse_attention,
which folds llmc.rope into paged attention. Partial rotary (Phi-4-mini), concat((rope(x[..., :R]), x[..., R:])),
becomes one llmc.rope on the whole head whose inv_freq has R / 2 entries: the kernels rotate the leading R dims
and leave the rest. Not covered: interleaved (GPT-J style) rotation, and inverse frequencies computed in the graph
rather than traced as a constant.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .common import bindings, calls, llmc_call, main_function, matching_bindings, rewrite, source_of

_VIEWS_AND_CASTS = ("relax.reshape", "relax.expand_dims", "relax.astype")


def _pattern():
    """x * cos + rotated * sin; the check callbacks below pin down rotated, cos and sin."""
    rotated_times_sin = is_op("relax.multiply")(is_op("relax.concat")(wildcard()), is_op("relax.sin")(wildcard()))
    return is_op("relax.add")(is_op("relax.multiply")(wildcard(), is_op("relax.cos")(wildcard())), rotated_times_sin)


def _rotate_half_of(rotated: relax.Expr, var2val) -> relax.Expr | None:
    """x if `rotated` is concat(-x[..., d/2:], x[..., :d/2]) on the last axis, else None."""
    value = var2val.get(rotated)
    if not calls(value, "relax.concat"):
        return None
    parts = value.args[0]
    parts = var2val.get(parts, parts)
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2:
        return None
    neg, low = (var2val.get(f) for f in parts.fields)
    if not (calls(neg, "relax.negative") and calls(low, "relax.strided_slice")):
        return None
    high = var2val.get(neg.args[0])
    if not calls(high, "relax.strided_slice") or not high.args[0].same_as(low.args[0]):
        return None
    return low.args[0]


def _angles(emb: relax.Expr, var2val) -> tuple[relax.Var, tvm.ir.Constant] | None:
    """(positions, inv_freq) if emb is concat(f, f) with f = positions[:, None] * inv_freq[None, :], else None.

    positions must be a parameter of main and inv_freq a float32 [n] constant.
    """
    value = var2val.get(source_of(emb, var2val))
    if not calls(value, "relax.concat"):
        return None
    parts = value.args[0]
    parts = var2val.get(parts, parts)
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2 or not parts.fields[0].same_as(parts.fields[1]):
        return None
    freqs = var2val.get(parts.fields[0])
    if not calls(freqs, "relax.multiply"):
        return None
    positions, inv_freq = (source_of(a, var2val, through=_VIEWS_AND_CASTS) for a in freqs.args)
    if not (
        isinstance(positions, relax.Var)
        and positions not in var2val
        and isinstance(inv_freq, tvm.ir.Constant)
        and inv_freq.ty.dtype == "float32"
        and inv_freq.ty.ndim == 1
    ):
        return None
    return positions, inv_freq


def _last_axis_slice(expr: relax.Expr, var2val) -> tuple[relax.Expr, int, int] | None:
    """(x, begin, end) if expr is x[..., begin:end] (a unit-stride strided_slice of x's last axis), else None."""
    value = var2val.get(expr)
    if not calls(value, "relax.strided_slice") or len(value.args) != 5:
        return None
    x, axes, begin, end, strides = value.args
    ndim = x.ty.ndim
    if [int(a) for a in axes] not in ([ndim - 1], [-1]) or [int(s) for s in strides] != [1]:
        return None
    return x, int(begin[0]), int(end[0])


def _partial(b: relax.VarBinding, roped: dict, var2val) -> tuple[relax.Expr, relax.Var] | None:
    """(llmc.rope over the whole head, the var of the rotated part's rope) if b is Phi-4-mini's partial rotary,
    concat((rope(x[..., :R]), x[..., R:])) on the last axis with R the rope's 2 * len(inv_freq); else None."""
    if not calls(b.value, "relax.concat"):
        return None
    parts = b.value.args[0]
    parts = var2val.get(parts, parts)
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2 or parts.fields[0] not in roped:
        return None
    x, positions, inv_freq = roped[parts.fields[0]]
    rotated, passed = _last_axis_slice(x, var2val), _last_axis_slice(parts.fields[1], var2val)
    dim = 2 * int(inv_freq.ty.shape.values[0])
    if rotated is None or passed is None or not rotated[0].same_as(passed[0]) or rotated[1:] != (0, dim):
        return None
    head_dim = int(rotated[0].ty.shape.values[-1])
    if passed[1] != dim or passed[2] < head_dim or int(b.value.attrs.axis) not in (-1, rotated[0].ty.ndim - 1):
        return None
    return llmc_call("rope", [rotated[0], positions, inv_freq], b.var.ty), parts.fields[0]


def fuse_rope(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits, roped = {}, {}
    for b, var2val in matching_bindings(func, _pattern()):
        first, second = (var2val[a] for a in b.value.args)
        x, rotated = first.args[0], second.args[0]
        cos, sin = var2val[first.args[1]], var2val[second.args[1]]
        source = _rotate_half_of(rotated, var2val)
        if source is None or not source.same_as(x) or not cos.args[0].same_as(sin.args[0]):
            continue
        angles = _angles(cos.args[0], var2val)
        if angles is None or 2 * int(angles[1].ty.shape.values[0]) != int(x.ty.shape.values[-1]):
            continue
        edits[b.var] = llmc_call("rope", [x, *angles], b.var.ty)
        roped[b.var] = (x, *angles)
    var2val = relax.analysis.get_var2val(func)
    for b in bindings(func):
        partial = _partial(b, roped, var2val)
        if partial is not None:  # the rotated part's own rope becomes unused
            edits[b.var] = partial[0]
            del edits[partial[1]]
    return rewrite(mod, edits, pass_name="fuse_rope", count=len(edits))
