"""fuse_rope: the rotate-half RoPE on q and k becomes
`llmc.rope(x, positions, inv_freq, long_inv_freq, original_max, attention_factor)`.

Matches transformers' `x * cos + rotate_half(x) * sin` with
`rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2])`, where cos and sin are taken in the graph of the
same angles `concat(f, f)`, `f = positions[:, None] * inv_freq[None, :]`, and inv_freq is a float32
constant (the model's inverse frequencies, scaling included, as the frontend traced them). The op carries
that constant, so the cos/sin subgraph becomes dead and is removed. LongRoPE (Phi-3) is a switch between two
such constants, `where(max(positions) + 1 > original, long, short)`, and cos and sin times its attention
factor: the op carries both sets, the original length and the factor (else an empty long set, 0 and 1).

Runs after the first fold (which drops the no-op casts around cos and sin) and before fuse_attention,
which folds llmc.rope into paged attention. Partial rotary (Phi-4-mini), concat((rope(x[..., :R]), x[..., R:])),
becomes one llmc.rope on the whole head whose inv_freq has R / 2 entries: the kernels rotate the leading R dims
and leave the rest. Not covered: interleaved (GPT-J style) rotation, and inverse frequencies computed in the graph
rather than traced as a constant.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .common import (
    NO_WEIGHT,
    bindings,
    calls,
    llmc_call,
    main_function,
    matching_bindings,
    prim,
    rewrite,
    scalar,
    source_of,
)

_VIEWS_AND_CASTS = ("relax.reshape", "relax.expand_dims", "relax.astype")


def _pattern():
    """x * cos + rotated * sin, cos and sin optionally times a constant (LongRoPE's attention factor); the checks
    in fuse_rope pin down rotated, cos and sin."""

    def scaled(op: str):
        return is_op(op)(wildcard()) | is_op("relax.multiply")(is_op(op)(wildcard()), is_const())

    rotated_times_sin = is_op("relax.multiply")(is_op("relax.concat")(wildcard()), scaled("relax.sin"))
    return is_op("relax.add")(is_op("relax.multiply")(wildcard(), scaled("relax.cos")), rotated_times_sin)


def _unscaled(expr: relax.Expr, var2val) -> tuple[relax.Call, float | None]:
    """(cos or sin call, the constant it is multiplied by or 1.0; None for a constant that is no float32 scalar)."""
    value = var2val[expr]
    if calls(value, "relax.multiply"):
        return var2val[value.args[0]], scalar(value.args[1])
    return value, 1.0


def _longrope_switch(inv_freq: relax.Expr, positions: relax.Var, var2val):
    """(short, long, original length) if inv_freq is LongRoPE's where(max(positions) + 1 > original, long, short)
    over two float32 constants, else None."""
    value = var2val.get(inv_freq)
    if not calls(value, "relax.where"):
        return None
    cond, long, short = (source_of(a, var2val, through=_VIEWS_AND_CASTS) for a in value.args)
    cond = var2val.get(cond)
    if not (isinstance(long, tvm.ir.Constant) and isinstance(short, tvm.ir.Constant) and calls(cond, "relax.greater")):
        return None
    total, orig = var2val.get(cond.args[0]), cond.args[1]
    if not calls(total, "relax.add"):
        return None
    top, one = var2val.get(total.args[0]), total.args[1]
    if not (
        isinstance(orig, tvm.ir.Constant)
        and isinstance(one, tvm.ir.Constant)
        and int(one.value.numpy()) == 1
        and calls(top, "relax.max")
        and top.args[0].same_as(positions)
    ):
        return None
    return short, long, int(orig.value.numpy())


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


def _angles(emb: relax.Expr, var2val) -> tuple[relax.Var, tvm.ir.Constant, tvm.ir.Constant, int] | None:
    """(positions, inv_freq, long_inv_freq, original length) if emb is concat(f, f) with
    f = positions[:, None] * inv_freq[None, :], else None.

    positions must be a parameter of main and inv_freq a float32 [n] constant (long_inv_freq empty, length 0), or
    LongRoPE's switch between two of them (_longrope_switch).
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
    if not isinstance(positions, relax.Var) or positions in var2val:
        return None
    long, orig = NO_WEIGHT, 0
    switch = _longrope_switch(inv_freq, positions, var2val)
    if switch is not None:
        inv_freq, long, orig = switch
        if (
            long.ty.dtype != "float32"
            or long.ty.ndim != 1
            or int(long.ty.shape.values[0]) != int(inv_freq.ty.shape.values[0])
        ):
            return None
    if not (isinstance(inv_freq, tvm.ir.Constant) and inv_freq.ty.dtype == "float32" and inv_freq.ty.ndim == 1):
        return None
    return positions, inv_freq, long, orig


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
    x, args = roped[parts.fields[0]]
    rotated, passed = _last_axis_slice(x, var2val), _last_axis_slice(parts.fields[1], var2val)
    dim = 2 * int(args[1].ty.shape.values[0])
    if rotated is None or passed is None or not rotated[0].same_as(passed[0]) or rotated[1:] != (0, dim):
        return None
    head_dim = int(rotated[0].ty.shape.values[-1])
    if passed[1] != dim or passed[2] < head_dim or int(b.value.attrs.axis) not in (-1, rotated[0].ty.ndim - 1):
        return None
    return llmc_call("rope", [rotated[0], *args], b.var.ty), parts.fields[0]


def fuse_rope(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits, roped = {}, {}
    for b, var2val in matching_bindings(func, _pattern()):
        first, second = (var2val[a] for a in b.value.args)
        x, rotated = first.args[0], second.args[0]
        (cos, factor), (sin, sin_factor) = _unscaled(first.args[1], var2val), _unscaled(second.args[1], var2val)
        source = _rotate_half_of(rotated, var2val)
        if source is None or not source.same_as(x) or not cos.args[0].same_as(sin.args[0]):
            continue
        angles = _angles(cos.args[0], var2val)
        if angles is None or 2 * int(angles[1].ty.shape.values[0]) != int(x.ty.shape.values[-1]):
            continue
        if factor is None or factor != sin_factor:
            continue
        positions, inv_freq, long, orig = angles
        args = [positions, inv_freq, long, prim(orig), prim(factor)]
        edits[b.var] = llmc_call("rope", [x, *args], b.var.ty)
        roped[b.var] = (x, args)
    var2val = relax.analysis.get_var2val(func)
    for b in bindings(func):
        partial = _partial(b, roped, var2val)
        if partial is not None:  # the rotated part's own rope becomes unused
            edits[b.var] = partial[0]
            del edits[partial[1]]
    return rewrite(mod, edits, pass_name="fuse_rope", count=len(edits))
