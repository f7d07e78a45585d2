// llmc CPU target: the dense GEMM / GEMV of every linear layer.
#pragma once

#include <vector>

#include "llmc_elementwise.h"
#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
//
// On an AMX host bf16 weights take llmc_gemm_amx.h instead, at every T (its own order, as row-independent).
//
// Numerics. Each (row, output) is one accumulator Vec over K, summed by Vec::sum(), in an order fixed by
// the weight type and the ISA (GemmOrder below) and nothing else: register tiles of any R x C, the GEMV and
// the GEMM paths, any thread count give bit-identical numbers for one row, so a row never depends on T.
//
// Paths. T <= kGemvRows (decode): each task streams ~kGemvTaskBytes of consecutive weight rows once, C rows
// at a time, shared by the T rows, with a software prefetch PF bytes ahead. Larger T (batched decode,
// prefill): tasks of (up to kGemmXBytes of x rows) x (~kGemvTaskBytes of weight rows); in a task each tile of
// C weight rows is read once (streamed and prefetched like the GEMV, bf16 widened once into an L1 panel) and
// reused from L1 by every R-row tile of x, so the weights cross the memory bus once per call whatever T is.
constexpr int kGemvRows = 4;
constexpr int kGemmR = 4;
#if defined(__AVX512F__)
constexpr int gemm_cols(int rows) { return rows <= 2 ? 8 : 6; }  // R * C + C + 1 <= 32 zmm registers
#else
constexpr int gemm_cols(int rows) { return rows <= 2 ? 4 : 3; }  // R * C + C + 1 <= 16 ymm registers
#endif
constexpr long kGemvTaskBytes = 32 * 1024;  // weight bytes per parallel task (default of gemm's TASK)
constexpr long kGemmXBytes = 512 * 1024;    // x of a GEMM task's K block: stays in L2 while C-row tiles pass
constexpr int kGemmPanelRows = 16;          // see `panel` in gemm()
constexpr int kGemmDotPanelRows = 8;        // the same where the panel stands in for vdpbf16ps
// Default software prefetch distance of the weight stream in bytes (the gemm template's PF; 0: none).
// Measured with benchmarks/cpu_kernels.py on SmolLM-135M's bf16 GEMVs: the rows are too short for the
// hardware prefetcher to get ahead of.
constexpr int kGemvPrefetchBytes = 16 * 1024;
// The quantized GEMM's prefill blocking (llmc_qgemm.h): kGemmTChunk rows x ~kGemmBlockBytes of weights.
constexpr int kGemmTChunk = 64;
constexpr long kGemmBlockBytes = 128 * 1024;

// ---------------------------------------------------------------------------------------------
// GemmOrder<WT>: the order of one dot product's K loop. The main part [0, KMAIN), KMAIN = K / KS * KS, runs
// in steps of KS over x "prepared" once per call (XT[T][KMAIN]); the tail [KMAIN, K) in natural order,
// W at a time (the last one masked), over the caller's fp32 x.
//   fp32 weights: x as it is, one FMA per W (lane l sums k = l mod W in order).
//   bf16 weights, AVX-512 BF16: x rounded to bf16, one vdpbf16ps per 2W (lane l: the pairs 2l, 2l+1).
//   bf16 weights otherwise: each 2W block of x permuted to [even k | odd k], two FMAs per 2W with the
//   weights widened by Vec::load_pairs (a shift, an and). The same products in the same order come from a
//   panel of weights widened once in that permuted order (gemm_widen_panel), read as fp32.
template <typename WT>
struct GemmOrder;

