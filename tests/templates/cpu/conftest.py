"""Build CPU kernel templates into a test library and call them from numpy.

`cpu_kernels(specs)` renders every (op, params) in `specs` with render_kernel, puts them after
common.h in one translation unit with an `extern "C"` trampoline each (tests/templates/kernel_harness.py),
builds that once with build_shared_library (cached), and returns {kernel_id: Kernel}. A Kernel is called
with numpy arrays / ints / None in the order of the contract signature; dtypes and contiguity are checked.
`kernels` is that dict for the requesting module's SPECS; `weights` comes from tests/templates/conftest.py.
Each test module builds its whole grid in one g++ call, so the suite compiles ~7 times, not once
per parameter combination.

LLMC_TEST_MARCH=haswell (AVX2) or =x86-64 (portable fallback) builds the kernels for that ISA
instead of -march=native, to test common.h's other SIMD paths on an AVX-512 host.
"""

from __future__ import annotations

import ctypes
import os

import pytest
from kernel_harness import Kernel, kernels_source

from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
from llmc.compiler.codegen.render import template_file

_built: dict[tuple, dict[str, Kernel]] = {}
_MARCH = os.environ.get("LLMC_TEST_MARCH")
FLAGS = [f"-march={_MARCH}" if f == "-march=native" and _MARCH else f for f in CPU_FLAGS]


def build_kernels(specs) -> dict[str, Kernel]:
    key = tuple((op, repr(sorted(p.items()))) for op, p in specs)
    if key in _built:
        return _built[key]
    source, seen = kernels_source("cpu", specs)
    lib = ctypes.CDLL(str(build_shared_library({"common.h": template_file("cpu", "common.h"),
                                                "kernels.cc": source}, flags=FLAGS)))
    _built[key] = {kid: Kernel(getattr(lib, f"test_{kid}"), op, p) for kid, (op, p) in seen.items()}
    return _built[key]


@pytest.fixture(scope="session")
def cpu_kernels():
    """build_kernels([(op, params), ...]) -> {kernel_id("cpu", op, params): Kernel}."""
    return build_kernels


@pytest.fixture(scope="module")
def kernels(request, cpu_kernels):
    """The kernels of the requesting test module's SPECS."""
    return cpu_kernels(request.module.SPECS)


@pytest.fixture(scope="session")
def omp_threads():
    """omp_threads(n): set the OpenMP thread count of the kernels (libgomp is loaded by them)."""
    gomp = ctypes.CDLL("libgomp.so.1")
    gomp.omp_get_max_threads.restype = ctypes.c_int
    before = gomp.omp_get_max_threads()
    yield lambda n: gomp.omp_set_num_threads(ctypes.c_int(n))
    gomp.omp_set_num_threads(ctypes.c_int(before))
