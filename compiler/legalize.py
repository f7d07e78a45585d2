"""One Relax call of the fused graph as a TIR PrimFunc: TVM's default lowering of the op
(relax.transform.LegalizeOps), for the ops no kernel template covers. Lowering launches it as `tvm_call`, and
compiler/codegen/tvm_fallback.py compiles it to C.
"""

from __future__ import annotations

from tvm import relax, tirx

from llmc.errors import CompileError


def legalize_call(call: relax.Call, params: list[relax.Var]) -> tirx.PrimFunc:
    """The PrimFunc computing `call` (whose tensor arguments are `params`), with params then the output."""
    bb = relax.BlockBuilder()
    fresh = [relax.Var(p.name, p.ty) for p in params]
    remap = dict(zip(params, fresh, strict=True))

    def substitute(arg):
        if isinstance(arg, relax.Var):
            return remap[arg]
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([substitute(f) for f in arg.fields])
        return arg

    with bb.function("main", fresh):
        out = bb.emit(relax.Call(call.op, [substitute(a) for a in call.args], call.attrs, call.ty_args))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    op = call.op.name if hasattr(call.op, "name") else str(call.op)
    tir_calls = [
        b.value
        for blk in mod["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.call_tir"
    ]
    if len(tir_calls) != 1:
        raise CompileError(
            f"TVM cannot lower `{op}` to one TIR function ({len(tir_calls)} found)", "this op needs a kernel template"
        )
    callee, args = tir_calls[0].args[0], tir_calls[0].args[1]
    takes = list(args.fields)
    if (
        len(tir_calls[0].args) > 2
        or len(takes) != len(fresh)
        or not all(a.same_as(f) for a, f in zip(takes, fresh, strict=True))
    ):
        raise CompileError(
            f"TVM's lowering of `{op}` takes arguments other than its input tensors", "this op needs a kernel template"
        )
    return mod[callee]
