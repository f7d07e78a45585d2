// llmc_kernels.cuh: device code shared by the CUDA kernel templates (templates/cuda/*.cu.j2).
//
// The templates are thin: each renders `__global__` wrappers that call the static device functions of one
// config struct below (its template arguments are the op's compile-time parameters), plus one host launcher
// `static void name(<the CPU signature>, cudaStream_t stream)` that takes its grid and block from the same
// struct and launches through LLMC_LAUNCH. A generated model.cu includes this header once, before the kernels.
//
// Numerics: every accumulation is float32. Activations (the A of each config: the step's buffers), weights and
// the KV cache are float or uint16_t (bf16 bits), widened to float on load; a bf16 activation is rounded to
// nearest even where it is stored, at the points where transformers' bf16 modules round (a GEMM's output, the
// residual sum, the normalized row before its weight), and the tensor-core paths take it as it is (a float x
// is rounded to bf16 there). With float activations nothing rounds. Every result is
// computed by one thread, one warp or one block in a fixed order; the one split reduction (paged attention's
// KV splits) is combined in split order whichever block finishes last, its only atomic a counter. So a run is
// bit-reproducible (and seed-independent under the simulator). expf/sincosf/sqrtf/division are the accurate
// (non-fast-math) versions.
//
// Alignment: vector (16-byte) accesses are used only where the row length makes every row 16-byte aligned
// (decided at compile time), and assume 16-byte aligned base pointers (cudaMalloc'd buffers, offsets that are
// multiples of 16 bytes). The simulator checks every vector access and reports a misaligned one.
#pragma once

#include "llmc_device.cuh"

#include <stdint.h>

#ifdef LLMC_SIMULATOR
#define LLMC_CHECK_ALIGNED16(p)                                                                            \
  do {                                                                                                     \
    if (reinterpret_cast<uintptr_t>(p) % 16)                                                               \
      ::llmc_sim::fatal("%s:%d: 16-byte vector access at %p is misaligned (buffers must be 16-byte aligned)", \
                        __FILE__, __LINE__, static_cast<const void*>(p));                                 \
  } while (0)
#else
#define LLMC_CHECK_ALIGNED16(p) ((void)0)
#endif

namespace llmc {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }
__host__ __device__ constexpr int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }
// Threads for a row of n work items: a multiple of 32, at least 32, at most cap.
__host__ __device__ constexpr int row_threads(int n, int cap) { return clamp_int(round_up(n, 32), 32, cap); }
// Warps that share a GEMV's output rows at decode, each a k slice, their sums added in slice order: enough that
// row_groups times the split reach kGemvTargetWarps (about 16 warps on each SM of an H100) where N alone leaves
// the SMs short of loads in flight at batch 1; a power of two, at most max_split. A function of the shape
// alone, so that no tunable changes the numbers.
constexpr int kGemvTargetWarps = 2048;
__host__ __device__ constexpr int gemv_split(int row_groups, int max_split) {
  const int want = clamp_int(ceil_div(kGemvTargetWarps, row_groups), 1, max_split);
  return want >= 8 ? 8 : (want >= 4 ? 4 : (want >= 2 ? 2 : 1));
}
__host__ __device__ constexpr int largest_divisor_le(int n, int cap) {
  for (int d = cap; d > 1; --d)
    if (n % d == 0) return d;
  return 1;
}

// ---------------------------------------------------------------------------------------------------
// a weight, KV or activation element: float or uint16_t (bf16 bits) -> float
__device__ __forceinline__ float wload(float v) { return v; }
__device__ __forceinline__ float wload(uint16_t v) { return bf16_to_float(v); }

__device__ __forceinline__ float4 load4(const float* p) {
  LLMC_CHECK_ALIGNED16(p);
  return vload<float4>(p);
}
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
  LLMC_CHECK_ALIGNED16(p);
  vstore(p, float4{a, b, c, d});
}

// One 16-byte load of weights, widened: N elements.
template <typename W>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void load(const float* p, float (&o)[4]) {
    const float4 v = load4(p);
    o[0] = v.x, o[1] = v.y, o[2] = v.z, o[3] = v.w;
  }
};
template <>
struct Vec16<uint16_t> {
  static constexpr int N = 8;
  static __device__ __forceinline__ void load(const uint16_t* p, float (&o)[8]) {
    LLMC_CHECK_ALIGNED16(p);
    load_bf16x8(p, o);
  }
};

// ---------------------------------------------------------------------------------------------------
// activations: float, or uint16_t (bf16 bits)
__device__ __forceinline__ uint16_t bf16_bits(float v) { return pack_bf16x2(v, 0.0f) & 0xffffu; }
__device__ __forceinline__ void astore(float* p, float v) { *p = v; }
__device__ __forceinline__ void astore(uint16_t* p, float v) { *p = bf16_bits(v); }
// v as an activation of type A holds it: what a fused epilogue reads where the unfused kernel reads memory
template <typename A>
__device__ __forceinline__ float act_round(float v) {
  if constexpr (sizeof(A) == 2)
    return bf16_to_float(bf16_bits(v));
  else
    return v;
}
// Four consecutive activations (16 or 8 bytes, aligned to that), and two (8 or 4 bytes).
__device__ __forceinline__ void load_act4(const float* p, float (&o)[4]) { Vec16<float>::load(p, o); }
__device__ __forceinline__ void load_act4(const uint16_t* p, float (&o)[4]) { load_bf16x4(p, o); }
__device__ __forceinline__ void store_act4(float* p, float a, float b, float c, float d) { store4(p, a, b, c, d); }
__device__ __forceinline__ void store_act4(uint16_t* p, float a, float b, float c, float d) {
  vstore(p, uint2{pack_bf16x2(a, b), pack_bf16x2(c, d)});
}
__device__ __forceinline__ void store_act2(float* p, float a, float b) { vstore(p, float2{a, b}); }
__device__ __forceinline__ void store_act2(uint16_t* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = pack_bf16x2(a, b);
}
// V (a multiple of 4) consecutive activations from f: 16-byte stores where they hold 16 bytes.
template <int V>
__device__ __forceinline__ void store_acts(float* p, const float (&f)[V]) {
#pragma unroll
  for (int j = 0; j < V; j += 4) store4(p + j, f[j], f[j + 1], f[j + 2], f[j + 3]);
}
template <int V>
__device__ __forceinline__ void store_acts(uint16_t* p, const float (&f)[V]) {
  if constexpr (V % 8 == 0) {
#pragma unroll
    for (int j = 0; j < V; j += 8) {
      LLMC_CHECK_ALIGNED16(p + j);
      vstore(p + j, uint4{pack_bf16x2(f[j], f[j + 1]), pack_bf16x2(f[j + 2], f[j + 3]), pack_bf16x2(f[j + 4], f[j + 5]),
                          pack_bf16x2(f[j + 6], f[j + 7])});
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; j += 4) store_act4(p + j, f[j], f[j + 1], f[j + 2], f[j + 3]);
  }
}

