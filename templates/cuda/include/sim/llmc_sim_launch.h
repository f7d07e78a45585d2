// llmc_sim_launch.h (part of llmc_sim.h): the block scheduler and kernel launch. A launch checks the
// configuration as a GPU would, then runs the blocks one at a time in a seeded order; run_block starts one
// fiber per thread and, until all have exited, resumes a random runnable one, completes warp collectives
// whose lanes have all arrived, and releases a __syncthreads once every thread waits at it. When nothing can
// run, deadlock() says who waits where.
#pragma once

namespace llmc_sim {

inline void fiber_main() {
#if defined(LLMC_SIM_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &g.sched_stack_bottom, &g.sched_stack_size);
#endif
  g.invoke(g.args);
  Thread& t = g.th[g.cur];
  for (auto& grp : t.groups) retire_group(grp);  // copies still in flight when the thread exits land
  retire_group(t.uncommitted);
  t.groups.clear();
  t.st = St::Exited;
  to_scheduler();
  fatal("internal: an exited fiber was resumed");
}

// ---------------------------------------------------------------------------------------------------
// the block scheduler
[[noreturn]] inline void deadlock() {
  std::fflush(stdout);
  unsigned nbar = 0, nwarp = 0;
  for (unsigned i = 0; i < g.nthreads; ++i) {
    nbar += g.th[i].st == St::Barrier;
    nwarp += g.th[i].st == St::Warp;
  }
  std::fprintf(stderr, "llmc_sim: error: deadlock in block (%u,%u,%u) of %u threads: %u exited, %u wait at "
               "__syncthreads, %u wait at a warp primitive\n", g_bid.x, g_bid.y, g_bid.z, g.nthreads, g.nexited,
               nbar, nwarp);
  std::vector<bool> told(g.nthreads, false);
  for (unsigned i = 0; i < g.nthreads; ++i) {  // one line per distinct sync point
    const Thread& t = g.th[i];
    if (told[i] || (t.st != St::Barrier && t.st != St::Warp)) continue;
    if (t.st == St::Barrier) {
      unsigned n = 0;
      for (unsigned j = i; j < g.nthreads; ++j)
        if (g.th[j].st == St::Barrier && same_site(g.th[j], t)) told[j] = true, ++n;
      std::fprintf(stderr, "  %u threads (first: %u) wait at __syncthreads at %s:%d\n", n, i, t.file, t.line);
      continue;
    }
    const unsigned w = i / 32;
    unsigned here = 0;
    for (unsigned l = 0; l < 32; ++l) {
      const unsigned j = 32 * w + l;
      if (j < g.nthreads && g.th[j].st == St::Warp && g.th[j].op == t.op && g.th[j].mask == t.mask &&
          same_site(g.th[j], t))
        told[j] = true, here |= 1u << l;
    }
    const unsigned live = live_lanes(w);
    std::fprintf(stderr, "  warp %u: lanes 0x%08x wait at %s (mask 0x%08x) at %s:%d; lanes of the mask not there: "
                 "0x%08x (of them exited: 0x%08x)\n", w, here, op_name(t.op), t.mask, t.file, t.line,
                 t.mask & ~here, t.mask & ~live);
  }
  if (nbar && g.nexited)
    std::fprintf(stderr, "  a __syncthreads must be reached by every thread of the block; %u threads exited "
                 "before it\n", g.nexited);
  if (nwarp)
    std::fprintf(stderr, "  the lanes of a warp primitive's mask must all reach it, at the same call site and "
                 "with the same mask\n");
  std::fflush(stderr);
  std::abort();
}

inline bool release_barrier() {
  int first = -1;
  for (unsigned i = 0; i < g.nthreads; ++i) {
    const Thread& t = g.th[i];
    if (t.st != St::Barrier) return false;
    if (first < 0) first = static_cast<int>(i);
    else if (!same_site(t, g.th[first]))
      fatal("threads of block (%u,%u,%u) wait at different __syncthreads: thread %d at %s:%d, thread %u at %s:%d",
            g_bid.x, g_bid.y, g_bid.z, first, g.th[first].file, g.th[first].line, i, t.file, t.line);
  }
  uint64_t count = 0;
  for (unsigned i = 0; i < g.nthreads; ++i) count += g.th[i].in != 0;
  for (unsigned i = 0; i < g.nthreads; ++i) {
    g.th[i].out = count;
    g.th[i].st = St::Runnable;
    g.runnable.push_back(static_cast<int>(i));
  }
  return true;
}

inline void run_block() {
  if (g.dyn_smem_bytes) poison(g.dyn_smem, g.dyn_smem_bytes);
  const unsigned bx = g_bdim.x, by = g_bdim.y;
  g.runnable.clear();
  for (unsigned i = 0; i < g.nthreads; ++i) {
    Thread& t = g.th[i];
    t.st = St::Runnable;
    t.tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    t.op = Op::None;
    t.uncommitted.clear();
    t.groups.clear();
    char* stack = stack_of(static_cast<int>(i));
#if defined(LLMC_SIM_ASAN)
    __asan_unpoison_memory_region(stack, g.stack_size);
#endif
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stack;
    t.ctx.uc_stack.ss_size = g.stack_size;
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, fiber_main, 0);
    g.runnable.push_back(static_cast<int>(i));
  }
  g.nexited = 0;
  LLMC_SIM_PROF(llmc_sim_prof_block_begin());
  for (;;) {
    if (g.runnable.empty()) {
      if (g.nexited == g.nthreads) break;
      if (!release_barrier()) deadlock();
      continue;
    }
    const size_t k = next_random() % g.runnable.size();
    const int i = g.runnable[k];
    g.runnable[k] = g.runnable.back();
    g.runnable.pop_back();
    switch_to(i);
    const St st = g.th[i].st;
    if (st == St::Runnable) g.runnable.push_back(i);
    else if (st == St::Exited) { ++g.nexited; try_warp(static_cast<unsigned>(i) / 32); }
    else if (st == St::Warp) try_warp(static_cast<unsigned>(i) / 32);
  }
  LLMC_SIM_PROF(llmc_sim_prof_block_end());
}

