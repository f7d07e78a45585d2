// llmc_sim.h: the llmc CUDA simulator. A .cu file compiled by g++ with -DLLMC_SIMULATOR includes this
// header (through llmc_device.cuh) instead of the CUDA runtime, and runs its kernels on the host CPU.
//
// Model:
// - The threads of a block run as ucontext fibers on the calling OS thread; blocks run one at a time, in an
//   order shuffled with the seed. threadIdx/blockIdx/blockDim/gridDim are globals set by the scheduler.
// - A thread runs until it reaches a sync point (__syncthreads, a warp primitive, __nanosleep) or exits.
//   Which runnable thread goes next is chosen at random from the seed (LLMC_SIM_SEED, or
//   llmc_sim_set_seed()), so a data race shows up as a result that changes with the seed.
// - Warp primitives (shuffles, votes, __syncwarp, mma, ldmatrix) are barriers among the lanes of the mask:
//   all of them arrive, the values are exchanged, then all continue. The lanes must agree on the op, the
//   mask and the call site; .aligned ops (mma, ldmatrix) need all 32 lanes.
// - __syncthreads completes when every thread of the block waits at the same __syncthreads. A thread that
//   exited before it, a warp op that can never complete, or threads at different barriers are reported as an
//   error ("llmc_sim: error: ...") and abort() instead of hanging.
// - Static __shared__ variables are C++ statics (blocks run one at a time, so all threads of the block see
//   the same storage); they start zeroed and keep their values from block to block. The dynamic shared
//   memory buffer (LLMC_DYNAMIC_SMEM) is filled with 0xFF bytes before every block, so reading dynamic
//   shared memory the block did not write gives NaN / -1.
// - cp.async (llmc_device.cuh wrappers) reads its source at issue, fills the destination with 0xFF bytes,
//   and writes the data only at the cp_async_wait that retires its group, so a read before the wait shows.
// - mma.sync / ldmatrix gather the operands of all 32 lanes by the PTX fragment layouts; mma products are
//   exact and summed in double (hardware differs in the last bits: compare with a tolerance).
// - Built with -fsanitize=address, fiber switches are annotated for ASan. Fiber stacks are 64 KB (256 KB under
//   ASan), or LLMC_SIM_STACK_KB / llmc_sim_set_stack_size(bytes); an overflow is reported as such.
// - cudaMalloc & co. work on host memory, so host code compiles unchanged. Launches are serialized; a bad
//   launch configuration sets the error that cudaGetLastError() returns, as on a GPU.
// Build: compiler/codegen/simulator.py build_simulated() (g++ -x c++ -std=c++17 -O1 -DLLMC_SIMULATOR
// -I templates/cuda/include -I <cuda>/include -fPIC -shared).
// Limits: no preemption between sync points (a thread spinning on a value another thread of the block
// writes must call __nanosleep in the loop, or it hangs); no inter-block waiting; memory visibility is
// sequentially consistent (weak-memory bugs other than missing barriers are not exposed).
#pragma once
#ifndef LLMC_SIMULATOR
#error "llmc_sim.h is the g++ simulator header: compile with -DLLMC_SIMULATOR, or include llmc_device.cuh"
#endif

#include <ucontext.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>  // before __noinline__ is defined: shared_ptr_base.h spells __attribute__((__noinline__))
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define LLMC_SIM_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// CUDA qualifiers. Defined before CUDA's headers, which keep definitions that already exist.
#define __host__
#define __device__
#define __global__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static

// <cuda_runtime.h> / <cuda_runtime_api.h> become no-ops (cuda_fp16.h would pull in the latter): this header
// defines the runtime functions itself, with C++ linkage, so they never bind to a libcudart in the process.
#ifndef __CUDA_RUNTIME_H__
#define __CUDA_RUNTIME_H__
#endif
#ifndef __CUDA_RUNTIME_API_H__
#define __CUDA_RUNTIME_API_H__
#endif
#include <driver_types.h>
#include <vector_types.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

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

inline void retire_group(std::vector<CpAsync>& ops) {
  for (CpAsync& op : ops) std::memcpy(op.dst, op.data, static_cast<size_t>(op.size));
  ops.clear();
}

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
// warp-level exchange
inline unsigned live_lanes(unsigned w) {
  unsigned m = 0;
  for (unsigned l = 0; l < 32; ++l) {
    unsigned i = 32 * w + l;
    if (i < g.nthreads && g.th[i].st != St::Exited) m |= 1u << l;
  }
  return m;
}

