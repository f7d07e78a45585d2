"""Fixtures of the kernel template tests: one test module per op (test_<op>.py), each run on every target.

The shared modules beside it: kernel_reference (numpy / torch references and input builders) and kernel_harness
(signatures, trampolines, the per-target builds).

An op module lists its kernels in SPECS = [(op, params), ...]. `target` parametrizes its tests over TARGETS
("cuda" runs the kernels under the CUDA simulator, or with LLMC_TEST_CUDA=gpu on the machine's GPU);
`kernels(op, params)` is the built Kernel on that target. Every collected module's SPECS are built together,
one library per target. A case marked `pytest.mark.targets("cpu")` runs on those targets only (it is
deselected on the others).
"""

import pytest

from tests.cuda_mode import ON_GPU
from tests.templates.kernel_harness import CpuHarness, CudaHarness, GpuHarness  # noqa: E402
from tests.templates.kernel_reference import make_weights  # noqa: E402

TARGETS = ("cpu", "cuda")
_collected: list[tuple[str, dict]] = []  # the SPECS of the collected op modules


def pytest_configure(config):
    config.addinivalue_line("markers", "targets(*names): run this kernel test case on these targets only")


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("targets")
        params = getattr(getattr(item, "callspec", None), "params", {})
        (drop if mark and params.get("target", mark.args[0]) not in mark.args else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    seen = set()
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and mod.__name__ not in seen and "target" in getattr(item, "fixturenames", ()):
            seen.add(mod.__name__)
            _collected.extend(getattr(mod, "SPECS", []))


@pytest.fixture(scope="session")
def harnesses(tmp_path_factory):
    """{target: Harness}; nothing is built before a test asks for a kernel."""
    built = {"cpu": CpuHarness(), "cuda": GpuHarness() if ON_GPU else CudaHarness(tmp_path_factory.mktemp("cuda-sim"))}
    for harness in built.values():
        harness.pending = list(_collected)
    return built


@pytest.fixture(scope="module", params=TARGETS)
def target(request):
    return request.param


@pytest.fixture(scope="module")
def kernels(request, target, harnesses):
    """kernels(op, params) -> the Kernel on `target`, for the (op, params) of the requesting module's SPECS."""
    harness = harnesses[target]
    harness.build(request.module.SPECS)
    return harness


@pytest.fixture
def schedules(target, harnesses):
    """Functions that each put `target` in another schedule (OpenMP thread counts on the CPU, scheduling seeds
    under the CUDA simulator); the default comes back after the test."""
    harness = harnesses[target]
    yield harness.schedules()
    harness.reset_schedule()


@pytest.fixture(scope="session")
def weights():
    """weights(float32 array, wdtype) -> (array to pass the kernel, float32 values it holds)."""
    return make_weights
