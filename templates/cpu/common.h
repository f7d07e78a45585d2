// llmc CPU target: helpers shared by every kernel of a generated model.cc.
//
// The kernel templates (templates/cpu/*.cc.j2) are thin: each renders one `static void name(...)`
// that fixes the compile-time sizes and calls one of the inline functions below.
//
// Numerics. Activations are float32; weights are float32 or bf16 (uint16_t, widened with `<< 16`).
// Built without -ffast-math: every reduction has one fixed order. A dot product of length K is
// always summed the same way (one accumulator of Vec::W lanes, a masked tail, a fixed horizontal
// sum), whether it runs alone (T = 1, decode) or in a register tile (prefill), on whichever thread.
// Work is split across rows / outputs / heads, never inside one reduction, so a row's result does not
// depend on T, on its neighbours in the batch, or on the thread count.
//
// SIMD: AVX-512 (F+BW+VL) intrinsics, else AVX2+FMA intrinsics, else a portable 8-lane fallback.
// Threads: llmc's own small pool (parallel_for below), sized by OpenMP's thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
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

// A kernel spreads over the thread pool only above this much work (multiply-adds or elements);
// below it the fork/join costs more than it saves. Never changes results, only speed.
constexpr long kParallelWork = 1L << 15;

// ---------------------------------------------------------------------------------------------
// parallel_for(n, parallel, f): f(i) for every i in [0, n), spread over the calling thread and the
// pool's workers when `parallel`, else a plain loop on the calling thread.
//
// Why not an OpenMP parallel region: it ends in a barrier that every thread of the team must reach. When
// the cores are shared (other processes, a VM), a worker that is not running when the region opens holds
// the launch up until the OS schedules it: a time slice, milliseconds, for a decode GEMV of tens of
// microseconds. (Measured on a busy 2-core VM: SmolLM-135M decode on 2 OpenMP threads ran at 1 to 5
// tokens/s, against ~20 on one thread.)
//
// Here the n tasks are cut into one contiguous block per thread, as a static schedule would, and each
// block is claimed task by task through one atomic word (generation | end | next): its owner takes tasks
// from the front, a thread done with its own block steals from the back of the others. The caller owns
// block 0, so a worker that wakes late finds its block done by the others and nobody waits for it; the
// caller waits only for tasks that a worker has actually claimed. With a free core, each thread streams
// its own contiguous half of a weight matrix, as with OpenMP's static schedule.
//
// Numbers never depend on which thread runs a task: every task writes its own outputs and computes them
// the same way wherever it runs (see "Numerics" above).
//
// Thread count: omp_get_max_threads() (OMP_NUM_THREADS, omp_set_num_threads) when built with -fopenmp,
// else 1. Workers start on first use, wait for the next launch (a few pauses, then yielding the core) for
// kPoolSpinUs, then sleep on a condition variable; the pool is never destroyed (its threads end with the
// process). A launch that finds the pool busy (another host thread in a step) runs on its calling thread.
//
// The pool has internal linkage (anonymous namespace): each model.so owns its own. An `inline` function's
// static would be a process-wide STB_GNU_UNIQUE symbol, shared by every model.so loaded in the process,
// whatever common.h each was built from. (A model.so with workers running must not be dlclose()d; ctypes
// never unloads a library.)
namespace {

constexpr int kPoolSpinUs = 300;
constexpr int kPoolPauses = 64;  // busy-wait this many pauses (~ a few us), then yield the core while waiting

class Pool {
 public:
  using Fn = void (*)(void*, int);

  static Pool& instance() {
    static Pool* pool = new Pool();  // leaked on purpose: detached workers may still read it at exit
    return *pool;
  }

