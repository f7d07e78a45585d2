"""fuse_swiglu: act(gate(x)) * up(x) becomes `llmc.silu_mul(gate_up(x))` (or its sibling
`llmc.gelu_tanh_mul`), gate and up merged.

Matches the traced SwiGLU, `silu(g) * u` (silu as one op, or spelled `g * sigmoid(g)`), and Gemma's GeGLU,
`gelu_tanh(g) * u`, with g and u Linears of the same input, and rewrites it to one GEMM over the concatenated
[gate; up] weights followed by the op, which reads the [rows, 2 * inter] result and writes [rows, inter].

Needs no other pass's ops; the pipeline runs it after merge_qkv, before select_logits_rows. Not covered:
other activations (the frontend rejects them).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from .common import Linear, calls, llmc_call, main_function, matching_bindings, merged_linear, rewrite, source_of


def _pattern():
    gate = wildcard()
    silu = is_op("relax.nn.silu")(gate) | is_op("relax.multiply")(gate, is_op("relax.sigmoid")(gate))
    return is_op("relax.multiply")(silu | is_op("relax.nn.gelu_tanh")(gate), wildcard())


def fuse_swiglu(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    edits, count = {}, 0
    for b, var2val in matching_bindings(func, _pattern()):
        act, up_var = b.value.args
        gate_var = var2val[act].args[0]
        op = "gelu_tanh_mul" if calls(var2val[act], "relax.nn.gelu_tanh") else "silu_mul"
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
        out = llmc_call(op, [gate_up], relax.TensorType([rows, b.var.ty.shape.values[-1]], "float32"))
        edits[b.var] = relax.op.reshape(out, b.var.ty.shape)
        count += 1
    return rewrite(mod, edits, pass_name="fuse_swiglu", count=count)