// Copies a row of C elements from src to dst, threads [0, NT) of the block; 16 bytes at a time when the row
// is whole 16-byte pieces (row_pieces: how many, else 0).
template <typename T, int C>
__host__ __device__ constexpr int row_pieces() { return (C * sizeof(T)) % 16 == 0 ? C * sizeof(T) / 16 : 0; }
template <typename T, int C, int NT>
__device__ __forceinline__ void copy_row(const T* src, T* dst) {
  constexpr int P = row_pieces<T, C>();
  if constexpr (P > 0) {
    for (int i = threadIdx.x; i < P; i += NT) {
      LLMC_CHECK_ALIGNED16(src + i * (16 / sizeof(T)));
      LLMC_CHECK_ALIGNED16(dst + i * (16 / sizeof(T)));
      vstore(dst + i * (16 / sizeof(T)), vload<uint4>(src + i * (16 / sizeof(T))));
    }
  } else {
    for (int i = threadIdx.x; i < C; i += NT) dst[i] = src[i];
  }
}

// ---------------------------------------------------------------------------------------------------
// embedding: out[t, :] = table[ids[t], :]. Grid (T), block kThreads; 16-byte loads when rows are aligned.
template <int H, typename W, typename A = float>
struct Embedding {
  static constexpr int V = Vec16<W>::N;
  static constexpr bool kVec = H % V == 0;
  static constexpr int kThreads = row_threads(ceil_div(H, kVec ? V : 1), 256);