template <>
struct GemmOrder<float> {
  using XT = float;
  static constexpr int KS = Vec::W;
  static constexpr bool kPrepare = false;
  static constexpr int kPhases = 1;
  struct X {
    Vec v;
  };
  using W = X;
  static LLMC_INLINE X load_x(const float* p, int) { return {Vec::load(p)}; }
  static LLMC_INLINE W load_w(const float* p, int) { return {Vec::load(p)}; }
  static LLMC_INLINE void step(Vec& acc, const X& x, const W& w) { acc.fma(x.v, w.v); }
  template <class V>
  static LLMC_INLINE void pin(V& a) { a.v.pin(); }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMC_BF16_DOT 1
template <>
struct GemmOrder<uint16_t> {
  using XT = uint16_t;
  static constexpr int KS = 2 * Vec::W;
  static constexpr bool kPrepare = true;
  static constexpr int kPhases = 1;
  struct X {
    __m512i v;
  };
  using W = X;
  static LLMC_INLINE X load_x(const uint16_t* p, int) { return {_mm512_loadu_si512(p)}; }
  static LLMC_INLINE W load_w(const uint16_t* p, int) { return {_mm512_loadu_si512(p)}; }
  static LLMC_INLINE void step(Vec& acc, const X& x, const W& w) {
    acc.v = _mm512_dpbf16_ps(acc.v, (__m512bh)x.v, (__m512bh)w.v);
  }
  static LLMC_INLINE void pin(X& a) { asm("" : "+v"(a.v)); }  // see Vec::pin
  // x[0, KMAIN) rounded to bf16 (nearest even), in order.
  static LLMC_INLINE void prepare(const float* x, uint16_t* xp, int kmain) {
    for (int i = 0; i < kmain; i += KS) {
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
      _mm512_storeu_si512(xp + i, (__m512i)h);
    }
  }
};
#else
#define LLMC_BF16_DOT 0
template <>
struct GemmOrder<uint16_t> {
  using XT = float;
  static constexpr int KS = 2 * Vec::W;
  static constexpr bool kPrepare = true;
  // Phase 0: the even k of the step, phase 1: the odd ones. A tile runs all its FMAs of one phase before the
  // next, so it holds C widened vectors at a time, not 2C (no spills at R x C = 4 x 3 on 16 registers).
  static constexpr int kPhases = 2;
  struct X {
    Vec v;
  };
  using W = X;
  static LLMC_INLINE X load_x(const float* p, int phase) { return {Vec::load(p + phase * Vec::W)}; }
  static LLMC_INLINE W load_w(const uint16_t* p, int phase) {
    Vec even, odd;
    Vec::load_pairs(p, even, odd);
    return {phase == 0 ? even : odd};
  }
  static LLMC_INLINE void step(Vec& acc, const X& x, const W& w) { acc.fma(x.v, w.v); }
  static LLMC_INLINE void pin(X& a) { a.v.pin(); }
  // Each 2W block of x[0, KMAIN) as [x[0], x[2], ..., x[2W-2] | x[1], x[3], ..., x[2W-1]].
  static LLMC_INLINE void prepare(const float* x, float* xp, int kmain) {
    for (int i = 0; i < kmain; i += KS) {
      for (int j = 0; j < Vec::W; ++j) {
        xp[i + j] = x[i + 2 * j];
        xp[i + Vec::W + j] = x[i + 2 * j + 1];
      }
    }
  }
};
#endif

// The GEMM path's K blocks: a C-row weight tile's block of ~kGemmKBlockBytes stays in L1 while the x rows pass;
// K is cut into equal blocks of whole steps. (Llama-3.2-1B's K = 2048 in one block, 48 KB of fp32 tile, left
// every tile pass to L2: 1B prefill GEMMs at 22-27% of the FMA peak, 2 threads, Xeon.)
constexpr long kGemmKBlockBytes = 16 * 1024;
constexpr int kGemmBlockTiles = 4;          // pairs of C-row tiles per task when K takes several blocks
constexpr int kGemmXPrefetchBytes = 1024;  // packed x prefetched ahead: +11% on a 4 x 6 tile over 64 rows, K = 576
template <class O, typename PT>
constexpr int gemm_kblock(int C, int KMAIN) {
  const int most = std::max<int>(O::KS, kGemmKBlockBytes / (C * (long)sizeof(PT)) / O::KS * O::KS);
  if (KMAIN <= most) return std::max(KMAIN, O::KS);
  const int blocks = (KMAIN + most - 1) / most;
  return (KMAIN / blocks + O::KS - 1) / O::KS * O::KS;
}

#if LLMC_BF16_DOT
// MXCSR's flush-to-zero and denormals-are-zero: vdpbf16ps's own treatment of denormals, for its FMA emulation.
LLMC_INLINE void gemm_ftz_daz(bool on) {
  constexpr unsigned kFtzDaz = 0x8040;
  _mm_setcsr(on ? _mm_getcsr() | kFtzDaz : _mm_getcsr() & ~kFtzDaz);
}

// Whether the GEMM path runs bf16 weights' steps as two fp32 FMAs per vdpbf16ps lane (the odd pair element,
// then the even one, under FTZ and DAZ) over widened panels, instead of vdpbf16ps itself. The products of two
// bf16 are exact in fp32, so where the instruction is that sequence (Intel documents it so) the numbers are
// the same; checked here on this CPU, not assumed. Where two FMAs are also faster (Sapphire Rapids: vdpbf16ps
// at half the FMA rate per flop; Zen 4 the other way round), they are used. LLMC_CPU_BF16_GEMM=dot or =fma
// forces one (fma only where exact), read at every call so tests can take each path.
struct Bf16DotEmulation {
  bool exact = false, faster = false;
};
inline Bf16DotEmulation bf16_dot_probe() {
  Bf16DotEmulation e;
  uint32_t seed = 12345;
  auto bf16 = [&seed] {  // normal values over most of the range (products stay normal), some denormals
    seed = seed * 1664525u + 1013904223u;
    const uint32_t r = seed >> 8;
    const uint32_t exp = (r & 31) == 0 ? 0 : 64 + (r >> 5) % 126;
    return uint16_t(((r >> 12) & 1) << 15 | exp << 7 | (r >> 13) % 128);
  };
  alignas(64) uint16_t xs[32 * 64], ws[32 * 64];
  for (int i = 0; i < 32 * 64; ++i) xs[i] = bf16(), ws[i] = bf16();
  __m512 dot = _mm512_setzero_ps(), fma = _mm512_setzero_ps();
  gemm_ftz_daz(true);
  for (int i = 0; i < 32 * 64; i += 32) {
    const __m512i xv = _mm512_load_si512(xs + i), wv = _mm512_load_si512(ws + i);
    dot = _mm512_dpbf16_ps(dot, (__m512bh)xv, (__m512bh)wv);
    Vec xe, xo, we, wo;
    Vec::load_pairs(xs + i, xe, xo);
    Vec::load_pairs(ws + i, we, wo);
    fma = _mm512_fmadd_ps(xe.v, we.v, _mm512_fmadd_ps(xo.v, wo.v, fma));
  }
  gemm_ftz_daz(false);
  e.exact = _mm512_cmpneq_ps_mask(dot, fma) == 0 && _mm512_cmpeq_ps_mask(dot, dot) == 0xffff;
  // Eight independent chains of each, best of 5: 2 FMAs per vdpbf16ps against 1 vdpbf16ps.
  auto best = [](auto&& body) {
    double t = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      body();
      t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return t;
  };
  constexpr int kIters = 4096;
  float sink = 0;
  const double t_dot = best([&] {
    __m512 a[8];
    for (auto& v : a) v = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < kIters; ++i) {
      for (auto& v : a) v = _mm512_dpbf16_ps(v, x, x);
      asm volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]));
    }
    for (auto& v : a) sink += _mm512_cvtss_f32(v);
  });
  const double t_fma = best([&] {
    __m512 a[8];
    for (auto& v : a) v = _mm512_setzero_ps();
    const __m512 x = _mm512_set1_ps(1.0f);
    for (int i = 0; i < kIters; ++i) {
      for (auto& v : a) v = _mm512_fmadd_ps(x, x, _mm512_fmadd_ps(x, x, v));
      asm volatile("" : "+v"(a[0]), "+v"(a[1]), "+v"(a[2]), "+v"(a[3]), "+v"(a[4]), "+v"(a[5]), "+v"(a[6]), "+v"(a[7]));
    }
    for (auto& v : a) sink += _mm512_cvtss_f32(v);
  });
  e.faster = t_fma < t_dot && sink != 1.5f;
  return e;
}
inline bool bf16_gemm_emulates_dot() {
  static const Bf16DotEmulation e = bf16_dot_probe();
  const char* force = std::getenv("LLMC_CPU_BF16_GEMM");
  if (force && std::strcmp(force, "dot") == 0) return false;
  if (force && std::strcmp(force, "fma") == 0) return e.exact;
  return e.exact && e.faster;
}
#else
LLMC_INLINE void gemm_ftz_daz(bool) {}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && LLMC_BF16_DOT
// bf16 weights on AMX tiles, every T: llmc_gemm_amx.h.
#define LLMC_AMX 1
constexpr int kAmxK = 32;  // bf16 per tile row (64 bytes): k per tdpbf16ps
inline bool bf16_gemm_uses_amx();
template <int N, int K, bool HAS_BIAS, long TASK>
void gemm_amx(const float* x, const uint16_t* w, const uint16_t* bias, float* y, int T, float cap);
#else
#define LLMC_AMX 0
#endif