  void run(int n, Fn fn, void* ctx) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    threads = std::min(threads, kMaxThreads);
    if (threads <= 1 || n <= 1 || busy_.test_and_set(std::memory_order_acquire)) {
      for (int i = 0; i < n; ++i) fn(ctx, i);
      return;
    }
    while (num_workers_ < threads - 1) {
      std::thread(&Pool::worker, this, num_workers_).detach();
      ++num_workers_;
    }
    active_.store(threads - 1, std::memory_order_relaxed);
    for (int base = 0; base < n; base += kMaxTasks) {
      const int count = std::min(kMaxTasks, n - base);
      const int parts = std::min(threads, count);
      fn_.store(fn, std::memory_order_relaxed);
      ctx_.store(ctx, std::memory_order_relaxed);
      base_.store(base, std::memory_order_relaxed);
      parts_.store(parts, std::memory_order_relaxed);
      pending_.store(count, std::memory_order_relaxed);
      gen_ = (gen_ + 1) & kGenMask;
      for (int b = 0; b < parts; ++b)
        blocks_[b].word.store(pack(gen_, (long)count * (b + 1) / parts, (long)count * b / parts),
                              std::memory_order_relaxed);
      // seq_cst store, then seq_cst load of sleepers_: pairs with the worker's increment-then-check
      job_.store(gen_, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) {
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
      }
      work(gen_, 0);
      for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
        if (spins < kPoolPauses) {
          pause();
        } else {
          std::this_thread::yield();  // a worker is inside a task (maybe preempted)
        }
      }
    }
    busy_.clear(std::memory_order_release);
  }

 private:
  // A block word: generation (24 bits) | end (20 bits) | next (20 bits); tasks [next, end) are unclaimed.
  static constexpr int kMaxTasks = (1 << 20) - 1;
  static constexpr uint32_t kGenMask = (1u << 24) - 1;
  static constexpr int kMaxThreads = 64;
  static uint64_t pack(uint64_t gen, uint64_t end, uint64_t next) { return gen << 40 | end << 20 | next; }
  static uint32_t gen_of(uint64_t s) { return uint32_t(s >> 40); }
  static int end_of(uint64_t s) { return int((s >> 20) & kMaxTasks); }
  static int next_of(uint64_t s) { return int(s & kMaxTasks); }
  static LLMC_INLINE void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // Run tasks of generation g: block `self` from the front, then the others from the back. A claim
  // succeeds only while g is the current job and the block has tasks left, so fn_/ctx_/base_ (written
  // before g was published) are g's and stay so until the claimed task is done: the job cannot finish,
  // nor the next one start, before it.
  void work(uint32_t g, int self) {
    const int parts = parts_.load(std::memory_order_relaxed);  // if stale, g is over and no claim succeeds
    for (int k = 0; k < parts; ++k) {
      std::atomic<uint64_t>& word = blocks_[(self + k) % parts].word;
      const uint64_t step = k == 0 ? 1 : uint64_t(1) << 20;  // own block: next + 1; stealing: end - 1
      for (;;) {
        uint64_t s = word.load(std::memory_order_acquire);
        do {
          if (gen_of(s) != g || next_of(s) >= end_of(s)) break;
        } while (!word.compare_exchange_weak(s, k == 0 ? s + step : s - step, std::memory_order_acq_rel,
                                             std::memory_order_acquire));
        if (gen_of(s) != g || next_of(s) >= end_of(s)) break;
        const int task = k == 0 ? next_of(s) : end_of(s) - 1;
        fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed),
                                            base_.load(std::memory_order_relaxed) + task);
        pending_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  uint32_t wait_job(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kPoolSpinUs);
    for (int i = 1;; ++i) {
      const uint32_t g = job_.load(std::memory_order_acquire);
      if (g != seen) return g;
      if (i < kPoolPauses) {
        pause();
      } else {
        std::this_thread::yield();  // a core shared with the caller (or anyone) is not spun away
        if (i % 16 == 0 && std::chrono::steady_clock::now() > until) break;
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t g;
    cv_.wait(lock, [&] { return (g = job_.load(std::memory_order_seq_cst)) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return g;
  }

  void worker(int index) {
    uint32_t seen = job_.load(std::memory_order_acquire);
    for (;;) {
      seen = wait_job(seen);
      if (index < active_.load(std::memory_order_relaxed)) work(seen, index + 1);
    }
  }

  struct alignas(64) Block {
    std::atomic<uint64_t> word{0};
  };
  Block blocks_[kMaxThreads];
  alignas(64) std::atomic<uint32_t> job_{0};  // generation of the latest job
  alignas(64) std::atomic<int> pending_{0};   // tasks of the current job not finished yet
  alignas(64) std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> base_{0};
  std::atomic<int> parts_{1};
  std::atomic<int> active_{0};  // workers [0, active_) take part
  std::atomic<int> sleepers_{0};
  uint32_t gen_ = 0;  // the caller's copy; written only while holding busy_
  int num_workers_ = 0;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  std::mutex mu_;
  std::condition_variable cv_;
};

template <typename F>
LLMC_INLINE void parallel_for(int n, bool parallel, F&& f) {
  if (!parallel || n <= 1) {
    for (int i = 0; i < n; ++i) f(i);
    return;
  }
  using Fd = std::remove_reference_t<F>;
  Pool::instance().run(n, [](void* ctx, int i) { (*static_cast<Fd*>(ctx))(i); },
                       const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace

LLMC_INLINE float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
LLMC_INLINE float load_w(float v) { return v; }
LLMC_INLINE float load_w(uint16_t v) { return bf16_to_f32(v); }

// ---------------------------------------------------------------------------------------------
// Vec: one SIMD register of float32 lanes, with just what the kernels need.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMC_SIMD "avx512"
struct Vec {
  static constexpr int W = 16;
  __m512 v;
  static LLMC_INLINE Vec zero() { return {_mm512_setzero_ps()}; }
  static LLMC_INLINE Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static LLMC_INLINE Vec load(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  // The first n (< W) elements, zeros after.
  static LLMC_INLINE Vec load_part(const float* p, int n) {
    return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  static LLMC_INLINE Vec load_part(const uint16_t* p, int n) {
    __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  LLMC_INLINE void fma(Vec a, Vec b) { v = _mm512_fmadd_ps(a.v, b.v, v); }  // this += a * b
  LLMC_INLINE Vec operator+(Vec o) const { return {_mm512_add_ps(v, o.v)}; }
  LLMC_INLINE float sum() const { return _mm512_reduce_add_ps(v); }  // fixed shuffle tree
};
#elif defined(__AVX2__) && defined(__FMA__)
#define LLMC_SIMD "avx2"
struct Vec {
  static constexpr int W = 8;
  __m256 v;
  static LLMC_INLINE Vec zero() { return {_mm256_setzero_ps()}; }
  static LLMC_INLINE Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static LLMC_INLINE Vec load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  template <typename T>
  static LLMC_INLINE Vec load_part(const T* p, int n) {
    alignas(32) float tmp[W] = {};
    for (int i = 0; i < n; ++i) tmp[i] = load_w(p[i]);
    return {_mm256_load_ps(tmp)};
  }
  LLMC_INLINE void fma(Vec a, Vec b) { v = _mm256_fmadd_ps(a.v, b.v, v); }
  LLMC_INLINE Vec operator+(Vec o) const { return {_mm256_add_ps(v, o.v)}; }
  LLMC_INLINE float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
};
#else
#define LLMC_SIMD "scalar"
struct Vec {  // portable fallback: 8 independent lanes the compiler may map onto SSE/NEON
  static constexpr int W = 8;
  float v[W];
  static LLMC_INLINE Vec zero() { return Vec{}; }
  template <typename T>
  static LLMC_INLINE Vec load(const T* p) {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = load_w(p[i]);
    return r;
  }
  template <typename T>
  static LLMC_INLINE Vec load_part(const T* p, int n) {
    Vec r{};
    for (int i = 0; i < n; ++i) r.v[i] = load_w(p[i]);
    return r;
  }
  LLMC_INLINE void fma(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) v[i] += a.v[i] * b.v[i];
  }
  LLMC_INLINE Vec operator+(Vec o) const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = v[i] + o.v[i];
    return r;
  }
  LLMC_INLINE float sum() const {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
  }
};
#endif

// ---------------------------------------------------------------------------------------------
// dot_block<R, C, K>: out[r * C + c] = sum_i x[r * ldx + i] * w[c * ldw + i], r < R, c < C.
//
// One accumulator Vec per (r, c): element i goes to lane i % W in order of i, the last partial vector
// is a masked load into the same accumulator, then Vec::sum(). So the result of one (row, output) is a
// function of K and the data only: dot_block<1, 1> and dot_block<4, 4> give bit-identical numbers for
// it. The R x C independent accumulators are the instruction-level parallelism (R + C loads per
// R * C FMAs), not a split of one dot product.
//
// PF > 0: also prefetch each weight row's stream PF bytes ahead (one prefetch per cache line). A decode GEMV
// reads C rows at once, each only K * sizeof(WT) bytes long: too short for the hardware prefetcher to get
// ahead of, while the next rows to read lie right after (w is row-major and tiles are contiguous).
template <int R, int C, int K, typename WT, int PF = 0>
LLMC_INLINE void dot_block(const float* LLMC_RESTRICT x, long ldx, const WT* LLMC_RESTRICT w, long ldw,
                           float* LLMC_RESTRICT out) {
  static_assert(R >= 1 && C >= 1 && K >= 1, "dot_block: bad sizes");
  constexpr int VW = Vec::W;
  constexpr int KMAIN = K / VW * VW;
  constexpr int NREM = K - KMAIN;

  Vec acc[R][C];
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  }
  constexpr int LINE = 64 / (int)sizeof(WT);  // weights per cache line
  for (int i = 0; i < KMAIN; i += VW) {
    Vec wv[C];
    if constexpr (PF > 0) {
      if (VW >= LINE || i % LINE == 0) {
        LLMC_UNROLL for (int c = 0; c < C; ++c)
          __builtin_prefetch(reinterpret_cast<const char*>(w + c * ldw + i) + PF, 0, 3);
      }
    }
    LLMC_UNROLL for (int c = 0; c < C; ++c) wv[c] = Vec::load(w + c * ldw + i);
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::load(x + r * ldx + i);
      LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c].fma(xv, wv[c]);
    }
  }
  if constexpr (NREM > 0) {
    Vec wv[C];
    LLMC_UNROLL for (int c = 0; c < C; ++c) wv[c] = Vec::load_part(w + c * ldw + KMAIN, NREM);
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::load_part(x + r * ldx + KMAIN, NREM);
      LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c].fma(xv, wv[c]);
    }
  }
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) out[r * C + c] = acc[r][c].sum();
  }
}

