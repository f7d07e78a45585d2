"""This host's ceilings, measured: the floors of a CPU artifact's kernels (`llmc profile`) and the CPU
benchmarks' rooflines.

- `Bandwidth(threads)`: memory read bandwidth over one buffer far above any last-level cache.
- `probes()`: the peak rates of the instructions llmc's CPU kernels compute with: fp32 FMA, vdpbf16ps and AMX's
  tdpbf16ps (bf16 weights, where the host has avx512_bf16 / amx_bf16) and the int8 dot product of quantized
  weights against int8 activations (vpdpbusd where the host has VNNI, else vpmaddubsw + vpmaddwd). A peak of
  those instructions, not of every unit the machine has (AMX int8): it is what the kernels could reach.
- `cpu_ceilings()`: both, as `llmc profile`'s ceilings.

The probes are C++ built with the CPU target's flags (-march=native, OpenMP), cached as any build.
"""

from __future__ import annotations

import ctypes
import functools
import time

from llmc.host import host_cpu_model

from .build import build_shared_library

CLOCK_SOURCE = r"""
#include <time.h>
// Seconds: wall clock, or with cpu != 0 the calling thread's CPU time (a 1-thread figure that the other
// processes of a shared machine do not inflate by taking the core away).
static double bench_clock(int cpu) {
  timespec ts;
  clock_gettime(cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
"""

_PROBES = r"""
#include <cstdint>
#include <immintrin.h>
#include <omp.h>
%CLOCK%
extern "C" int llmc_probe_threads() { return omp_get_max_threads(); }

// Read n uint64 words with `threads` threads (static schedule); the xor keeps the loads alive.
extern "C" uint64_t llmc_read_probe(const uint64_t* p, long n, int threads) {
  uint64_t acc = 0;
#pragma omp parallel for schedule(static) reduction(^ : acc) num_threads(threads)
  for (long i = 0; i < n; ++i) acc ^= p[i];
  return acc;
}

// Each probe: operations/s of kChains independent chains of one instruction (more than its latency times its
// pipes) on `threads` threads; 0 where the host lacks the instruction.
constexpr int kChains = 16;

// fp32 FMA of the widest vector llmc's build uses: 2 operations per lane.
#if defined(__AVX512F__)
using FmaVec = __m512;
#define FMA_SET1 _mm512_set1_ps
#define FMA_FMADD _mm512_fmadd_ps
#else
using FmaVec = __m256;
#define FMA_SET1 _mm256_set1_ps
#define FMA_FMADD _mm256_fmadd_ps
#endif
extern "C" double fma_probe(int threads, long iters, int cpu) {
  constexpr int kLanes = sizeof(FmaVec) / sizeof(float);
  const double t0 = bench_clock(cpu);
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    FmaVec a[kChains], m = FMA_SET1(0.999f), c = FMA_SET1(1e-3f);
    for (int j = 0; j < kChains; ++j) a[j] = FMA_SET1(float(j));
    for (long i = 0; i < iters; ++i)
      for (int j = 0; j < kChains; ++j) a[j] = FMA_FMADD(a[j], m, c);
    for (int j = 0; j < kChains; ++j) sink += a[j][0];
  }
  const double s = bench_clock(cpu) - t0;
  return sink == 12345.f ? 0 : 2.0 * kLanes * kChains * iters * threads / s;
}

// vdpbf16ps: 2 multiply-adds per fp32 lane.
extern "C" double dpbf16_probe(int threads, long iters, int cpu) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const double t0 = bench_clock(cpu);
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 a[kChains];
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3c003c00);  // 2^-7 in both halves: the sums stay finite
    for (int j = 0; j < kChains; ++j) a[j] = _mm512_set1_ps(float(j));
    for (long i = 0; i < iters; ++i)
      for (int j = 0; j < kChains; ++j) a[j] = _mm512_dpbf16_ps(a[j], x, x);
    for (int j = 0; j < kChains; ++j) sink += a[j][0];
  }
  const double s = bench_clock(cpu) - t0;
  return sink == 12345.f ? 0 : 4.0 * 16 * kChains * iters * threads / s;
#else
  return 0;
#endif
}

// tdpbf16ps (AMX, llmc_gemm_amx.h): 16 x 16 x 32 multiply-adds per instruction, four independent C tiles.
// iters / 8 rounds of four: one round is about as long as eight of the vector probes' 16 chains.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
extern "C" double amx_bf16_probe(int threads, long iters, int cpu) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  const long rounds = iters / 8;
  const double t0 = bench_clock(cpu);
#pragma omp parallel num_threads(threads)
  {
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {64, 64, 64, 64, 64, 0, 64};
      uint8_t rows[16] = {16, 16, 16, 16, 16, 0, 16};
    } cfg;
    alignas(64) static const uint16_t ones[16 * 32] = {};  // zeros: the sums stay finite
    asm volatile("" : : "m"(cfg));  // g++ 12's ldtilecfg does not tell the optimizer it reads cfg
    _tile_loadconfig(&cfg);
    _tile_loadd(4, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long i = 0; i < rounds; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_release();
  }
  const double s = bench_clock(cpu) - t0;
  return 4.0 * 2 * 16 * 16 * 32 * rounds * threads / s;
#else
  return 0;
#endif
}

// The int8 dot product of the quantized GEMMs (llmc_qgemm.h): 4 u8 x s8 multiply-adds per int32 lane.
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
using DotVec = __m512i;
#define DOT_SET1 _mm512_set1_epi8
static inline DotVec dot4(DotVec acc, DotVec u, DotVec s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline int32_t lane0(DotVec v) { return _mm512_cvtsi512_si32(v); }
#elif defined(__AVX2__)
using DotVec = __m256i;
#define DOT_SET1 _mm256_set1_epi8
static inline int32_t lane0(DotVec v) { return _mm256_cvtsi256_si32(v); }
static inline DotVec dot4(DotVec acc, DotVec u, DotVec s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif
extern "C" double int8_probe(int threads, long iters, int cpu) {
#if defined(__AVX2__)
  constexpr int kBytes = sizeof(DotVec);
  const double t0 = bench_clock(cpu);
  int64_t sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    DotVec a[kChains];
    DotVec u = DOT_SET1(1), s = DOT_SET1(-1);  // the sums stay in range: -4 per lane and step
    asm volatile("" : "+v"(u), "+v"(s));        // opaque: g++ folds dot products of constants
    for (int j = 0; j < kChains; ++j) a[j] = DOT_SET1(char(j));
    for (long i = 0; i < iters; ++i)
      for (int j = 0; j < kChains; ++j) a[j] = dot4(a[j], u, s);
    for (int j = 0; j < kChains; ++j) sink += lane0(a[j]);
  }
  const double s = bench_clock(cpu) - t0;
  return sink == 12345 ? 0 : 2.0 * kBytes * kChains * iters * threads / s;
#else
  return 0;
#endif
}
"""


