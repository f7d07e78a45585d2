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
LLMC_INLINE float load_w(int8_t v) { return float(v); }  // an int8 KV cache's value, before its scale

// exp_poly: the SIMD exp of Vec::exp (Cephes' expf: e^x = 2^n e^r, n = floor(x log2 e + 1/2), r = x - n ln 2 in
// two parts, e^r by a degree-7 polynomial; within 2 ulp of expf), with x clamped to [kExpLo, kExpHi] so that
// 2^n stays a normal float: for silu, whose 1 + e^-g is then 1 or e^-g within float32 precision either way.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// ---------------------------------------------------------------------------------------------
// Vec: one SIMD register of float32 lanes, with just what the kernels need.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMC_SIMD "avx512"
struct Vec {
  static constexpr int W = 16;
  __m512 v;
  static LLMC_INLINE Vec zero() { return {_mm512_setzero_ps()}; }
  static LLMC_INLINE Vec splat(float a) { return {_mm512_set1_ps(a)}; }
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
  static LLMC_INLINE Vec load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static LLMC_INLINE Vec load_part(const int8_t* p, int n) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), p)))};
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
  LLMC_INLINE void store_part(float* p, int n) const { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
  static LLMC_INLINE Vec exp(Vec a) {  // see exp_poly below
    const __m512 x = _mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 y = _mm512_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpP[i]));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return {_mm512_mul_ps(y, _mm512_castsi512_ps(e))};
  }
  static LLMC_INLINE Vec silu_mul(Vec g, Vec u) {  // g / (1 + exp(-g)) * u
    const Vec e = exp({_mm512_sub_ps(_mm512_setzero_ps(), g.v)});
    return {_mm512_mul_ps(_mm512_div_ps(g.v, _mm512_add_ps(_mm512_set1_ps(1.0f), e.v)), u.v)};
  }
  LLMC_INLINE void fma(Vec a, Vec b) { v = _mm512_fmadd_ps(a.v, b.v, v); }  // this += a * b
  LLMC_INLINE Vec operator+(Vec o) const { return {_mm512_add_ps(v, o.v)}; }
  LLMC_INLINE Vec operator-(Vec o) const { return {_mm512_sub_ps(v, o.v)}; }
  LLMC_INLINE Vec operator*(Vec o) const { return {_mm512_mul_ps(v, o.v)}; }
  LLMC_INLINE Vec operator/(Vec o) const { return {_mm512_div_ps(v, o.v)}; }
  static LLMC_INLINE Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  LLMC_INLINE float hmax() const { return _mm512_reduce_max_ps(v); }
  // The tree, spelled out (sum16 below repeats it for 16 at once): lanes i + (i + 8), then + 4, then
  // (0 + 2) + (1 + 3).
  LLMC_INLINE float sum() const {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
  }
};

