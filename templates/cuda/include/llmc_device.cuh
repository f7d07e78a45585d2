// llmc_device.cuh: the device header every generated .cu includes. It compiles under nvcc (sm_80+) and,
// with g++ -DLLMC_SIMULATOR, against the simulator (sim/llmc_sim.h), which emulates the inline-PTX wrappers
// below from the PTX fragment layouts.
//
//   LLMC_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)   the only way to launch a kernel
//                       (wrap a template-id with commas in parentheses: LLMC_LAUNCH((k<64, 4>), ...))
//                       (with llmc::launch_timing().on, CUDA events bracket it: `llmc profile` on a GPU)
//   LLMC_DYNAMIC_SMEM(type, name)    inside a kernel: `type* name` points at the dynamic shared memory
//                       (16-byte aligned; never write `extern __shared__` directly)
//   LLMC_DEVICE_ARRAY(type, name, count), LLMC_REGISTER_DEVICE_ARRAY(name)   a kernel's global scratch
//   llmc::warp_sum / warp_max, llmc::block_sum / block_max       reductions (1-D blocks, blockDim.x % 32 == 0)
//   llmc::bf16_to_float, load_bf16x2/x4/x8, pack_bf16x2 / pack_f16x2 (mma operands)
//   llmc::mma_m16n8k16_bf16 / _f16  (f32 accumulate), llmc::ldmatrix_x1/x2/x4[_trans],
//   llmc::cp_async_16 / cp_async_16_zfill / cp_async_commit / cp_async_wait<N> / cp_async_wait_all
#pragma once

#ifdef LLMC_SIMULATOR
#include "sim/llmc_sim.h"
#define LLMC_SITE_DECL , const char *llmc_file_ = __builtin_FILE(), int llmc_line_ = __builtin_LINE()
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define LLMC_SITE_DECL
#endif
#include <stdint.h>

#include <vector>

// LLMC_DEVICE_ARRAY(type, name, count): a global array of device memory, zero at load (a __device__
// variable; 256-byte aligned), that device code names directly: a kernel's scratch. Under the simulator it is a
// static array, which the launcher registers with LLMC_REGISTER_DEVICE_ARRAY(name) so that the profiler counts
// its accesses as global memory.
#ifdef LLMC_SIMULATOR
#define LLMC_DEVICE_ARRAY(type, name, count) alignas(256) static type name[count]
#define LLMC_REGISTER_DEVICE_ARRAY(name) ::llmc_sim::device_array(name, sizeof(name))
#else
#define LLMC_DEVICE_ARRAY(type, name, count) __device__ __align__(256) type name[count]
#define LLMC_REGISTER_DEVICE_ARRAY(name) ((void)0)
#endif