  static __device__ __forceinline__ void run(const int32_t* ids, const W* table, A* out) {
    const int t = blockIdx.x;
    const W* src = table + static_cast<int64_t>(ids[t]) * H;
    A* dst = out + static_cast<int64_t>(t) * H;
    if constexpr (kVec) {
      for (int i = threadIdx.x * V; i < H; i += kThreads * V) {
        float f[V];
        Vec16<W>::load(src + i, f);
        store_acts<V>(dst + i, f);
      }
    } else {
      for (int i = threadIdx.x; i < H; i += kThreads) astore(dst + i, wload(src[i]));
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// rmsnorm, as transformers' LlamaRMSNorm: y = w * A(h * (1 / sqrt(mean(h^2) + eps))), in float32, A() the
// rounding to the activation type (bf16: as LlamaRMSNorm casts back to the input dtype before the weight).
// ADD: h = residual_out = A(x + residual_in) first (residual_out may alias x or residual_in: each element is
// read and written by the same thread). Grid (T), block kThreads; a thread keeps its PER elements in
// registers (element i = j * kThreads + tid: coalesced), one block_sum.
template <int H, bool ADD, typename W, typename A = float>
struct RmsNorm {
  static constexpr int kThreads = row_threads(ceil_div(H, 8), 512);
  static constexpr int PER = ceil_div(H, kThreads);

  static __device__ __forceinline__ void run(const A* x, const A* residual_in, A* residual_out, const W* w, A* y,
                                             float eps) {
    const int64_t base = static_cast<int64_t>(blockIdx.x) * H;
    float h[PER];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = j * kThreads + threadIdx.x;
      float v = 0.0f;
      if (i < H) {
        v = wload(x[base + i]);
        if constexpr (ADD) {
          v = act_round<A>(v + wload(residual_in[base + i]));
          astore(residual_out + base + i, v);
        }
      }
      h[j] = v;
      ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = j * kThreads + threadIdx.x;
      if (i < H) astore(y + base + i, wload(w[i]) * act_round<A>(h[j] * r));
    }
  }
};

// silu(g) * u, silu(g) = g / (1 + exp(-g)) as torch computes it: silu_mul's, and the SwiGLU GEMM's epilogue.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---------------------------------------------------------------------------------------------------
// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
//  - decode (T <= kGemvMaxT): gemv(). kSplit warps per output row j (1 unless N is small), each a k slice;
//    lanes stride it 4 values at a time (float4 of x, 16 or 8 bytes of w; scalar loads when K % 4 != 0),
//    kGemvRows rows of x per pass over the weight row, one warp_sum per (row, output, slice), the slices
//    added in order through shared memory. Grid (kGemvBlocks), block kGemvThreads.
//  - prefill: tiled(), a BM x BN output tile per block, BK-deep k steps. Grid (kTilesN, ceil(T / BM)), block
//    kTileThreads.
//    - bf16 weights with 16-byte rows (kMma): on tensor cores, tiled_mma(). Four warps in 2 x 2, each a
//      (BM / 2) x (BN / 2) tile of mma.sync m16n8k16 (bf16 in, fp32 accumulate). x and w (bf16) tiles go
//      global -> shared by cp.async 16 bytes at a time, STAGES k steps in flight (rows past T or N and
//      chunks past K zero-filled); B fragments come from ldmatrix.x4 on w's [n][k] rows; A fragments from
//      ldmatrix.x4 on x's [m][k] rows (bf16 x), or from fp32 x pairs rounded to bf16 in registers (nearest
//      even, as the CPU's vdpbf16ps path rounds x). Rows are padded (+16 bytes; fp32 x: +4 floats) so that
//      ldmatrix, the x pair reads and the cp.async stores touch every bank equally: no replays. The output is
//      summed in k order by one mma chain per element.
//    - otherwise tiled_simt(): x and w staged k-major in shared memory (w widened to float), 4 x 4 outputs
//      per thread, fp32 accumulate; zero-filled tails.
// GEMV_WARPS, BM, BN, BK and STAGES are tunable (templates/cuda/gemm.tune.toml). None changes the numbers:
// each output is kSplit warps' sums added in slice order (GEMV; kSplit follows N and K alone), one thread's
// k-ordered sum (SIMT) or one k-ordered mma chain whatever the block shape.
// SWIGLU (gemm_swiglu.cu.j2): the MLP's gate and up projections with silu(gate) * up as the epilogue, so the
// [T, N] product never goes to memory. w's N rows are the gate and up rows interleaved 8 at a time (rows
// 16q..16q+7: gate rows 8q..8q+7; rows 16q+8..16q+15: their up rows; the compiler packs them so), so that an
// mma warp's n8 tiles 2j and 2j + 1 hold gate and up of the same 8 outputs, and y is [T, N / 2]: y[t, o] =
// silu(gate_o . x_t) * (up_o . x_t). The GEMV's warp takes both rows of its output. Each sum is the unfused
// GEMM's, in its order, and is rounded to A as the unfused GEMM stores it, so the result equals gemm +
// silu_mul bit for bit. bf16 weights with 16-byte rows only.
// A: the activation element of x and y.
template <int N, int K, bool BIAS, typename W, int GEMV_WARPS = 4, int TILE_M = 64, int TILE_N = 64,
          int TILE_K = 32, int STAGES = 3, bool SWIGLU = false, typename A = float>
struct Gemm {
  static constexpr int kOut = SWIGLU ? N / 2 : N;  // y's columns
  static constexpr int kRowsPerOut = SWIGLU ? 2 : 1;
  // The weight row of output o's gate (r = 0) or up (r = 1) under SWIGLU; else o.
  static __host__ __device__ constexpr int weight_row(int o, int r) {
    return SWIGLU ? 16 * (o / 8) + o % 8 + 8 * r : o;
  }
  // GEMV: each lane access takes 4 values of a row (x and w: 16 or 8 bytes), so that both x's and w's warp
  // accesses are contiguous (full sectors); rows of 4k values keep them aligned. A block holds GEMV_WARPS
  // output rows of kSplit warps each (split-K where N is small: gemv_split, slices of whole warp sweeps of at
  // least 256 values; at most 4, so a block stays within 1024 threads).
  static constexpr bool kVec = K % 4 == 0;
  static constexpr int kSweep = kVec ? 128 : 32;  // the values one warp access covers
  static constexpr int kSplit = gemv_split(kOut, clamp_int(K / 256, 1, 4));
  static constexpr int kSlice = round_up(ceil_div(K, kSplit), kSweep);
  static constexpr int kGemvWarps = GEMV_WARPS, kGemvThreads = 32 * kGemvWarps * kSplit, kGemvRows = 4;
  static constexpr int kGemvMaxT = 8, kGemvBlocks = ceil_div(kOut, kGemvWarps);
  static constexpr bool kMma = sizeof(W) == 2 && K % 8 == 0;  // bf16 rows of whole 16-byte pieces
  static_assert(!SWIGLU || (kMma && !BIAS && N % 16 == 0), "gemm: SWIGLU takes bf16 16-byte rows, whole groups");
  static constexpr int BM = TILE_M, BN = TILE_N, BK = TILE_K;
  static constexpr int kTileThreads = kMma ? 128 : (BM / 4) * (BN / 4);
  static constexpr int kTilesN = ceil_div(N, BN);

  static __device__ __forceinline__ void load_w4(const float* p, float (&o)[4]) { Vec16<float>::load(p, o); }
  static __device__ __forceinline__ void load_w4(const uint16_t* p, float (&o)[4]) { load_bf16x4(p, o); }

  // One output's value from its row sums (slice sums added): SWIGLU: silu(gate) * up; else the sum + bias.
  static __device__ __forceinline__ float gemv_out(const float (&s)[kRowsPerOut], float b) {
    if constexpr (SWIGLU)
      return silu_mul(act_round<A>(s[0]), act_round<A>(s[1]));
    else
      return s[0] + b;
  }

  static __device__ __forceinline__ void gemv(const A* x, const W* w, const W* bias, A* y, int T) {
    constexpr int R = kGemvRows, NR = kRowsPerOut;
    __shared__ float part[kSplit > 1 ? kGemvWarps * kSplit : 1][NR][R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % kSplit;
    const int j = blockIdx.x * kGemvWarps + warp / kSplit;
    if (kSplit == 1 && j >= kOut) return;  // whole warps only; a split block keeps every warp for its barriers
    const bool live = j < kOut;  // a warp past the outputs adds no terms but still reaches the barriers
    const W* wr[NR];
#pragma unroll
    for (int q = 0; q < NR; ++q) wr[q] = w + static_cast<int64_t>(live ? weight_row(j, q) : 0) * K;
    const int k_lo = slice * kSlice, k_hi = live ? min(K, k_lo + kSlice) : k_lo;
    const float b = BIAS && live ? wload(bias[j]) : 0.0f;
    for (int t0 = 0; t0 < T; t0 += R) {
      const int rows = min(R, T - t0);
      const A* x0 = x + static_cast<int64_t>(t0) * K;
      float acc[NR][R];
#pragma unroll
      for (int q = 0; q < NR; ++q)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[q][r] = 0.0f;
      if constexpr (kVec) {
        // Two sweeps in flight; a slice of at most two fully unrolled left ptxas spilling (bf16 at K = 136).
#pragma unroll(kSlice > 2 * kSweep ? 2 : 1)
        for (int k = k_lo + lane * 4; k < k_hi; k += 32 * 4) {
          float wv[NR][4];
#pragma unroll
          for (int q = 0; q < NR; ++q) load_w4(wr[q] + k, wv[q]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r < rows) {
              float xv[4];
              load_act4(x0 + static_cast<int64_t>(r) * K + k, xv);
#pragma unroll
              for (int q = 0; q < NR; ++q)
                acc[q][r] += xv[0] * wv[q][0] + xv[1] * wv[q][1] + xv[2] * wv[q][2] + xv[3] * wv[q][3];
            }
          }
        }
      } else {
        for (int k = k_lo + lane; k < k_hi; k += 32) {
          float wv[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) wv[q] = wload(wr[q][k]);
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (r < rows) {
#pragma unroll
              for (int q = 0; q < NR; ++q) acc[q][r] += wload(x0[static_cast<int64_t>(r) * K + k]) * wv[q];
            }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) {  // warp-uniform
          float s[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) s[q] = warp_sum(acc[q][r]);
          if constexpr (kSplit == 1) {
            if (lane == 0) astore(y + static_cast<int64_t>(t0 + r) * kOut + j, gemv_out(s, b));
          } else if (lane == 0) {
#pragma unroll
            for (int q = 0; q < NR; ++q) part[warp][q][r] = s[q];
          }
        }
      }
      if constexpr (kSplit > 1) {
        __syncthreads();
        if (slice == 0 && live && lane < rows) {  // lane r of the row's first warp adds its slices in order
          float v[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            v[q] = 0.0f;
#pragma unroll
            for (int sl = 0; sl < kSplit; ++sl) v[q] += part[warp + sl][q][lane];
          }
          astore(y + static_cast<int64_t>(t0 + lane) * kOut + j, gemv_out(v, b));
        }
        __syncthreads();  // part is rewritten by the next rows
      }
    }
  }

  static __device__ __forceinline__ void tiled(const A* x, const W* w, const W* bias, A* y, int T) {
    if constexpr (kMma)
      tiled_mma(x, w, bias, y, T);
    else
      tiled_simt(x, w, bias, y, T);
  }

  static __device__ __forceinline__ void tiled_mma(const A* x, const uint16_t* w, const uint16_t* bias, A* y, int T) {
    static_assert(BM % 32 == 0 && BN % 32 == 0 && BK % 16 == 0 && STAGES >= 2, "gemm: mma tile shape");
    constexpr bool kBf16X = sizeof(A) == 2;
    // row strides in elements: 16-byte multiples that shift banks
    constexpr int XS = kBf16X ? BK + 8 : BK + 4, WS = BK + 8;
    constexpr int MT = BM / 32, NT = BN / 16;  // m16 and n8 tiles per warp
    constexpr int KT = ceil_div(K, BK);
    struct alignas(16) Stage {
      A x[BM][XS];
      uint16_t w[BN][WS];
    };
    __shared__ Stage sm[STAGES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp >> 1) * (BM / 2), wn = (warp & 1) * (BN / 2);

    auto load_stage = [&](int st, int kt) {
      const int k0 = kt * BK;
      constexpr int XE = 16 / sizeof(A), XC = BK / XE, WC = BK / 8;  // elements per 16-byte chunk, chunks per row
      for (int c = tid; c < BM * XC; c += kTileThreads) {
        const int r = c / XC, kk = k0 + XE * (c % XC);
        const bool in = m0 + r < T && kk < K;  // K % 8 == 0: a chunk is wholly in or out
        cp_async_16_zfill(&sm[st].x[r][XE * (c % XC)], x + (in ? static_cast<int64_t>(m0 + r) * K + kk : 0), in ? 16 : 0);
      }
      for (int c = tid; c < BN * WC; c += kTileThreads) {
        const int r = c / WC, kk = k0 + 8 * (c % WC);
        const bool in = n0 + r < N && kk < K;
        cp_async_16_zfill(&sm[st].w[r][8 * (c % WC)], w + (in ? static_cast<int64_t>(n0 + r) * K + kk : 0), in ? 16 : 0);
      }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT) load_stage(s, s);
      cp_async_commit();  // one group per stage, empty past KT, so the wait count below holds throughout
    }
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt is in for every thread, and every warp is done with stage kt - 1
      if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
      cp_async_commit();
      const Stage& st = sm[kt % STAGES];
#pragma unroll
      for (int ks = 0; ks < BK; ks += 16) {
        uint32_t a[MT][4], b[NT][2];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if constexpr (kBf16X) {  // matrices: (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
            ldmatrix_x4(a[mi], &st.x[wm + 16 * mi + (lane & 7) + 8 * ((lane >> 3) & 1)][ks + 8 * (lane >> 4)]);
          } else {
            const float* r0 = &st.x[wm + 16 * mi + g][ks + 2 * t];
            const float* r1 = r0 + 8 * XS;
            const float2 v0 = vload<float2>(r0), v1 = vload<float2>(r1);
            const float2 v2 = vload<float2>(r0 + 8), v3 = vload<float2>(r1 + 8);
            a[mi][0] = pack_bf16x2(v0.x, v0.y), a[mi][1] = pack_bf16x2(v1.x, v1.y);
            a[mi][2] = pack_bf16x2(v2.x, v2.y), a[mi][3] = pack_bf16x2(v3.x, v3.y);
          }
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {  // matrices: (tile j, k 0-7), (j, k 8-15), (j + 1, 0-7), (j + 1, 8-15)
          uint32_t r[4];
          ldmatrix_x4(r, &st.w[wn + 8 * (j + (lane >> 4)) + (lane & 7)][ks + 8 * ((lane >> 3) & 1)]);
          b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int j = 0; j < NT; ++j) mma_m16n8k16_bf16(acc[mi][j], a[mi], b[j], acc[mi][j]);
      }
    }
    cp_async_wait<0>();  // no copy outlives the block (the groups past KT are empty)

    if constexpr (SWIGLU) {  // tiles j, j + 1: gate and up of outputs 8q..8q+7, q = (n0 + wn + 8j) / 16
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          const int col = (n0 + wn + 8 * j) / 2 + 2 * t;  // kOut % 8 == 0: the pair is wholly in or out
          if (col >= kOut) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm + 16 * mi + g + 8 * h;
            if (row >= T) continue;
            const float* gate = acc[mi][j];
            const float* up = acc[mi][j + 1];
            store_act2(y + static_cast<int64_t>(row) * kOut + col,
                       silu_mul(act_round<A>(gate[2 * h]), act_round<A>(up[2 * h])),
                       silu_mul(act_round<A>(gate[2 * h + 1]), act_round<A>(up[2 * h + 1])));
          }
        }
      }
      return;
    }
    constexpr bool kPairs = N % 2 == 0;  // each (row, col pair) aligned to its size: one store
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = n0 + wn + 8 * j + 2 * t;
        const float b0 = BIAS && col < N ? wload(bias[col]) : 0.0f, b1 = BIAS && col + 1 < N ? wload(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + wm + 16 * mi + g + 8 * h;
          if (row >= T) continue;
          A* yr = y + static_cast<int64_t>(row) * N + col;
          const float v0 = acc[mi][j][2 * h] + b0, v1 = acc[mi][j][2 * h + 1] + b1;
          if (kPairs && col + 1 < N) {
            store_act2(yr, v0, v1);
          } else {
            if (col < N) astore(yr, v0);
            if (col + 1 < N) astore(yr + 1, v1);
          }
        }
      }
    }
  }

  static __device__ __forceinline__ void tiled_simt(const A* x, const W* w, const W* bias, A* y, int T) {
    static_assert(BM * BK % kTileThreads == 0 && BN * BK % kTileThreads == 0, "gemm: tile loads");
    static_assert((BM / 4) * (BN / 4) == kTileThreads, "gemm: 4 x 4 outputs per thread");
    struct alignas(16) Smem {
      float x[BK][BM + 4];  // k-major; +4 keeps rows 16-byte aligned and spreads the transposing stores
      float w[BK][BN + 4];
    };
    __shared__ Smem sm;
    const int tid = threadIdx.x;
    const int tx = tid % (BN / 4), ty = tid / (BN / 4);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) acc[i][jj] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
      for (int e = 0; e < BM * BK / kTileThreads; ++e) {  // consecutive threads read consecutive k
        const int idx = tid + e * kTileThreads, r = idx / BK, c = idx % BK;
        const int gm = m0 + r, gk = k0 + c;
        sm.x[c][r] = (gm < T && gk < K) ? wload(x[static_cast<int64_t>(gm) * K + gk]) : 0.0f;
      }
