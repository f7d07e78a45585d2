"""select_logits_rows: only the rows in logits_indices reach the final norm and the lm_head.

A step computes hidden states for every token, but the runtime wants logits at a few rows: one per
sequence when it samples (its last token), K+1 rows of a sequence under speculative verification, every
row when it scores a prompt. This pass adds the parameter `logits_indices: [N] int32` (any N token rows,
in the order the caller wants them) and gathers those rows before the final (add +) RMSNorm, so the norm
and the vocab-sized GEMM run on N rows, not T: for a 512-token prefill sampled once that is 512x less
lm_head work. main then returns logits [N, vocab], as the C ABI says.

Logits divided (or multiplied) by a scalar constant (Granite's logits_scaling) are linear in the final
norm's output, so the scale moves onto that norm's weight (`weight * (1 / c)`, evaluated when lowering
packs it) and the lm_head stays a plain GEMM.

Runs after fuse_rmsnorm (it moves the fused final norm). N is a symbolic dimension of its own, so
lowering can tell the logits rows from token rows.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .common import Linear, calls, llmc_args, llmc_call, llmc_op_name, main_function, rewrite, scalar, source_of


def _output_linear(func: relax.Function, var2val):
    """(scale, softcap, the lm_head Linear) whose result main returns (through reshapes, a leading-1 squeeze,
    scalar multiplies and divides, whose product is the scale, and the llmc.softcap call, if any, that main's
    result is)."""
    out = func.body.body
    expr, scale, softcap = out, 1.0, None
    while True:
        value = var2val.get(expr)
        if llmc_op_name(value) == "softcap" and softcap is None and scale == 1.0:  # a scale before it: the norm's
            softcap, expr = llmc_args(value)["cap"], llmc_args(value)["x"]
            continue
        if calls(value, "relax.multiply", "relax.divide") and scalar(value.args[1]) not in (None, 0.0):
            c = scalar(value.args[1])
            scale *= c if calls(value, "relax.multiply") else 1.0 / c
            expr = value.args[0]
            continue
        if isinstance(value, relax.Var) or (
            isinstance(value, relax.Call)
            and value.op.name in ("relax.reshape", "relax.take", "relax.squeeze")
            and (value.op.name != "relax.take" or int(value.args[0].ty.shape.values[0]) == 1)
        ):
            expr = value if isinstance(value, relax.Var) else value.args[0]
            continue
        return scale, softcap, Linear.match(expr, var2val)


def select_logits_rows(mod: tvm.IRModule) -> tvm.IRModule:
    func = main_function(mod)
    var2val = relax.analysis.get_var2val(func)
    scale, softcap, head = _output_linear(func, var2val)
    if head is None:
        return rewrite(mod, {}, pass_name="select_logits_rows", count=0)
    normed = source_of(head.x, var2val)
    value = var2val.get(normed)
    norm_call = value.tuple_value if isinstance(value, relax.TupleGetItem) else value
    norm_call = var2val.get(norm_call, norm_call)
    op = llmc_op_name(norm_call)
    if op not in ("rms_norm", "add_rms_norm"):
        return rewrite(mod, {}, pass_name="select_logits_rows", count=0)

    num_logits = tvm.tirx.Var("N", "int64")
    indices = relax.Var("logits_indices", relax.TensorType([num_logits], "int32"))
    args = llmc_args(norm_call)
    weight = args["weight"] if scale == 1.0 else relax.op.multiply(args["weight"], relax.const(scale, "float32"))
    hidden = normed.ty.shape.values[-1]
    row_axis = len(normed.ty.shape.values) - 2

    def gather(x):
        return relax.op.take(x, indices, axis=row_axis)

    if op == "add_rms_norm":
        gathered_ty = relax.TensorType([*normed.ty.shape.values[:-2], num_logits, hidden], "float32")
        call = llmc_call(
            "add_rms_norm",
            [
                gather(args["x"]),
                gather(args["residual"]),
                weight,
                args["eps"],
                args["residual_scale"],
                args["residual_weight"],
            ],
            relax.TupleType([gathered_ty, gathered_ty]),
        )
        rows = relax.TupleGetItem(call, 1)
    else:
        rows = llmc_call(
            "rms_norm",
            [gather(args["x"]), weight, args["eps"]],
            relax.TensorType([*normed.ty.shape.values[:-2], num_logits, hidden], "float32"),
        )
    logits = relax.op.matmul(relax.op.reshape(rows, [num_logits, hidden]), relax.op.permute_dims(head.weight, [1, 0]))
    if softcap is not None:
        vocab = head.weight.ty.shape.values[0]
        logits = llmc_call("softcap", [logits, softcap], relax.TensorType([num_logits, vocab], "float32"))
    out_var = func.body.body
    return rewrite(
        mod,
        {out_var: logits},
        pass_name="select_logits_rows",
        count=1,
        params=[*func.params[:2], indices, *func.params[2:]],
    )