// ---------------------------------------------------------------------------------------------
// gemm_steps<O, R, C, LDW, PF, XPACK>: acc[r][c] += the main-part steps [0, n) of row r and weight row c (w,
// stride LDW): the caller offsets both to a block's first step. x: rows of stride ldxp, or with XPACK the R
// rows packed step by step ([step][r][KS], gemm_pack_rows: one sequential stream for the prefetchers, where R
// rows far apart leave a GEMM's x stream from L2 at 44% of the FMA peak). WT: O's weight type, or float for a
// widened panel.
// PF > 0: also prefetch PF bytes ahead of ws, the tile's weights as they lie in memory (w itself, or the bf16
// rows a panel w was widened from; LDS, ST: their stride and type), C cache lines per line of a row read. A
// tile whose C rows span less than PF bytes gets its lines in address order, so the prefetches of tile after
// tile form one stream; a longer tile gets one line per row, PF bytes along each row. (Streamed from DRAM, 2
// threads, AVX-512 EPYC: bf16 GEMVs at K = 576, 9 KB tiles, +25% in address order; at 24-64 KB tiles 5-14%
// slower than per row. llmc_qgemm.h's GEMV prefetches by the same rule.)
template <class O, int R, int C, long LDW, int PF, bool XPACK = false, long LDS = LDW, typename XT, typename WT,
          typename ST>
