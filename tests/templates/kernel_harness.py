"""Builds kernel templates into test libraries and calls them from numpy, on either target.

kernels_source(target, specs, units) renders every distinct (op, params) of `specs` after the target's header, split
into `units` translation units (the CPU's: one per core, compiled in parallel), each an `extern "C"` trampoline `test_<kernel_id>` taking the contract signature: on the CPU it calls the
kernel, on CUDA the host launcher with the default stream, returning cudaGetLastError(). A Kernel wraps a
loaded trampoline and is called with numpy arrays / ints / None in contract order; dtypes and contiguity are
checked. Under the CUDA simulator device memory is host memory, so both targets take the same numpy arrays.

A Harness per target (CpuHarness: g++ with the CPU target's flags; CudaHarness: g++ against the CUDA
simulator) builds specs into one library, cached by content, and hands out the Kernel of an (op, params).
Its schedules() are the ways the target may order a kernel's work (OpenMP thread counts; the simulator's
scheduling seeds, which shuffle threads and blocks), for tests that results do not depend on them.

LLMC_TEST_MARCH=haswell (AVX2) or =x86-64 (portable fallback, at -O1) builds the CPU kernels for that ISA instead of
-march=native, to test the CPU headers' other SIMD paths on an AVX-512 host.

LLMC_TEST_CUDA=gpu (benchmarks/gpu_check.py sets it) runs the CUDA cases on a real GPU instead (GpuHarness):
nvcc builds the same kernels and trampolines, and each call stages its arrays in device memory.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
from llmc.compiler.codegen.render import kernel_id, render_kernel, scale_ctype, target_headers, template_path
from llmc.errors import CompileError

# docs/contracts.md, "Kernel templates": (argument, kind) per op; the CUDA launcher takes a cudaStream_t after
# them. W* (weights, by wdtype), KV* (KV cache, by kv_dtype) and A* (activations, by adtype: CUDA's templates
# take it, the CPU's are float32) are float32 or bf16 (uint16 bits); S* (quantization scales and mins, by
# scale_bits) float32 or fp16 (passed as numpy float16, read as uint16 bits).
SIGNATURES = {
    "embedding": [("ids", "i32*"), ("T", "int"), ("table", "W*"), ("out", "A*")],
    "rmsnorm": [
        ("x", "A*"),
        ("residual_in", "A*"),
        ("residual_out", "A*"),
        ("w", "W*"),
        ("y", "A*"),
        ("T", "int"),
        ("residual_w", "W*"),
    ],
    "gemm": [("x", "A*"), ("w", "W*"), ("bias", "W*"), ("y", "A*"), ("T", "int")],
    "gemm_swiglu": [("x", "A*"), ("w", "W*"), ("bias", "W*"), ("y", "A*"), ("T", "int")],
    "rope": [("x", "A*"), ("row_stride", "int"), ("positions", "i32*"), ("T", "int"), ("norm_w", "f32*")],
    "paged_attention": [
        ("q", "A*"),
        ("k", "A*"),
        ("v", "A*"),
        ("row_stride", "int"),
        ("k_cache", "KV*"),
        ("v_cache", "KV*"),
        ("slot_mapping", "i64*"),
        ("query_start_loc", "i32*"),
        ("seq_lens", "i32*"),
        ("block_tables", "i32*"),
        ("max_blocks", "int"),
        ("B", "int"),
        ("T", "int"),
        ("out", "A*"),
    ],
    "silu_mul": [("gate_up", "A*"), ("out", "A*"), ("T", "int")],
    "gather_rows": [("x", "A*"), ("rows", "i32*"), ("n", "int"), ("out", "A*")],
    "qembedding": [("ids", "i32*"), ("T", "int"), ("qweight", "u8*"), ("scales", "S*"), ("mins", "S*"), ("out", "A*")],
    "moe_route": [("x", "A*"), ("router", "W*"), ("route", "A*"), ("T", "int")],
    "moe_gemm": [("x", "A*"), ("route", "A*"), ("w", "W*"), ("out", "A*"), ("T", "int")],
    "moe_qgemm": [
        ("x", "A*"),
        ("route", "A*"),
        ("qweight", "u8*"),
        ("scales", "S*"),
        ("mins", "S*"),
        ("out", "A*"),
        ("T", "int"),
    ],
    "moe_combine": [("y", "A*"), ("route", "A*"), ("out", "A*"), ("T", "int")],
    "qgemm": [
        ("x", "A*"),
        ("qweight", "u8*"),
        ("scales", "S*"),
        ("mins", "S*"),
        ("bias", "f32*"),
        ("y", "A*"),
        ("T", "int"),
    ],
}
_C_TYPE = {"f32*": "float*", "u8*": "uint8_t*", "i32*": "int32_t*", "i64*": "int64_t*", "int": "int"}
_NP_TYPE = {"f32*": np.float32, "u8*": np.uint8, "i32*": np.int32, "i64*": np.int64}
W_TYPES = {"f32": ("float*", np.float32), "bf16": ("uint16_t*", np.uint16)}
# an int8 or fp8 (e4m3 bits) cache: its blocks' bytes (values and scales)
KV_TYPES = {**W_TYPES, "i8": ("int8_t*", np.int8), "fp8": ("uint8_t*", np.uint8)}
_S_DTYPES = {32: np.float32, 16: np.float16, 8: np.uint8}  # scales by scale_bits (8: K-quant record bytes)
# kind -> (the kernel parameter that picks the element type, its (C type, numpy dtype) per value); and S*, the
# scales, whose C type render.scale_ctype gives
_ELEMENT = {
    "W*": ("wdtype", W_TYPES),
    "KV*": ("kv_dtype", KV_TYPES),
    "A*": ("adtype", W_TYPES),
}
_ELEMENTS = {*_ELEMENT, "S*"}
_ROW_STRIDED = {"q", "k", "v"}  # may be column slices of a fused [T, row_stride] qkv buffer
HEADERS = {"cpu": "common.h", "cuda": "llmc_kernels.cuh"}


def _element(kind: str, params: dict) -> tuple[str, type]:
    if kind == "S*":
        return (
            f"{scale_ctype(params['scale_bits'], params['asymmetric'], params.get('codebook', False), params['group_size'])}*",
            _S_DTYPES[params["scale_bits"]],
        )
    param, types = _ELEMENT[kind]
    return types[params.get(param, "f32") if kind == "A*" else params[param]]


def spec_id(spec) -> str:
    """`gemm_n53_k37_f32_bias0`: the kernel id of (op, params) without a target, for test ids."""
    return kernel_id("", *spec).lstrip("_")


class Kernel:
    """A built CPU kernel, callable with numpy arrays in contract order."""

    restype = None  # what the trampoline returns

    def __init__(self, fn, op: str, params: dict):
        self.fn, self.op, self.params = fn, op, params
        self.sig = SIGNATURES[op]
        fn.restype = self.restype
        fn.argtypes = [ctypes.c_int if kind == "int" else ctypes.c_void_p for _, kind in self.sig]

    def __call__(self, *args):
        return self.fn(*self._c_args(args))

    def _address(self, a: np.ndarray) -> int:
        return a.ctypes.data

    def _c_args(self, args) -> list:
        assert len(args) == len(self.sig), f"{self.op} takes {[a for a, _ in self.sig]}"
        c_args = []
        for (name, kind), a in zip(self.sig, args, strict=True):
            if kind == "int":
                c_args.append(int(a))
                continue
            if a is None:
                c_args.append(None)
                continue
            want = _element(kind, self.params)[1] if kind in _ELEMENTS else _NP_TYPE[kind]
            assert isinstance(a, np.ndarray) and a.dtype == want, f"{self.op}.{name}: want {np.dtype(want)}"
            if name in _ROW_STRIDED:
                assert a.ndim == 2 and a.strides[1] == a.itemsize, f"{self.op}.{name}: rows must be dense"
            else:
                assert a.flags.c_contiguous, f"{self.op}.{name} must be C-contiguous"
            c_args.append(self._address(a))
        return c_args


class CudaKernel(Kernel):
    """A built CUDA kernel (simulator build): its trampoline returns the launch's cudaError, which must be 0."""

    restype = ctypes.c_int

    def __call__(self, *args):
        err = super().__call__(*args)
        assert err == 0, f"{self.op}: the launch failed with cudaError {err}"


