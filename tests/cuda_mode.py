"""Where the CUDA tests run: under the CUDA simulator (the default: no GPU needed), or, with
LLMC_TEST_CUDA=gpu (benchmarks/gpu_check.py sets it), on the machine's GPU."""

import os

from llmc.compiler.codegen.simulator import build_simulated_library

ON_GPU = os.environ.get("LLMC_TEST_CUDA") == "gpu"


def cuda_library(artifact):
    """What CompiledModel.load runs a CUDA artifact with: on a GPU its own model.so, else its simulated build."""
    return None if ON_GPU else build_simulated_library(artifact)
