// llmc_sim_memory.h (part of llmc_sim.h): memory and its checks. Dynamic shared memory is a per-launch
// buffer poisoned before every block; cp.async lands only at the wait that retires it; a fault in a fiber's
// guard page is reported as a stack overflow (ASan builds report it themselves); the host runtime API
// (cudaMalloc, cudaMemcpy, errors, streams) works on host memory, so host code compiles unchanged.
#pragma once

namespace llmc_sim {

// dynamic shared memory: filled with 0xFF before each block (run_block), so a read of what the block did not
// write shows as NaN / -1
__attribute__((no_sanitize_address)) inline void poison(void* p, size_t n) {
  volatile unsigned char* c = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) c[i] = 0xFF;
}

inline void* dynamic_smem() {
  if (!g.in_kernel) fatal("dynamic shared memory used outside a kernel");
  return g.dyn_smem;
}

// cp.async: each thread's copies, in its uncommitted list and its committed groups
LLMC_SIM_UNCOUNTED inline void retire_group(std::vector<CpAsync>& ops) {
  for (CpAsync& op : ops) std::memcpy(op.dst, op.data, static_cast<size_t>(op.size));
  ops.clear();
}
LLMC_SIM_UNCOUNTED inline void cp_async(void* dst, const void* src, int cp_size, int src_size, const char* file, int line) {
  Thread& t = self();
  if (reinterpret_cast<uintptr_t>(dst) % cp_size || (src_size > 0 && reinterpret_cast<uintptr_t>(src) % cp_size))
    fatal("cp.async of %d bytes: dst %p / src %p not aligned to %d bytes (%s:%d)", cp_size, dst, src, cp_size, file, line);
  if (src_size < 0 || src_size > cp_size) fatal("cp.async: src-size %d not in 0..%d (%s:%d)", src_size, cp_size, file, line);
  CpAsync op;
  op.dst = dst;
  op.size = cp_size;
  std::memset(op.data, 0, sizeof op.data);
  if (src_size > 0) std::memcpy(op.data, src, static_cast<size_t>(src_size));
  // the global read; each call site's k-th copy by a warp's lanes is one warp-wide access
  LLMC_SIM_PROF(llmc_sim_prof_access(src, static_cast<size_t>(src_size), 0,
                                     reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(file) + line)));
  std::memset(dst, 0xFF, static_cast<size_t>(cp_size));  // the destination is garbage until the copy is waited for
  t.uncommitted.push_back(op);
}
LLMC_SIM_UNCOUNTED inline void cp_async_commit() {
  Thread& t = self();
  t.groups.push_back(std::move(t.uncommitted));
  t.uncommitted.clear();
}
LLMC_SIM_UNCOUNTED inline void cp_async_wait(int n) {
  Thread& t = self();
  while (t.groups.size() > static_cast<size_t>(n)) {
    retire_group(t.groups.front());
    t.groups.erase(t.groups.begin());
  }
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

}  // namespace llmc_sim

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
// host runtime API on host memory
inline cudaError_t llmc_sim_ret(cudaError_t e) {
  if (e != cudaSuccess) llmc_sim::g.last_error = e;
  return e;
}
namespace llmc_sim {
// A kernel's static device array (LLMC_DEVICE_ARRAY): global memory to the profiler, as a cudaMalloc'ed block
// is; registered by its launcher before each launch (idempotent).
inline void device_array(const void* p, size_t n) {
  (void)p, (void)n;
  LLMC_SIM_PROF(llmc_sim_prof_alloc(p, n));
}
}  // namespace llmc_sim

inline cudaError_t cudaMalloc(void** p, size_t n) {
  *p = nullptr;
  if (n == 0) return cudaSuccess;
  if (posix_memalign(p, 256, n)) return llmc_sim_ret(cudaErrorMemoryAllocation);
  LLMC_SIM_PROF(llmc_sim_prof_alloc(*p, n));
  return cudaSuccess;
}
template <class T> inline cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaMallocHost(void** p, size_t n) { return cudaMalloc(p, n); }
template <class T> inline cudaError_t cudaMallocHost(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaMallocManaged(void** p, size_t n, unsigned = 1) { return cudaMalloc(p, n); }
template <class T> inline cudaError_t cudaMallocManaged(T** p, size_t n, unsigned = 1) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaFree(void* p) {
  LLMC_SIM_PROF(llmc_sim_prof_free(p));
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
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
template <class T>
inline cudaError_t cudaMemcpyFromSymbolAsync(void* dst, const T& symbol, size_t n, size_t offset = 0,
                                             cudaMemcpyKind k = cudaMemcpyDeviceToHost, cudaStream_t = nullptr) {
  return cudaMemcpyFromSymbol(dst, symbol, n, offset, k);
}
template <class T>
inline cudaError_t cudaGetSymbolAddress(void** p, const T& symbol) {
  *p = const_cast<void*>(static_cast<const void*>(&symbol));
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
// Events: a launch here is done when it returns, so an event holds the host clock when it is recorded and an
// elapsed time is the simulator's wall time, not a GPU's: host code that times its kernels runs unchanged.
struct CUevent_st {
  std::chrono::steady_clock::time_point t;
};
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st{};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  e->t = std::chrono::steady_clock::now();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->t - start->t).count();
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
