// llmc_sim_fibers.h (part of llmc_sim.h, which includes it first): the simulator's state and its threads.
// Each CUDA thread of the block being run is a ucontext fiber with its own mmap'ed stack (a guard page below
// it); a fiber runs until it reaches a sync point, then swaps back to the block scheduler (llmc_sim_launch.h).
// The Thread record says which sync point it waits at and carries what it brings there. fatal() is the one
// error exit; next_random() is the seeded choice that shuffles threads and blocks.
#pragma once

namespace llmc_sim {

enum class St : uint8_t { Runnable, Barrier, Warp, Exited };
enum class Op : uint8_t {
  None, Syncwarp, ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All,
  ReduxAddU, ReduxMinU, ReduxMaxU, ReduxMinI, ReduxMaxI, ReduxAnd, ReduxOr, ReduxXor, Mma, Ldmatrix
};
inline const char* op_name(Op op) {
  static const char* names[] = {"none", "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                "__reduce_add_sync", "__reduce_min_sync", "__reduce_max_sync",
                                "__reduce_min_sync", "__reduce_max_sync", "__reduce_and_sync",
                                "__reduce_or_sync", "__reduce_xor_sync", "mma.sync", "ldmatrix"};
  return names[static_cast<int>(op)];
}

struct CpAsync {  // one cp.async: the source bytes are read at issue, the destination written at retire
  void* dst;
  int size;
  unsigned char data[16];
};

struct Thread {
  ucontext_t ctx;
  St st = St::Exited;
  uint3 tid{};
  // The sync point the thread waits at, and the data it brings.
  const char* file = nullptr;
  int line = 0;
  Op op = Op::None;
  unsigned mask = 0;
  uint64_t in = 0, out = 0;
  int a0 = 0, a1 = 0;
  const void* p[3] = {nullptr, nullptr, nullptr};
  void* q = nullptr;
  // cp.async state
  std::vector<CpAsync> uncommitted;
  std::vector<std::vector<CpAsync>> groups;
#if defined(LLMC_SIM_ASAN)
  void* fake_stack = nullptr;
#endif
};

struct Engine {
  std::vector<Thread> th;
  unsigned nthreads = 0, nexited = 0;
  int cur = -1;
  bool in_kernel = false;
  std::vector<int> runnable;
  ucontext_t sched;
  // fiber stacks (mmap'ed, one guard page below each)
  char* stacks = nullptr;
  size_t stacks_len = 0, stack_size = 0, stack_stride = 0, stacks_n = 0;
  size_t stack_request = 0;  // bytes; 0 = default / LLMC_SIM_STACK_KB
  // kernel being launched
  void (*invoke)(void*) = nullptr;
  void* args = nullptr;
  unsigned char* dyn_smem = nullptr;
  size_t dyn_smem_bytes = 0;
  // randomness
  uint64_t rng = 0;
  bool seeded = false;
  // host API state
  cudaError_t last_error = cudaSuccess;
  std::unordered_map<const void*, int> max_dyn_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize
  std::recursive_mutex launch_mutex;
#if defined(LLMC_SIM_ASAN)
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
#endif
};
inline Engine g;

inline uint3 g_tid{}, g_bid{};
inline dim3 g_bdim, g_gdim;

// ---------------------------------------------------------------------------------------------------
// errors
[[noreturn]] inline void fatal(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "llmc_sim: error: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  if (g.in_kernel && g.cur >= 0)
    std::fprintf(stderr, "\n  (in block (%u,%u,%u), thread (%u,%u,%u); grid (%u,%u,%u), block dim (%u,%u,%u))",
                 g_bid.x, g_bid.y, g_bid.z, g_tid.x, g_tid.y, g_tid.z, g_gdim.x, g_gdim.y, g_gdim.z,
                 g_bdim.x, g_bdim.y, g_bdim.z);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

// ---------------------------------------------------------------------------------------------------
// seed and random choice (splitmix64)
inline void set_seed(uint64_t seed) {
  g.rng = seed;
  g.seeded = true;
}
inline uint64_t next_random() {
  if (!g.seeded) {
    const char* s = std::getenv("LLMC_SIM_SEED");
    set_seed(s && *s ? std::strtoull(s, nullptr, 0) : 1);
  }
  uint64_t z = (g.rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---------------------------------------------------------------------------------------------------
// fibers
inline Thread& self() {
  if (!g.in_kernel || g.cur < 0) fatal("a device intrinsic was called outside a kernel launch");
  return g.th[g.cur];
}

inline void ensure_stacks(size_t n) {
  size_t want = g.stack_request;
  if (!want) {
    const char* s = std::getenv("LLMC_SIM_STACK_KB");
    want = (s && *s) ? std::strtoull(s, nullptr, 0) * 1024 : 64 * 1024;
#if defined(LLMC_SIM_ASAN)
    if (!(s && *s)) want *= 4;  // ASan frames carry redzones
#endif
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  want = (want + page - 1) / page * page;
  if (g.stacks && g.stacks_n >= n && g.stack_size == want) return;
  if (g.stacks) munmap(g.stacks, g.stacks_len);
  g.stack_size = want;
  g.stack_stride = want + page;
  g.stacks_n = n;
  g.stacks_len = n * g.stack_stride;
  void* mem = mmap(nullptr, g.stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) fatal("cannot map %zu fiber stacks of %zu KB", n, want / 1024);
  g.stacks = static_cast<char*>(mem);
  for (size_t i = 0; i < n; ++i) mprotect(g.stacks + i * g.stack_stride, page, PROT_NONE);  // guard page
}
inline char* stack_of(int i) {
  return g.stacks + static_cast<size_t>(i) * g.stack_stride + (g.stack_stride - g.stack_size);
}

inline void switch_to(int i) {  // scheduler -> fiber i
  g.cur = i;
  g_tid = g.th[i].tid;
#if defined(LLMC_SIM_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, stack_of(i), g.stack_size);
#endif
  swapcontext(&g.sched, &g.th[i].ctx);
#if defined(LLMC_SIM_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  g.cur = -1;
}

inline void to_scheduler() {  // current fiber -> scheduler; returns when the scheduler resumes it
  Thread& t = g.th[g.cur];
#if defined(LLMC_SIM_ASAN)
  __sanitizer_start_switch_fiber(t.st == St::Exited ? nullptr : &t.fake_stack, g.sched_stack_bottom,
                                 g.sched_stack_size);
#endif
  swapcontext(&t.ctx, &g.sched);
#if defined(LLMC_SIM_ASAN)
  __sanitizer_finish_switch_fiber(t.fake_stack, &g.sched_stack_bottom, &g.sched_stack_size);
#endif
}

inline bool same_site(const Thread& a, const Thread& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

}  // namespace llmc_sim

// The call site of a sync point, recorded for error messages: a trailing defaulted parameter of every
// intrinsic that can block.
#define LLMC_SIM_SITE const char *llmc_file_ = __builtin_FILE(), int llmc_line_ = __builtin_LINE()
