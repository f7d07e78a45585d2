// llmc CPU target: the standard headers, intrinsics and macros every kernel header uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || \
    (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define LLMC_RESTRICT __restrict__
#define LLMC_INLINE inline __attribute__((always_inline))
#define LLMC_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define LLMC_UNROLL LLMC_PRAGMA(unroll)
#else
#define LLMC_UNROLL LLMC_PRAGMA(GCC unroll 16)
#endif

namespace llmc {

// Software prefetch of a streamed line (weights, KV cache rows) into L2 (prefetcht1), not L1. A decode GEMV
// over short rows (SmolLM-135M's K = 576) leaves the hardware prefetchers behind, so its bandwidth is what the
// software prefetches keep in flight; into L1 they hold the core's few L1 miss buffers until the line arrives,
// into L2 the L2's many. (2-core Zen 4 EPYC, weights streamed from DRAM: bf16 GEMVs at K = 576 1.3-1.65x
// faster, at K = 8192 unchanged; benchmarks/cpu_kernels.py --only gemv --baseline.) The load that follows
// hits L2.
LLMC_INLINE void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

namespace {  // one per model.so, as the pool (llmc_pool.h)

// Each launch's wall time while `on`, for `llmc profile` (llmc_profile_timing in model.cc): it includes the
// launch's pool dispatch and its wait for the workers. Off, a launch pays one branch.
struct LaunchTiming {
  struct Launch {
    const char* kernel;
    double ms;
    int experts;  // an expert GEMM's: the experts it read (llmc_moe.h); 0 for the other kernels
  };
  bool on = false;
  int experts = 0;  // set by the running launch, taken by its TimedLaunch
  std::vector<Launch> launches;
};
LaunchTiming launch_timing;  // at namespace scope: a function's static would pay its guard check every launch
class TimedLaunch {
 public:
  explicit TimedLaunch(const char* kernel) {
    if (!launch_timing.on) return;
    kernel_ = kernel;
    start_ = std::chrono::steady_clock::now();
  }
  ~TimedLaunch() {
    if (!kernel_) return;
    const std::chrono::duration<double, std::milli> ms = std::chrono::steady_clock::now() - start_;
    launch_timing.launches.push_back({kernel_, ms.count(), launch_timing.experts});
    launch_timing.experts = 0;
  }
  TimedLaunch(const TimedLaunch&) = delete;
  TimedLaunch& operator=(const TimedLaunch&) = delete;

 private:
  const char* kernel_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

}  // namespace llmc
