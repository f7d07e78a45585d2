// llmc CPU target: the thread pool behind parallel_for.
#pragma once

#include "llmc_base.h"

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
// whatever llmc_pool.h each was built from. (A model.so with workers running must not be dlclose()d; ctypes
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

  // The threads a parallel launch runs on: the caller and the workers.
  static int threads() {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    return std::min(threads, kMaxThreads);
  }

  void run(int n, Fn fn, void* ctx) {
    const int threads = Pool::threads();
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

LLMC_INLINE int pool_threads() { return Pool::threads(); }

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

}  // namespace llmc
