"""fuse_rmsnorm: RMSNorm, and the residual add in front of it, become one llmc op.

Matches transformers' RMSNorm as traced at fp32:
    weight * (x * rsqrt(mean(x ** 2, axis=-1, keepdims=True) + eps))
and rewrites it to `llmc.rms_norm(x, weight, eps)`. When x is itself `a + b` (the residual stream),
the add joins the op: `llmc.add_rms_norm(a, b, weight, eps)` returns (a + b, norm(a + b)), and every
other user of the sum (the next residual add) reads field 0.

Runs after the first fold (which removes the no-op fp32 casts inside the traced norm), before everything
that reads its fused ops. Not covered: RMSNorm traced with dtype casts (llmc traces at fp32), and norms
whose weight is applied before the scale (Gemma's 1 + w).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .common import bindings, llmc_call, main_function, prim, rewrite


def _pattern():
    x, w, exponent, eps = wildcard(), wildcard(), is_const(), is_const()
    mean = is_op("relax.mean")(is_op("relax.power")(x, exponent))
    scaled = is_op("relax.multiply")(x, is_op("relax.rsqrt")(is_op("relax.add")(mean, eps)))
    return is_op("relax.multiply")(w, scaled), mean, exponent, eps


def _mean_square_of_rows(mean: relax.Call, exponent: relax.Expr) -> bool:
    """mean(x ** 2) over the last axis, kept as a column."""
    axis = mean.attrs.axis
    rank = len(mean.ty.shape.values)
    return (
        float(exponent.value.numpy()) == 2.0
        and mean.attrs.keepdims
        and axis is not None
        and len(axis) == 1
        and int(axis[0]) % rank == rank - 1
    )


def _residual_add(x: relax.Expr, var2val) -> tuple[relax.Expr, relax.Expr] | None:
    value = var2val.get(x) if isinstance(x, relax.Var) else None
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.add")):
        return None
    a, b = value.args
    if not (isinstance(a, relax.Var) and isinstance(b, relax.Var)):
        return None
    if not tvm_ffi.structural_equal(a.ty, b.ty):
        return None
    return a, b


def fuse_rmsnorm(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    root, mean_pat, exponent_pat, eps_pat = _pattern()
    edits, count = {}, 0
    for b in bindings(func):
        m = root.extract_matched_expr(b.value, var2val)
        if m is None or not _mean_square_of_rows(m[mean_pat], m[exponent_pat]):
            continue
        # Matched expressions are auto-jumped values; the vars the rewrite needs are the call's arguments.
        w, scaled = b.value.args
        x = var2val[scaled].args[0]
        eps = float(m[eps_pat].value.numpy())
        sinfo = b.var.ty
        residual = _residual_add(x, var2val)
        if residual is not None and isinstance(x, relax.Var) and x not in edits:
            call = llmc_call("add_rms_norm", [*residual, w, prim(eps)], relax.TupleType([sinfo, sinfo]))
            edits[x] = relax.TupleGetItem(call, 0)
            edits[b.var] = relax.TupleGetItem(call, 1)
        else:
            edits[b.var] = llmc_call("rms_norm", [x, w, prim(eps)], sinfo)
        count += 1
    return rewrite(mod, edits, pass_name="fuse_rmsnorm", count=count)
