"""The GPU harness's staging (kernel_harness.StagedKernel, LLMC_TEST_CUDA=gpu) checked under the simulator,
with host buffers standing in for device memory: a fused qkv buffer's column slices are staged as one buffer
and keep their row stride, the KV caches come back written, and the output is the direct call's."""

import math

import numpy as np
import pytest

from tests.cuda_mode import ON_GPU
from tests.templates.kernel_harness import HostStaging, StagedKernel
from tests.templates.test_paged_attention import make_batch

PARAMS = dict(
    num_heads=8, num_kv_heads=2, head_dim=32, block_size=8, scale=1 / math.sqrt(32), sliding_window=0, kv_dtype="bf16"
)
SEQS = [(30, 1), (0, 19)]  # a decode token beside a prefill that takes the tensor-core path


@pytest.mark.skipif(ON_GPU, reason="stages host buffers into the simulator")
def test_staged_call_matches_the_direct_one(harnesses):
    harness = harnesses["cuda"]
    harness.build([("paged_attention", PARAMS)])
    direct = harness("paged_attention", PARAMS)
    staged = StagedKernel(direct.fn, direct.op, direct.params, HostStaging())

    want, got = make_batch(PARAMS, SEQS, seed=3), make_batch(PARAMS, SEQS, seed=3)
    out_want = want.run(direct)
    out_got = got.run(staged)
    assert len(staged._staged) == 8  # qkv once for its three slices, two caches, four step arrays, out
    np.testing.assert_array_equal(out_got, out_want)
    assert np.array_equal(got.k_cache, want.k_cache) and np.array_equal(got.v_cache, want.v_cache)
    assert not np.array_equal(got.k_cache, make_batch(PARAMS, SEQS, seed=3).k_cache)  # the write came back