LLMC_INLINE void gemm_steps(const XT* LLMC_RESTRICT xp, long ldxp, const WT* LLMC_RESTRICT w, int n,
                            Vec (&acc)[R][C], const ST* ws) {
  constexpr int LINE = 64 / (int)sizeof(ST);
  constexpr int PSTEP = O::KS >= LINE ? O::KS : LINE;  // row elements per prefetch of C lines
  constexpr bool kAddressOrder = C * LDS * (long)sizeof(ST) < PF;
  for (int i = 0; i < n; i += O::KS) {
    if constexpr (PF > 0) {
      if (O::KS >= LINE || i % LINE == 0) {
        LLMC_UNROLL for (int c = 0; c < C; ++c) {
          const char* p = kAddressOrder ? reinterpret_cast<const char*>(ws) + ((long)(i / PSTEP) * C + c) * 64
                                        : reinterpret_cast<const char*>(ws + c * LDS + i);
          prefetch_l2(p + PF);
        }
      }
    }
    if constexpr (XPACK) {
      LLMC_UNROLL for (int r = 0; r < R * O::KS * (int)sizeof(XT) / 64; ++r)
        __builtin_prefetch(reinterpret_cast<const char*>(xp + (long)i * R) + kGemmXPrefetchBytes + 64 * r, 0, 3);
    }
    LLMC_UNROLL for (int ph = 0; ph < O::kPhases; ++ph) {
      typename O::W wv[C];
      LLMC_UNROLL for (int c = 0; c < C; ++c) {
        wv[c] = O::load_w(w + c * LDW + i, ph);
        if constexpr (R > 1) O::pin(wv[c]);
      }
      LLMC_UNROLL for (int r = 0; r < R; ++r) {
        typename O::X xv = O::load_x(XPACK ? xp + (long)i * R + r * O::KS : xp + r * ldxp + i, ph);
        if constexpr (C > 1) O::pin(xv);
        LLMC_UNROLL for (int c = 0; c < C; ++c) O::step(acc[r][c], xv, wv[c]);
      }
    }
  }
}

// acc[r][c] += the tail of K - KMAIN elements in natural order, W at a time (the last one masked): x at the
// tail's first element of row r (stride K), w at that of weight row c (stride LDW).
template <int R, int C, int K, int KMAIN, long LDW, typename WT>
LLMC_INLINE void gemm_tail(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w, Vec (&acc)[R][C]) {
  constexpr int VW = Vec::W;
  LLMC_UNROLL for (int i = 0; i < K - KMAIN; i += VW) {
    const int n = K - KMAIN - i < VW ? K - KMAIN - i : VW;
    Vec wv[C];
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const WT* p = w + c * LDW + i;
      wv[c] = n == VW ? Vec::load(p) : Vec::load_part(p, n);
    }
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      const float* p = x + (long)r * K + i;
      const Vec xv = n == VW ? Vec::load(p) : Vec::load_part(p, n);
      LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c].fma(xv, wv[c]);
    }
  }
}

// gemm_tile<O, R, C, KMAIN, K, PF>: s[r * C + c] = dot(row r, weight row c), r < R, c < C, in O's order.
// xp: prepared rows (stride KMAIN; fp32 weights: x itself, stride K); x: the fp32 rows (stride K), for the
// tail; w: C weight rows of stride K.
template <class O, int R, int C, int KMAIN, int K, int PF, typename XT, typename WT>
LLMC_INLINE void gemm_tile(const XT* LLMC_RESTRICT xp, long ldxp, const float* LLMC_RESTRICT x,
                           const WT* LLMC_RESTRICT w, float* LLMC_RESTRICT s) {
  Vec acc[R][C];
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  }
  gemm_steps<O, R, C, K, PF>(xp, ldxp, w, KMAIN, acc, w);
  gemm_tail<R, C, K, KMAIN, K>(x + KMAIN, w + KMAIN, acc);
  sum_each<R * C>(&acc[0][0], s);
}

