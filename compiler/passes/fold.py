"""fold: remove layout no-ops that fusion leaves behind, then dead code.

- reshape(reshape(x, s1), s2) -> reshape(x, s2)
- reshape(x, shape of x) -> x
- permute_dims(permute_dims(x, p1), p2) -> x when p2 undoes p1
- y = x (an alias) -> uses of y read x
- astype(x, dtype of x) -> x (torch's `.float()` / `.to(dtype)` on a tensor already of that dtype)

Runs first (on the imported graph) and last (after the fusing passes); the kernel program then sees only
row-major [rows, cols] tensors joined by free views. Not covered: general constant folding (the traced
graph has no weight constants to fold).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from .common import bindings, calls, main_function, rewrite

_RESHAPE = "relax.reshape"
_PERMUTE = "relax.permute_dims"


def _same_shape(a: relax.Expr, b_ty) -> bool:
    return tvm_ffi.structural_equal(a.ty.shape, b_ty.shape) and a.ty.dtype == b_ty.dtype


def _axes(call) -> list[int]:
    return [int(a) for a in call.attrs.axes]


def fold(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    edits, count = {}, 0

    def resolve(v):
        """Follow aliases and already-decided edits, so chains collapse in one pass."""
        while isinstance(v, relax.Var):
            if v in edits and isinstance(edits[v], relax.Var):
                v = edits[v]
            elif isinstance(var2val.get(v), relax.Var):
                v = var2val[v]
            else:
                return v
        return v

    for b in bindings(func):
        value = b.value
        if isinstance(value, relax.Var) and isinstance(b.var, relax.DataflowVar):
            edits[b.var] = resolve(value)
            count += 1
        elif calls(value, _RESHAPE):
            src = resolve(value.args[0])
            inner = var2val.get(src)
            if calls(inner, _RESHAPE):
                src = inner.args[0]
            if _same_shape(src, b.var.ty):
                edits[b.var] = src
                count += 1
            elif not src.same_as(value.args[0]):
                edits[b.var] = relax.op.reshape(src, value.args[1])
                count += 1
        elif calls(value, "relax.astype") and value.args[0].ty.dtype == b.var.ty.dtype:
            edits[b.var] = resolve(value.args[0])
            count += 1
        elif calls(value, _PERMUTE):
            inner = var2val.get(resolve(value.args[0]))
            if calls(inner, _PERMUTE) and value.attrs.axes is not None and inner.attrs.axes is not None:
                outer_axes, inner_axes = _axes(value), _axes(inner)
                if [inner_axes[a] for a in outer_axes] == list(range(len(outer_axes))):
                    edits[b.var] = inner.args[0]
                    count += 1
    return rewrite(mod, edits, pass_name="fold", count=count)