#pragma unroll
      for (int e = 0; e < BN * BK / kTileThreads; ++e) {
        const int idx = tid + e * kTileThreads, r = idx / BK, c = idx % BK;
        const int gn = n0 + r, gk = k0 + c;
        sm.w[c][r] = (gn < N && gk < K) ? wload(w[static_cast<int64_t>(gn) * K + gk]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        const float4 a = load4(&sm.x[kk][ty * 4]);
        const float4 bv = load4(&sm.w[kk][tx * 4]);
        const float av[4] = {a.x, a.y, a.z, a.w}, bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[i][jj] += av[i] * bw[jj];
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int gm = m0 + ty * 4 + i;
      if (gm >= T) break;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int gn = n0 + tx * 4 + jj;
        if (gn < N) astore(y + static_cast<int64_t>(gm) * N + gn, BIAS ? acc[i][jj] + wload(bias[gn]) : acc[i][jj]);
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// rope, rotate-half (transformers' Llama), in place on heads [0, NH) of each row: with c, s = cos, sin of
// float(pos) * inv_freq[i],  x[i] = x[i] c - x[i + D/2] s,  x[i + D/2] = x[i + D/2] c + x[i] s.
// Grid (T), block kThreads: the token's D/2 (cos, sin) pairs once into shared memory (accurate sincosf),
// then one thread per (head, i) pair.
template <int NH, int D, typename A = float>
struct Rope {
  static_assert(D % 2 == 0, "rope: odd head_dim");
  static constexpr int HALF = D / 2;
  static constexpr int kThreads = row_threads(NH * HALF, 256);

  static __device__ __forceinline__ void run(A* x, int row_stride, const int32_t* positions, const float* inv_freq) {
    __shared__ float cos_s[HALF], sin_s[HALF];
    const int t = blockIdx.x;
    const float p = static_cast<float>(positions[t]);
    for (int i = threadIdx.x; i < HALF; i += kThreads) sincosf(p * inv_freq[i], &sin_s[i], &cos_s[i]);
    __syncthreads();
    A* row = x + static_cast<int64_t>(t) * row_stride;
    for (int idx = threadIdx.x; idx < NH * HALF; idx += kThreads) {
      const int h = idx / HALF, i = idx % HALF;
      const float c = cos_s[i], s = sin_s[i];
      A* x1 = row + h * D + i;
      const float a = wload(x1[0]), b = wload(x1[HALF]);
      A* y1 = store_ptr(x1);
      astore(y1, a * c - b * s);
      astore(y1 + HALF, b * c + a * s);
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// paged attention over a ragged batch (docs/contracts.md, "The step"). KV cache [num_blocks, BS, NKV, D]
// each, of KV: float, or uint16_t bf16 bits (rounded to nearest even when written, widened to float when read);
// q, k, v and out of A, the activation element.
// The launcher takes the step's T from the host (the kernels read their own copy, query_start_loc[B]) and
// sizes the grids by it, capped at kMaxGrid; the kernels loop over their items.
//  1. write(): token t's k/v rows (kv heads [0, NKV)) go to cache slot slot_mapping[t] (< 0: skipped).
//     Grid (write_grid()), block kWriteThreads; one block per token.
//  2. attend(): one warp per (token t, head h, KV split); a block holds HPB heads of one token that share a kv head
//     (HPB divides NH / NKV), so their K/V reads meet in L1. Causal over cache positions 0..p of t's
//     sequence (W > 0, a sliding window: p-W+1..p), through its block table. Per 32 cache positions: the
//     scores, then warp_max / warp_sum for the online softmax (fp32, one rescale per 32 positions), then every
//     lane accumulates D/32 output dims over the 32 positions' V rows (coalesced). Scores, where a K row is
//     whole 16-byte vectors (kRowVec): LPR lanes share a row, each a 16-byte piece at a time (a warp access
//     reads 32 / LPR whole rows: full sectors), its part of q in registers, summed over the LPR lanes by a
//     butterfly; otherwise lane j takes position c0 + j alone (a full D-long dot with the q row staged in
//     shared memory).
//     Split-KV (flash-decoding), so that a few decoding tokens still give every SM work: a token's positions
//     [first, ctx) are cut into St = min(kMaxSplits, ceil(len / kSplitChunk)) splits of ceil(len / St), each
//     a unit of work of its own (block: token, HPB heads, split). A split writes its (m, l, unnormalized
//     acc) per head to `partials`; the block whose split completes the token's set (a counter per (token,
//     head block) in `done`, which it resets) combines them in split order: O = sum_s acc_s e^(m_s - M) /
//     sum_s l_s e^(m_s - M), M = max_s m_s. St depends on the token's own context alone, and the combination
//     order is fixed, so results are bit-reproducible whatever the block order. A launch splits when its
//     partials fit the scratch (T * NH * S <= kScratchHeads, S = max_splits(max_blocks)); otherwise (large
//     prefill steps) every token takes one split, whose result differs from a split one in the last bits.
//     Grid (attend_grid()), block kThreads.
//  3. prefill() (kFlash: a bf16 cache, D % 16 == 0, D <= 128): the sequences with kFlashMinRows or more new
//     tokens, which attend() skips, on tensor cores, flash-attention style. A block takes 64 of a sequence's
//     new tokens for one head (4 warps of 16 rows; q rounded to bf16 into A fragments), and walks the key
//     positions its rows can see (causal, the window) in tiles of FN through its block table: K and V rows
//     go to shared memory by cp.async (double-buffered; positions past the context zero-filled), S = Q K^T by
//     mma.sync m16n8k16 with K's B fragments from ldmatrix, the mask, an fp32 online softmax per row (each
//     lane keeps its own part of l; the quad sums it once at the end), then O += P V with P's bf16 A fragments
//     straight from S's accumulators and V's B fragments from ldmatrix.trans. Rows padded by 16 bytes: no
//     bank replays. Grid (prefill_grid()), block kFlashThreads.
template <int NH, int NKV, int D, int BS, int W, typename KV, typename A = float>
struct PagedAttention {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  static constexpr int GROUP = NH / NKV;
  static constexpr int HPB = largest_divisor_le(GROUP, 8);  // heads (warps) per block
  static constexpr int kThreads = 32 * HPB;
  static constexpr int kHeadBlocks = NH / HPB;
  static constexpr int DPL = ceil_div(D, 32);  // output dims per lane
  static constexpr int SLOT = NKV * D;         // values per cache slot
  static constexpr int kWriteThreads = row_threads(SLOT, 256);
  static constexpr int64_t kMaxGrid = 1024;
  static constexpr int VW = Vec16<KV>::N;                  // values per 16-byte piece of a K row
  static constexpr bool kRowVec = D % VW == 0 && (D / VW <= 32 ? 32 % (D / VW) == 0 : (D / VW) % 32 == 0);
  static constexpr int LPR = kRowVec ? (D / VW < 32 ? D / VW : 32) : 1;  // lanes per K row
  static constexpr int RPA = 32 / LPR;                                   // K rows per warp access
  static constexpr int PPL = kRowVec ? D / (VW * LPR) : 1;               // pieces per lane and row

  static int clamp_grid(int64_t bound) { return static_cast<int>(bound < kMaxGrid ? (bound > 0 ? bound : 1) : kMaxGrid); }
  static constexpr int kSplitChunk = 64, kMaxSplits = 32;
  static constexpr int64_t kScratchHeads = 16384;          // (token, head, split) partials of one launch
  static constexpr int kPartial = round_up(D + 2, 8);      // acc[D], m, l: records of whole 32-byte sectors
  static constexpr int64_t kScratchFloats = kScratchHeads * kPartial, kDoneCounters = kScratchHeads / 2;
  __host__ __device__ static int max_splits(int max_blocks) {
    return clamp_int(ceil_div(max_blocks * BS, kSplitChunk), 1, kMaxSplits);
  }
  static int write_grid(int T) { return clamp_grid(T); }
  static dim3 attend_grid(int T, int max_blocks) {
    return dim3(clamp_grid(static_cast<int64_t>(T) * kHeadBlocks), max_splits(max_blocks));
  }

  static constexpr bool kFlash = sizeof(KV) == 2 && D % 16 == 0 && D <= 128;  // D <= 128: O and Q in registers
  static constexpr int kFlashMinRows = 16, FM = 64, FN = 32, kFlashThreads = 128;
  static constexpr int FS = D + 8;  // bf16 per shared K/V row
  // bounds the units (sequence, 64-row tile, head): each sequence has <= max_blocks * BS new tokens, all of
  // them T, so at most ceil(T / FM) + B tiles
  static int prefill_grid(int B, int max_blocks, int T) {
    const int64_t by_tables = static_cast<int64_t>(B) * ceil_div(max_blocks * BS, FM), by_tokens = ceil_div(T, FM) + B;
    return clamp_grid((by_tables < by_tokens ? by_tables : by_tokens) * NH);
  }

  // The cache offset (elements) of kv head kvh's row at position pos of a sequence with block table `table`.
  static __device__ __forceinline__ int64_t cache_row(const int32_t* table, int pos, int kvh) {
    return (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * SLOT + kvh * D;
  }

  static __device__ __forceinline__ float to_kv(float x, float*) { return x; }
  static __device__ __forceinline__ uint16_t to_kv(float x, uint16_t*) { return bf16_bits(x); }

  static __device__ __forceinline__ void write(const A* k, const A* v, int row_stride, KV* k_cache,
                                               KV* v_cache, const int64_t* slot_mapping,
                                               const int32_t* query_start_loc, int B) {
    const int T = query_start_loc[B];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t src = static_cast<int64_t>(t) * row_stride, dst = slot * SLOT;
      for (int i = threadIdx.x; i < SLOT; i += kWriteThreads) {
        k_cache[dst + i] = to_kv(wload(k[src + i]), k_cache);
        v_cache[dst + i] = to_kv(wload(v[src + i]), v_cache);
      }
    }
  }

  // Where q's value d sits in shared memory. A bf16 cache gives each lane two float4s of q per piece (8 values),
  // and 8 lanes' float4s at a 32-byte stride cover only half the banks (2-way); so pieces 4-7 mod 8 keep their
  // two halves swapped, and the in-order reads of each 8-lane phase hit 8 distinct 4-bank groups.
  static __device__ __forceinline__ int q_slot(int d) {
    if constexpr (kRowVec && VW == 8) return d ^ (((d >> 5) & 1) << 2);
    return d;
  }

  static __device__ __forceinline__ float dot_q(const float* qs, const KV* kr) {
    float s = 0.0f;
    constexpr int N = Vec16<KV>::N;
    if constexpr (D % N == 0) {  // cache rows start at multiples of D values: 16-byte aligned
#pragma unroll 4
      for (int d = 0; d < D; d += N) {
        float b[N];
        Vec16<KV>::load(kr + d, b);
#pragma unroll
        for (int j = 0; j < N; j += 4) {
          const float4 a = load4(qs + d + j);
          s += a.x * b[j] + a.y * b[j + 1] + a.z * b[j + 2] + a.w * b[j + 3];
        }
      }
    } else {
      for (int d = 0; d < D; ++d) s += qs[d] * wload(kr[d]);
    }
    return s;
  }

  // The `splits` partials of head h of token t (at a stride of S per head) -> out; one warp, in the block
  // whose split came last.
  static __device__ __forceinline__ void combine(const float* partials, int t, int h, int S, int splits, A* out) {
    const int lane = threadIdx.x & 31;
    const volatile float* part = partials + (static_cast<int64_t>(t) * NH + h) * S * kPartial;  // past L1
    const float m_lane = lane < splits ? part[lane * kPartial + D] : -INFINITY;
    const float M = warp_max(m_lane);
    const float L = warp_sum(lane < splits ? part[lane * kPartial + D + 1] * expf(m_lane - M) : 0.0f);
    float o[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
      const float e = expf(__shfl_sync(kFullMask, m_lane, sp) - M);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (D % 32 == 0 || d < D) o[i] = fmaf(part[sp * kPartial + d], e, o[i]);
      }
    }
    store_dims(out + (static_cast<int64_t>(t) * NH + h) * D, o, 1.0f / L);
  }

  // dst[d] = acc * scale for this lane's dims d = lane + 32 i of a head (an output row, or a float partial)
  template <typename T>
  static __device__ __forceinline__ void store_dims(T* dst, const float (&acc)[DPL], float scale) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (D % 32 == 0 || d < D) astore(dst + d, acc[i] * scale);
    }
  }

  static __device__ __forceinline__ void attend(const A* q, int row_stride, const KV* k_cache,
                                                const KV* v_cache, const int32_t* query_start_loc,
                                                const int32_t* seq_lens, const int32_t* block_tables,
                                                int max_blocks, int B, A* out, float scale,
                                                float* partials, unsigned* done) {
    struct alignas(16) Smem {
      float q[HPB][D];     // this warp's query row
      float p[HPB][32];    // softmax weights of the current 32 positions
      int64_t row[HPB][32];  // their V rows (element offsets into the cache)
      int last;            // this block finished its token's last split
    };
    __shared__ Smem sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int T = query_start_loc[B];
    const int S = static_cast<int64_t>(T) * NH * gridDim.y <= kScratchHeads ? gridDim.y : 1, split = blockIdx.y;
    if (split >= S) return;  // block-uniform, before any barrier
    for (int item = blockIdx.x; item < T * kHeadBlocks; item += gridDim.x) {
      const int t = item / kHeadBlocks, h = (item % kHeadBlocks) * HPB + warp;
      int b = 0, b_hi = B;  // the last b with query_start_loc[b] <= t
      while (b_hi - b > 1) {
        const int mid = (b + b_hi) >> 1;
        if (query_start_loc[mid] <= t) b = mid; else b_hi = mid;
      }
      const int n_new = query_start_loc[b + 1] - query_start_loc[b];
      const int ctx = seq_lens[b] - n_new + (t - query_start_loc[b]) + 1;  // positions 0..p
      if (kFlash && n_new >= kFlashMinRows) continue;                      // prefill()'s; block-uniform
      const int first = W > 0 ? max(0, ctx - W) : 0;                      // the window's first position
      const int splits = min(S, ceil_div(ctx - first, kSplitChunk));        // this token's: no split is empty
      if (split >= splits) continue;                                       // block-uniform
      const int chunk = ceil_div(ctx - first, splits);
      const int lo = first + split * chunk, hi = min(ctx, lo + chunk);     // this split's positions
      const int kvh = h / GROUP;
      const int32_t* table = block_tables + static_cast<int64_t>(b) * max_blocks;
      const A* qh = q + static_cast<int64_t>(t) * row_stride + h * D;
      for (int d = lane; d < D; d += 32) sm.q[warp][q_slot(d)] = wload(qh[d]);
      __syncwarp();

      float qv[PPL][VW];  // kRowVec: this lane's pieces of q, d = (i * LPR + lane % LPR) * VW + e
      if constexpr (kRowVec) {
        const int piece = lane % LPR;
#pragma unroll
        for (int i = 0; i < PPL; ++i)
#pragma unroll
          for (int c = 0; c < VW; c += 4) {
            const float4 v = load4(&sm.q[warp][q_slot((i * LPR + piece) * VW + c)]);
            qv[i][c] = v.x, qv[i][c + 1] = v.y, qv[i][c + 2] = v.z, qv[i][c + 3] = v.w;
          }
      }
      float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
      for (int c0 = lo; c0 < hi; c0 += 32) {
        const int pos = c0 + lane;
        float s = -INFINITY;
        if constexpr (kRowVec) {
          // the chunk's cache rows, one block-table read per lane (not one per K access: 32 / RPA of them)
          if (pos < hi) sm.row[warp][lane] = cache_row(table, pos, kvh);
          __syncwarp();
#pragma unroll 2
          for (int r0 = 0; r0 < 32; r0 += RPA) {
            const int j = r0 + lane / LPR, pj = c0 + j;  // this lane's row of the access
            float part = 0.0f;
            if (pj < hi) {
              const int64_t row = sm.row[warp][j];
#pragma unroll
              for (int i = 0; i < PPL; ++i) {
                float kv[VW];
                Vec16<KV>::load(k_cache + row + (i * LPR + lane % LPR) * VW, kv);
#pragma unroll
                for (int e = 0; e < VW; ++e) part = fmaf(qv[i][e], kv[e], part);
              }
            }
            part = warp_sum<LPR>(part);  // every lane of the row's group: its dot
            if (lane % LPR == 0 && pj < hi) sm.p[warp][j] = part;
          }
          __syncwarp();
          if (pos < hi) s = sm.p[warp][lane] * scale;
          __syncwarp();  // sm.p is rewritten with the weights below
        } else if (pos < hi) {
          const int64_t row = cache_row(table, pos, kvh);
          sm.row[warp][lane] = row;
          s = dot_q(sm.q[warp], k_cache + row) * scale;
        }
        const float m_new = fmaxf(m, warp_max(s));  // finite: position c0 is always < hi
        const float corr = expf(m - m_new);         // 0 on the first chunk (m = -inf)
        const float p = pos < hi ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
        sm.p[warp][lane] = p;
        __syncwarp();
        const int n = min(32, hi - c0);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= corr;
        for (int j = 0; j < n; ++j) {
          const float pj = sm.p[warp][j];
          const KV* vr = v_cache + sm.row[warp][j];
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            if (D % 32 == 0 || d < D) acc[i] += pj * wload(vr[d]);
          }
        }
        m = m_new;
        __syncwarp();  // p/row are rewritten by the next chunk, q by the next item
      }
      if (splits == 1) {
        store_dims(out + (static_cast<int64_t>(t) * NH + h) * D, acc, 1.0f / l);
        continue;
      }
      float* part = partials + ((static_cast<int64_t>(t) * NH + h) * S + split) * kPartial;
      if (lane == 0) part[D] = m, part[D + 1] = l;
      store_dims(part, acc, 1.0f);  // unnormalized: x * 1.0f is x
      __threadfence();  // this block's partials are visible before its count
      __syncthreads();
      if (threadIdx.x == 0) {
        unsigned* counter = done + static_cast<int64_t>(t) * kHeadBlocks + item % kHeadBlocks;
        sm.last = atomicAdd(counter, 1u) == static_cast<unsigned>(splits - 1);
        if (sm.last) *counter = 0;  // ready for the next launch: every split of this set has counted
      }
      __syncthreads();
      if (sm.last) {
        __threadfence();
        combine(partials, t, h, S, splits, out);
      }
      __syncthreads();  // sm.last is rewritten by the next unit
    }
  }

  static __device__ __forceinline__ void prefill(const A* q, int row_stride, const KV* k_cache,
                                                 const KV* v_cache, const int32_t* query_start_loc,
                                                 const int32_t* seq_lens, const int32_t* block_tables,
                                                 int max_blocks, int B, A* out, float scale) {
    if constexpr (kFlash) {
      struct alignas(16) Smem {
        uint16_t k[2][FN][FS];
        uint16_t v[2][FN][FS];
      };
      __shared__ Smem sm;
      const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
      constexpr int KS = D / 16, NT = FN / 8, DT = D / 8;  // k16 steps over D, n8 tiles over FN and over D
      constexpr int CPR = D / 8;                           // 16-byte chunks per K/V row
      // units: (sequence b with >= kFlashMinRows new tokens, 64-row tile, head), counted in sequence order
      int unit = blockIdx.x;
      for (int b = 0, seen = 0; b < B; ++b) {
        const int n_new = query_start_loc[b + 1] - query_start_loc[b];
        if (n_new < kFlashMinRows) continue;
        const int tiles = ceil_div(n_new, FM) * NH;
        while (unit < seen + tiles) {
          const int m0 = (unit - seen) / NH * FM, h = (unit - seen) % NH, kvh = h / GROUP;
          const int ctx = seq_lens[b], cached = ctx - n_new;
          const int32_t* table = block_tables + static_cast<int64_t>(b) * max_blocks;
          const int t0 = query_start_loc[b];
          const int r0 = m0 + 16 * warp + g;  // this lane's rows r0 and r0 + 8 (of the sequence's new tokens)
          // Q's A fragments: a[ks][r] = Q(row g + 8 (r & 1), d = 16 ks + 2 t4 + 8 (r >> 1) + {0, 1})
          uint32_t qa[KS][4];
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int row = r0 + 8 * (r & 1), d = 16 * ks + 2 * t4 + 8 * (r >> 1);
              const A* qp = q + static_cast<int64_t>(t0 + row) * row_stride + h * D + d;
              if constexpr (sizeof(A) == 2) {  // bf16 q: the pair's bits as they are
                qa[ks][r] = row < n_new ? *reinterpret_cast<const uint32_t*>(qp) : 0u;
              } else {
                float2 v = float2{0.0f, 0.0f};
                if (row < n_new) v = vload<float2>(qp);
                qa[ks][r] = pack_bf16x2(v.x, v.y);
              }
            }
          }
          // the key positions the block's rows see
          const int q_lo = cached + m0, q_hi = min(cached + n_new, cached + m0 + FM) - 1;  // query positions
          const int k_lo = W > 0 ? max(0, q_lo - W + 1) : 0, k_hi = q_hi;
          const int ntiles = ceil_div(k_hi + 1 - k_lo, FN);
          auto load_tile = [&](int buf, int j) {
            for (int c = tid; c < FN * CPR; c += kFlashThreads) {
              const int r = c / CPR, d = 8 * (c % CPR), pos = k_lo + j * FN + r;
              const bool in = pos <= k_hi;
              const int64_t off = in ? cache_row(table, pos, kvh) + d : 0;
              cp_async_16_zfill(&sm.k[buf][r][d], k_cache + off, in ? 16 : 0);
              cp_async_16_zfill(&sm.v[buf][r][d], v_cache + off, in ? 16 : 0);
            }
          };
          float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
          for (int i = 0; i < DT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;
          load_tile(0, 0);
          cp_async_commit();
          for (int j = 0; j < ntiles; ++j) {
            if (j + 1 < ntiles) load_tile((j + 1) & 1, j + 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();  // tile j is in for every thread
            const int buf = j & 1, p0 = k_lo + j * FN;
            float sc[NT][4];
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) sc[i][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
              for (int i = 0; i < NT; i += 2) {  // matrices: (tile i, d 0-7), (i, d 8-15), (i + 1, 0-7), (i + 1, 8-15)
                uint32_t r[4];
                ldmatrix_x4(r, &sm.k[buf][8 * (i + (lane >> 4)) + (lane & 7)][16 * ks + 8 * ((lane >> 3) & 1)]);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16_bf16(sc[i], qa[ks], b0, sc[i]);
                mma_m16n8k16_bf16(sc[i + 1], qa[ks], b1, sc[i + 1]);
              }
            }
            // mask and the online softmax, per row half hr (rows r0, r0 + 8)
            float corr[2];
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int qp = cached + r0 + 8 * hr;
              float mx = -INFINITY;
#pragma unroll
              for (int i = 0; i < NT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int kp = p0 + 8 * i + 2 * t4 + e;
                  const bool see = kp <= qp && kp <= k_hi && (W == 0 || kp > qp - W);
                  float& v = sc[i][2 * hr + e];
                  v = see ? v * scale : -INFINITY;
                  mx = fmaxf(mx, v);
                }
              }
              const float m_new = fmaxf(m[hr], warp_max<4>(mx));  // over the row's quad
              const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row that sees nothing yet stays 0
              corr[hr] = expf(m[hr] - base);
              float ps = 0.0f;
#pragma unroll
              for (int i = 0; i < NT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  float& v = sc[i][2 * hr + e];
                  v = expf(v - base);
                  ps += v;
                }
              }
              l[hr] = l[hr] * corr[hr] + ps;
              m[hr] = m_new;
            }
#pragma unroll
            for (int i = 0; i < DT; ++i) {
              o[i][0] *= corr[0], o[i][1] *= corr[0];
              o[i][2] *= corr[1], o[i][3] *= corr[1];
            }
            // O += P V: P's A fragment for key step kk from S's n8 tiles 2 kk and 2 kk + 1
#pragma unroll
            for (int kk = 0; kk < FN / 16; ++kk) {
              const uint32_t pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                      pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                      pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
              for (int i = 0; i < DT; i += 2) {  // matrices: (keys 0-7, d tile i), (8-15, i), (0-7, i + 1), (8-15, i + 1)
                uint32_t r[4];
                ldmatrix_x4_trans(r, &sm.v[buf][16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)][8 * (i + (lane >> 4))]);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16_bf16(o[i], pa, b0, o[i]);
                mma_m16n8k16_bf16(o[i + 1], pa, b1, o[i + 1]);
              }
            }
            __syncthreads();  // every warp is done with buffer j & 1 before tile j + 2 overwrites it
          }
          cp_async_wait<0>();
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const float lt = warp_sum<4>(l[hr]);
            const int row = r0 + 8 * hr;
            if (row < n_new) {
              const float inv = 1.0f / lt;
              A* orow = out + static_cast<int64_t>(t0 + row) * (NH * D) + h * D;
#pragma unroll
              for (int i = 0; i < DT; ++i) store_act2(orow + 8 * i + 2 * t4, o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
            }
          }
          unit += gridDim.x;
        }
        seen += tiles;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// silu_mul: out[t, i] = silu(gate[t, i]) * up[t, i], gate_up = [gate | up] per row. Grid (T, kChunks), block
