"""The fallback for ops that no kernel template covers: TVM's own TIR codegen, emitted as C.

Lowering turns each such Relax call into a TIR PrimFunc (compiler/legalize.py). `c_source` compiles those PrimFuncs with TVM's C backend
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
from tvm import tirx


def c_source(funcs: dict[str, tirx.PrimFunc]) -> str:
    """C for every PrimFunc, each exported as `__tvm_ffi_<name>`."""
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    return tvm.compile(mod, target="c").mod.inspect_source()


def include_dirs() -> list[str]:
    """TVM's and tvm-ffi's C headers (with dlpack), which the generated C includes."""
    import tvm_ffi.libinfo

    dirs = [
        *_as_list(tvm.libinfo.find_include_path()),
        *_as_list(tvm_ffi.libinfo.find_include_path()),
        *_as_list(tvm_ffi.libinfo.find_dlpack_include_path()),
    ]
    return list(dict.fromkeys(dirs))


def _as_list(x) -> list[str]:
    return [x] if isinstance(x, str) else list(x)