// y[r, j + c] = s[r * C + c] (+ bias[j + c]) for r < R, c < C.
template <int R, int C, int N, bool HAS_BIAS, typename WT>
LLMC_INLINE void gemm_store(const float* s, const WT* bias, float* y, int j) {
  LLMC_UNROLL for (int c = 0; c < C; ++c) {
    const float b = HAS_BIAS ? load_w(bias[j + c]) : 0.0f;
    LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * N + j + c] = HAS_BIAS ? s[r * C + c] + b : s[r * C + c];
  }
}

// Outputs [j0, j1) of R rows: C-output tiles, then 1-output tiles for the tail.
template <class O, int R, int N, int K, bool HAS_BIAS, int PF, typename XT, typename WT>
LLMC_INLINE void gemv_rows(const XT* xp, const float* x, const WT* w, const WT* bias, float* y, int j0, int j1) {
  // The bf16 pair order holds one more register (the and mask): a full 4-row tile would spill accumulators.
  constexpr int C = O::kPhases == 2 && R == 4 ? gemm_cols(R) - 1 : gemm_cols(R);
  constexpr int KMAIN = K / O::KS * O::KS;
  constexpr long LDXP = O::kPrepare ? KMAIN : K;
  int j = j0;
  for (; j + C <= j1; j += C) {
    float s[R * C];
    gemm_tile<O, R, C, KMAIN, K, PF>(xp, LDXP, x, w + (long)j * K, s);
    gemm_store<R, C, N, HAS_BIAS>(s, bias, y, j);
  }
  for (; j < j1; ++j) {
    float s[R];
    gemm_tile<O, R, 1, KMAIN, K, PF>(xp, LDXP, x, w + (long)j * K, s);
    gemm_store<R, 1, N, HAS_BIAS>(s, bias, y, j);
  }
}

// Weight rows [0, C) at w (stride K), steps [i0, i0 + n) of the main part and, with tail, the tail [KMAIN, K):
// widened into panel rows of stride LDP as a GemmOrder<float> tile then reads them from L1, each 2W step
// permuted as the x it meets (ODD_FIRST: [odd k | even k], vdpbf16ps's order; else [even k | odd k]), the
// tail in order.
template <int C, int K, long LDP, bool ODD_FIRST>
LLMC_INLINE void gemm_widen_panel(const uint16_t* LLMC_RESTRICT w, int i0, int n, bool tail,
                                  float* LLMC_RESTRICT panel) {
  constexpr int VW = Vec::W, KS = 2 * VW;
  constexpr int KMAIN = K / KS * KS;
  for (int c = 0; c < C; ++c) {
    const uint16_t* row = w + (long)c * K;
    float* out = panel + c * LDP;
    for (int i = 0; i < n; i += KS) {
      Vec even, odd;
      Vec::load_pairs(row + i0 + i, even, odd);
      (ODD_FIRST ? odd : even).store(out + i);
      (ODD_FIRST ? even : odd).store(out + i + VW);
    }
    if (tail) {
      for (int i = KMAIN; i < K; ++i) out[n + i - KMAIN] = bf16_to_f32(row[i]);
    }
  }
}

// One R x CC tile of a GEMM block over the main-part steps [i0, i0 + n): xr: the tile's packed x; xt: its
// row 0 of fp32 x; wt: weight row 0 at step i0 (stride LDW); acc: the tile's spilled accumulators
// (stride LDA) between K blocks. first: start from zero, else from acc; last: add the tail (wtail: weight
// row 0's tail) and store y, else spill to acc. ftz: the MXCSR of the steps, lifted for the tail (see
// bf16_gemm_emulates_dot()). ws: weight row 0 at step i0 as it lies in memory, the base of PF's prefetches.
template <class OT, int R, int CC, int N, int K, int KMAIN, long LDW, int PF, bool HAS_BIAS, typename XT, typename PT,
          typename WT>