template <int K, typename WT>
LLMC_INLINE float dot(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w) {
  float s;
  dot_block<1, 1, K>(x, 0, w, 0, &s);
  return s;
}

// y[i] += a * x[i] (element-wise, no reduction: auto-vectorised, order-free).
template <int N>
LLMC_INLINE void axpy(float a, const float* LLMC_RESTRICT x, float* LLMC_RESTRICT y) {
  for (int i = 0; i < N; ++i) y[i] += a * x[i];
}

template <int N>
LLMC_INLINE void scale_inplace(float a, float* LLMC_RESTRICT y) {
  for (int i = 0; i < N; ++i) y[i] *= a;
}

// ---------------------------------------------------------------------------------------------
// embedding: out[t, :] = table[ids[t], :] (bf16 widened).
template <int H, typename WT>
inline void embedding(const int32_t* ids, int T, const WT* LLMC_RESTRICT table, float* LLMC_RESTRICT out) {
  parallel_for(T, (long)T * H >= kParallelWork, [&](int t) {
    const WT* src = table + (long)ids[t] * H;
    float* dst = out + (long)t * H;
    for (int i = 0; i < H; ++i) dst[i] = load_w(src[i]);
  });
}

// rmsnorm, as transformers' LlamaRMSNorm in float32: y = w * (h * (1 / sqrt(mean(h^2) + eps))).
// ADD: h = residual_out = x + residual_in first (residual_out may alias residual_in or x).
template <int H, bool ADD, typename WT>
inline void rmsnorm(const float* x, const float* residual_in, float* residual_out, const WT* w, float* y,
                    int T, float eps) {
  parallel_for(T, (long)T * H >= kParallelWork, [&](int t) {
    const float* h = x + (long)t * H;
    if constexpr (ADD) {
      const float* ri = residual_in + (long)t * H;
      float* ro = residual_out + (long)t * H;
      for (int i = 0; i < H; ++i) ro[i] = h[i] + ri[i];
      h = ro;
    }
    const float ss = dot<H>(h, h);
    const float r = 1.0f / std::sqrt(ss / float(H) + eps);
    float* out = y + (long)t * H;
    for (int i = 0; i < H; ++i) out[i] = load_w(w[i]) * (h[i] * r);
  });
}

// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
//
// Register tiles of `rows` rows of x x gemm_cols(rows) outputs (dot_block), with 1-output tiles
// for the N tail. T <= kGemmRows (decode): a GEMV split into tasks of ~kGemvTaskBytes of weight rows,
// each weight row streamed once and shared by the T rows, with a software prefetch kGemvPrefetchBytes
// ahead (measured on SmolLM-135M's bf16 GEMVs, 1 thread: 7-9 -> 11-15 GB/s; fp32 unchanged, ~13 GB/s,
// the hardware prefetcher keeps up with its 2x longer rows). Larger T (prefill): blocks of kGemmTChunk rows x NB
// outputs (NB weight rows ~ kGemmBlockBytes, so they stay in L2), kGemmRows rows per tile.
// Every (row, output) is one dot_block accumulator over the same K, so numbers do not depend on T.
constexpr int kGemmRows = 4;
#if defined(__AVX512F__)
constexpr int gemm_cols(int rows) { return rows <= 2 ? 8 : 4; }  // <= 16 + 8 of 32 zmm registers
#else
constexpr int gemm_cols(int rows) { return rows <= 2 ? 4 : 2; }  // <= 8 + 4 of 16 ymm registers
#endif
constexpr long kGemvTaskBytes = 32 * 1024;  // weight bytes per parallel task in decode (>= 8 rows, a multiple of 8)
constexpr int kGemvPrefetchBytes = 16 * 1024;
constexpr int kGemmTChunk = 64;
constexpr long kGemmBlockBytes = 128 * 1024;

