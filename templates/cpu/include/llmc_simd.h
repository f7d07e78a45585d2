// llmc CPU target: weight loads, the SIMD vector type and the fixed-order dot products.
#pragma once

#include "llmc_base.h"

namespace llmc {

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
  // 2W bf16 at p, widened: even = p[0], p[2], ..., odd = p[1], p[3], ... One shift or one and per W
  // weights (a 32-bit lane holds the pair), against a zero-extend (a shuffle) and a shift in load().
  static LLMC_INLINE void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even.v = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    odd.v = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));
  }
  LLMC_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  LLMC_INLINE void pin() { asm("" : "+v"(v)); }  // see the AVX2 one
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
  static LLMC_INLINE void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {  // as the AVX-512 one
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even.v = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    odd.v = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xffff0000u))));
  }
  LLMC_INLINE void store(float* p) const { _mm256_storeu_ps(p, v); }
  // Keep this value in a register: g++ otherwise folds a register tile's loads into its FMAs, R * C loads
  // per R * C FMAs instead of R + C (Zen 3 and Haswell-Skylake load 2 vectors per cycle, FMA 2).
  LLMC_INLINE void pin() { asm("" : "+x"(v)); }
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
  static LLMC_INLINE void load_pairs(const uint16_t* p, Vec& even, Vec& odd) {  // as the AVX-512 one
    for (int i = 0; i < W; ++i) {
      even.v[i] = bf16_to_f32(p[2 * i]);
      odd.v[i] = bf16_to_f32(p[2 * i + 1]);
    }
  }
  LLMC_INLINE void store(float* p) const { std::memcpy(p, v, sizeof v); }
  LLMC_INLINE void pin() {}
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

}  // namespace llmc