LLMC_INLINE void gemm_block_tile(const XT* xr, const float* xt, const PT* wt, const WT* ws, int i0, int n,
                                 const PT* wtail, Vec* acc_spill, long lda, bool first, bool last, bool ftz,
                                 const WT* bias, float* yt, int j) {
  Vec acc[R][CC];
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < CC; ++c) acc[r][c] = first ? Vec::zero() : acc_spill[r * lda + c];
  }
  gemm_steps<OT, R, CC, LDW, PF, true, K>(xr + (long)i0 * R, 0, wt, n, acc, ws);
  if (!last) {
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      LLMC_UNROLL for (int c = 0; c < CC; ++c) acc_spill[r * lda + c] = acc[r][c];
    }
    return;
  }
  if constexpr (K > KMAIN) {
    if (ftz) gemm_ftz_daz(false);
    gemm_tail<R, CC, K, KMAIN, LDW>(xt + KMAIN, wtail, acc);
    if (ftz) gemm_ftz_daz(true);
  }
  float s[R * CC];
  sum_each<R * CC>(&acc[0][0], s);
  gemm_store<R, CC, N, HAS_BIAS>(s, bias, yt, j);
}

// Rows [t0, t1) x outputs [j0, j1) of the GEMM path (see the top), K block by K block; xp: x packed by
// gemm_pack_rows from row 0 on. OT, PANEL: the order of the tiles (O itself, or GemmOrder<float> over a widened
// panel of ODD_FIRST order; XT is then float).
// acc_spill: (t1 - t0) x (j1 - j0) accumulators, used when K takes more than one block.
template <class O, class OT, bool PANEL, bool ODD_FIRST, int N, int K, bool HAS_BIAS, int PF, typename XT,
          typename WT>
LLMC_INLINE void gemm_block(const XT* xp, const float* x, const WT* w, const WT* bias, float* y, int t0, int t1,
                            int j0, int j1, Vec* acc_spill, bool ftz) {
  constexpr int R = kGemmR, C = O::kPhases == 2 && !PANEL ? gemm_cols(R) - 1 : gemm_cols(R);  // see gemv_rows
  constexpr int KMAIN = K / O::KS * O::KS;
  using PT = std::conditional_t<PANEL, float, WT>;
  constexpr int KB = gemm_kblock<O, PT>(C, KMAIN);
  constexpr long LDP = KB + (K - KMAIN);  // a panel row: one block and the tail
  // The first pass over a block prefetches: with several blocks, each row's next block; with one, PF ahead.
  constexpr int PF_STREAM = KMAIN > KB ? KB * (int)sizeof(WT) : PF;
  const long lda = j1 - j0;
  for (int i0 = 0; i0 < KMAIN || i0 == 0; i0 += KB) {
    const int n = std::min(KB, KMAIN - i0);
    const bool first = i0 == 0, last = i0 + KB >= KMAIN;
    auto tiles = [&](auto cols, int j) {
      constexpr int CC = decltype(cols)::value;
      alignas(64) float panel[PANEL ? CC * LDP : 1];
      const PT* wt;
      const PT* wtail;
      if constexpr (PANEL) {
        gemm_widen_panel<CC, K, LDP, ODD_FIRST>(w + (long)j * K, i0, n, last, panel);
        wt = panel;
        wtail = panel + n;
      } else {
        wt = w + (long)j * K + i0;
        wtail = w + (long)j * K + KMAIN;
      }
      constexpr long LDW = PANEL ? LDP : K;
      for (int t = t0; t < t1; t += R) {
        const XT* xr = xp + (long)t * KMAIN;
        const float* xt = x + (long)t * K;
        float* yt = y + (long)t * N;
        Vec* sp = acc_spill + (t - t0) * lda + (j - j0);
        // always_inline: left to the compiler, the call cost bf16 GEMMs 6-11% (cpu_kernels.py, Xeon)
        auto tile = [&](auto rows, auto pf) __attribute__((always_inline)) {
          gemm_block_tile<OT, decltype(rows)::value, CC, N, K, KMAIN, LDW, decltype(pf)::value, HAS_BIAS>(
              xr, xt, wt, w + (long)j * K + i0, i0, n, wtail, sp, lda, first, last, ftz, bias, yt, j);
        };
        // The first pass prefetches the weight stream ahead (the panel's widening read this tile's: without
        // that, SmolLM-135M's bf16 GEMMs at batch 16 waited on the L3, 15-20% slower: llmc profile, Xeon);
        // later passes find the tile in L1.
        using Zero = std::integral_constant<int, 0>;
        switch (t == t0 && t1 - t >= R ? 0 : std::min(R, t1 - t)) {
          case 0: tile(std::integral_constant<int, R>{}, std::integral_constant<int, PF_STREAM>{}); break;
          case 1: tile(std::integral_constant<int, 1>{}, Zero{}); break;
          case 2: tile(std::integral_constant<int, 2>{}, Zero{}); break;
          case 3: tile(std::integral_constant<int, 3>{}, Zero{}); break;
          case 4: tile(std::integral_constant<int, 4>{}, Zero{}); break;
        }
      }
    };
    int j = j0;
    for (; j + C <= j1; j += C) tiles(std::integral_constant<int, C>{}, j);
    for (; j < j1; ++j) tiles(std::integral_constant<int, 1>{}, j);
  }
}