// kThreads, V elements per thread.
template <int I, typename A = float>
struct SiluMul {
  static constexpr int V = I % 4 == 0 ? 4 : 1;
  static constexpr int kThreads = row_threads(ceil_div(I, V), 256);
  static constexpr int kChunks = ceil_div(I, kThreads * V);

  static __device__ __forceinline__ void run(const A* gate_up, A* out) {
    const int64_t t = blockIdx.x;
    const int i = (blockIdx.y * kThreads + threadIdx.x) * V;
    if (i >= I) return;
    const A* g = gate_up + t * 2 * I + i;
    A* o = out + t * I + i;
    if constexpr (V == 4) {
      float gv[4], uv[4];
      load_act4(g, gv);
      load_act4(g + I, uv);
      store_act4(o, silu_mul(gv[0], uv[0]), silu_mul(gv[1], uv[1]), silu_mul(gv[2], uv[2]), silu_mul(gv[3], uv[3]));
    } else {
      astore(o, silu_mul(wload(g[0]), wload(g[I])));
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// gather_rows: out[i, :] = x[rows[i], :]. Grid (n), block kThreads.
template <int C, typename A = float>
struct GatherRows {
  static constexpr int kThreads = row_threads(row_pieces<A, C>() > 0 ? row_pieces<A, C>() : C, 256);

  static __device__ __forceinline__ void run(const A* x, const int32_t* rows, A* out) {
    const int i = blockIdx.x;
    copy_row<A, C, kThreads>(x + static_cast<int64_t>(rows[i]) * C, out + static_cast<int64_t>(i) * C);
  }
};

}  // namespace llmc

#include "llmc_qgemm.cuh"  // quantized GEMMs (w8a16 / w4a16), after the helpers above