@functools.cache
def probes() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_shared_library({"probes.cc": _PROBES.replace("%CLOCK%", CLOCK_SOURCE)})))
    lib.llmc_probe_threads.restype = ctypes.c_int
    lib.llmc_read_probe.restype = ctypes.c_uint64
    lib.llmc_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    for name in ("fma_probe", "dpbf16_probe", "amx_bf16_probe", "int8_probe"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    return lib


class Bandwidth:
    """Memory read bandwidth probes over one buffer (1 GiB: far above any last-level cache), kept for the run."""

    def __init__(self, threads: int, nbytes: int = 1 << 30):
        import numpy as np

        self.threads, self.nbytes = threads, nbytes
        self.probe = probes().llmc_read_probe
        self.src = np.ones(nbytes // 8, dtype=np.uint64)  # every page touched

    def read(self, threads: int, repeats: int) -> float:
        """GB/s: the best of `repeats` reads of the whole buffer with `threads` threads."""
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            self.probe(self.src.ctypes.data, self.src.size, threads)
            best = max(best, self.nbytes / (time.perf_counter() - t))
        return best / 1e9

    def measure(self, repeats: int = 5) -> dict:
        import numpy as np

        dst = self.src.copy()  # every page touched
        copy = 0.0
        for _ in range(3):
            t = time.perf_counter()
            np.copyto(dst, self.src)
            copy = max(copy, 2 * self.nbytes / (time.perf_counter() - t))
        return {
            "read_GBps": self.read(self.threads, repeats),
            "read_1thread_GBps": self.read(1, 3),
            "copy_1thread_GBps": copy / 1e9,
        }


def peak_rate(probe: str, threads: int, repeats: int = 3, iters: int = 20_000_000) -> float:
    """Operations/s of one of the probes (fma_probe, dpbf16_probe, amx_bf16_probe, int8_probe): the best of
    `repeats`; 0 where the host lacks the instruction."""
    fn = getattr(probes(), probe)
    return max(fn(threads, iters, 0) for _ in range(repeats))


def cpu_ceilings() -> dict:
    """`llmc profile`'s ceilings for this host, measured with the thread count a CPU module runs on (OpenMP's):
    read bandwidth, the fp32 FMA rate, the bf16 rate (AMX tiles where the host has them, as bf16 GEMMs run
    there; else vdpbf16ps, else the FMA rate: bf16 weights then widen to fp32) and the int8 rate of the
    quantized GEMMs. No launch cost: a kernel's time includes its pool dispatch."""
    threads = probes().llmc_probe_threads()
    fp32 = peak_rate("fma_probe", threads)
    bf16_amx = peak_rate("amx_bf16_probe", threads)
    return {
        "part": f"{host_cpu_model()}, {threads} threads (measured)",
        "bandwidth_gb_s": round(Bandwidth(threads).read(threads, 3), 1),
        "bf16_tensor_tflop_s": round(max(fp32, peak_rate("dpbf16_probe", threads), bf16_amx) / 1e12, 3),
        "fp32_tflop_s": round(fp32 / 1e12, 3),
        "int8_tops": round(peak_rate("int8_probe", threads) / 1e12, 3),
        "launch_us": 0.0,
    }
