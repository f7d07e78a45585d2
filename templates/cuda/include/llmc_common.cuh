// llmc_common.cuh: the helpers every CUDA kernel header shares (templates/cuda/include/llmc_*.cuh): integer
// arithmetic for launch shapes, 16-byte vector loads and stores of weights and activations, row copies, silu.
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
__device__ __forceinline__ float wload(int8_t v) { return static_cast<float>(v); }  // an int8 KV value, unscaled

// fp8 e4m3 (OCP "fn": bias 7, no infinities, 0x7f / 0xff NaN; largest 448, subnormals m * 2^-9), the element of an
// fp8 KV cache, held as uint8_t bits. In integer arithmetic, so the simulator and every sm run the same code.
__device__ __forceinline__ float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  // normal: the fp32 with that exponent (rebiased 7 -> 127) and mantissa; subnormal: m * 2^-9, exact in fp32
  const float a = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : static_cast<float>(m) * 0x1p-9f;
  return b & 0x80u ? -a : a;
}
// x -> e4m3, rounded to nearest even, |x| past 448 saturated to 448 (a scaled KV row never gets there by more
// than a rounding)
__device__ __forceinline__ uint8_t float_to_fp8_e4m3(float x) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u;
  const float a = fabsf(x);
  uint32_t code;
  if (a < 0x1p-6f) {
    code = static_cast<uint32_t>(rintf(a * 0x1p9f));  // subnormals (8: the smallest normal, 2^-6, as it should)
  } else {
    const uint32_t ua = __float_as_uint(a), mant = ua & 0x7fffffu, rem = mant & 0xfffffu;
    uint32_t e = (ua >> 23) - 120u, m = mant >> 20;  // e4m3's biased exponent, 3 mantissa bits
    if (rem > 0x80000u || (rem == 0x80000u && (m & 1u))) ++m;
    if (m == 8u) m = 0, ++e;
    code = e > 15u || (e == 15u && m == 7u) ? 0x7eu : (e << 3) | m;
  }
  return static_cast<uint8_t>(sign | code);
}
__device__ __forceinline__ float wload(uint8_t v) { return fp8_e4m3_to_float(v); }  // an fp8 KV value, unscaled

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
// A scaled KV cache's 16 one-byte values, unscaled: int8, or fp8 e4m3 bits (uint8_t), each as wload reads it
template <typename B>
struct Vec16Bytes {
  static constexpr int N = 16;
  static __device__ __forceinline__ void load(const B* p, float (&o)[16]) {
    LLMC_CHECK_ALIGNED16(p);
    const uint4 v = vload<uint4>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i] = wload(static_cast<B>(w[i / 4] >> (8 * (i % 4))));
  }
};
template <>
struct Vec16<int8_t> : Vec16Bytes<int8_t> {};
template <>
struct Vec16<uint8_t> : Vec16Bytes<uint8_t> {};

// ---------------------------------------------------------------------------------------------------
// activations: float, or uint16_t (bf16 bits)
__device__ __forceinline__ uint16_t bf16_bits(float v) { return pack_bf16x2(v, 0.0f) & 0xffffu; }
__device__ __forceinline__ void astore(float* p, float v) { *p = v; }
__device__ __forceinline__ void astore(uint16_t* p, float v) { *p = bf16_bits(v); }
// Gemma 2's soft-capping, cap * tanh(v / cap); cap 0: v. The generated kernels pass cap as a literal, so the
// branch folds away (attention's scores take it as an argument: a uniform branch).
__device__ __forceinline__ float soft_cap(float v, float cap) { return cap > 0.0f ? cap * tanhf(v / cap) : v; }
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
// The rows a GEMM runs over: its row r reads x's row x_row(r) and goes to y's row y_row(r), stored by store /
// store2. DenseRows: row r itself, the block's first row from the grid; a grouped GEMM gathers its rows instead
// (llmc_moe.cuh ExpertRows: kGathered, each block's rows from 0).
struct DenseRows {
  static constexpr bool kGathered = false;
  __device__ __forceinline__ int64_t x_row(int r) const { return r; }
  __device__ __forceinline__ int64_t y_row(int r) const { return r; }
  template <typename A>
  __device__ __forceinline__ void store(A* p, float v) const { astore(p, v); }
  template <typename A>
  __device__ __forceinline__ void store2(A* p, float a, float b) const { store_act2(p, a, b); }
};
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

// silu(g) * u, silu(g) = g / (1 + exp(-g)) as torch computes it: silu_mul's, and the SwiGLU GEMM's epilogue.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// gelu_tanh(g) * u, as torch's gelu(approximate="tanh"): Gemma's GeGLU, the sibling of silu_mul.
__device__ __forceinline__ float gelu_tanh_mul(float g, float u) {
  const float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
  return 0.5f * g * (1.0f + tanhf(inner)) * u;
}

// The gated MLP's activation times up: GELU (GeGLU) or SiLU (SwiGLU).
template <bool GELU>
__device__ __forceinline__ float gated_mul(float g, float u) {
  return GELU ? gelu_tanh_mul(g, u) : silu_mul(g, u);
}

}  // namespace llmc
