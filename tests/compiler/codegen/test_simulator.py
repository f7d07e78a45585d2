"""The CUDA simulator (templates/cuda/include/sim/llmc_sim.h) and the device header, against numpy.

kernels.cu is built once with g++ against the simulator and called through ctypes; faults.cu (an ASan
build) runs in subprocesses, because its reports end the process. The same kernels.cu goes through nvcc
for sm_80/89/90 to check that ptxas reports no spills.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.compiler.codegen import simulator
from llmc.errors import CompileError

HERE = Path(__file__).parent
P = ctypes.c_void_p


def ptr(a: np.ndarray):
    assert a.flags.c_contiguous
    return a.ctypes.data_as(P)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = simulator.build_simulated([HERE / "kernels.cu"], tmp_path_factory.mktemp("sim") / "kernels.so")
    lib = ctypes.CDLL(str(so))
    lib.llmc_sim_set_seed.argtypes = [ctypes.c_ulonglong]
    lib.llmc_sim_set_seed(1)
    return lib


@pytest.fixture(scope="module")
def kernels_so(lib):
    return Path(lib._name)


@pytest.fixture(scope="module")
def faults_so(tmp_path_factory):
    return simulator.build_simulated([HERE / "faults.cu"], tmp_path_factory.mktemp("asan") / "faults.so", asan=True)


def run_entry(so: Path, expr: str, env_extra: dict | None = None, asan: bool = True) -> subprocess.CompletedProcess:
    """Prints `expr` (with `lib` = the loaded .so) in a fresh Python, under ASan by default."""
    env = simulator.asan_env() if asan else dict(os.environ)
    env.update(env_extra or {})
    code = f"import ctypes; lib = ctypes.CDLL({str(so)!r}); print({expr})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def line_of(text: str, src: str = "faults.cu") -> str:
    """'faults.cu:<line>' of the first line that contains `text`."""
    lines = (HERE / src).read_text().splitlines()
    return f"{src}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------------


def test_block_reduction(lib):
    x = np.random.default_rng(0).integers(-50, 50, size=(5, 1000)).astype(np.float32)
    for threads in (32, 128, 256):
        out = np.zeros(10, np.float32)
        assert lib.block_reduce(ptr(x), 5, 1000, threads, ptr(out)) == 0
        np.testing.assert_array_equal(out[0::2], x.sum(axis=1))
        np.testing.assert_array_equal(out[1::2], x.max(axis=1))


def test_warp_shuffles_votes_and_counting_barriers(lib):
    out = np.zeros((64, 15), np.int32)
    assert lib.warp_ops(64, ptr(out)) == 0
    tid = np.arange(64)
    lane, base, v = tid % 32, tid - tid % 32, tid * 10
    seg16 = lane & ~15
    exp = np.zeros_like(out)
    exp[:, 0] = (base + (lane + 3) % 32) * 10
    exp[:, 1] = np.where(lane >= 2, v - 20, v)
    exp[:, 2] = np.where(lane + 5 <= seg16 + 15, v + 50, v)
    exp[:, 3] = (base + (lane ^ 7)) * 10
    exp[:, 4] = np.where(lane >= 16, v - 160, v)  # xor 16 with width 16: earlier segment, or own value
    exp[:, 5] = np.uint32(sum(1 << bit for bit in range(0, 32, 3))).view(np.int32)
    exp[:, 6] = 1 + 2 + 0
    exp[:, 7] = 496
    exp[:, 8] = np.where(lane < 16, (base + 15 - lane) * 10, -1)
    exp[:, 9] = base + 31 - lane
    exp[:, 10] = 496
    exp[:, 11] = 31
    exp[:, 12] = 32
    exp[:, 13] = 1
    exp[:, 14] = 1
    np.testing.assert_array_equal(out, exp)


def test_dynamic_shared_memory(lib):
    x = np.arange(6 * 96, dtype=np.float32)
    y = np.zeros_like(x)
    assert lib.reverse(ptr(x), ptr(y), 6, 96, 0) == 0
    np.testing.assert_array_equal(y, x.reshape(6, 96)[:, ::-1].ravel())
    # Above 48 KB a launch fails unless the kernel's attribute allows it, as on a GPU.
    y[:] = 0
    assert lib.reverse_too_much_smem(ptr(x), ptr(y)) != 0
    assert not y.any()
    assert lib.reverse(ptr(x), ptr(y), 6, 96, 100 * 1024) == 0
    np.testing.assert_array_equal(y, x.reshape(6, 96)[:, ::-1].ravel())


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_m16n8k16(lib, dtype):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    if dtype == "bf16":
        A, B = to_bf16(a), to_bf16(b)
        af, bf = bf16_to_f32(A), bf16_to_f32(B)
    else:
        A, B = a.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16)
        af, bf = A.view(np.float16).astype(np.float32), B.view(np.float16).astype(np.float32)
    Bt = np.ascontiguousarray(B.T)
    d = np.zeros((16, 8), np.float32)
    assert lib.mma(ptr(A), ptr(Bt), ptr(c), ptr(d), int(dtype == "f16")) == 0
    ref = af.astype(np.float64) @ bf.astype(np.float64) + c
    np.testing.assert_allclose(d, ref, rtol=1e-6, atol=1e-5)
    # Not symmetric under a wrong layout: the transposed product must not match.
    assert not np.allclose(d, af.T @ bf + c, atol=1e-2)


def test_gemm_cp_async_ldmatrix_mma(lib):
    rng = np.random.default_rng(3)
    M, K, N = 32, 48, 64
    A, B = to_bf16(rng.standard_normal((M, K))), to_bf16(rng.standard_normal((K, N)))
    d = np.zeros((M, N), np.float32)
    assert lib.gemm_32x48(ptr(A), ptr(B), ptr(d), N) == 0
    ref = bf16_to_f32(A).astype(np.float64) @ bf16_to_f32(B).astype(np.float64)
    np.testing.assert_allclose(d, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_layout(lib, num, trans):
    rng = np.random.default_rng(num + 10 * trans)
    table = rng.permutation(32 * 8).astype(np.uint16).reshape(32, 8)  # distinct values
    rows = rng.permutation(32).astype(np.int32)  # lane 8j+r gives the address of row r of matrix j
    out = np.zeros((32, num), np.uint32)
    assert lib.ldmatrix(num, int(trans), ptr(table), ptr(rows), ptr(out)) == 0
    exp = np.zeros_like(out)
    for t in range(32):
        for j in range(num):
            Mj = table[rows[8 * j : 8 * j + 8]]  # 8x8: row r = table row given by lane 8j+r
            if trans:
                Mj = Mj.T
            lo, hi = Mj[t // 4, 2 * (t % 4)], Mj[t // 4, 2 * (t % 4) + 1]
            exp[t, j] = int(lo) | (int(hi) << 16)
    np.testing.assert_array_equal(out, exp)


def test_cp_async(lib):
    n = 64
    x = np.arange(1, 2 * n * 4 + 1, dtype=np.float32)
    zfill = (np.arange(n) * 5 % 17).astype(np.int32)  # 0..16 source bytes per 16-byte copy
    out0, out1, out2 = (np.zeros(n * 4, np.float32) for _ in range(3))
    assert lib.cp_async(ptr(x), ptr(zfill), n, ptr(out0), ptr(out1), ptr(out2)) == 0
    stage0 = x[: n * 4].copy().view(np.uint8).reshape(n, 16)
    for i in range(n):
        stage0[i, zfill[i] :] = 0
    stage0 = stage0.view(np.float32).ravel()
    np.testing.assert_array_equal(out0, np.roll(stage0.reshape(n, 4), -1, axis=0).ravel())
    # The younger group was not waited for: its destination still holds the simulator's 0xFF bytes.
    assert (out1.view(np.uint32) == 0xFFFFFFFF).all()
    np.testing.assert_array_equal(out2, x[n * 4 :])


def test_race_is_exposed_by_the_seed(lib):
    blocks, n = 3, 64
    x = np.arange(blocks * n, dtype=np.float32) + 1
    correct = np.roll(x.reshape(blocks, n), -1, axis=1).ravel()
    results = []
    for seed in range(1, 7):
        lib.llmc_sim_set_seed(seed)
        y = np.zeros_like(x)
        assert lib.racy(ptr(x), ptr(y), blocks, n, 0) == 0
        results.append(y.tobytes())
        ys = np.zeros_like(x)
        assert lib.racy(ptr(x), ptr(ys), blocks, n, 1) == 0
        np.testing.assert_array_equal(ys, correct)  # with the barriers: right for every seed
    assert len(set(results)) > 1, "the racy kernel gave the same result for every seed"
    assert any(r != correct.tobytes() for r in results)
    lib.llmc_sim_set_seed(3)  # same seed, same result
    y = np.zeros_like(x)
    lib.racy(ptr(x), ptr(y), blocks, n, 0)
    assert y.tobytes() == results[2]


# ---------------------------------------------------------------------------------------------------
# reports that end the process: ASan build, in subprocesses


def test_asan_reports_out_of_bounds_write(faults_so):
    r = run_entry(faults_so, "lib.oob_write(100)")
    assert r.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in r.stderr, r.stderr[-3000:]
    assert "in oob_write_kernel" in r.stderr and line_of("y[i] = 1.0f;  // no bounds check") in r.stderr


def test_asan_no_false_reports_with_fibers(faults_so):
    r = run_entry(faults_so, "lib.busy()")
    assert r.returncode == 0 and r.stdout.strip() == "0", r.stderr[-3000:]
    assert "ERROR: AddressSanitizer" not in r.stderr


def test_barrier_not_reached_by_all_threads_is_reported(faults_so):
    r = run_entry(faults_so, "lib.half_barrier()")
    assert r.returncode != 0
    assert "llmc_sim: error: deadlock" in r.stderr and "exited before it" in r.stderr, r.stderr[-3000:]
    assert line_of("__syncthreads();               // ... and the others") in r.stderr


def test_warp_lane_missing_is_reported(faults_so):
    r = run_entry(faults_so, "lib.warp_divergent()")
    assert r.returncode != 0
    assert "llmc_sim: error: deadlock" in r.stderr and "__shfl_xor_sync" in r.stderr, r.stderr[-3000:]
    assert "0x80000000" in r.stderr  # lane 31 is the one missing


def test_fiber_stack_overflow_is_reported(kernels_so):
    r = run_entry(kernels_so, "lib.stack_overflow((ctypes.c_float * 32)())", asan=False)
    assert r.returncode != 0
    assert "llmc_sim: error: fiber stack overflow" in r.stderr and "LLMC_SIM_STACK_KB" in r.stderr, r.stderr[-3000:]
    r = run_entry(kernels_so, "lib.stack_overflow((ctypes.c_float * 32)())", {"LLMC_SIM_STACK_KB": "2048"}, asan=False)
    assert r.returncode == 0, r.stderr[-3000:]


def test_seed_from_environment(faults_so):
    expr = "ctypes.CFUNCTYPE(ctypes.c_float)(('racy_sum', lib))()"
    sums = [run_entry(faults_so, expr, {"LLMC_SIM_SEED": str(s)}).stdout for s in (1, 2, 1)]
    assert sums[0] == sums[2] and sums[0] != sums[1], sums


# ---------------------------------------------------------------------------------------------------
# the helpers


def test_build_errors_and_cache(tmp_path):
    with pytest.raises(CompileError, match="no_such_function"):
        simulator.build_simulated("__global__ void k() { no_such_function(); }", tmp_path / "bad.so")
    src = '#include "llmc_device.cuh"\nextern "C" int f() { return 7; }\n'
    a = simulator.build_simulated(src, tmp_path / "a.so")
    b = simulator.build_simulated(src, tmp_path / "b.so")  # from the cache
    assert ctypes.CDLL(str(a)).f() == 7 and a.read_bytes() == b.read_bytes()
    assert (simulator.cuda_include_dir() / "cuda_bf16.h").exists()


def test_parse_ptxas():
    report = """ptxas info    : Compiling entry function '_Z1kPf' for 'sm_80'