class StagedKernel(CudaKernel):
    """A CUDA kernel whose arrays live in other memory than numpy's (a GPU's): a call stages each array's whole
    allocation there (a column slice of a fused qkv buffer keeps its row stride, and views of one buffer stay
    one buffer), launches on the staged copies, synchronizes, and copies every writeable one back."""

    def __init__(self, fn, op: str, params: dict, memory):
        super().__init__(fn, op, params)
        self.memory = memory
        self._staged: dict[int, tuple[np.ndarray, object]] = {}

    def __call__(self, *args):
        self._staged = {}
        super().__call__(*args)
        self.memory.synchronize()
        for root, copy in self._staged.values():
            if root.flags.writeable:
                self.memory.get(copy, root)

    def _address(self, a: np.ndarray) -> int:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        assert root.flags.c_contiguous, f"{self.op}: an argument views a non-contiguous allocation"
        if id(root) not in self._staged:
            self._staged[id(root)] = (root, self.memory.put(root))
        return self.memory.address(self._staged[id(root)][1]) + (a.ctypes.data - root.ctypes.data)


class HostStaging:
    """Staging into other host buffers: under the simulator, a test of StagedKernel's bookkeeping."""

    def put(self, root: np.ndarray) -> np.ndarray:
        return root.copy(order="C")

    def address(self, copy: np.ndarray) -> int:
        return copy.ctypes.data

    def get(self, copy: np.ndarray, root: np.ndarray) -> None:
        root[...] = copy

    def synchronize(self) -> None:
        pass


