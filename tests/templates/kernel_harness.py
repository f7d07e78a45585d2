"""The calling side shared by the CPU and CUDA kernel test harnesses (tests/templates/{cpu,cuda}/conftest.py).

kernels_source(target, specs) renders every distinct (op, params) of `specs` after the target's header, each
with an `extern "C"` trampoline `test_<kernel_id>` taking the contract signature: on the CPU it calls the
kernel, on CUDA the host launcher with the default stream, returning cudaGetLastError(). A Kernel wraps a
loaded trampoline and is called with numpy arrays / ints / None in contract order; dtypes and contiguity are
checked. Under the CUDA simulator device memory is host memory, so both targets take the same numpy arrays.
"""

from __future__ import annotations

import ctypes

import numpy as np

from llmc.compiler.codegen.render import kernel_id, render_kernel

# docs/contracts.md, "Kernel templates": (argument, kind) per op; the CUDA launcher takes a cudaStream_t after
# them. W* is float32 or bf16 (uint16 bits).
SIGNATURES = {
    "embedding": [("ids", "i32*"), ("T", "int"), ("table", "W*"), ("out", "f32*")],
    "rmsnorm": [("x", "f32*"), ("residual_in", "f32*"), ("residual_out", "f32*"), ("w", "W*"), ("y", "f32*"),
                ("T", "int")],
    "gemm": [("x", "f32*"), ("w", "W*"), ("bias", "W*"), ("y", "f32*"), ("T", "int")],
    "rope": [("x", "f32*"), ("row_stride", "int"), ("positions", "i32*"), ("T", "int")],
    "paged_attention": [("q", "f32*"), ("k", "f32*"), ("v", "f32*"), ("row_stride", "int"), ("k_cache", "f32*"),
                        ("v_cache", "f32*"), ("slot_mapping", "i64*"), ("query_start_loc", "i32*"),
                        ("seq_lens", "i32*"), ("block_tables", "i32*"), ("max_blocks", "int"), ("B", "int"),
                        ("out", "f32*")],
    "silu_mul": [("gate_up", "f32*"), ("out", "f32*"), ("T", "int")],
    "gather_rows": [("x", "f32*"), ("rows", "i32*"), ("n", "int"), ("out", "f32*")],
}
_C_TYPE = {"f32*": "float*", "i32*": "int32_t*", "i64*": "int64_t*", "int": "int"}
_NP_TYPE = {"f32*": np.float32, "i32*": np.int32, "i64*": np.int64}
W_TYPES = {"f32": ("float*", np.float32), "bf16": ("uint16_t*", np.uint16)}
_ROW_STRIDED = {"q", "k", "v"}  # may be column slices of a fused [T, row_stride] qkv buffer
HEADERS = {"cpu": "common.h", "cuda": "llmc_kernels.cuh"}


class Kernel:
    """A built CPU kernel, callable with numpy arrays in contract order."""

    restype = None  # what the trampoline returns

    def __init__(self, fn, op: str, params: dict):
        self.fn, self.op, self.params = fn, op, params
        self.sig = SIGNATURES[op]
        fn.restype = self.restype
        fn.argtypes = [ctypes.c_int if kind == "int" else ctypes.c_void_p for _, kind in self.sig]

    def __call__(self, *args):
        assert len(args) == len(self.sig), f"{self.op} takes {[a for a, _ in self.sig]}"
        c_args = []
        for (name, kind), a in zip(self.sig, args):
            if kind == "int":
                c_args.append(int(a))
                continue
            if a is None:
                c_args.append(None)
                continue
            want = W_TYPES[self.params["wdtype"]][1] if kind == "W*" else _NP_TYPE[kind]
            assert isinstance(a, np.ndarray) and a.dtype == want, f"{self.op}.{name}: want {np.dtype(want)}"
            if name in _ROW_STRIDED:
                assert a.ndim == 2 and a.strides[1] == a.itemsize, f"{self.op}.{name}: rows must be dense"
            else:
                assert a.flags.c_contiguous, f"{self.op}.{name} must be C-contiguous"
            c_args.append(a.ctypes.data)
        return self.fn(*c_args)


class CudaKernel(Kernel):
    """A built CUDA kernel (simulator build): its trampoline returns the launch's cudaError, which must be 0."""

    restype = ctypes.c_int

    def __call__(self, *args):
        err = super().__call__(*args)
        assert err == 0, f"{self.op}: the launch failed with cudaError {err}"


def trampoline(target: str, op: str, params: dict, kid: str) -> str:
    """`extern "C"` test_<kid> with the contract signature, calling kernel (CPU) or launcher (CUDA) kid."""
    args = []
    for name, kind in SIGNATURES[op]:
        ctype = W_TYPES[params["wdtype"]][0] if kind == "W*" else _C_TYPE[kind]
        args.append(f"{ctype} {name}")
    names = ", ".join(name for name, _ in SIGNATURES[op])
    if target == "cpu":
        return f'extern "C" void test_{kid}({", ".join(args)}) {{ {kid}({names}); }}\n'
    return (f'extern "C" int test_{kid}({", ".join(args)}) {{\n'
            f"  {kid}({names}, (cudaStream_t)0);\n  return (int)cudaGetLastError();\n}}\n")


def kernels_source(target: str, specs) -> tuple[str, dict[str, tuple[str, dict]]]:
    """One translation unit with every distinct kernel of `specs` and its trampoline, after the target's header;
    also {kernel_id: (op, params)}."""
    parts = [f'#include "{HEADERS[target]}"\n']
    seen: dict[str, tuple[str, dict]] = {}
    for op, params in specs:
        kid = kernel_id(target, op, params)
        if kid in seen:
            continue
        seen[kid] = (op, params)
        parts.append(render_kernel(target, op, name=kid, **params))
        parts.append(trampoline(target, op, params, kid))
    return "".join(parts), seen