#ifdef LLMC_SIMULATOR
#define LLMC_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)        \
  do {                                                                    \
    ::llmc::TimedLaunch llmc_timed_launch_(#kernel, (stream));             \
    ::llmc_sim::launch(kernel, grid, block, smem_bytes, stream, ##__VA_ARGS__); \
  } while (0)
#define LLMC_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::llmc_sim::dynamic_smem())
#else
#define LLMC_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)          \
  do {                                                                      \
    ::llmc::TimedLaunch llmc_timed_launch_(#kernel, (stream));               \
    kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__);        \
  } while (0)
#define LLMC_DYNAMIC_SMEM(type, name)                                 \
  extern __shared__ __align__(16) unsigned char llmc_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(llmc_dynamic_smem_)
#endif

namespace llmc {

constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------------------
// Per-launch timing for `llmc profile` on a GPU. While `on`, every LLMC_LAUNCH records a CUDA event on its
// stream before and after the kernel, so an elapsed time is the kernel's GPU time, not its launch cost.
// (Under the simulator an event holds the host clock.) Events are reused across steps; a host that turns
// timing on runs its steps without CUDA graphs, which would capture the events as graph nodes.
struct LaunchTiming {
  struct Launch {
    const char* kernel;
    cudaEvent_t start, stop;
    int experts = 0;  // an expert GEMM's: the experts it read (record_launch_experts)
  };
  bool on = false;
  std::vector<Launch> launches;  // since the last clear(), in launch order
  std::vector<cudaEvent_t> spare;

  cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    if (spare.empty()) {
      cudaEventCreate(&e);
    } else {
      e = spare.back();
      spare.pop_back();
    }
    return e;
  }
  void clear() {
    for (const Launch& l : launches) {
      spare.push_back(l.start);
      spare.push_back(l.stop);
    }
    launches.clear();
  }
};
inline LaunchTiming& launch_timing() {
  static LaunchTiming timing;
  return timing;
}
class TimedLaunch {
 public:
  TimedLaunch(const char* kernel, cudaStream_t stream) : stream_(stream) {
    LaunchTiming& t = launch_timing();
    if (!t.on) return;
    stop_ = t.event();
    t.launches.push_back({kernel, t.event(), stop_});
    cudaEventRecord(t.launches.back().start, stream_);
  }
  ~TimedLaunch() {
    if (stop_) cudaEventRecord(stop_, stream_);
  }
  TimedLaunch(const TimedLaunch&) = delete;
  TimedLaunch& operator=(const TimedLaunch&) = delete;

 private:
  cudaStream_t stream_;
  cudaEvent_t stop_ = nullptr;
};

// While timing is on: the experts the last launch read, for `llmc profile` (an expert GEMM's launcher).
inline void record_launch_experts(int experts) {
  LaunchTiming& t = launch_timing();
  if (t.on && !t.launches.empty()) t.launches.back().experts = experts;
}

// ---------------------------------------------------------------------------------------------------
// reductions
struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  static __device__ __forceinline__ float identity() { return -INFINITY; }
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Every lane of the WIDTH-lane group gets the result (butterfly through __shfl_xor_sync).
template <class Op, int WIDTH = 32>
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = Op()(v, __shfl_xor_sync(kFullMask, v, o, WIDTH));
  return v;
}
template <int WIDTH = 32>
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce<SumOp, WIDTH>(v); }
template <int WIDTH = 32>
__device__ __forceinline__ float warp_max(float v) { return warp_reduce<MaxOp, WIDTH>(v); }

// Every thread of the (1-D, blockDim.x % 32 == 0) block gets the result. Contains two __syncthreads, so
// every thread must call it; it may be called repeatedly.
template <class Op>
__device__ __forceinline__ float block_reduce(float v) {
  __shared__ float llmc_scratch[32];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce<Op>(v);
  if (lane == 0) llmc_scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? llmc_scratch[lane] : Op::identity();
  v = warp_reduce<Op>(v);
  __syncthreads();  // the scratch may be reused by the next call
  return v;
}
__device__ __forceinline__ float block_sum(float v) { return block_reduce<SumOp>(v); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<MaxOp>(v); }

// ---------------------------------------------------------------------------------------------------
// One vector access of sizeof(T) = 8 or 16 bytes (float2, uint2, float4, uint4; p aligned to it), as the GPU
// issues it: one LD/ST.64 or .128 per thread. Every vector load and store of device code goes through these:
// under the simulator, g++ splits a plain struct copy into its 4-byte fields (scalar replacement), and the
// profiler's counters (sim/llmc_sim_profile.h) would see four narrow accesses per lane where the GPU makes one,
// with a quarter of the sector efficiency. A volatile GCC vector access is never split.
template <typename T>
__device__ __forceinline__ T vload(const void* p) {
#ifdef LLMC_SIMULATOR
  static_assert(sizeof(T) == 8 || sizeof(T) == 16, "vload: 8 or 16 bytes");
  typedef int V __attribute__((vector_size(sizeof(T))));
  const V v = *static_cast<const volatile V*>(p);
  T r;
  __builtin_memcpy(&r, &v, sizeof(T));
  return r;
#else
  return *static_cast<const T*>(p);
#endif
}
template <typename T>
__device__ __forceinline__ void vstore(void* p, const T& x) {
#ifdef LLMC_SIMULATOR
  static_assert(sizeof(T) == 8 || sizeof(T) == 16, "vstore: 8 or 16 bytes");
  typedef int V __attribute__((vector_size(sizeof(T))));
  V v;
  __builtin_memcpy(&v, &x, sizeof(T));
  *static_cast<volatile V*>(p) = v;
#else
  *static_cast<T*>(p) = x;
#endif
}

