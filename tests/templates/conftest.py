"""Shared by the CPU and CUDA kernel tests (cpu/, cuda/).

Puts this folder on sys.path, so the test modules and the two harness conftests import the shared modules by
name: kernel_reference (numpy / torch references and input builders) and kernel_harness (signatures,
trampolines, the ctypes Kernel wrapper). A package import (`templates.kernel_reference`) would not do: the
repository's own `templates` package shadows tests/templates whenever the repository root is on sys.path.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kernel_reference import make_weights  # noqa: E402


@pytest.fixture(scope="session")
def weights():
    """weights(float32 array, wdtype) -> (array to pass the kernel, float32 values it holds)."""
    return make_weights
