"""fuse_rmsnorm: RMSNorm, and the residual add in front of it, become one llmc op.

Matches transformers' RMSNorm as traced at fp32:
    weight * (x * rsqrt(mean(x ** 2, axis=-1, keepdims=True) + eps))
and rewrites it to `llmc.rms_norm(x, weight, eps)`. The weight may be computed from a parameter (Gemma's
1 + w): the op then takes that expression, which lowering evaluates when it packs the weight. When x is
itself `a + b` (the residual stream), the add joins the op: `llmc.add_rms_norm(a, b, weight, eps,
residual_scale, residual_weight)` returns (a + b, norm(a + b)), and every other user of the sum (the next
residual add) reads field 0. The branch b joins it too when the add alone reads it, in either of its forms:
- `b = c * s` with a scalar constant s (Granite's residual_multiplier): residual_scale s, b := c;
- `b = rms_norm(c)` with the same eps (Gemma's norm of each branch before its add): residual_weight is that
  norm's weight, b := c; else residual_weight is an empty constant.
A normed branch whose sum no norm follows (OLMo 2, whose layers have no input norm) joins its add as
`llmc.add_normed(a, c, weight, eps)`.

Runs after the first fold (which removes the no-op fp32 casts inside the traced norm), before everything
that reads its fused ops. Not covered: RMSNorm traced with dtype casts (llmc traces at fp32), and a
branch norm whose eps differs from the norm after the add.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from .common import NO_WEIGHT, bindings, calls, llmc_call, main_function, prim, rewrite, scalar, users


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


@dataclasses.dataclass
class _Norm:
    x: relax.Expr
    weight: relax.Expr  # a parameter, or the expression (of one) that computes it
    eps: float


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


def _branch(b: relax.Var, var2val, norms: dict, uses: dict, eps: float | None):
    """(source, scale, the norm it absorbs or None) of the add's branch b: b itself, or c of `c * s` and of a
    norm of c (of epsilon eps, unless None) that only the add reads."""
    scale = 1.0
    value = var2val.get(b)
    if uses.get(b) == 1 and calls(value, "relax.multiply") and scalar(value.args[1]) is not None:
        b, scale = value.args[0], scalar(value.args[1])
    norm = norms.get(b)
    if norm is not None and uses.get(b) == 1 and eps in (norm.eps, None):
        return norm.x, scale, b
    return b, scale, None


def fuse_rmsnorm(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    uses = users(func)
    root, mean_pat, exponent_pat, eps_pat = _pattern()
    norms: dict[relax.Var, _Norm] = {}
    for b in bindings(func):
        m = root.extract_matched_expr(b.value, var2val)
        if m is None or not _mean_square_of_rows(m[mean_pat], m[exponent_pat]):
            continue
        # Matched expressions are auto-jumped values; the vars the rewrite needs are the call's arguments.
        w, scaled = b.value.args
        # A computed weight joins as its expression: its binding may come after the residual add's.
        weight = var2val[w] if isinstance(var2val.get(w), relax.Call) else w
        norms[b.var] = _Norm(var2val[scaled].args[0], weight, float(m[eps_pat].value.numpy()))
    edits, absorbed = {}, set()
    for var, norm in norms.items():
        sinfo = var.ty
        residual = _residual_add(norm.x, var2val)
        if residual is not None and isinstance(norm.x, relax.Var) and norm.x not in edits:
            branch, scale, branch_norm = _branch(residual[1], var2val, norms, uses, norm.eps)
            branch_weight = NO_WEIGHT if branch_norm is None else norms[branch_norm].weight
            absorbed.add(branch_norm)
            args = [residual[0], branch, norm.weight, prim(norm.eps), prim(scale), branch_weight]
            call = llmc_call("add_rms_norm", args, relax.TupleType([sinfo, sinfo]))
            edits[norm.x] = relax.TupleGetItem(call, 0)
            edits[var] = relax.TupleGetItem(call, 1)
        else:
            edits[var] = llmc_call("rms_norm", [norm.x, norm.weight, prim(norm.eps)], sinfo)
    absorbed.discard(None)
    for var in absorbed:
        del edits[var]
    for b in bindings(func):  # the adds of a normed branch left: no norm reads their sums
        residual = _residual_add(b.var, var2val)
        if residual is None or b.var in edits:
            continue
        branch, scale, branch_norm = _branch(residual[1], var2val, norms, uses, None)
        if branch_norm is None or scale != 1.0 or branch_norm in absorbed:
            continue
        norm = norms[branch_norm]
        edits[b.var] = llmc_call("add_normed", [residual[0], branch, norm.weight, prim(norm.eps)], b.var.ty)
        edits.pop(branch_norm, None)
        absorbed.add(branch_norm)
    return rewrite(mod, edits, pass_name="fuse_rmsnorm", count=len(norms) - len(absorbed))