inline float bits_to_float(uint16_t b, bool f16) {
  if (f16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 from the PTX fragment layouts:
// A: lane 4*(m%8) + (k%8)/2, reg m/8 + 2*(k/8), half k%2; B: lane 4*n + (k%8)/2, reg k/8, half k%2;
// C/D: lane 4*(m%8) + n/2, reg 2*(m/8) + n%2. Products are exact; the sum is done in double.
inline void do_mma(unsigned w) {
  Thread* L = &g.th[32 * w];
  const bool f16 = L[0].a0 == 1;
  auto half_of = [](uint32_t reg, int h) { return static_cast<uint16_t>(h ? reg >> 16 : reg & 0xffff); };
  float A[16][16], B[16][8], C[16][8];
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const uint32_t* a = static_cast<const uint32_t*>(L[4 * (m % 8) + (k % 8) / 2].p[0]);
      A[m][k] = bits_to_float(half_of(a[m / 8 + 2 * (k / 8)], k % 2), f16);
    }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      const uint32_t* b = static_cast<const uint32_t*>(L[4 * n + (k % 8) / 2].p[1]);
      B[k][n] = bits_to_float(half_of(b[k / 8], k % 2), f16);
    }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) C[m][n] = static_cast<const float*>(L[4 * (m % 8) + n / 2].p[2])[2 * (m / 8) + n % 2];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[m][k]) * static_cast<double>(B[k][n]);
      static_cast<float*>(L[4 * (m % 8) + n / 2].q)[2 * (m / 8) + n % 2] = static_cast<float>(acc);
    }
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: lane 8j+r gives the address of row r of
// matrix j; lane t's register j = {M_j[t/4][2(t%4)], M_j[t/4][2(t%4)+1]} (.trans: M_j transposed).
inline void do_ldmatrix(unsigned w) {
  Thread* L = &g.th[32 * w];
  const int num = L[0].a0;
  const bool trans = L[0].a1 != 0;
  uint16_t M[4][8][8];
  for (int j = 0; j < num; ++j)
    for (int r = 0; r < 8; ++r) {
      const void* row = L[8 * j + r].p[0];
      if (reinterpret_cast<uintptr_t>(row) % 16)
        fatal("ldmatrix: lane %d gives a row address %p that is not 16-byte aligned (%s:%d)", 8 * j + r, row,
              L[0].file, L[0].line);
      std::memcpy(M[j][r], row, 16);
    }
  for (int t = 0; t < 32; ++t) {
    uint32_t* regs = static_cast<uint32_t*>(L[t].q);
    for (int j = 0; j < num; ++j) {
      uint16_t lo, hi;
      if (!trans) {
        lo = M[j][t / 4][2 * (t % 4)];
        hi = M[j][t / 4][2 * (t % 4) + 1];
      } else {
        lo = M[j][2 * (t % 4)][t / 4];
        hi = M[j][2 * (t % 4) + 1][t / 4];
      }
      regs[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

inline bool same_site(const Thread& a, const Thread& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

inline void exchange(unsigned w, unsigned group, Op op) {
  Thread* L = &g.th[32 * w];
  const Thread& first = L[__builtin_ctz(group)];
  switch (op) {
    case Op::Syncwarp: break;
    case Op::ShflIdx: case Op::ShflUp: case Op::ShflDown: case Op::ShflXor:
      for (unsigned l = 0; l < 32; ++l) {
        if (!(group >> l & 1)) continue;
        const int width = L[l].a1, v = L[l].a0;
        if (width < 1 || width > 32 || (width & (width - 1)))
          fatal("%s: width %d is not a power of two in 1..32 (%s:%d)", op_name(op), width, L[l].file, L[l].line);
        const unsigned base = l & ~static_cast<unsigned>(width - 1), end = base + width - 1;
        unsigned src = l;
        if (op == Op::ShflIdx) src = base + (static_cast<unsigned>(v) & 31u) % static_cast<unsigned>(width);
        else if (op == Op::ShflUp) { int s = static_cast<int>(l) - (v & 31); if (s >= static_cast<int>(base)) src = s; }
        else if (op == Op::ShflDown) { unsigned s = l + (v & 31); if (s <= end) src = s; }
        else { unsigned s = l ^ (v & 31); if (s <= end) src = s; }
        if (!(group >> src & 1))
          fatal("%s: lane %u reads lane %u, which is not in the mask 0x%08x or has exited (%s:%d)", op_name(op), l,
                src, L[l].mask, L[l].file, L[l].line);
        L[l].out = L[src].in;
      }
      return;
    default: break;
  }
  if (op == Op::Mma || op == Op::Ldmatrix) {
    if (group != 0xffffffffu)
      fatal("%s needs all 32 lanes of the warp (the warp has lanes 0x%08x alive) (%s:%d)", op_name(op), group,
            first.file, first.line);
    if (op == Op::Mma) do_mma(w); else do_ldmatrix(w);
    return;
  }
  if (op == Op::Syncwarp) return;
  uint64_t r = 0;
  bool init = false;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(group >> l & 1)) continue;
    const uint64_t x = L[l].in;
    const uint32_t u = static_cast<uint32_t>(x);
    const int32_t s = static_cast<int32_t>(u);
    switch (op) {
      case Op::Ballot: r |= (x != 0 ? 1ull : 0ull) << l; break;
      case Op::Any: r |= (x != 0); break;
      case Op::All: r = (init ? r : 1) & (x != 0); break;
      case Op::ReduxAddU: r = static_cast<uint32_t>(r + u); break;
      case Op::ReduxMinU: r = init ? std::min<uint32_t>(static_cast<uint32_t>(r), u) : u; break;
      case Op::ReduxMaxU: r = init ? std::max<uint32_t>(static_cast<uint32_t>(r), u) : u; break;
      case Op::ReduxMinI: r = static_cast<uint32_t>(init ? std::min<int32_t>(static_cast<int32_t>(r), s) : s); break;
      case Op::ReduxMaxI: r = static_cast<uint32_t>(init ? std::max<int32_t>(static_cast<int32_t>(r), s) : s); break;
      case Op::ReduxAnd: r = init ? (r & u) : u; break;
      case Op::ReduxOr: r |= u; break;
      case Op::ReduxXor: r ^= u; break;
      default: fatal("internal: unknown warp op");
    }
    init = true;
  }
  for (unsigned l = 0; l < 32; ++l)
    if (group >> l & 1) L[l].out = r;
}

// Completes every group of lanes of warp w whose lanes have all arrived at the same primitive (op, mask and
// call site). A group whose lanes wait at different primitives stays blocked; if nothing else can run, that
// is reported as a deadlock.
inline void try_warp(unsigned w) {
  const unsigned live = live_lanes(w);
  unsigned waiting = 0;
  for (unsigned l = 0; l < 32; ++l) {
    unsigned i = 32 * w + l;
    if (i < g.nthreads && g.th[i].st == St::Warp) waiting |= 1u << l;
  }
  unsigned todo = waiting;
  while (todo) {
    const unsigned l0 = static_cast<unsigned>(__builtin_ctz(todo));
    todo &= todo - 1;
    const Thread& t0 = g.th[32 * w + l0];
    if (!(t0.mask >> l0 & 1))
      fatal("%s: lane %u calls it with mask 0x%08x, which does not include the lane itself (%s:%d)", op_name(t0.op),
            l0, t0.mask, t0.file, t0.line);
    const unsigned group = t0.mask & live;
    if (group & ~waiting) continue;  // lanes still running, or stuck elsewhere (see deadlock)
    bool same = true;
    for (unsigned l = 0; l < 32 && same; ++l) {
      const Thread& t = g.th[32 * w + l];
      same = !(group >> l & 1) || (t.op == t0.op && t.mask == t0.mask && same_site(t, t0));
    }
    if (!same) continue;
    exchange(w, group, t0.op);
    waiting &= ~group;
    todo &= ~group;
    for (unsigned l = 0; l < 32; ++l)
      if (group >> l & 1) {
        g.th[32 * w + l].st = St::Runnable;
        g.runnable.push_back(static_cast<int>(32 * w + l));
      }
  }
}

inline uint64_t warp_op(Op op, unsigned mask, uint64_t in, int a0, int a1, const char* file, int line) {
  Thread& t = self();
  t.op = op;
  t.mask = mask;
  t.in = in;
  t.a0 = a0;
  t.a1 = a1;
  t.file = file;
  t.line = line;
  t.st = St::Warp;
  to_scheduler();
  t.op = Op::None;
  return t.out;
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

__attribute__((no_sanitize_address)) inline void poison(void* p, size_t n) {
  volatile unsigned char* c = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) c[i] = 0xFF;
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

// A fault in a fiber stack's guard page is a stack overflow: say so instead of a bare "Segmentation fault".
// (ASan builds report it themselves.) Any other fault goes on to the handler that was there before.
inline struct sigaction g_old_segv;
inline bool g_segv_installed = false;
inline void segv_handler(int, siginfo_t* info, void* uctx) {
  const char* a = static_cast<const char*>(info->si_addr);
  bool overflow = g.stacks && a >= g.stacks && a < g.stacks + g.stacks_len &&
                  static_cast<size_t>(a - g.stacks) % g.stack_stride < g.stack_stride - g.stack_size;
  if (g.in_kernel && g.cur >= 0) {  // a big frame jumps over the guard page: look at the stack pointer
    const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
    uintptr_t sp = 0;
#if defined(__x86_64__)
    sp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
#elif defined(__aarch64__)
    sp = static_cast<uintptr_t>(uc->uc_mcontext.sp);
#endif
    overflow |= sp && sp < reinterpret_cast<uintptr_t>(stack_of(g.cur));
  }
  if (overflow) {
    char msg[300];
    const int n = std::snprintf(msg, sizeof msg, "llmc_sim: error: fiber stack overflow in block (%u,%u,%u), thread "
                                "(%u,%u,%u): the stack is %zu KB; raise it with LLMC_SIM_STACK_KB or "
                                "llmc_sim_set_stack_size()\n", g_bid.x, g_bid.y, g_bid.z, g_tid.x, g_tid.y, g_tid.z,
                                g.stack_size / 1024);
    if (write(2, msg, static_cast<size_t>(n)) < 0) {}
    signal(SIGABRT, SIG_DFL);
    std::abort();
  }
  sigaction(SIGSEGV, &g_old_segv, nullptr);  // the fault repeats and reaches the previous handler
  g_segv_installed = false;
}
inline void install_segv_handler() {
#if !defined(LLMC_SIM_ASAN)
  if (g_segv_installed) return;
  stack_t cur;
  if (sigaltstack(nullptr, &cur) == 0 && (cur.ss_flags & SS_DISABLE)) {  // the handler needs its own stack
    static char alt[64 * 1024];
    stack_t st{};
    st.ss_sp = alt;
    st.ss_size = sizeof alt;
    sigaltstack(&st, nullptr);
  }
  struct sigaction sa{};
  sa.sa_sigaction = segv_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGSEGV, &sa, &g_old_segv) == 0) g_segv_installed = true;
#endif
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
  for (size_t b : order) {
    g_bid = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                  static_cast<unsigned>(b / (1ull * grid.x * grid.y))};
    run_block();
  }
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

inline void* dynamic_smem() {
  if (!g.in_kernel) fatal("dynamic shared memory used outside a kernel");
  return g.dyn_smem;
}

// cp.async
inline void cp_async(void* dst, const void* src, int cp_size, int src_size, const char* file, int line) {
  Thread& t = self();
  if (reinterpret_cast<uintptr_t>(dst) % cp_size || (src_size > 0 && reinterpret_cast<uintptr_t>(src) % cp_size))
    fatal("cp.async of %d bytes: dst %p / src %p not aligned to %d bytes (%s:%d)", cp_size, dst, src, cp_size, file, line);
  if (src_size < 0 || src_size > cp_size) fatal("cp.async: src-size %d not in 0..%d (%s:%d)", src_size, cp_size, file, line);
  CpAsync op;
  op.dst = dst;
  op.size = cp_size;
  std::memset(op.data, 0, sizeof op.data);
  if (src_size > 0) std::memcpy(op.data, src, static_cast<size_t>(src_size));
  std::memset(dst, 0xFF, static_cast<size_t>(cp_size));  // the destination is garbage until the copy is waited for
  t.uncommitted.push_back(op);
}
inline void cp_async_commit() {
  Thread& t = self();
  t.groups.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
}
inline void cp_async_wait(int n) {
  Thread& t = self();
  while (t.groups.size() > static_cast<size_t>(n)) {
    retire_group(t.groups.front());
    t.groups.erase(t.groups.begin());
  }
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
// synchronization and warp primitives (the call site is recorded for error messages)
#define LLMC_SIM_SITE const char *llmc_file_ = __builtin_FILE(), int llmc_line_ = __builtin_LINE()

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
inline void __syncwarp(unsigned mask = 0xffffffffu, LLMC_SIM_SITE) {
  llmc_sim::warp_op(llmc_sim::Op::Syncwarp, mask, 0, 0, 32, llmc_file_, llmc_line_);
}

namespace llmc_sim {
template <class T>
inline T shfl(Op op, unsigned mask, T var, int v, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");  // __half2 & co. are not trivially copyable
  uint64_t in = 0;
  std::memcpy(&in, &var, sizeof(T));
  uint64_t out = warp_op(op, mask, in, v, width, file, line);
  T r;
  std::memcpy(&r, &out, sizeof(T));
  return r;
}
}  // namespace llmc_sim

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflIdx, mask, var, srcLane, width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflUp, mask, var, static_cast<int>(delta), width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflDown, mask, var, static_cast<int>(delta), width, llmc_file_, llmc_line_);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, LLMC_SIM_SITE) {
  return llmc_sim::shfl(llmc_sim::Op::ShflXor, mask, var, laneMask, width, llmc_file_, llmc_line_);
}
inline unsigned __ballot_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<unsigned>(llmc_sim::warp_op(llmc_sim::Op::Ballot, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline int __any_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<int>(llmc_sim::warp_op(llmc_sim::Op::Any, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline int __all_sync(unsigned mask, int pred, LLMC_SIM_SITE) {
  return static_cast<int>(llmc_sim::warp_op(llmc_sim::Op::All, mask, pred != 0, 0, 32, llmc_file_, llmc_line_));
}
inline unsigned __activemask() {
  llmc_sim::self();
  return llmc_sim::live_lanes(static_cast<unsigned>(llmc_sim::g.cur) / 32);
}
#define LLMC_SIM_REDUX(name, T, op)                                                                       \
  inline T name(unsigned mask, T value, LLMC_SIM_SITE) {                                                  \
    return static_cast<T>(llmc_sim::warp_op(llmc_sim::Op::op, mask, static_cast<uint32_t>(value), 0, 32, \
                                            llmc_file_, llmc_line_));                                     \
  }
LLMC_SIM_REDUX(__reduce_add_sync, unsigned, ReduxAddU)
LLMC_SIM_REDUX(__reduce_add_sync, int, ReduxAddU)
LLMC_SIM_REDUX(__reduce_min_sync, unsigned, ReduxMinU)
LLMC_SIM_REDUX(__reduce_min_sync, int, ReduxMinI)
LLMC_SIM_REDUX(__reduce_max_sync, unsigned, ReduxMaxU)
LLMC_SIM_REDUX(__reduce_max_sync, int, ReduxMaxI)
LLMC_SIM_REDUX(__reduce_and_sync, unsigned, ReduxAnd)
LLMC_SIM_REDUX(__reduce_or_sync, unsigned, ReduxOr)
LLMC_SIM_REDUX(__reduce_xor_sync, unsigned, ReduxXor)
#undef LLMC_SIM_REDUX

inline void __nanosleep(unsigned) {  // a scheduling point: lets a spin-wait loop make progress
  llmc_sim::Thread& t = llmc_sim::self();
  t.st = llmc_sim::St::Runnable;
  llmc_sim::to_scheduler();
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
[[noreturn]] inline void __trap() { llmc_sim::fatal("__trap() called"); }
inline long long clock64() {
  static long long c = 0;
  return c += 1000;
}

// cached/streaming loads and stores: plain accesses
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------------------------------
// atomics: fibers switch only at sync points, so a plain read-modify-write is atomic
#define LLMC_SIM_ATOMIC(name, T, expr) \
  inline T name(T* address, T val) {   \
    T old = *address;                  \
    *address = (expr);                 \
    return old;                        \
  }
LLMC_SIM_ATOMIC(atomicAdd, int, old + val)
LLMC_SIM_ATOMIC(atomicAdd, unsigned, old + val)
LLMC_SIM_ATOMIC(atomicAdd, unsigned long long, old + val)
LLMC_SIM_ATOMIC(atomicAdd, float, old + val)
LLMC_SIM_ATOMIC(atomicAdd, double, old + val)
LLMC_SIM_ATOMIC(atomicAdd, __half, __float2half(__half2float(old) + __half2float(val)))
LLMC_SIM_ATOMIC(atomicAdd, __nv_bfloat16, __float2bfloat16(__bfloat162float(old) + __bfloat162float(val)))
LLMC_SIM_ATOMIC(atomicAdd, __half2, __floats2half2_rn(__low2float(old) + __low2float(val), __high2float(old) + __high2float(val)))
LLMC_SIM_ATOMIC(atomicAdd, __nv_bfloat162, __floats2bfloat162_rn(__low2float(old) + __low2float(val), __high2float(old) + __high2float(val)))
LLMC_SIM_ATOMIC(atomicSub, int, old - val)
LLMC_SIM_ATOMIC(atomicSub, unsigned, old - val)
LLMC_SIM_ATOMIC(atomicExch, int, val)
LLMC_SIM_ATOMIC(atomicExch, unsigned, val)
LLMC_SIM_ATOMIC(atomicExch, unsigned long long, val)
LLMC_SIM_ATOMIC(atomicExch, float, val)
LLMC_SIM_ATOMIC(atomicMin, int, val < old ? val : old)
LLMC_SIM_ATOMIC(atomicMin, unsigned, val < old ? val : old)
LLMC_SIM_ATOMIC(atomicMin, long long, val < old ? val : old)
LLMC_SIM_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
LLMC_SIM_ATOMIC(atomicMax, int, val > old ? val : old)
LLMC_SIM_ATOMIC(atomicMax, unsigned, val > old ? val : old)
LLMC_SIM_ATOMIC(atomicMax, long long, val > old ? val : old)
LLMC_SIM_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
LLMC_SIM_ATOMIC(atomicAnd, int, old & val)
LLMC_SIM_ATOMIC(atomicAnd, unsigned, old & val)
LLMC_SIM_ATOMIC(atomicAnd, unsigned long long, old & val)
LLMC_SIM_ATOMIC(atomicOr, int, old | val)
LLMC_SIM_ATOMIC(atomicOr, unsigned, old | val)
LLMC_SIM_ATOMIC(atomicOr, unsigned long long, old | val)
LLMC_SIM_ATOMIC(atomicXor, int, old ^ val)
LLMC_SIM_ATOMIC(atomicXor, unsigned, old ^ val)
LLMC_SIM_ATOMIC(atomicXor, unsigned long long, old ^ val)
LLMC_SIM_ATOMIC(atomicInc, unsigned, old >= val ? 0u : old + 1)
LLMC_SIM_ATOMIC(atomicDec, unsigned, (old == 0 || old > val) ? val : old - 1)
#undef LLMC_SIM_ATOMIC
#define LLMC_SIM_CAS(T)                                   \
  inline T atomicCAS(T* address, T compare, T val) {      \
    T old = *address;                                     \
    if (old == compare) *address = val;                   \
    return old;                                           \
  }
LLMC_SIM_CAS(int)
LLMC_SIM_CAS(unsigned)
LLMC_SIM_CAS(unsigned long long)
LLMC_SIM_CAS(unsigned short)
#undef LLMC_SIM_CAS

// ---------------------------------------------------------------------------------------------------
// math intrinsics (exact libm versions of the fast approximations)
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((static_cast<uint64_t>(hi) << 32) | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((static_cast<uint64_t>(hi) << 32) | lo) >> (s & 31)));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((1ull * a * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((1ll * a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffff) * (b & 0xffffff); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// fp16 / bf16 math that CUDA's headers declare for the device only: computed in float, rounded once
#define LLMC_SIM_HMATH(name, name2, expr)                                                        \
  inline __half name(__half a) { const float x = __half2float(a); return __float2half(expr); }   \
  inline __nv_bfloat16 name(__nv_bfloat16 a) {                                                   \
    const float x = __bfloat162float(a);                                                         \
    return __float2bfloat16(expr);                                                               \
  }                                                                                              \
  inline __half2 name2(__half2 a) {                                                              \
    const float lo = [](float x) { return expr; }(__low2float(a));                               \
    const float hi = [](float x) { return expr; }(__high2float(a));                              \
    return __floats2half2_rn(lo, hi);                                                            \
  }                                                                                              \
  inline __nv_bfloat162 name2(__nv_bfloat162 a) {                                                \
    const float lo = [](float x) { return expr; }(__low2float(a));                               \
    const float hi = [](float x) { return expr; }(__high2float(a));                              \
    return __floats2bfloat162_rn(lo, hi);                                                        \
  }
LLMC_SIM_HMATH(hexp, h2exp, expf(x))
LLMC_SIM_HMATH(hexp2, h2exp2, exp2f(x))
LLMC_SIM_HMATH(hlog, h2log, logf(x))
LLMC_SIM_HMATH(hlog2, h2log2, log2f(x))
LLMC_SIM_HMATH(hsqrt, h2sqrt, sqrtf(x))
LLMC_SIM_HMATH(hrsqrt, h2rsqrt, 1.0f / sqrtf(x))
LLMC_SIM_HMATH(hrcp, h2rcp, 1.0f / x)
LLMC_SIM_HMATH(hsin, h2sin, sinf(x))
LLMC_SIM_HMATH(hcos, h2cos, cosf(x))
#undef LLMC_SIM_HMATH
inline __half __hfma(__half a, __half b, __half c) {
  return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c)));
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16(fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __floats2half2_rn(fmaf(__low2float(a), __low2float(b), __low2float(c)),
                           fmaf(__high2float(a), __high2float(b), __high2float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __floats2bfloat162_rn(fmaf(__low2float(a), __low2float(b), __low2float(c)),
                               fmaf(__high2float(a), __high2float(b), __high2float(c)));
}

// ---------------------------------------------------------------------------------------------------
// host runtime API on host memory
inline cudaError_t llmc_sim_ret(cudaError_t e) {
  if (e != cudaSuccess) llmc_sim::g.last_error = e;
  return e;
}
inline cudaError_t cudaMalloc(void** p, size_t n) {
  *p = nullptr;
  if (n == 0) return cudaSuccess;
  if (posix_memalign(p, 256, n)) return llmc_sim_ret(cudaErrorMemoryAllocation);
  return cudaSuccess;
}
template <class T> inline cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaMallocHost(void** p, size_t n) { return cudaMalloc(p, n); }
template <class T> inline cudaError_t cudaMallocHost(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaMallocManaged(void** p, size_t n, unsigned = 1) { return cudaMalloc(p, n); }
template <class T> inline cudaError_t cudaMallocManaged(T** p, size_t n, unsigned = 1) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaFreeHost(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  if (n) std::memcpy(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind k, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, n, k);
}
inline cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                                cudaMemcpyKind) {
  for (size_t r = 0; r < height; ++r)
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int v, size_t n) {
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = nullptr) { return cudaMemset(p, v, n); }
template <class T>
inline cudaError_t cudaMemcpyToSymbol(T& symbol, const void* src, size_t n, size_t offset = 0,
                                      cudaMemcpyKind = cudaMemcpyHostToDevice) {
  std::memcpy(reinterpret_cast<char*>(&symbol) + offset, src, n);
  return cudaSuccess;
}
template <class T>
inline cudaError_t cudaMemcpyFromSymbol(void* dst, const T& symbol, size_t n, size_t offset = 0,
                                        cudaMemcpyKind = cudaMemcpyDeviceToHost) {
  std::memcpy(dst, reinterpret_cast<const char*>(&symbol) + offset, n);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = reinterpret_cast<cudaStream_t>(new char(0));
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return cudaStreamCreate(s); }
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<char*>(s);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
  cudaError_t e = llmc_sim::g.last_error;
  llmc_sim::g.last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return llmc_sim::g.last_error; }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unknown error (simulator)";
  }
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    default: return "cudaErrorUnknown";
  }
}
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
template <class... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > 227 * 1024) return llmc_sim_ret(cudaErrorInvalidValue);
    llmc_sim::g.max_dyn_smem[reinterpret_cast<const void*>(kernel)] = value;
  }
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------------
// entry points for a host (e.g. Python through ctypes) that loads the built .so
extern "C" {
__attribute__((used, visibility("default"))) inline void llmc_sim_set_seed(unsigned long long seed) {
  llmc_sim::set_seed(seed);
}
__attribute__((used, visibility("default"))) inline void llmc_sim_set_stack_size(unsigned long long bytes) {
  llmc_sim::g.stack_request = bytes;
}
__attribute__((used, visibility("default"))) inline int llmc_sim_get_last_error() {
  return static_cast<int>(cudaGetLastError());
}
}
