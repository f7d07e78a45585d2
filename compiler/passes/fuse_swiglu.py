"""fuse_swiglu: silu(gate(x)) * up(x) becomes `llmc.silu_mul(gate_up(x))`, gate and up merged.

Matches the traced SwiGLU, `silu(g) * u` (silu as one op, or spelled `g * sigmoid(g)`) with g and u
Linears of the same input, and rewrites
it to one GEMM over the concatenated [gate; up] weights followed by `llmc.silu_mul`, which reads the
[rows, 2 * inter] result and writes [rows, inter].

Needs no other pass's ops; the pipeline runs it after merge_qkv, before select_logits_rows. Not covered:
GeGLU / other activations (the frontend rejects hidden_act other than silu).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .common import Linear, llmc_call, main_function, matching_bindings, merged_linear, rewrite, source_of


def _pattern():
    gate = wildcard()
    silu = is_op("relax.nn.silu")(gate) | is_op("relax.multiply")(gate, is_op("relax.sigmoid")(gate))
    return is_op("relax.multiply")(silu, wildcard())


def fuse_swiglu(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits, count = {}, 0
    for b, var2val in matching_bindings(func, _pattern()):
        silu, up_var = b.value.args
        gate_var = var2val[silu].args[0]
        gate, up = (
            Linear.match(source_of(gate_var, var2val), var2val),
            Linear.match(source_of(up_var, var2val), var2val),
        )
        if gate is None or up is None or (gate.bias is None) != (up.bias is None):
            continue
        if not source_of(gate.x, var2val).same_as(source_of(up.x, var2val)):
            continue
        gate_up = merged_linear(gate.x, [gate, up])
        rows = gate.x.ty.shape.values[0]
        out = llmc_call("silu_mul", [gate_up], relax.TensorType([rows, b.var.ty.shape.values[-1]], "float32"))
        edits[b.var] = relax.op.reshape(out, b.var.ty.shape)
        count += 1
    return rewrite(mod, edits, pass_name="fuse_swiglu", count=count)