class TorchCudaMemory:
    """The GPU's memory, through torch (byte tensors, whatever the numpy dtype)."""

    def __init__(self):
        import torch

        assert torch.cuda.is_available(), "LLMC_TEST_CUDA=gpu needs torch with CUDA and a GPU"
        self.torch = torch

    @staticmethod
    def _bytes(root: np.ndarray) -> np.ndarray:
        return root.reshape(-1).view(np.uint8)

    def put(self, root: np.ndarray):
        return self.torch.from_numpy(self._bytes(root).copy()).to("cuda")

    def address(self, tensor) -> int:
        return tensor.data_ptr()

    def get(self, tensor, root: np.ndarray) -> None:
        self._bytes(root)[...] = tensor.cpu().numpy()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()


def trampoline(target: str, op: str, params: dict, kid: str) -> str:
    """`extern "C"` test_<kid> with the contract signature, calling kernel (CPU) or launcher (CUDA) kid."""
    args = []
    for name, kind in SIGNATURES[op]:
        ctype = _element(kind, params)[0] if kind in _ELEMENTS else _C_TYPE[kind]
        args.append(f"{ctype} {name}")
    names = ", ".join(name for name, _ in SIGNATURES[op])
    if target == "cpu":
        return f'extern "C" void test_{kid}({", ".join(args)}) {{ {kid}({names}); }}\n'
    return (
        f'extern "C" int test_{kid}({", ".join(args)}) {{\n'
        f"  {kid}({names}, (cudaStream_t)0);\n  return (int)cudaGetLastError();\n}}\n"
    )


def kernels_source(target: str, specs, units: int = 1) -> tuple[list[str], dict[str, tuple[str, dict]]]:
    """`units` translation units (fewer if there are fewer kernels) that hold every distinct kernel of `specs` and
    its trampoline between them, each after the target's header; also {kernel_id: (op, params)}."""
    seen: dict[str, tuple[str, dict]] = {}
    for op, params in specs:
        seen.setdefault(kernel_id(target, op, params), (op, params))
    parts: list[list[str]] = [[f'#include "{HEADERS[target]}"\n'] for _ in range(min(units, len(seen)) or 1)]
    for i, (kid, (op, params)) in enumerate(seen.items()):
        parts[i % len(parts)] += [render_kernel(target, op, name=kid, **params), trampoline(target, op, params, kid)]
    return ["".join(p) for p in parts], seen


class Harness:
    """The kernels of one target: build(specs) compiles what is missing, harness(op, params) is its Kernel.

    `pending` holds specs to compile along with the next build (the collected test modules' SPECS), so a run
    builds one library per target, not one per module. A target class adds _load(sources) -> CDLL,
    schedules() (functions that each put the target in one schedule, the default first) and reset_schedule().
    """

    target: str
    kernel_class = Kernel
    units = 1  # translation units a build splits its kernels into

    def __init__(self):
        self._kernels: dict[str, Kernel] = {}
        self.pending: list[tuple[str, dict]] = []

    def spec(self, op: str, params: dict) -> tuple[str, dict] | None:
        """(op, params) as this target's templates take them; None where the target has no such kernel."""
        return op, params

    def build(self, specs) -> None:
        specs = [t for s in specs if (t := self.spec(*s)) is not None]
        if all(kernel_id(self.target, *s) in self._kernels for s in specs):
            return
        pending = [t for s in self.pending if (t := self.spec(*s)) is not None]
        missing = [s for s in [*specs, *pending] if kernel_id(self.target, *s) not in self._kernels]
        sources, seen = kernels_source(self.target, missing, self.units)
        lib = self._load(sources)
        self._kernels.update(
            {kid: self.kernel_class(getattr(lib, f"test_{kid}"), op, p) for kid, (op, p) in seen.items()}
        )

    def __call__(self, op: str, params: dict) -> Kernel:
        return self._kernels[kernel_id(self.target, *self.spec(op, params))]