inline void launch_error(cudaError_t e, const char* fmt, ...) {
  g.last_error = e;
  std::fflush(stdout);
  std::fprintf(stderr, "llmc_sim: launch failed: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
}

inline void launch_impl(const void* kernel, dim3 grid, dim3 block, size_t smem, void (*invoke)(void*), void* args) {
  std::lock_guard<std::recursive_mutex> lock(g.launch_mutex);
  if (g.in_kernel) fatal("a kernel was launched from inside a kernel (not supported by the simulator)");
  const unsigned long long nthreads = 1ull * block.x * block.y * block.z;
  if (nthreads == 0 || nthreads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    return launch_error(cudaErrorInvalidConfiguration, "block (%u,%u,%u) is not a valid block shape", block.x,
                        block.y, block.z);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    return launch_error(cudaErrorInvalidConfiguration, "grid (%u,%u,%u) is not a valid grid shape", grid.x, grid.y,
                        grid.z);
  size_t limit = 48 * 1024;
  auto it = g.max_dyn_smem.find(kernel);
  if (it != g.max_dyn_smem.end()) limit = static_cast<size_t>(it->second);
  if (smem > limit)
    return launch_error(cudaErrorInvalidValue, "%zu bytes of dynamic shared memory exceed the kernel's limit of %zu "
                        "(raise it with cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, n))",
                        smem, limit);
  g.nthreads = static_cast<unsigned>(nthreads);
  if (g.th.size() < g.nthreads) g.th.resize(g.nthreads);
  ensure_stacks(g.nthreads);
  install_segv_handler();
  g.invoke = invoke;
  g.args = args;
  g.dyn_smem_bytes = smem;
  void* buf = nullptr;
  if (posix_memalign(&buf, 128, smem ? smem : 1)) fatal("out of memory for %zu bytes of dynamic shared memory", smem);
  g.dyn_smem = static_cast<unsigned char*>(buf);
  g_gdim = grid;
  g_bdim = block;
  const size_t nblocks = 1ull * grid.x * grid.y * grid.z;
  std::vector<size_t> order(nblocks);
  for (size_t b = 0; b < nblocks; ++b) order[b] = b;
  for (size_t b = nblocks; b > 1; --b) std::swap(order[b - 1], order[next_random() % b]);
  g.in_kernel = true;
  LLMC_SIM_PROF(llmc_sim_prof_launch_begin(kernel));
  for (size_t b : order) {
    g_bid = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                  static_cast<unsigned>(b / (1ull * grid.x * grid.y))};
    run_block();
  }
  LLMC_SIM_PROF(llmc_sim_prof_launch_end());
  g.in_kernel = false;
  std::free(buf);
  g.dyn_smem = nullptr;
  g.dyn_smem_bytes = 0;
}

template <class F, class Tuple>
struct LaunchArgs {
  F kernel;
  Tuple params;
  static void invoke(void* p) {
    auto* self = static_cast<LaunchArgs*>(p);
    Tuple copy = self->params;  // kernel parameters are per-thread copies
    std::apply(self->kernel, copy);
  }
};

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "LLMC_LAUNCH: wrong number of kernel arguments");
  using Tuple = std::tuple<std::decay_t<P>...>;
  LaunchArgs<void (*)(P...), Tuple> la{kernel, Tuple(std::forward<A>(args)...)};
  launch_impl(reinterpret_cast<const void*>(kernel), grid, block, smem, &LaunchArgs<void (*)(P...), Tuple>::invoke,
              &la);
}

}  // namespace llmc_sim

// ---------------------------------------------------------------------------------------------------
// built-in variables
inline const uint3& threadIdx = llmc_sim::g_tid;
inline const uint3& blockIdx = llmc_sim::g_bid;
inline const dim3& blockDim = llmc_sim::g_bdim;
inline const dim3& gridDim = llmc_sim::g_gdim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------------
// __syncthreads and its counting variants
inline int llmc_sim_barrier(int pred, const char* file, int line) {
  llmc_sim::Thread& t = llmc_sim::self();
  t.in = pred != 0;
  t.file = file;
  t.line = line;
  t.st = llmc_sim::St::Barrier;
  llmc_sim::to_scheduler();
  return static_cast<int>(t.out);
}
inline void __syncthreads(LLMC_SIM_SITE) { llmc_sim_barrier(0, llmc_file_, llmc_line_); }
inline int __syncthreads_count(int pred, LLMC_SIM_SITE) { return llmc_sim_barrier(pred, llmc_file_, llmc_line_); }
inline int __syncthreads_and(int pred, LLMC_SIM_SITE) {
  return llmc_sim_barrier(pred, llmc_file_, llmc_line_) == static_cast<int>(llmc_sim::g.nthreads);
}
inline int __syncthreads_or(int pred, LLMC_SIM_SITE) { return llmc_sim_barrier(pred, llmc_file_, llmc_line_) != 0; }

inline void __nanosleep(unsigned) {  // a scheduling point: lets a spin-wait loop make progress
  llmc_sim::Thread& t = llmc_sim::self();
  t.st = llmc_sim::St::Runnable;
  llmc_sim::to_scheduler();
}
// Blocks run one at a time and a thread yields only at sync points: a read-modify-write is atomic as it stands.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
[[noreturn]] inline void __trap() { llmc_sim::fatal("__trap() called"); }
inline long long clock64() {
  static long long c = 0;
  return c += 1000;
}
