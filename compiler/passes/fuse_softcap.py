"""fuse_softcap: Gemma 2's final-logit soft-capping, `tanh(x / c) * c`, becomes `llmc.softcap(x, c)`.

Matches the traced form (divide by a float32 scalar constant, tanh, multiply by the same constant) and
rewrites it into one op, which lowering launches in place on the rows it reads. Runs before
select_logits_rows, which carries the op onto the gathered logits rows (soft-capping is row-wise). A
near miss (two different constants, a tanh alone) stays as the import wrote it.
"""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, is_op, wildcard

from .common import calls, llmc_call, main_function, matching_bindings, prim, rewrite, scalar


def _pattern():
    return is_op("relax.multiply")(is_op("relax.tanh")(is_op("relax.divide")(wildcard(), is_const())), is_const())


def fuse_softcap(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits = {}
    for b, var2val in matching_bindings(func, _pattern()):
        if not calls(b.value, "relax.multiply"):  # an alias of the match (main's output var)
            continue
        divide = var2val[b.value.args[0]].args[0]
        divide = var2val.get(divide, divide)
        cap, outer = scalar(divide.args[1]), scalar(b.value.args[1])
        if cap is None or cap != outer or not cap > 0:
            continue
        edits[b.var] = llmc_call("softcap", [divide.args[0], prim(cap)], b.var.ty)
    return rewrite(mod, edits, pass_name="fuse_softcap", count=len(edits))
