"""fuse_rope: the rotate-half RoPE on q and k becomes `llmc.rope(x, positions)`.

Matches transformers' `x * cos + rotate_half(x) * sin` with
`rotate_half(x) = concat(-x[..., d/2:], x[..., :d/2])`, where cos and sin are computed in the graph
from the positions. The rewritten op rotates by the model's own inverse frequencies (ModelConfig and
`rope_inv_freq`), so the cos/sin subgraph becomes dead and is removed.

Runs before fuse_attention, which folds llmc.rope into paged attention. Not covered: interleaved
(GPT-J style) rotation and partial rotary dims.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .common import calls, llmc_call, main_function, matching_bindings, rewrite


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


def fuse_rope(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits, count = {}, 0
    for b, var2val in matching_bindings(func, _pattern()):
        first, second = (var2val[a] for a in b.value.args)
        x, rotated = first.args[0], second.args[0]
        source = _rotate_half_of(rotated, var2val)
        if source is None or not source.same_as(x):
            continue
        positions = func.params[1]  # main is (input_ids, positions, ...) as traced
        edits[b.var] = llmc_call("rope", [x, positions], b.var.ty)
        count += 1
    return rewrite(mod, edits, pass_name="fuse_rope", count=count)
