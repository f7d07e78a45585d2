"""Build CUDA kernel templates for the simulator and call them from numpy.

`cuda_kernels(specs)` renders every (op, params) with render_kernel("cuda", ...), puts them after
llmc_kernels.cuh in one .cu with an `extern "C"` trampoline each (it calls the host launcher with the
default stream and returns cudaGetLastError(); tests/templates/kernel_harness.py), builds that with
build_simulated (g++ against llmc_sim.h, cached) and returns {kernel_id: CudaKernel}. The first build also
takes the SPECS of every collected test module, so a whole run compiles the simulated kernels once. Under the
simulator device memory is host memory, so a CudaKernel is called with numpy arrays / ints / None in the
order of the contract signature, exactly like the CPU harness (tests/templates/cpu/conftest.py).
`kernels` is that dict for the requesting module's SPECS; `weights` comes from tests/templates/conftest.py.

`sim_seed(n)` sets the simulator's scheduling seed (thread order between sync points).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest
from kernel_harness import CudaKernel, kernels_source

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import kernel_id

_kernels: dict[str, CudaKernel] = {}  # every kernel built so far, by kernel id
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
    """cuda_kernels([(op, params), ...]) -> {kernel_id("cuda", op, params): CudaKernel} (simulator build).

    The first call builds its specs together with those of every collected module (one g++ run);
    later calls build only what is still missing.
    """
    out_dir = tmp_path_factory.mktemp("cuda-sim")

    def build(specs) -> dict[str, CudaKernel]:
        ids = [kernel_id("cuda", op, p) for op, p in specs]
        missing = [s for s in [*specs, *_collected] if kernel_id("cuda", *s) not in _kernels]
        if any(kid not in _kernels for kid in ids):
            source, seen = kernels_source("cuda", missing)
            so = simulator.build_simulated(source, out_dir / f"kernels{len(_libs)}.so")
            lib = ctypes.CDLL(str(so))
            lib.llmc_sim_set_seed.argtypes = [ctypes.c_ulonglong]
            lib.llmc_sim_set_seed(1)
            _libs.append(lib)
            _kernels.update({kid: CudaKernel(getattr(lib, f"test_{kid}"), op, p) for kid, (op, p) in seen.items()})
        return {kid: _kernels[kid] for kid in ids}

    return build


@pytest.fixture(scope="module")
def kernels(request, cuda_kernels):
    """The kernels of the requesting test module's SPECS."""
    return cuda_kernels(request.module.SPECS)


@pytest.fixture(scope="session")
def cuda_source():
    """cuda_source(specs) -> (.cu text with the kernels and trampolines, {kernel_id: (op, params)})."""
    return functools.partial(kernels_source, "cuda")


@pytest.fixture
def sim_seed():
    """sim_seed(n): set the scheduling seed; it goes back to 1 after the test."""
    yield set_seed
    set_seed(1)
