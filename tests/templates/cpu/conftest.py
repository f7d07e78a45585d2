"""Build CPU kernel templates into a test library and call them from numpy.

`cpu_kernels(specs)` renders every (op, params) in `specs` with render_kernel, puts them after
common.h in one translation unit with an `extern "C"` trampoline each, builds that once with
build_shared_library (cached), and returns {kernel_id: Kernel}. A Kernel is called with numpy
arrays / ints / None in the order of the contract signature; dtypes and contiguity are checked.
Each test module builds its whole grid in one g++ call, so the suite compiles ~7 times, not once
per parameter combination.

LLMC_TEST_MARCH=haswell (AVX2) or =x86-64 (portable fallback) builds the kernels for that ISA
instead of -march=native, to test common.h's other SIMD paths on an AVX-512 host.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
from llmc.compiler.codegen.render import kernel_id, render_kernel, template_file

# docs/contracts.md, "Kernel templates": (argument, kind) per op. W* is float32 or bf16 (uint16).
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
_W = {"f32": ("float*", np.float32), "bf16": ("uint16_t*", np.uint16)}
_ROW_STRIDED = {"q", "k", "v"}  # may be column slices of a fused [T, row_stride] qkv buffer


class Kernel:
    """A built kernel, callable with numpy arrays in contract order."""

    def __init__(self, fn, op: str, params: dict):
        self.fn, self.op, self.params = fn, op, params
        self.sig = SIGNATURES[op]
        fn.restype = None
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
            want = _W[self.params["wdtype"]][1] if kind == "W*" else _NP_TYPE[kind]
            assert isinstance(a, np.ndarray) and a.dtype == want, f"{self.op}.{name}: want {np.dtype(want)}"
            if name in _ROW_STRIDED:
                assert a.ndim == 2 and a.strides[1] == a.itemsize, f"{self.op}.{name}: rows must be dense"
            else:
                assert a.flags.c_contiguous, f"{self.op}.{name} must be C-contiguous"
            c_args.append(a.ctypes.data)
        self.fn(*c_args)


def _trampoline(op: str, params: dict, kid: str) -> str:
    args = []
    for name, kind in SIGNATURES[op]:
        ctype = _W[params["wdtype"]][0] if kind == "W*" else _C_TYPE[kind]
        args.append(f"{ctype} {name}")
    names = ", ".join(name for name, _ in SIGNATURES[op])
    return f'extern "C" void test_{kid}({", ".join(args)}) {{ {kid}({names}); }}\n'


_built: dict[tuple, dict[str, Kernel]] = {}
_MARCH = os.environ.get("LLMC_TEST_MARCH")
FLAGS = [f"-march={_MARCH}" if f == "-march=native" and _MARCH else f for f in CPU_FLAGS]


def build_kernels(specs) -> dict[str, Kernel]:
    key = tuple((op, repr(sorted(p.items()))) for op, p in specs)
    if key in _built:
        return _built[key]
    parts = ['#include "common.h"\n']
    seen = {}
    for op, params in specs:
        kid = kernel_id("cpu", op, params)
        if kid in seen:
            continue
        seen[kid] = (op, params)
        parts.append(render_kernel("cpu", op, name=kid, **params))
        parts.append(_trampoline(op, params, kid))
    lib = ctypes.CDLL(str(build_shared_library({"common.h": template_file("cpu", "common.h"),
                                                "kernels.cc": "".join(parts)}, flags=FLAGS)))
    _built[key] = {kid: Kernel(getattr(lib, f"test_{kid}"), op, p) for kid, (op, p) in seen.items()}
    return _built[key]


@pytest.fixture(scope="session")
def cpu_kernels():
    """build_kernels([(op, params), ...]) -> {kernel_id("cpu", op, params): Kernel}."""
    return build_kernels


def _to_bf16(a):
    """Round float32 to bf16 (nearest even). Returns (uint16 bits, the float32 values they hold)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="session")
def bf16():
    """bf16(float32 array) -> (uint16 bits, float32 values)."""
    return _to_bf16


@pytest.fixture(scope="session")
def weights(bf16):
    """weights(float32 array, wdtype) -> (array to pass the kernel, float32 values it holds)."""

    def make(a, wdtype):
        a = np.ascontiguousarray(a, dtype=np.float32)
        return (a, a) if wdtype == "f32" else bf16(a)

    return make


@pytest.fixture(scope="session")
def omp_threads():
    """omp_threads(n): set the OpenMP thread count of the kernels (libgomp is loaded by them)."""
    gomp = ctypes.CDLL("libgomp.so.1")
    gomp.omp_get_max_threads.restype = ctypes.c_int
    before = gomp.omp_get_max_threads()
    yield lambda n: gomp.omp_set_num_threads(ctypes.c_int(n))
    gomp.omp_set_num_threads(ctypes.c_int(before))