// rows (T of stride ld) -> out: each kGemmR-row tile from row 0 on, its main part [0, kmain) step by step:
// [step][r][KS] (gemm_steps' XPACK), the last tile with the rows it has.
template <int KS, typename XT>
void gemm_pack_rows(const XT* rows, long ld, int T, int kmain, XT* out) {
  for (int t0 = 0; t0 < T; t0 += kGemmR) {
    const int rr = std::min(kGemmR, T - t0);
    XT* o = out + (long)t0 * kmain;
    for (int i = 0; i < kmain; i += KS) {
      for (int r = 0; r < rr; ++r, o += KS) std::memcpy(o, rows + (t0 + r) * ld + i, KS * sizeof(XT));
    }
  }
}

namespace {
// Per-thread scratch of one call (grows, never shrinks: no allocation in steady state), one per use.
enum { kScratchPrepared, kScratchWide, kScratchPacked, kScratchSpill, kScratchAmxX, kScratchAmxTail, kScratchGemmEnd };
template <typename XT, int USE>
XT* gemm_scratch(long n) {
  static thread_local std::vector<XT> buf;
  if ((long)buf.size() < n) buf.resize(n);
  return buf.data();
}
}  // namespace

// PF and TASK (weight bytes per parallel task) are tunable (templates/cpu/gemm.tune.toml); they change the
// speed, never the numbers. cap > 0: each output soft-capped (softcap_block), a task's own once it has them.
template <int N, int K, bool HAS_BIAS, int PF = kGemvPrefetchBytes, long TASK = kGemvTaskBytes, typename WT>
inline void gemm(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w, const WT* LLMC_RESTRICT bias,
                 float* LLMC_RESTRICT y, int T, float cap = 0.0f) {
#if LLMC_AMX
  if constexpr (std::is_same<WT, uint16_t>::value && K >= kAmxK) {
    if (bf16_gemm_uses_amx()) return gemm_amx<N, K, HAS_BIAS, TASK>(x, w, bias, y, T, cap);
  }
#endif
  using O = GemmOrder<WT>;
  using XT = typename O::XT;
  constexpr int KMAIN = K / O::KS * O::KS;
  const XT* xp;
  if constexpr (O::kPrepare) {
    XT* buf = gemm_scratch<XT, kScratchPrepared>((long)T * KMAIN + 1);
    for (int t = 0; t < T; ++t) O::prepare(x + (long)t * K, buf + (long)t * KMAIN, KMAIN);
    xp = buf;
  } else {
    xp = x;
  }
  const bool par = (long)T * N * K >= kParallelWork;
  constexpr long RB = (long)K * sizeof(WT);
  constexpr int CH0 = (int)std::max<long>(1, TASK / RB);
  if (T <= kGemvRows) {
    constexpr int CH = CH0 < 8 ? 8 : CH0 / 8 * 8;
    constexpr int NCH = (N + CH - 1) / CH;
    parallel_for(NCH, par, [&](int ch) {
      const int j0 = ch * CH, j1 = std::min(N, j0 + CH);
      switch (T) {
        case 1: gemv_rows<O, 1, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, j0, j1); break;
        case 2: gemv_rows<O, 2, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, j0, j1); break;
        case 3: gemv_rows<O, 3, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, j0, j1); break;
        case 4: gemv_rows<O, 4, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, j0, j1); break;
      }
      if (cap > 0.0f) softcap_block(y, N, 0, T, j0, j1, cap);
    });
    return;
  }
  static_assert(kGemvRows == 4 && kGemmR == 4, "gemm: extend the switches");
  constexpr int C = gemm_cols(kGemmR);
  // bf16 weights: a widened panel pays from more than kGemmPanelRows rows on. Without a bf16 dot (SmolLM-135M's
  // gate_up, 1 thread, bf16 by CPU time: at 8 rows tiles on the bf16 weights are 16% faster, even at 16, the
  // panel 7-12% faster at 64 and 128; both bit-identical). With one, where two FMAs per vdpbf16ps give its
  // numbers and are faster (bf16_gemm_emulates_dot()), from more than kGemmDotPanelRows rows on (SmolLM-135M's
  // gate_up and down streamed from DRAM, 2 threads, Xeon: the panel 23-29% slower at 5 rows, even at 8,
  // 10-27% faster at 16, 14-20% at 32).
  constexpr bool kBf16 = std::is_same<WT, uint16_t>::value;
