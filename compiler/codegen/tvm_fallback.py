"""The fallback for ops that no kernel template covers: TVM's own TIR codegen, emitted as C.

`legalize_call` turns one Relax call of the fused graph into a TIR PrimFunc (relax.transform.LegalizeOps,
TVM's default lowering of every Relax op). `c_source` compiles those PrimFuncs with TVM's C backend
(target "c"). The generated functions use the TVM FFI calling convention: one array of TVMFFIAny holding
DLTensor pointers. The `tvm_call` template wraps each one behind a plain pointer signature, and
templates/cpu/tvm_backend.cc defines the three TVM runtime functions the C code calls. So the built
module still needs no TVM at run time; TVM's headers are needed only where the module is built (compile).

The fallback is correct, not fast: the code is TVM's unscheduled loop nest, single-threaded. It exists
so that a graph with an op the passes did not fuse still compiles and runs exactly; `llmc inspect` names
the ops that took it.
"""

from __future__ import annotations

import tvm
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
        raise CompileError(f"TVM cannot lower `{op}` to one TIR function ({len(tir_calls)} found)",
                           "this op needs a kernel template")  # fmt: skip
    callee, args = tir_calls[0].args[0], tir_calls[0].args[1]
    takes = list(args.fields)
    if (
        len(tir_calls[0].args) > 2
        or len(takes) != len(fresh)
        or not all(a.same_as(f) for a, f in zip(takes, fresh, strict=True))
    ):
        raise CompileError(f"TVM's lowering of `{op}` takes arguments other than its input tensors",
                           "this op needs a kernel template")  # fmt: skip
    return mod[callee]


def c_source(funcs: dict[str, tirx.PrimFunc]) -> str:
    """C for every PrimFunc, each exported as `__tvm_ffi_<name>`."""
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, target="c").mod.inspect_source()


def include_dirs() -> list[str]:
    """TVM's and tvm-ffi's C headers (with dlpack), which the generated C includes."""
    import tvm_ffi.libinfo

    dirs = [*_as_list(tvm.libinfo.find_include_path()), *_as_list(tvm_ffi.libinfo.find_include_path()),
            *_as_list(tvm_ffi.libinfo.find_dlpack_include_path())]  # fmt: skip
    return list(dict.fromkeys(dirs))


def _as_list(x) -> list[str]:
    return [x] if isinstance(x, str) else list(x)