// An in-place update's store pointer. Under the simulator, GCC's AddressSanitizer pass drops the check of a
// store to an address the same basic block has just loaded (redundant for ASan), so the profiler would count
// a read-modify-write as a load only; an opaque copy of the pointer keeps that check. A no-op under nvcc.
template <typename T>
__device__ __forceinline__ T* store_ptr(T* p) {
#ifdef LLMC_SIMULATOR
  asm("" : "+r"(p));
#endif
  return p;
}

// ---------------------------------------------------------------------------------------------------
// bf16 loads (pointers aligned to the load width) and bf16 / fp16 packing. Element 2j of a packed pair is
// the low half of the 32-bit word (PTX register packing).
__device__ __forceinline__ float bf16_to_float(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
__device__ __forceinline__ void unpack_bf16x2(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ float2 load_bf16x2(const void* p) {
  float2 r;
  unpack_bf16x2(*static_cast<const uint32_t*>(p), r.x, r.y);
  return r;
}
__device__ __forceinline__ void load_bf16x4(const void* p, float (&out)[4]) {
  const uint2 v = vload<uint2>(p);
  unpack_bf16x2(v.x, out[0], out[1]);
  unpack_bf16x2(v.y, out[2], out[3]);
}
__device__ __forceinline__ void load_bf16x8(const void* p, float (&out)[8]) {
  const uint4 v = vload<uint4>(p);
  unpack_bf16x2(v.x, out[0], out[1]);
  unpack_bf16x2(v.y, out[2], out[3]);
  unpack_bf16x2(v.z, out[4], out[5]);
  unpack_bf16x2(v.w, out[6], out[7]);
}
// (lo, hi) -> one 32-bit register, lo in bits 15:0, round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col, f32 accumulate: d = a * b + c for the warp's 16x8 tile.
// Fragments (g = lane / 4, t = lane % 4, register r, half h):
//   a[r] = A(g + 8*(r&1), 2t + h + 8*(r>>1)),  b[r] = B(k = 2t + h + 8r, n = g),
//   c[i], d[i] = C(g + 8*(i>>1), 2t + (i&1)).   d may alias c. All 32 lanes must call it together.
// The simulator gathers the operands of all 32 lanes at once (sim/llmc_sim_mma.h).
#ifdef LLMC_SIMULATOR
#define LLMC_MMA_M16N8K16(NAME, AB, IS_F16)                                                            \
  __device__ __forceinline__ void NAME(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],    \
                                       const float (&c)[4] LLMC_SITE_DECL) {                            \
    llmc_sim::Thread& t = llmc_sim::self();                                                            \
    t.p[0] = a, t.p[1] = b, t.p[2] = c, t.q = d;                                                       \
    llmc_sim::warp_op(llmc_sim::Op::Mma, kFullMask, 0, IS_F16, 0, llmc_file_, llmc_line_);             \
  }
#else
#define LLMC_MMA_M16N8K16(NAME, AB, IS_F16)                                                                \
  __device__ __forceinline__ void NAME(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],        \
                                       const float (&c)[4]) {                                               \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "   \
                 "{%8,%9}, {%10,%11,%12,%13};\n"                                                            \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), \
                   "f"(c[2]), "f"(c[3]));                                                                   \
  }
#endif
LLMC_MMA_M16N8K16(mma_m16n8k16_bf16, "bf16", 0)
LLMC_MMA_M16N8K16(mma_m16n8k16_f16, "f16", 1)
#undef LLMC_MMA_M16N8K16

// ---------------------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16. Lane 8j + i passes the (16-byte aligned) shared
// address of row i of matrix j (x1: lanes 0-7, x2: 0-15, x4: all). Lane t receives in r[j]
// {M_j[t/4][2(t%4)], M_j[t/4][2(t%4)+1]} (lo, hi); with .trans the same of M_j transposed.
// LLMC_LDMATRIX(name, NUM matrices, TRANS, PTX registers, r's output operands): NUM is also the PTX operand
// number of the address.
#ifdef LLMC_SIMULATOR
#define LLMC_LDMATRIX(NAME, NUM, TRANS, ...)                                                     \
  __device__ __forceinline__ void NAME(uint32_t (&r)[NUM], const void* smem_row LLMC_SITE_DECL) { \
    llmc_sim::Thread& t = llmc_sim::self();                                                      \
    t.p[0] = smem_row, t.q = r;                                                                  \
    llmc_sim::warp_op(llmc_sim::Op::Ldmatrix, kFullMask, 0, NUM, TRANS, llmc_file_, llmc_line_); \
  }
#else
#define LLMC_LDMATRIX_SUFFIX0 ""
#define LLMC_LDMATRIX_SUFFIX1 ".trans"
#define LLMC_LDMATRIX(NAME, NUM, TRANS, REGS, ...)                                                          \
  __device__ __forceinline__ void NAME(uint32_t (&r)[NUM], const void* smem_row) {                          \
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));                        \
    asm volatile("ldmatrix.sync.aligned.m8n8.x" #NUM LLMC_LDMATRIX_SUFFIX##TRANS ".shared.b16 " REGS ", [%" \
                 #NUM "];\n" : __VA_ARGS__ : "r"(addr));                                                    \
  }
