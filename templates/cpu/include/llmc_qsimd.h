// llmc CPU target: the integer dot products of the quantized GEMM's steps (llmc_qgemm.h), per ISA: AVX-512 VNNI,
// AVX-VNNI, AVX2 and a portable path with the same lanes as plain arrays.
#pragma once

#include <cmath>
#include <cstring>

#include "llmc_qscales.h"

namespace llmc {
// IQ4_NL / IQ4_XS's 16 levels (compiler/quant.py IQ4_LEVELS, llama.cpp's kvalues_iq4nl) plus 128: the u a codebook
// index decodes to, so that a codebook weight's dot is int8's (u = q + 128).
alignas(16) constexpr uint8_t kIq4LevelsU[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// The integer dot products of one step, per ISA. Bytes: 32 int8/uint8; Ints: 8 int32; Floats: 8 float.
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLMC_QDOT "avx512vnni"
#elif defined(__AVXVNNI__)
#define LLMC_QDOT "avxvnni"
#else
#define LLMC_QDOT "avx2"
#endif
namespace qsimd {
using Bytes = __m256i;
using Ints = __m256i;
using Floats = __m256;
LLMC_INLINE Bytes load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
LLMC_INLINE void store32(void* p, Bytes v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
// 32 packed bytes (two chunks) -> (low nibbles of both, high nibbles of both).
LLMC_INLINE void nibbles32(const uint8_t* p, Bytes& lo, Bytes& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(b, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}
// The last chunk of a row with an odd count: 16 bytes (reading 32 could pass the end of the matrix), zeros
// where the second chunk would be.
LLMC_INLINE void nibbles16(const uint8_t* p, Bytes& lo, Bytes& hi) {
  const __m256i b = _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(b, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}
// A chunk's 16 bytes of nibbles -> its 32 low nibbles in element order (int5's and int6's low 4 bits): the 16
// bytes in both halves (a broadcast load), the upper half's shifted down a nibble.
LLMC_INLINE Bytes nibbles_in_order(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}
// 8 bytes of 2-bit fields -> 32 values in order: element j + 8i's from bits 2i of byte j, one 64-bit lane i each
// (int6's top 2 bits, int3's low 2).
LLMC_INLINE Bytes bit_pairs_in_order(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  const __m256i lanes = _mm256_srlv_epi64(_mm256_set1_epi64x(v), _mm256_setr_epi64x(0, 2, 4, 6));
  return _mm256_and_si256(lanes, _mm256_set1_epi8(0x03));
}
// 4 bytes of one bit per element (int5's fifth, int3's third), element 4q + r's at bit q of byte r -> 32 bytes of
// 0 / 1 in order: 32-bit lane q shifted right by q has each of its bytes' bit q at bit 0.
LLMC_INLINE Bytes plane_bits(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_and_si256(lanes, _mm256_set1_epi8(0x01));
}
// 24 bytes of an int6 chunk -> its 32 u = q + 32 in order: the low nibbles, then the top 2 bits' 8 bytes.
LLMC_INLINE Bytes decode6(const uint8_t* p) {
  return _mm256_or_si256(nibbles_in_order(p), _mm256_slli_epi16(bit_pairs_in_order(p + 16), 4));
}
// 8 bytes of an int2 chunk -> its 32 u = q in order.
LLMC_INLINE Bytes decode2(const uint8_t* p) { return bit_pairs_in_order(p); }
// 12 bytes of an int3 chunk -> its 32 u = q + 4 in order: the low 2 bits' 8 bytes, then the third bits' uint32.
LLMC_INLINE Bytes decode3(const uint8_t* p) {
  return _mm256_or_si256(bit_pairs_in_order(p), _mm256_slli_epi16(plane_bits(p + 8), 2));
}
// 16 bytes of an IQ4 chunk -> its 32 u = level + 128 in order: each nibble looks its level up (one byte shuffle).
LLMC_INLINE Bytes decode_iq4(const uint8_t* p) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4LevelsU)));
  return _mm256_shuffle_epi8(lut, nibbles_in_order(p));
}
// 20 bytes of an int5 chunk -> its 32 u in order: the low nibbles, then the fifth bits' 4 bytes (plane_bits).
LLMC_INLINE Bytes decode5(const uint8_t* p) {
  return _mm256_or_si256(nibbles_in_order(p), _mm256_slli_epi16(plane_bits(p + 16), 4));
}
// acc + sum of 4 products u[4l + i] * s[4l + i] per lane l: u unsigned, s signed (u * s pairs fit int16:
// u <= 255 with |s| <= 127 would not, callers pass u <= 128, or u <= 15 two at a time).
LLMC_INLINE Ints dot_us(Ints acc, Bytes u, Bytes s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// The int8 (BIAS 128), int6 (32) and int5 (16; 0 with mins) weights' P = sum4((u - BIAS) * x) = sum4(u * x) +
// base, from base = neg_bias_of<BIAS>(x) = -BIAS * sum4(x) (per lane; formed once per row and step, for all the
// outputs).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
template <int BIAS>
LLMC_INLINE Ints neg_bias_of(Bytes x) {
  if constexpr (BIAS == 0)  // asymmetric int5: u is q
    return _mm256_setzero_si256();
  else
    return _mm256_sub_epi32(_mm256_setzero_si256(), dot_us(_mm256_setzero_si256(), _mm256_set1_epi8(int8_t(BIAS)), x));
}
template <int BIAS>
LLMC_INLINE Ints dot_biased(Ints base, Bytes u, Bytes x) {
  return dot_us(base, u, x);  // one instruction: u * x pairs would saturate only maddubs' int16
}
#else
// Without VNNI the products go through maddubs' int16 pair sums, which saturate past 32767. Where u < 2 BIAS <= 64
// (int6, symmetric int5, int3), a pair sum of (u - BIAS) * x is at most 2 * 127 * (63 + 32) = 24130 either way:
// base is then the int16 pair sums of BIAS * x, once per row and step, and each output takes
// maddubs, one int16 subtraction and madd, where the sign trick took five instructions. int8 and IQ4 (BIAS 128)
// keep the sign trick.
template <int BIAS>
constexpr bool kFoldBias = BIAS > 0 && BIAS <= 32;
template <int BIAS>
LLMC_INLINE Ints neg_bias_of(Bytes x) {
  if constexpr (kFoldBias<BIAS>)
    return _mm256_maddubs_epi16(_mm256_set1_epi8(int8_t(BIAS)), x);
  else
    return _mm256_setzero_si256();
}
template <int BIAS>
LLMC_INLINE Ints dot_biased(Ints base, Bytes u, Bytes x) {
  if constexpr (BIAS == 0) {
    // asymmetric int5 and int2 (Q5_K, Q5_1, Q2_K): u = q < 32, whose pairs u * x cannot saturate maddubs' int16
    return dot_us(_mm256_setzero_si256(), u, x);
  } else if constexpr (kFoldBias<BIAS>) {
    return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(u, x), base), _mm256_set1_epi16(1));
  } else {
    // w = u - BIAS as int8, then |w| * (x with w's sign), llama.cpp's sign trick (x in [-127, 127])
    const __m256i w = _mm256_sub_epi8(u, _mm256_set1_epi8(int8_t(BIAS)));
    return dot_us(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  }
}
#endif
// nibbles (lo, hi) times x (xlo, xhi), plus acc.
LLMC_INLINE Ints dot_nib(Ints acc, Bytes lo, Bytes xlo, Bytes hi, Bytes xhi) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return dot_us(dot_us(acc, lo, xlo), hi, xhi);
#else
  // 15 * 127 * 4 < 2^15: the two int16 pair sums add without saturating
  const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
#endif
}
LLMC_INLINE Ints load_ints(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
LLMC_INLINE void store_ints(int32_t* p, Ints v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
LLMC_INLINE Ints sub(Ints a, Ints b) { return _mm256_sub_epi32(a, b); }
LLMC_INLINE Bytes splat_bytes(int8_t v) { return _mm256_set1_epi8(v); }
LLMC_INLINE Ints zero_ints() { return _mm256_setzero_si256(); }
LLMC_INLINE Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
LLMC_INLINE Floats zero_floats() { return _mm256_setzero_ps(); }
LLMC_INLINE Floats splat(float a) { return _mm256_set1_ps(a); }
// [p[0] x 4, p[1] x 4]: one 8-byte load (fp16: a 4-byte load and a conversion) and a permute
LLMC_INLINE Floats splat2(const float* p) {
  // through __m128i (may_alias): a double* load of floats would break strict aliasing (K-quant scales are
  // decoded into a stack array just before)
  const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
LLMC_INLINE Floats splat2(const uint16_t* p) {
#if defined(__F16C__)
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
#else
  const __m128 two = _mm_setr_ps(scale_value(p[0]), scale_value(p[1]), 0.0f, 0.0f);
#endif
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
// The n <= 8 fp16 scales at p as floats (lanes past n: 0), reading nothing past p[n - 1]; lane(v, i): v[i] x 8.
LLMC_INLINE Floats widen8(const uint16_t* p, int n) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), p));  // masked lanes never fault
#else
  alignas(32) float f[8] = {};
  for (int i = 0; i < n; ++i) f[i] = scale_value(p[i]);
  return _mm256_load_ps(f);
#endif
}
LLMC_INLINE Floats lane(Floats v, int i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i)); }
// [v[2i] x 4, v[2i + 1] x 4]: the scales of a SPLIT step's two groups
LLMC_INLINE Floats pair(Floats v, int i) {
  return _mm256_permutevar8x32_ps(v, _mm256_add_epi32(_mm256_set1_epi32(2 * i), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
}
// A Q6_K record's 16 scales, as floats (exact products): groups 0-7 and 8-15
LLMC_INLINE void kscales16(const KScales6& r, Floats& lo, Floats& hi) {
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.sc));
  const __m256 d = _mm256_set1_ps(scale_value(r.d));
  lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
}
// A K-quant record's 8 scales (returned) and 8 mins, as floats (exact products)
LLMC_INLINE Floats kscales8(const KScales& r, Floats& mins) {
  // kscale_bytes' words formed in one register: its four 32-bit stores read back as one 16-byte load missed
  // store-to-load forwarding, a stall per record and output
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&r));  // [d | dmin, u0, u1, u2]
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 0, 1, 0)), 2),
                                    _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m128i bytes = _mm_or_si128(low, top);  // sc 0..7, m 0..7
  mins = _mm256_mul_ps(_mm256_set1_ps(scale_value(r.dmin)),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))));
  return _mm256_mul_ps(_mm256_set1_ps(scale_value(r.d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
}
// A Q2_K record's 16 scales and 16 mins, as floats (exact products): groups 0-7 and 8-15 of each
LLMC_INLINE void kscales2(const KScales2& r, Floats (&scales)[2], Floats (&mins)[2]) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.codes)), m = _mm_set1_epi8(0x0F);
  const __m128i sc = _mm_and_si128(codes, m), mn = _mm_and_si128(_mm_srli_epi16(codes, 4), m);
  const __m256 d = _mm256_set1_ps(scale_value(r.d)), dmin = _mm256_set1_ps(scale_value(r.dmin));
  for (int h = 0; h < 2; ++h) {
    scales[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc, 8) : sc)));
    mins[h] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(mn, 8) : mn)));
  }
}
// An IQ4_XS record's 8 scales, as floats (exact products): the low nibbles interleaved into bytes, the high bits
// shifted out of sh per lane
LLMC_INLINE Floats iq4_scales8(const Iq4Scales& r) {
  int32_t sl;
  std::memcpy(&sl, r.sl, 4);
  const __m128i v = _mm_cvtsi32_si128(sl), m = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
  const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(r.sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                        _mm256_set1_epi32(3));
  const __m256i ls = _mm256_or_si256(_mm256_cvtepu8_epi32(low), _mm256_slli_epi32(high, 4));
  return _mm256_mul_ps(_mm256_set1_ps(scale_value(r.d)), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
}
LLMC_INLINE Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
LLMC_INLINE Floats fma(Floats a, Floats b, Floats acc) { return _mm256_fmadd_ps(a, b, acc); }
LLMC_INLINE Floats fma_ints(Ints p, Floats d, Floats acc) { return fma(_mm256_cvtepi32_ps(p), d, acc); }
// q[i] = round-to-nearest-even(x[i] * id), i < 32; returns max |x[i]| (exact, as any order of max is).
LLMC_INLINE float absmax32(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
LLMC_INLINE void round32(const float* x, float id, int8_t* q) {
  const __m256 v = _mm256_set1_ps(id);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i)
    i32[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs interleave the 128-bit halves: [0 1 4 5 | 2 3 6 7] of 4-int groups, put back in order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
LLMC_INLINE float madd(float a, float b, float c) { return std::fma(a, b, c); }
LLMC_INLINE float hsum(Floats v) {  // the tree of the portable hsum below
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
}  // namespace qsimd
#else
#define LLMC_QDOT "scalar"
namespace qsimd {  // portable: the same lanes as plain arrays
struct Bytes {
  int8_t v[32];
};
struct Ints {
  int32_t v[8];
};
struct Floats {
  float v[8];
};
LLMC_INLINE Bytes load32(const void* p) {
  Bytes r;
  std::memcpy(r.v, p, 32);
  return r;
}
LLMC_INLINE void store32(void* p, Bytes v) { std::memcpy(p, v.v, 32); }
LLMC_INLINE void nibbles32(const uint8_t* p, Bytes& lo, Bytes& hi) {
  for (int j = 0; j < 32; ++j) {
    lo.v[j] = int8_t(p[j] & 0x0F);
    hi.v[j] = int8_t(p[j] >> 4);
  }
}
LLMC_INLINE void nibbles16(const uint8_t* p, Bytes& lo, Bytes& hi) {
  for (int j = 0; j < 32; ++j) {
    lo.v[j] = j < 16 ? int8_t(p[j] & 0x0F) : 0;
    hi.v[j] = j < 16 ? int8_t(p[j] >> 4) : 0;
  }
}
LLMC_INLINE Bytes decode6(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 32; ++j)
    r.v[j] = int8_t(((p[j % 16] >> (j / 16 * 4)) & 0x0F) | (((p[16 + j % 8] >> (2 * (j / 8))) & 3) << 4));
  return r;
}
LLMC_INLINE Bytes decode_iq4(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.v[j] = int8_t(kIq4LevelsU[(p[j % 16] >> (j / 16 * 4)) & 0x0F]);
  return r;
}
LLMC_INLINE Bytes decode2(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.v[j] = int8_t((p[j % 8] >> (2 * (j / 8))) & 3);
  return r;
}
LLMC_INLINE Bytes decode3(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.v[j] = int8_t(((p[j % 8] >> (2 * (j / 8))) & 3) | (((p[8 + j % 4] >> (j / 4)) & 1) << 2));
  return r;
}
LLMC_INLINE Bytes decode5(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.v[j] = int8_t(((p[j % 16] >> (j / 16 * 4)) & 0x0F) | (((p[16 + j % 4] >> (j / 4)) & 1) << 4));
  return r;
}
template <int BIAS>
LLMC_INLINE Ints neg_bias_of(Bytes) { return Ints{}; }
template <int BIAS>
LLMC_INLINE Ints dot_biased(Ints, Bytes u, Bytes x) {
  Ints r;
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += (int32_t(uint8_t(u.v[4 * l + i])) - BIAS) * int32_t(x.v[4 * l + i]);
    r.v[l] = s;
  }
  return r;
}
LLMC_INLINE Ints dot_nib(Ints acc, Bytes lo, Bytes xlo, Bytes hi, Bytes xhi) {
  for (int l = 0; l < 8; ++l) {
    int32_t s = acc.v[l];
    for (int i = 0; i < 4; ++i)
      s += int32_t(lo.v[4 * l + i]) * xlo.v[4 * l + i] + int32_t(hi.v[4 * l + i]) * xhi.v[4 * l + i];
    acc.v[l] = s;
  }
  return acc;
}
LLMC_INLINE Ints load_ints(const int32_t* p) {
  Ints r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
LLMC_INLINE void store_ints(int32_t* p, Ints v) { std::memcpy(p, v.v, sizeof v.v); }
LLMC_INLINE Ints sub(Ints a, Ints b) {
  for (int l = 0; l < 8; ++l) a.v[l] -= b.v[l];
  return a;
}
LLMC_INLINE Bytes splat_bytes(int8_t v) {
  Bytes r;
  for (int8_t& b : r.v) b = v;
  return r;
}
LLMC_INLINE Ints zero_ints() { return Ints{}; }
LLMC_INLINE Floats load_floats(const float* p) {
  Floats r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
LLMC_INLINE Floats zero_floats() { return Floats{}; }
LLMC_INLINE Floats splat(float a) {
  Floats r;
  for (float& f : r.v) f = a;
  return r;
}
template <typename SC>
LLMC_INLINE Floats splat2(const SC* p) {
  const float s0 = scale_value(p[0]), s1 = scale_value(p[1]);
  Floats r;
  for (int l = 0; l < 8; ++l) r.v[l] = l < 4 ? s0 : s1;
  return r;
}
LLMC_INLINE Floats widen8(const uint16_t* p, int n) {
  Floats r{};
  for (int i = 0; i < n; ++i) r.v[i] = scale_value(p[i]);
  return r;
}
LLMC_INLINE Floats lane(Floats v, int i) { return splat(v.v[i]); }
LLMC_INLINE Floats pair(Floats v, int i) {
  Floats r;
  for (int l = 0; l < 8; ++l) r.v[l] = v.v[2 * i + l / 4];
  return r;
}
LLMC_INLINE void kscales16(const KScales6& r, Floats& lo, Floats& hi) {
  for (int j = 0; j < 8; ++j) {
    float m;
    group_scale_min(&r, &r, j, lo.v[j], m);
    group_scale_min(&r, &r, 8 + j, hi.v[j], m);
  }
}
LLMC_INLINE Floats kscales8(const KScales& r, Floats& mins) {
  Floats scales;
  for (int j = 0; j < 8; ++j) kscale_min(r, j, scales.v[j], mins.v[j]);
  return scales;
}
LLMC_INLINE void kscales2(const KScales2& r, Floats (&scales)[2], Floats (&mins)[2]) {
  for (int j = 0; j < 16; ++j) group_scale_min(&r, &r, j, scales[j / 8].v[j % 8], mins[j / 8].v[j % 8]);
}
LLMC_INLINE Floats iq4_scales8(const Iq4Scales& r) {
  Floats scales;
  for (int j = 0; j < 8; ++j) scales.v[j] = scale_value(r.d) * float(iq4_code(r, j) - 32);
  return scales;
}
LLMC_INLINE Floats mul(Floats a, Floats b) {
  for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
  return a;
}
LLMC_INLINE Floats fma(Floats a, Floats b, Floats acc) {
  for (int l = 0; l < 8; ++l) acc.v[l] += a.v[l] * b.v[l];
  return acc;
}
LLMC_INLINE Floats fma_ints(Ints p, Floats d, Floats acc) {
  for (int l = 0; l < 8; ++l) acc.v[l] += float(p.v[l]) * d.v[l];
  return acc;
}
LLMC_INLINE float absmax32(const float* x) {
  float m = 0.0f;
  for (int i = 0; i < 32; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}
LLMC_INLINE void round32(const float* x, float id, int8_t* q) {
  for (int i = 0; i < 32; ++i) q[i] = int8_t(std::nearbyint(x[i] * id));  // default mode: nearest, ties to even
}
LLMC_INLINE float madd(float a, float b, float c) { return a * b + c; }
LLMC_INLINE float hsum(Floats a) {
  const float* v = a.v;
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}
}  // namespace qsimd
#endif

}  // namespace llmc