ptxas info    : Function properties for _Z1kPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 512 bytes smem, 360 bytes cmem[0]
"""
    r = simulator.parse_ptxas(report)["_Z1kPf"]
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.smem) == (255, 4, 12, 8, 512)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_nvcc_compiles_without_spills(tmp_path, arch):
    res = simulator.nvcc_compile(HERE / "kernels.cu", arch, tmp_path / "kernels.cubin")
    assert (tmp_path / "kernels.cubin").stat().st_size > 0
    names = " ".join(res)
    for kernel in ("mma_kernel", "gemm_kernel", "ldmatrix_kernel", "cp_async_kernel", "warp_ops_kernel"):
        assert kernel in names
    spills = {k: (v.spill_stores, v.spill_loads) for k, v in res.items() if v.spill_stores or v.spill_loads}
    assert not spills


def test_nvcc_host_code_compiles(tmp_path):
    """LLMC_LAUNCH is `<<<>>>` under nvcc (with a parenthesized template-id too): compile the host side."""
    cmd = [
        simulator.nvcc_path(),
        "-c",
        "-std=c++17",
        "-gencode=arch=compute_80,code=sm_80",
        f"-I{simulator.INCLUDE_DIR}",
        str(HERE / "kernels.cu"),
        "-o",
        str(tmp_path / "kernels.o"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