// out[i] = a[i].sum() for i < 16, by the same tree for all 16 at once: each level adds two vectors' worth of
// lanes (shuffles gather the pairs), 15 adds and 31 shuffles where 16 sum() take 64 adds and shuffles.
LLMC_INLINE void sum16(const Vec* a, float* out) {
  __m512 l1[8], l2[4], l3[2];
  for (int k = 0; k < 8; ++k)  // [a(2k) lanes i + (i + 8) | a(2k + 1)'s]
    l1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0x44),
                          _mm512_shuffle_f32x4(a[2 * k].v, a[2 * k + 1].v, 0xEE));
  for (int m = 0; m < 4; ++m)  // 128-bit chunk c: a(4m + c) lanes i + (i + 4), i < 4
    l2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * m], l1[2 * m + 1], 0xDD));
  for (int h = 0; h < 2; ++h)  // chunk c: [a(8h + c): 0 + 2, 1 + 3, a(8h + 4 + c): 0 + 2, 1 + 3]
    l3[h] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * h], l2[2 * h + 1], 0x44),
                          _mm512_shuffle_ps(l2[2 * h], l2[2 * h + 1], 0xEE));
  // chunk c: the sums of a(c), a(4 + c), a(8 + c), a(12 + c); lane 4c + k holds a(4k + c)'s
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s));
}
#define LLMC_SUM16 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LLMC_SIMD "avx2"
struct Vec {
  static constexpr int W = 8;
  __m256 v;
  static LLMC_INLINE Vec zero() { return {_mm256_setzero_ps()}; }
  static LLMC_INLINE Vec splat(float a) { return {_mm256_set1_ps(a)}; }
  static LLMC_INLINE Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static LLMC_INLINE Vec load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
  }
  static LLMC_INLINE Vec load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
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
  LLMC_INLINE void store_part(float* p, int n) const {
    alignas(32) float tmp[W];
    _mm256_store_ps(tmp, v);
    std::memcpy(p, tmp, sizeof(float) * n);
  }
  static LLMC_INLINE Vec exp(Vec a) {  // see exp_poly below
    const __m256 x = _mm256_min_ps(_mm256_max_ps(a.v, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 y = _mm256_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP[i]));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(y, _mm256_castsi256_ps(e))};
  }
  static LLMC_INLINE Vec silu_mul(Vec g, Vec u) {  // g / (1 + exp(-g)) * u
    const Vec e = exp({_mm256_sub_ps(_mm256_setzero_ps(), g.v)});
    return {_mm256_mul_ps(_mm256_div_ps(g.v, _mm256_add_ps(_mm256_set1_ps(1.0f), e.v)), u.v)};
  }
  LLMC_INLINE void fma(Vec a, Vec b) { v = _mm256_fmadd_ps(a.v, b.v, v); }
  LLMC_INLINE Vec operator+(Vec o) const { return {_mm256_add_ps(v, o.v)}; }
  LLMC_INLINE Vec operator-(Vec o) const { return {_mm256_sub_ps(v, o.v)}; }
  LLMC_INLINE Vec operator*(Vec o) const { return {_mm256_mul_ps(v, o.v)}; }
  LLMC_INLINE Vec operator/(Vec o) const { return {_mm256_div_ps(v, o.v)}; }
  static LLMC_INLINE Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  LLMC_INLINE float hmax() const {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
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
  static LLMC_INLINE Vec splat(float a) {
    Vec r;
    for (float& f : r.v) f = a;
    return r;
  }
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
  LLMC_INLINE void store_part(float* p, int n) const { std::memcpy(p, v, sizeof(float) * n); }
  static LLMC_INLINE Vec exp(Vec a) {  // libm's expf
    for (float& f : a.v) f = std::exp(f);
    return a;
  }
  static LLMC_INLINE Vec silu_mul(Vec g, Vec u) {  // libm's expf, as torch's scalar formula
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = g.v[i] / (1.0f + std::exp(-g.v[i])) * u.v[i];
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
  LLMC_INLINE Vec operator-(Vec o) const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = v[i] - o.v[i];
    return r;
  }
  LLMC_INLINE Vec operator*(Vec o) const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = v[i] * o.v[i];
    return r;
  }
  LLMC_INLINE Vec operator/(Vec o) const {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = v[i] / o.v[i];
    return r;
  }
  static LLMC_INLINE Vec max(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
    return a;
  }
  LLMC_INLINE float hmax() const {
    float m = v[0];
    for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
    return m;
  }
  LLMC_INLINE float sum() const {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
  }
};
#endif

// out[i] = a[i].sum() for i < N: 16 at a time through sum16 where the ISA has it (the rest, from 8 on, with
// zeros alongside), one by one otherwise.
template <int N>
LLMC_INLINE void sum_each(const Vec* a, float* out) {
  int i = 0;
#ifdef LLMC_SUM16
  for (; i + 16 <= N; i += 16) sum16(a + i, out + i);
  if constexpr (N % 16 >= 8) {
    Vec rest[16];
    for (int j = 0; j < 16; ++j) rest[j] = i + j < N ? a[i + j] : Vec::zero();
    float o[16];
    sum16(rest, o);
    for (int j = 0; i + j < N; ++j) out[i + j] = o[j];
    return;
  }
#endif
  for (; i < N; ++i) out[i] = a[i].sum();
}

// ---------------------------------------------------------------------------------------------
// dot_block<R, C, K>: out[r * C + c] = sum_i x[r * ldx + i] * w[c * ldw + i], r < R, c < C.
//
// One accumulator Vec per (r, c): element i goes to lane i % W in order of i, the last partial vector
// is a masked load into the same accumulator, then Vec::sum(). So the result of one (row, output) is a
// function of K and the data only: dot_block<1, 1> and dot_block<4, 4> give bit-identical numbers for
// it. The R x C independent accumulators are the instruction-level parallelism (R + C loads per
// R * C FMAs), not a split of one dot product.
//
template <int R, int C, int K, typename WT>
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
  for (int i = 0; i < KMAIN; i += VW) {
    Vec wv[C];
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
  LLMC_UNROLL for (int r = 0; r < R; ++r) sum_each<C>(acc[r], out + r * C);
}

template <int K, typename WT>
LLMC_INLINE float dot(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w) {
  float s;
  dot_block<1, 1, K>(x, 0, w, 0, &s);
  return s;
}

template <int N>
LLMC_INLINE void scale_inplace(float a, float* LLMC_RESTRICT y) {
  for (int i = 0; i < N; ++i) y[i] *= a;
}

}  // namespace llmc