#endif
LLMC_LDMATRIX(ldmatrix_x1, 1, 0, "{%0}", "=r"(r[0]))
LLMC_LDMATRIX(ldmatrix_x2, 2, 0, "{%0,%1}", "=r"(r[0]), "=r"(r[1]))
LLMC_LDMATRIX(ldmatrix_x4, 4, 0, "{%0,%1,%2,%3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
LLMC_LDMATRIX(ldmatrix_x1_trans, 1, 1, "{%0}", "=r"(r[0]))
LLMC_LDMATRIX(ldmatrix_x2_trans, 2, 1, "{%0,%1}", "=r"(r[0]), "=r"(r[1]))
LLMC_LDMATRIX(ldmatrix_x4_trans, 4, 1, "{%0,%1,%2,%3}", "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]))
#undef LLMC_LDMATRIX
#undef LLMC_LDMATRIX_SUFFIX0
#undef LLMC_LDMATRIX_SUFFIX1

// ---------------------------------------------------------------------------------------------------
// cp.async (global -> shared, 16 bytes, both 16-byte aligned). The data may be read only after this thread's
// cp_async_wait that covers its group, and by other threads only after a __syncthreads that follows it.
// The simulator writes the destination only at that wait (0xFF bytes until then).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src LLMC_SITE_DECL) {
#ifdef LLMC_SIMULATOR
  llmc_sim::cp_async(smem_dst, gmem_src, 16, 16, llmc_file_, llmc_line_);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem_src) : "memory");
#endif
}
// Reads src_bytes (0..16) from gmem_src and zero-fills the rest; with 0, gmem_src is not read.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, int src_bytes LLMC_SITE_DECL) {
#ifdef LLMC_SIMULATOR
  llmc_sim::cp_async(smem_dst, gmem_src, 16, src_bytes, llmc_file_, llmc_line_);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem_src), "r"(src_bytes) : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef LLMC_SIMULATOR
  llmc_sim::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef LLMC_SIMULATOR
  llmc_sim::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
// Commits the uncommitted copies, then waits for all.
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef LLMC_SIMULATOR
  llmc_sim::cp_async_commit();
  llmc_sim::cp_async_wait(0);
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace llmc