#if LLMC_BF16_DOT
  const bool panel = kBf16 && T > kGemmDotPanelRows && bf16_gemm_emulates_dot();
#else
  const bool panel = kBf16 && T > kGemmPanelRows;
#endif
  // x rows per task: their K block stays in L2 (with the spilled accumulators) while the weight tiles pass.
  // KB: the shortest block gemm_block may take (fp32 panel or fp32 weights; bf16 tiles take twice as long).
  constexpr int KB = gemm_kblock<O, float>(C, KMAIN);
  // Outputs per task, whole tiles of C and of C - 1 = 2 (AVX2). With several K blocks a task reads all of its
  // rows' x once: kGemmBlockTiles tiles share that read.
  constexpr int NB = KMAIN > KB ? kGemmBlockTiles * 2 * C : std::max(2 * C, CH0 / (2 * C) * (2 * C));
  constexpr int NBLK = (N + NB - 1) / NB;
  constexpr long XROW = (long)std::min(K, KB + K - KMAIN) * sizeof(float);  // a row's x in one block
  constexpr int TC_MAX = (int)std::max<long>(kGemmR, kGemmXBytes / XROW / kGemmR * kGemmR);
  const int ntc = (T + TC_MAX - 1) / TC_MAX;
  const int tc_rows = ((T + ntc - 1) / ntc + kGemmR - 1) / kGemmR * kGemmR;
  // x packed for the tiles (gemm_pack_rows), in their order: with a panel, the prepared x widened as the panel
  // is (with a bf16 dot: the rounded x, [odd | even]).
  const void* xk;
  if (panel) {
    const float* rows = reinterpret_cast<const float*>(xp);
    if constexpr (kBf16 && LLMC_BF16_DOT) {
      float* wide = gemm_scratch<float, kScratchWide>((long)T * KMAIN + 1);
      for (int t = 0; t < T; ++t)
        gemm_widen_panel<1, KMAIN, KMAIN, true>(reinterpret_cast<const uint16_t*>(xp) + (long)t * KMAIN, 0, KMAIN,
                                                false, wide + (long)t * KMAIN);
      rows = wide;
    }
    float* packed = gemm_scratch<float, kScratchPacked>((long)T * KMAIN + 1);
    gemm_pack_rows<GemmOrder<float>::KS>(rows, KMAIN, T, KMAIN, packed);
    xk = packed;
  } else {
    XT* packed = gemm_scratch<XT, kScratchPacked>((long)T * KMAIN + 1);
    gemm_pack_rows<O::KS>(xp, O::kPrepare ? KMAIN : K, T, KMAIN, packed);
    xk = packed;
  }
  parallel_for(ntc * NBLK, par, [&](int task) {
    const int tc = task / NBLK, nb = task % NBLK;
    const int t0 = tc * tc_rows, t1 = std::min(T, t0 + tc_rows);
    const int j0 = nb * NB, j1 = std::min(N, j0 + NB);
    if (t0 >= t1) return;
    Vec* spill = KMAIN > KB ? gemm_scratch<Vec, kScratchSpill>((long)tc_rows * NB) : nullptr;
    const float* xf = static_cast<const float*>(xk);
    [&] {
      if constexpr (kBf16 && LLMC_BF16_DOT) {
        if (panel) {
          gemm_ftz_daz(true);
          gemm_block<O, GemmOrder<float>, true, true, N, K, HAS_BIAS, PF>(xf, x, w, bias, y, t0, t1, j0, j1, spill,
                                                                         true);
          gemm_ftz_daz(false);
          return;
        }
      } else if constexpr (kBf16) {
        if (panel) {
          gemm_block<O, GemmOrder<float>, true, false, N, K, HAS_BIAS, PF>(xf, x, w, bias, y, t0, t1, j0, j1,
                                                                          spill, false);
          return;
        }
      }
      gemm_block<O, O, false, false, N, K, HAS_BIAS, PF>(static_cast<const XT*>(xk), x, w, bias, y, t0, t1, j0, j1,
                                                        spill, false);
    }();
    if (cap > 0.0f) softcap_block(y, N, t0, t1, j0, j1, cap);
  });
}

}  // namespace llmc