// y[r, j] for r < R and j in [j0, j1); x and y point at the first row.
template <int R, int N, int K, bool HAS_BIAS, int PF, typename WT>
LLMC_INLINE void gemm_tile_rows(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w,
                                const WT* LLMC_RESTRICT bias, float* LLMC_RESTRICT y, int j0, int j1) {
  constexpr int C = gemm_cols(R);
  int j = j0;
  for (; j + C <= j1; j += C) {
    float s[R * C];
    dot_block<R, C, K, WT, PF>(x, K, w + (long)j * K, K, s);
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const float b = HAS_BIAS ? load_w(bias[j + c]) : 0.0f;
      LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * N + j + c] = HAS_BIAS ? s[r * C + c] + b : s[r * C + c];
    }
  }
  for (; j < j1; ++j) {
    float s[R];
    dot_block<R, 1, K, WT, PF>(x, K, w + (long)j * K, K, s);
    const float b = HAS_BIAS ? load_w(bias[j]) : 0.0f;
    LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * N + j] = HAS_BIAS ? s[r] + b : s[r];
  }
}

template <int N, int K, bool HAS_BIAS, int PF = 0, typename WT>
LLMC_INLINE void gemm_rows(int rows, const float* x, const WT* w, const WT* bias, float* y, int j0, int j1) {
  static_assert(kGemmRows == 4, "gemm_rows: extend the switch");
  switch (rows) {
    case 1: gemm_tile_rows<1, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 2: gemm_tile_rows<2, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 3: gemm_tile_rows<3, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 4: gemm_tile_rows<4, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
  }
}

template <int N, int K, bool HAS_BIAS, typename WT>
inline void gemm(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w, const WT* LLMC_RESTRICT bias,
                 float* LLMC_RESTRICT y, int T) {
  constexpr int R = kGemmRows;
  const bool par = (long)T * N * K >= kParallelWork;
  constexpr long RB = (long)K * sizeof(WT);
  if (T <= R) {
    constexpr int CH = (int)std::max<long>(8, kGemvTaskBytes / RB / 8 * 8);
    constexpr int NCH = (N + CH - 1) / CH;
    parallel_for(NCH, par, [&](int ch) {
      gemm_rows<N, K, HAS_BIAS, kGemvPrefetchBytes>(T, x, w, bias, y, ch * CH, std::min(N, (ch + 1) * CH));
    });
    return;
  }
  constexpr int NB0 = (int)std::max<long>(16, kGemmBlockBytes / RB) / 8 * 8;
  constexpr int NB = NB0 < N ? NB0 : N;
  constexpr int NBLK = (N + NB - 1) / NB;
  const int ntc = (T + kGemmTChunk - 1) / kGemmTChunk;
  parallel_for(ntc * NBLK, par, [&](int task) {
    const int tc = task / NBLK, nb = task % NBLK;
    const int t1 = std::min(T, (tc + 1) * kGemmTChunk);
    const int j0 = nb * NB, j1 = std::min(N, j0 + NB);
    for (int t = tc * kGemmTChunk; t < t1; t += R)
      gemm_rows<N, K, HAS_BIAS>(std::min(R, t1 - t), x + (long)t * K, w, bias, y + (long)t * N, j0, j1);
  });
}

