"""merge_qkv: the q, k and v projections of each attention become one GEMM.

For every `llmc.paged_attention` whose q, k and v are Linears of the same input, the three weights (and
biases, Qwen2) are concatenated along the output dim and q, k, v become column slices of one
[T, (H + 2 * KV) * D] result (`R.split`), which the attention kernel reads with a row stride. The weight
concat is evaluated when the weights are packed, never at run time.

Runs after fuse_attention. Not covered: projections with different inputs (cross-attention).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .common import Linear, bindings, llmc_args, llmc_op_name, main_function, merged_linear, rewrite, source_of


def merge_qkv(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    edits, count = {}, 0
    for b in bindings(func):
        if llmc_op_name(b.value) != "paged_attention":
            continue
        args = llmc_args(b.value)
        outs = [args["q"], args["k"], args["v"]]
        parts = [Linear.match(v, var2val) for v in outs]
        if any(p is None for p in parts):
            continue
        sources = [source_of(p.x, var2val) for p in parts]
        if not all(s.same_as(sources[0]) for s in sources) or len({p.bias is None for p in parts}) != 1:
            continue
        widths = [int(v.ty.shape.values[-1]) for v in outs]
        split = relax.op.split(merged_linear(parts[0].x, parts), [widths[0], widths[0] + widths[1]], axis=-1)
        for i, var in enumerate(outs):
            edits[var] = relax.TupleGetItem(split, i)
        count += 1
    return rewrite(mod, edits, pass_name="merge_qkv", count=count)