class CpuHarness(Harness):
    target = "cpu"
    units = os.cpu_count() or 1  # build_shared_library compiles them in parallel: the build is most of a run

    def spec(self, op: str, params: dict) -> tuple[str, dict] | None:
        """The CPU templates take no adtype: their activations are float32, and bf16 ones are CUDA's alone; so is
        an fp8 KV cache (llmc/dtypes.py FP8_KV_MIN_COMPUTE_CAPABILITY)."""
        if params.get("adtype", "f32") != "f32" or params.get("kv_dtype") == "fp8":
            return None
        return op, {k: v for k, v in params.items() if k != "adtype"}

    def __init__(self):
        super().__init__()
        march = os.environ.get("LLMC_TEST_MARCH")
        self.flags = [f"-march={march}" if f == "-march=native" and march else f for f in CPU_FLAGS]
        if march == "x86-64":
            # The portable path is for CPUs without AVX2: these tests check its numbers, which no -O level changes
            # (no -ffast-math, no FMA to contract into), and g++ builds it at -O1 5.7x faster than at -O3 (12 qgemm
            # kernels: 11 s against 63 s), most of CI's x86-64 step
            self.flags = ["-O1" if f == "-O3" else f for f in self.flags]
        self._gomp = None

    def _load(self, sources: list[str]) -> ctypes.CDLL:
        files = {**target_headers("cpu"), **{f"kernels{i}.cc": s for i, s in enumerate(sources)}}
        return ctypes.CDLL(str(build_shared_library(files, flags=self.flags)))

    def _omp(self) -> ctypes.CDLL:  # libgomp, which the kernels load
        if self._gomp is None:
            self._gomp = ctypes.CDLL("libgomp.so.1")
            self._gomp.omp_get_max_threads.restype = ctypes.c_int
            self._default_threads = self._gomp.omp_get_max_threads()
        return self._gomp

    def schedules(self) -> list:
        """OpenMP thread counts 1, 2 and 3."""
        return [lambda n=n: self._omp().omp_set_num_threads(ctypes.c_int(n)) for n in (1, 2, 3)]

    def reset_schedule(self) -> None:
        self._omp().omp_set_num_threads(ctypes.c_int(self._default_threads))


def target_params(target: str, params: dict) -> dict:
    """A kernel's params as `target`'s templates take them: CUDA's take the activation element (adtype), which a
    spec without one leaves float32, as the CPU's are."""
    return {"adtype": "f32", **params} if target == "cuda" else params


class CudaTemplates:
    target = "cuda"

    def spec(self, op: str, params: dict) -> tuple[str, dict] | None:
        """None for an op with no CUDA template, and for int6, int5, int3, int2 and IQ4 weights (a CUDA build
        holds them widened to int8)."""
        try:
            template_path("cuda", op)
        except CompileError:
            return None
        if params.get("bits") in (2, 3, 5, 6) or params.get("codebook"):
            return None
        return op, target_params("cuda", params)


class CudaHarness(CudaTemplates, Harness):
    kernel_class = CudaKernel

    def __init__(self, out_dir: Path):
        super().__init__()
        self.out_dir = out_dir
        self._libs: list[ctypes.CDLL] = []

    def _load(self, sources: list[str]) -> ctypes.CDLL:
        (source,) = sources
        lib = ctypes.CDLL(str(simulator.build_simulated(source, self.out_dir / f"kernels{len(self._libs)}.so")))
        lib.llmc_sim_set_seed.argtypes = [ctypes.c_ulonglong]
        lib.llmc_sim_set_seed(1)
        self._libs.append(lib)
        return lib

    def _set_seed(self, n: int) -> None:  # in every library loaded so far
        for lib in self._libs:
            lib.llmc_sim_set_seed(n)

    def schedules(self) -> list:
        """Scheduling seeds 1 (the default) and 2: other thread orders between sync points, other block orders."""
        return [lambda n=n: self._set_seed(n) for n in (1, 2)]

    def reset_schedule(self) -> None:
        self._set_seed(1)


class GpuHarness(CudaTemplates, Harness):
    """LLMC_TEST_CUDA=gpu: the CUDA kernels built by nvcc for LLMC_TEST_GPU_TARGET (default sm90), the way
    `llmc compile` builds model.so, and run on the machine's GPU with every array staged in device memory."""

    def __init__(self):
        super().__init__()
        from llmc.targets import load_target

        self.gpu_target = load_target(os.environ.get("LLMC_TEST_GPU_TARGET", "sm90"))
        self.memory = TorchCudaMemory()

    def kernel_class(self, fn, op: str, params: dict) -> StagedKernel:
        return StagedKernel(fn, op, params, self.memory)

    def _load(self, sources: list[str]) -> ctypes.CDLL:
        from llmc.compiler.compile import build_module

        (source,) = sources
        return ctypes.CDLL(str(build_module(self.gpu_target, source)))

    def schedules(self) -> list:
        """The GPU's own: one."""
        return [lambda: None]

    def reset_schedule(self) -> None:
        pass
