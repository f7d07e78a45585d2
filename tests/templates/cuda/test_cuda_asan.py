"""Representative CUDA kernels (paged attention on an f32 cache and on a bf16 one with bf16 activations, whose long
contexts take KV splits and whose 16+-token prefills the tensor-core path; the gemm's SIMT tiles and GEMV, and
its mma tiles on bf16 activations; rmsnorm) in an AddressSanitizer build of the simulator, run in a subprocess
(an ASan report ends the process): a clean run on the ragged test batches, and a block table entry past the
cache that ASan must report."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.compiler.codegen import simulator
from tests.templates.kernel_harness import kernels_source

ROOT = Path(__file__).resolve().parents[3]  # the repository: the child imports tests.templates.*
SPECS_ASAN = [
    (
        "paged_attention",
        dict(
            num_heads=9,
            num_kv_heads=3,
            head_dim=8,
            block_size=8,
            scale=1 / math.sqrt(8),
            sliding_window=0,
            kv_dtype="f32",
            adtype="f32",
        ),
    ),
    ("gemm", dict(n=53, k=37, wdtype="bf16", has_bias=True, adtype="f32")),
    ("rmsnorm", dict(hidden=37, eps=1e-6, wdtype="f32", add_residual=True, adtype="f32")),
    (
        "paged_attention",
        dict(
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            block_size=4,
            scale=1 / math.sqrt(16),
            sliding_window=0,
            kv_dtype="bf16",
            adtype="bf16",
        ),
    ),
    ("gemm", dict(n=70, k=136, wdtype="bf16", has_bias=True, adtype="bf16")),
]

# Runs in the subprocess: the kernels through the harness's CudaKernel wrapper (tests/templates/kernel_harness.py),
# checked against the same numpy references as the simulator tests (tests/templates/kernel_reference.py).
CHILD = r"""
import ctypes, sys
import numpy as np
sys.path[:0] = [{root!r}]
from tests.templates.kernel_harness import CudaKernel
from tests.templates.kernel_reference import MIXED, NUM_BLOCKS, Batch, bf16_bits_of, make_weights, rmsnorm_reference
from llmc.compiler.codegen.render import kernel_id
from tests.templates.cuda.test_cuda_asan import SPECS_ASAN
from tests.templates.test_paged_attention import assert_matches_reference, make_batch
lib = ctypes.CDLL({so!r})
k = {{kernel_id("cuda", op, p): CudaKernel(getattr(lib, "test_" + kernel_id("cuda", op, p)), op, p) for op, p in SPECS_ASAN}}
(op, attn), (_, gemm), (_, rms), (_, attn16), (_, gemm_tc) = SPECS_ASAN
fn = k[kernel_id("cuda", op, attn)]
if {oob!r}:
    batch = Batch(attn, [(5, 3), (20, 1)], seed=1)
    batch.block_tables[1, 1] = NUM_BLOCKS  # one block past the end of the cache
    batch.run(fn)
    sys.exit(0)
for seqs in (MIXED, [(0, 17)]):
    batch = Batch(attn, seqs, seed=2)
    np.testing.assert_allclose(batch.run(fn), batch.reference(), rtol=1e-5, atol=2e-6)
rng = np.random.default_rng(0)
for T in (3, 17):
    x = rng.standard_normal((T, 37), dtype=np.float32)
    w, wf = make_weights(rng.standard_normal((53, 37), dtype=np.float32), "bf16")
    b, bf = make_weights(rng.standard_normal(53, dtype=np.float32), "bf16")
    y = np.empty((T, 53), np.float32)
    k[kernel_id("cuda", "gemm", gemm)](x, w, b, y, T)
    np.testing.assert_allclose(y, x.astype(np.float64) @ wf.T.astype(np.float64) + bf, rtol=1e-4, atol=1e-5)
    res = rng.standard_normal((T, 37), dtype=np.float32)
    w, wf = make_weights(rng.standard_normal(37, dtype=np.float32), "f32")
    h = x + res
    y = np.empty_like(x)
    k[kernel_id("cuda", "rmsnorm", rms)](x, res, res, w, y, T, None)
    np.testing.assert_allclose(y, rmsnorm_reference(h, wf, 1e-6), rtol=1e-5, atol=1e-6)
for seqs in (MIXED, [(300, 1), (130, 2), (0, 70)]):  # bf16 activations: within their rounding
    batch = make_batch(attn16, seqs, seed=3)
    batch.qkv = make_weights(batch.qkv, "bf16")[1]
    want = batch.reference()
    batch.qkv = make_weights(batch.qkv, "bf16")[0]
    got = bf16_bits_of(batch.run(k[kernel_id("cuda", op, attn16)]))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())
xb, xr = make_weights(rng.standard_normal((70, 136), dtype=np.float32), "bf16")
w, wf = make_weights(rng.standard_normal((70, 136), dtype=np.float32), "bf16")
b, bf = make_weights(rng.standard_normal(70, dtype=np.float32), "bf16")
y = np.empty((70, 70), np.uint16)
k[kernel_id("cuda", "gemm", gemm_tc)](xb, w, b, y, 70)
ref = xr.astype(np.float64) @ wf.T.astype(np.float64) + bf
np.testing.assert_allclose(bf16_bits_of(y), ref, rtol=2.0**-7, atol=1e-5)
print("ok")
"""


@pytest.fixture(scope="module")
def asan_so(tmp_path_factory):
    (source,), _ = kernels_source("cuda", SPECS_ASAN)
    return simulator.build_simulated(source, tmp_path_factory.mktemp("asan") / "kernels.so", asan=True)


def _run(so: Path, oob: bool) -> subprocess.CompletedProcess:
    code = CHILD.format(root=str(ROOT), so=str(so), oob=oob)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=simulator.asan_env(), cwd=ROOT
    )


def test_asan_clean_on_ragged_batches(asan_so):
    r = _run(asan_so, oob=False)
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def test_asan_reports_block_table_past_the_cache(asan_so):
    r = _run(asan_so, oob=True)
    assert r.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-4000:]
    assert "_attend" in r.stderr  # in the attention kernel
