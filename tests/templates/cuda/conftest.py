"""Build CUDA kernel templates for the simulator and call them from numpy.

`cuda_kernels(specs)` renders every (op, params) with render_kernel("cuda", ...), puts them after
llmc_kernels.cuh in one .cu with an `extern "C"` trampoline each (it calls the host launcher with the
default stream and returns cudaGetLastError()), builds that with build_simulated (g++ against llmc_sim.h,
cached) and returns {kernel_id: Kernel}. The first build also takes the SPECS of every collected test
module, so a whole run compiles the simulated kernels once. Under the simulator device memory is host memory,
so a Kernel is called with numpy arrays / ints / None in the order of the contract signature, exactly
like the CPU harness (tests/templates/cpu/conftest.py).

`sim_seed(n)` sets the simulator's scheduling seed (thread order between sync points).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import kernel_id, render_kernel

# docs/contracts.md, "Kernel templates" (+ argmax): (argument, kind) per op; the CUDA launcher takes a
# cudaStream_t after them. W* is float32, bf16 (uint16 bits) or f16.
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
    "argmax": [("logits", "f32*"), ("B", "int"), ("out", "i32*")],
}
_C_TYPE = {"f32*": "float*", "i32*": "int32_t*", "i64*": "int64_t*", "int": "int"}
_NP_TYPE = {"f32*": np.float32, "i32*": np.int32, "i64*": np.int64}
W_TYPES = {"f32": ("float*", np.float32), "bf16": ("uint16_t*", np.uint16), "f16": ("__half*", np.float16)}
_ROW_STRIDED = {"q", "k", "v"}  # may be column slices of a fused [T, row_stride] qkv buffer


class Kernel:
    """A built kernel, callable with numpy arrays in contract order."""

    def __init__(self, fn, op: str, params: dict):
        self.fn, self.op, self.params = fn, op, params
        self.sig = SIGNATURES[op]
        fn.restype = ctypes.c_int
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
        err = self.fn(*c_args)
        assert err == 0, f"{self.op}: the launch failed with cudaError {err}"


def trampoline(op: str, params: dict, kid: str) -> str:
    args = []
    for name, kind in SIGNATURES[op]:
        ctype = W_TYPES[params["wdtype"]][0] if kind == "W*" else _C_TYPE[kind]
        args.append(f"{ctype} {name}")
    names = ", ".join(name for name, _ in SIGNATURES[op])
    return (f'extern "C" int test_{kid}({", ".join(args)}) {{\n'
            f"  {kid}({names}, (cudaStream_t)0);\n  return (int)cudaGetLastError();\n}}\n")


def kernels_source(specs) -> tuple[str, dict[str, tuple[str, dict]]]:
    """One .cu with every distinct kernel of `specs` and its trampoline; also {kernel_id: (op, params)}."""
    parts = ['#include "llmc_kernels.cuh"\n']
    seen: dict[str, tuple[str, dict]] = {}
    for op, params in specs:
        kid = kernel_id("cuda", op, params)
        if kid in seen:
            continue
        seen[kid] = (op, params)
        parts.append(render_kernel("cuda", op, name=kid, **params))
        parts.append(trampoline(op, params, kid))
    return "".join(parts), seen


_kernels: dict[str, Kernel] = {}  # every kernel built so far, by kernel id
_collected: list[tuple[str, dict]] = []  # the SPECS of the test modules collected in this session
_libs: list[ctypes.CDLL] = []


def pytest_collection_finish(session):
    """Note every collected test module's SPECS, so the first build compiles them all in one g++ call."""
    here, seen = Path(__file__).parent, set()
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is None or mod.__name__ in seen or Path(mod.__file__).parent != here:
            continue
        seen.add(mod.__name__)
        _collected.extend(getattr(mod, "SPECS", []))


def set_seed(n: int) -> None:
    """The simulator's scheduling seed, in every simulator build loaded so far."""
    for lib in _libs:
        lib.llmc_sim_set_seed(ctypes.c_ulonglong(n))


@pytest.fixture(scope="session")
def cuda_kernels(tmp_path_factory):
    """cuda_kernels([(op, params), ...]) -> {kernel_id("cuda", op, params): Kernel} (simulator build).

    The first call builds its specs together with those of every collected module (one g++ run);
    later calls build only what is still missing.
    """
    out_dir = tmp_path_factory.mktemp("cuda-sim")

    def build(specs) -> dict[str, Kernel]:
        ids = [kernel_id("cuda", op, p) for op, p in specs]
        missing = [s for s in [*specs, *_collected] if kernel_id("cuda", *s) not in _kernels]
        if any(kid not in _kernels for kid in ids):
            source, seen = kernels_source(missing)
            so = simulator.build_simulated(source, out_dir / f"kernels{len(_libs)}.so")
            lib = ctypes.CDLL(str(so))
            lib.llmc_sim_set_seed.argtypes = [ctypes.c_ulonglong]
            lib.llmc_sim_set_seed(1)
            _libs.append(lib)
            _kernels.update({kid: Kernel(getattr(lib, f"test_{kid}"), op, p) for kid, (op, p) in seen.items()})
        return {kid: _kernels[kid] for kid in ids}

    return build


@pytest.fixture(scope="session")
def cuda_source():
    """kernels_source(specs) -> (.cu text with the kernels and trampolines, {kernel_id: (op, params)})."""
    return kernels_source


@pytest.fixture
def sim_seed():
    """sim_seed(n): set the scheduling seed; it goes back to 1 after the test."""
    yield set_seed
    set_seed(1)


# ---------------------------------------------------------------------------------------------------
# numbers

def to_bf16(a):
    """Round float32 to bf16 (nearest even). Returns (uint16 bits, the float32 values they hold)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def make_weights(a, wdtype):
    """(array to pass the kernel, float32 values it holds) for wdtype f32 | bf16 | f16."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if wdtype == "f32":
        return a, a
    if wdtype == "bf16":
        return to_bf16(a)
    h = a.astype(np.float16)
    return h, h.astype(np.float32)


@pytest.fixture(scope="session")
def weights():
    return make_weights
