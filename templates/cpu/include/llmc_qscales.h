// llmc CPU target: the weight scales of the quantized kernels (llmc_qgemm.h, llmc_moe.h) as they are stored (fp32,
// fp16 bits, the K-quants' superblock records) and as floats.
#pragma once

#include <cstdint>
#include <type_traits>

#include "llmc_elementwise.h"

namespace llmc {
// A scale or min as float: SC float, or uint16_t fp16 bits (exact either way).
LLMC_INLINE float scale_value(float s) { return s; }
LLMC_INLINE float scale_value(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;  // scales are finite: e < 31
  if (e == 0) return (h & 0x8000 ? -1.0f : 1.0f) * (float(m) * 0x1p-24f);  // subnormal or zero: exact
  const uint32_t bits = (uint32_t(h & 0x8000) << 16) | ((e + 112) << 23) | (m << 13);  // rebias 15 -> 127
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// n consecutive scales or mins as floats: float ones are read in place; fp16 ones are converted into buf (n
// floats), 8 at a time where the host has F16C. Used where the floats are read long after these stores: the
// mins, once per output after its tile, and a prefill task's scales, by all its row tiles. The decode tiles
// convert their scales in registers as they go (splat2, widen8): read back from such a buffer right after its
// stores, they stalled on store-to-load forwarding, which halved int4's and int8's speed at K = 576 with the
// weights in cache (2-core Zen 4 EPYC).
LLMC_INLINE const float* scales_as_float(const float* p, long, float*) { return p; }
LLMC_INLINE const float* scales_as_float(const uint16_t* p, long n, float* buf) {
  long i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < n; ++i) buf[i] = scale_value(p[i]);
  return buf;
}

// K-quant superblock scales (SC = KScales; compiler/kquant.py): one 16-byte record per 8 groups of 32, fp16 d
// and dmin and eight 6-bit scale and min codes; group j's scale is d * sc[j] and its min dmin * m[j], exact
// float products. The record holds the mins: the mins pointer is null. qdot_tile decodes a record's 8 scales and
// 8 mins in registers (qsimd::kscales8) as its steps reach it.
struct KScales {
  uint16_t d, dmin;
  uint8_t codes[12];
};
static_assert(sizeof(KScales) == 16, "a K-quant record is 16 bytes");
// A record's codes rearranged into bytes sc[0..7], m[0..7] (b[0..1], b[2..3]), four at a time in 32-bit words,
// as llama.cpp unpacks them: a few integer ops per record, where the GEMV streams 128 bytes of int4 per record.
LLMC_INLINE void kscale_bytes(const KScales& r, uint32_t (&b)[4]) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, r.codes, 12);
  b[0] = u[0] & low6;                                         // sc 0..3
  b[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);        // sc 4..7
  b[2] = u[1] & low6;                                         // m 0..3
  b[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);  // m 4..7
}
LLMC_INLINE void kscale_min(const KScales& r, int j, float& scale, float& min) {
  uint32_t b[4];
  kscale_bytes(r, b);
  uint8_t c[16];
  std::memcpy(c, b, 16);
  scale = scale_value(r.d) * float(c[j]);
  min = scale_value(r.dmin) * float(c[8 + j]);
}
// Q6_K's superblock scales (SC = KScales6; compiler/kquant.py): one 18-byte record per 16 groups of 16, the int8
// sub-scales and fp16 d; group j's scale is d * sc[j], an exact float product. Symmetric: no mins.
struct KScales6 {
  int8_t sc[16];
  uint16_t d;
};
static_assert(sizeof(KScales6) == 18, "a Q6_K record is 18 bytes");
// IQ4_XS's superblock scales (SC = Iq4Scales; compiler/kquant.py): one 8-byte record per 8 groups of 32, fp16 d
// and each group's 6-bit code ls (low 4 bits in nibble j % 2 of sl[j / 2], high 2 at bits 2j of sh); group j's
// scale is d * (ls - 32), an exact float product. Symmetric: no mins.
struct Iq4Scales {
  uint16_t d, sh;
  uint8_t sl[4];
};
static_assert(sizeof(Iq4Scales) == 8, "an IQ4_XS record is 8 bytes");
LLMC_INLINE int iq4_code(const Iq4Scales& r, int j) {
  return ((r.sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((r.sh >> (2 * j)) & 3) << 4);
}
// Q2_K's superblock scales and mins (SC = KScales2; compiler/kquant.py): one 20-byte record per 16 groups of 16,
// each group's 4-bit scale code (low nibble) and min code (high), then fp16 d and dmin; group j's scale is
// d * sc[j] and its min dmin * m[j], exact float products. The record holds the mins: the mins pointer is null.
struct KScales2 {
  uint8_t codes[16];
  uint16_t d, dmin;
};
static_assert(sizeof(KScales2) == 20, "a Q2_K record is 20 bytes");
// Groups per SC item: a record's, or 1.
template <typename SC>
constexpr int groups_per_scale = std::is_same_v<SC, KScales> || std::is_same_v<SC, Iq4Scales>   ? 8
                                 : std::is_same_v<SC, KScales6> || std::is_same_v<SC, KScales2> ? 16
                                                                                                 : 1;
// Bytes of scales (and mins) per row of G groups.
template <typename SC>
constexpr long scale_row_bytes(int G, bool asym) {
  return groups_per_scale<SC> > 1 ? (long)G / groups_per_scale<SC> * sizeof(SC) : (long)G * sizeof(SC) * (asym ? 2 : 1);
}
// Group gi's scale and min (0 without mins), whatever SC.
template <typename SC>
LLMC_INLINE void group_scale_min(const SC* scales, const SC* mins, long gi, float& scale, float& min) {
  scale = scale_value(scales[gi]);
  min = mins ? scale_value(mins[gi]) : 0.0f;
}
LLMC_INLINE void group_scale_min(const KScales* scales, const KScales*, long gi, float& scale, float& min) {
  kscale_min(scales[gi / 8], int(gi % 8), scale, min);
}
LLMC_INLINE void group_scale_min(const KScales6* scales, const KScales6*, long gi, float& scale, float& min) {
  scale = scale_value(scales[gi / 16].d) * float(scales[gi / 16].sc[gi % 16]);
  min = 0.0f;
}
LLMC_INLINE void group_scale_min(const KScales2* scales, const KScales2*, long gi, float& scale, float& min) {
  const KScales2& r = scales[gi / 16];
  scale = scale_value(r.d) * float(r.codes[gi % 16] & 0xF);
  min = scale_value(r.dmin) * float(r.codes[gi % 16] >> 4);
}
LLMC_INLINE void group_scale_min(const Iq4Scales* scales, const Iq4Scales*, long gi, float& scale, float& min) {
  scale = scale_value(scales[gi / 8].d) * float(iq4_code(scales[gi / 8], int(gi % 8)) - 32);
  min = 0.0f;
}
// The n scales of K-quant records (KScales, KScales2, KScales6, Iq4Scales) as floats, into buf: the prefill's row-pair tiles read
// float scales.
template <typename R, std::enable_if_t<(groups_per_scale<R> > 1), int> = 0>
LLMC_INLINE const float* scales_as_float(const R* p, long n, float* buf) {
  float min;
  for (long i = 0; i < n; ++i) group_scale_min(p, p, i, buf[i], min);
  return buf;
}
// The n mins of K-quant records with mins (KScales, KScales2) as floats, into buf.
template <typename R>
LLMC_INLINE const float* mins_as_float(const R* p, long n, float* buf) {
  float scale;
  for (long i = 0; i < n; ++i) group_scale_min(p, p, i, scale, buf[i]);
  return buf;
}

}  // namespace llmc