// rope, rotate-half convention (transformers' Llama): with c, s = cos, sin(float(pos) * inv_freq[i]),
//   x[i] = x[i] * c - x[i + D/2] * s,   x[i + D/2] = x[i + D/2] * c + x[i] * s,   i < D/2,
// in place on heads [0, NH) of each row (row t starts at x + t * row_stride).
template <int NH, int D>
inline void rope(float* x, int row_stride, const int32_t* positions, int T, const float* inv_freq) {
  static_assert(D % 2 == 0, "rope: odd head_dim");
  constexpr int HALF = D / 2;
  parallel_for(T, (long)T * NH * D >= kParallelWork, [&](int t) {
    float c[HALF], s[HALF];
    const float p = float(positions[t]);
    for (int i = 0; i < HALF; ++i) {
      const float a = p * inv_freq[i];
      c[i] = std::cos(a);
      s[i] = std::sin(a);
    }
    float* row = x + (long)t * row_stride;
    for (int h = 0; h < NH; ++h) {
      float* x1 = row + h * D;
      float* x2 = x1 + HALF;
      for (int i = 0; i < HALF; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  });
}

// paged attention over a ragged batch (docs/contracts.md, "The step").
// 1. Write this step's k/v rows (kv heads [0, NKV) of k/v + t*row_stride) to their cache slots;
//    a negative slot (padding) is skipped. Cache layout: [num_blocks, BS, NKV, D] each.
// 2. For each query token t of sequence b at position p and each head h: causal attention over
//    cache positions 0..p of b (W > 0, a sliding window: p-W+1..p) through its block table, kv head
//    h / (NH / NKV), online softmax in float32 (one rescale per cache block). One (t, h) is one task:
//    no reduction is split.
template <int NH, int NKV, int D, int BS, int W>
inline void paged_attention(const float* q, const float* k, const float* v, int row_stride, float* k_cache,
                            float* v_cache, const int64_t* slot_mapping, const int32_t* query_start_loc,
                            const int32_t* seq_lens, const int32_t* block_tables, int max_blocks, int B,
                            float* out, float scale) {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  constexpr int GROUP = NH / NKV;
  constexpr long SLOT = (long)NKV * D;  // floats per cache slot
  const int T = query_start_loc[B];

  parallel_for(T, (long)T * SLOT >= kParallelWork, [&](int t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;
    std::memcpy(k_cache + slot * SLOT, k + (long)t * row_stride, sizeof(float) * SLOT);
    std::memcpy(v_cache + slot * SLOT, v + (long)t * row_stride, sizeof(float) * SLOT);
  });

  long work = 0;  // rough multiply-adds, to decide whether to go parallel
  for (int b = 0; b < B; ++b) work += (long)(query_start_loc[b + 1] - query_start_loc[b]) * seq_lens[b];
  parallel_for(T * NH, work * NH * D >= kParallelWork, [&](int task) {
    const int t = task / NH, h = task % NH;
    // sequence of token t: the last b with query_start_loc[b] <= t
    const int b = int(std::upper_bound(query_start_loc, query_start_loc + B + 1, t) - query_start_loc) - 1;
    const int n_new = query_start_loc[b + 1] - query_start_loc[b];
    const int ctx = seq_lens[b] - n_new + (t - query_start_loc[b]) + 1;  // positions 0..p
    const int first = W > 0 ? std::max(0, ctx - W) : 0;                   // the window's first position
    const float* qh = q + (long)t * row_stride + h * D;
    const long kvo = (long)(h / GROUP) * D;
    const int32_t* table = block_tables + (long)b * max_blocks;

    float acc[D] = {};
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    for (int j0 = first - first % BS; j0 < ctx; j0 += BS) {
      const int lo = std::max(0, first - j0), n = std::min(BS, ctx - j0);  // this block's positions [lo, n)
      const long base = (long)table[j0 / BS] * BS * SLOT + kvo;
      float sc[BS];
      float mb = m;
      int i = lo;
      for (; i + 4 <= n; i += 4) dot_block<1, 4, D>(qh, 0, k_cache + base + i * SLOT, SLOT, sc + i);
      for (; i < n; ++i) sc[i] = dot<D>(qh, k_cache + base + i * SLOT);
      for (i = lo; i < n; ++i) {
        sc[i] *= scale;
        mb = std::max(mb, sc[i]);
      }
      if (mb > m) {  // new running max: rescale what we have (exp(-inf) = 0 on the first block)
        const float corr = std::exp(m - mb);
        l *= corr;
        scale_inplace<D>(corr, acc);
        m = mb;
      }
      for (int i = lo; i < n; ++i) {
        const float p = std::exp(sc[i] - m);
        l += p;
        axpy<D>(p, v_cache + base + i * SLOT, acc);
      }
    }
    float* o = out + (long)t * NH * D + h * D;
    const float inv = 1.0f / l;
    for (int d = 0; d < D; ++d) o[d] = acc[d] * inv;
  });
}

// silu_mul: out[t, i] = silu(gate[t, i]) * up[t, i], gate_up = [gate | up] per row;
// silu(g) = g / (1 + exp(-g)) as torch computes it.
template <int I>
inline void silu_mul(const float* LLMC_RESTRICT gate_up, float* LLMC_RESTRICT out, int T) {
  parallel_for(T, (long)T * I >= kParallelWork, [&](int t) {
    const float* g = gate_up + (long)t * 2 * I;
    const float* u = g + I;
    float* o = out + (long)t * I;
    for (int i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
}

// gather_rows: out[i, :] = x[rows[i], :] for i < n (e.g. the rows that produce logits).
template <int C>
inline void gather_rows(const float* LLMC_RESTRICT x, const int32_t* rows, int n, float* LLMC_RESTRICT out) {
  for (int i = 0; i < n; ++i) std::memcpy(out + (long)i * C, x + (long)rows[i] * C, sizeof(float) * C);
}

// --- calling TVM-generated fallback kernels (tvm_call.cc.j2) ---------------------------------------
// TVM's C backend exports `int32_t f(void* self, TVMFFIAny* args, int32_t num_args, TVMFFIAny* result)`,
// where each tensor argument is a DLTensor pointer. These mirror dlpack's DLTensor and tvm-ffi's TVMFFIAny
// (both fixed C ABIs), so model.cc needs neither project's headers.
struct DLTensorABI {
  void* data;
  int32_t device_type, device_id;  // DLDevice
  int32_t ndim;
  uint8_t code, bits;  // DLDataType
  uint16_t lanes;
  const int64_t* shape;
  const int64_t* strides;
  uint64_t byte_offset;
};
static_assert(sizeof(DLTensorABI) == 48, "DLTensor is 48 bytes");
struct FFIAnyABI {
  int32_t type_index;
  uint32_t zero_padding;
  void* v_ptr;
};
static_assert(sizeof(FFIAnyABI) == 16, "TVMFFIAny is 16 bytes");
using TvmFunc = int32_t (*)(void*, void*, int32_t, void*);
constexpr int32_t kFFIDLTensorPtr = 7, kDLCPU = 1, kDLFloat = 2;

// Calls f on N float32 CPU tensors; nonzero when TVM's argument checks fail (message on stderr).
template <int N>
inline int call_tvm(TvmFunc f, float* const (&data)[N], const int64_t* const (&shapes)[N], const int (&ndims)[N]) {
  DLTensorABI tensors[N];
  FFIAnyABI args[N];
  for (int i = 0; i < N; ++i) {
    tensors[i] = DLTensorABI{data[i], kDLCPU, 0, ndims[i], kDLFloat, 32, 1, shapes[i], nullptr, 0};
    args[i] = FFIAnyABI{kFFIDLTensorPtr, 0, &tensors[i]};
  }
  FFIAnyABI result{0, 0, nullptr};
  return f(nullptr, args, N, &result);
}

}  // namespace llmc
