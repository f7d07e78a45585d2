// llmc CPU target: the dense GEMM / GEMV of every linear layer.
#pragma once

#include <vector>

#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
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
constexpr long kGemmXBytes = 128 * 1024;    // x rows per GEMM task: they stay in L2 while C-row tiles pass
constexpr int kGemmPanelRows = 16;          // see kWiden in gemm()
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
  static LLMC_INLINE void pin(X&) {}
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

// ---------------------------------------------------------------------------------------------
// gemm_tile<O, R, C, KMAIN, K, PF>: s[r * C + c] = dot(row r, weight row c), r < R, c < C, in O's order.
// xp: prepared rows (stride KMAIN; fp32 weights: x itself, stride K); x: the fp32 rows (stride K), for the
// tail; w: C weight rows of stride K (WT: O's weight type, or float for a widened panel).
// PF > 0: also prefetch PF bytes ahead, C cache lines per line of a row read. A tile whose C rows span less
// than PF bytes gets its lines in address order, so the prefetches of tile after tile form one stream; a
// longer tile gets one line per row, PF bytes along each row. (Streamed from DRAM, 2 threads, AVX-512 EPYC:
// bf16 GEMVs at K = 576, 9 KB tiles, +25% in address order; at 24-64 KB tiles 5-14% slower than per row.
// llmc_qgemm.h's GEMV prefetches by the same rule.)
template <class O, int R, int C, int KMAIN, int K, int PF, typename XT, typename WT>
LLMC_INLINE void gemm_tile(const XT* LLMC_RESTRICT xp, long ldxp, const float* LLMC_RESTRICT x,
                           const WT* LLMC_RESTRICT w, float* LLMC_RESTRICT s) {
  constexpr int VW = Vec::W;
  constexpr int LINE = 64 / (int)sizeof(WT);
  constexpr int PSTEP = O::KS >= LINE ? O::KS : LINE;  // row elements per prefetch of C lines
  constexpr bool kAddressOrder = (long)C * K * sizeof(WT) < PF;
  Vec acc[R][C];
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = Vec::zero();
  }
  for (int i = 0; i < KMAIN; i += O::KS) {
    if constexpr (PF > 0) {
      if (O::KS >= LINE || i % LINE == 0) {
        LLMC_UNROLL for (int c = 0; c < C; ++c) {
          const char* p = kAddressOrder ? reinterpret_cast<const char*>(w) + ((long)(i / PSTEP) * C + c) * 64
                                        : reinterpret_cast<const char*>(w + (long)c * K + i);
          __builtin_prefetch(p + PF, 0, 3);
        }
      }
    }
    LLMC_UNROLL for (int ph = 0; ph < O::kPhases; ++ph) {
      typename O::W wv[C];
      LLMC_UNROLL for (int c = 0; c < C; ++c) {
        wv[c] = O::load_w(w + (long)c * K + i, ph);
        if constexpr (R > 1) O::pin(wv[c]);
      }
      LLMC_UNROLL for (int r = 0; r < R; ++r) {
        typename O::X xv = O::load_x(xp + r * ldxp + i, ph);
        if constexpr (C > 1) O::pin(xv);
        LLMC_UNROLL for (int c = 0; c < C; ++c) O::step(acc[r][c], xv, wv[c]);
      }
    }
  }
  LLMC_UNROLL for (int i = KMAIN; i < K; i += VW) {
    const int n = K - i < VW ? K - i : VW;
    Vec wv[C];
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const WT* p = w + (long)c * K + i;
      wv[c] = n == VW ? Vec::load(p) : Vec::load_part(p, n);
    }
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      const float* p = x + (long)r * K + i;
      const Vec xv = n == VW ? Vec::load(p) : Vec::load_part(p, n);
      LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c].fma(xv, wv[c]);
    }
  }
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) s[r * C + c] = acc[r][c].sum();
  }
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

// C weight rows at w, widened into panel[C][K] as GemmOrder<uint16_t> reads them (its main part permuted,
// the tail in order), prefetching PF bytes ahead: what gemm_tile<GemmOrder<float>> then reads from L1.
template <int C, int K, int PF>
LLMC_INLINE void gemm_widen_panel(const uint16_t* LLMC_RESTRICT w, float* LLMC_RESTRICT panel) {
  constexpr int VW = Vec::W, KS = 2 * VW;
  constexpr int KMAIN = K / KS * KS;
  for (int c = 0; c < C; ++c) {
    const uint16_t* row = w + (long)c * K;
    float* out = panel + (long)c * K;
    for (int i = 0; i < KMAIN; i += KS) {
      if constexpr (PF > 0) {
        if (i % 32 == 0) __builtin_prefetch(reinterpret_cast<const char*>(row + i) + PF, 0, 3);
      }
      Vec even, odd;
      Vec::load_pairs(row + i, even, odd);
      even.store(out + i);
      odd.store(out + i + VW);
    }
    for (int i = KMAIN; i < K; ++i) out[i] = bf16_to_f32(row[i]);
  }
}

// Rows [t0, t1) x outputs [j0, j1) of the GEMM path (see the top). PANEL (bf16 weights without a bf16 dot only):
// widen each weight tile once into an fp32 panel, then fp32 tiles over it (the same products in the same order).
template <class O, bool PANEL, int N, int K, bool HAS_BIAS, int PF, typename XT, typename WT>
LLMC_INLINE void gemm_block(const XT* xp, const float* x, const WT* w, const WT* bias, float* y, int t0, int t1,
                            int j0, int j1) {
  constexpr bool kPanel = PANEL;
  constexpr int R = kGemmR, C = O::kPhases == 2 && !kPanel ? gemm_cols(R) - 1 : gemm_cols(R);  // see gemv_rows
  constexpr int KMAIN = K / O::KS * O::KS;
  constexpr long LDXP = O::kPrepare ? KMAIN : K;
  using OT = std::conditional_t<kPanel, GemmOrder<float>, O>;
  using PT = std::conditional_t<kPanel, float, WT>;
  auto rows = [&](auto cols, const PT* wt, int j) {
    constexpr int CC = decltype(cols)::value;
    for (int t = t0; t < t1; t += R) {
      const XT* xr = xp + (long)t * LDXP;
      const float* xt = x + (long)t * K;
      float* yt = y + (long)t * N;
      float s[R * CC];
      // The first pass streams the weights in (prefetched, unless the panel did); later ones find them in L1.
      switch (t == t0 && !kPanel && t1 - t >= R ? 0 : std::min(R, t1 - t)) {
        case 0:
          gemm_tile<OT, R, CC, KMAIN, K, PF>(xr, LDXP, xt, wt, s);
          gemm_store<R, CC, N, HAS_BIAS>(s, bias, yt, j);
          break;
        case 1:
          gemm_tile<OT, 1, CC, KMAIN, K, 0>(xr, LDXP, xt, wt, s);
          gemm_store<1, CC, N, HAS_BIAS>(s, bias, yt, j);
          break;
        case 2:
          gemm_tile<OT, 2, CC, KMAIN, K, 0>(xr, LDXP, xt, wt, s);
          gemm_store<2, CC, N, HAS_BIAS>(s, bias, yt, j);
          break;
        case 3:
          gemm_tile<OT, 3, CC, KMAIN, K, 0>(xr, LDXP, xt, wt, s);
          gemm_store<3, CC, N, HAS_BIAS>(s, bias, yt, j);
          break;
        case 4:
          gemm_tile<OT, 4, CC, KMAIN, K, 0>(xr, LDXP, xt, wt, s);
          gemm_store<4, CC, N, HAS_BIAS>(s, bias, yt, j);
          break;
      }
    }
  };
  auto tiles = [&](auto cols, int j) {
    constexpr int CC = decltype(cols)::value;
    if constexpr (kPanel) {
      alignas(64) float panel[CC * K];
      gemm_widen_panel<CC, K, PF>(w + (long)j * K, panel);
      rows(cols, panel, j);
    } else {
      rows(cols, w + (long)j * K, j);
    }
  };
  int j = j0;
  for (; j + C <= j1; j += C) tiles(std::integral_constant<int, C>{}, j);
  for (; j < j1; ++j) tiles(std::integral_constant<int, 1>{}, j);
}

namespace {
// Per-thread scratch for the prepared x of one call (grows, never shrinks: no allocation in steady state).
template <typename XT>
XT* gemm_scratch(long n) {
  static thread_local std::vector<XT> buf;
  if ((long)buf.size() < n) buf.resize(n);
  return buf.data();
}
}  // namespace

// PF and TASK (weight bytes per parallel task) are tunable (templates/cpu/gemm.tune.toml); they change the
// speed, never the numbers.
template <int N, int K, bool HAS_BIAS, int PF = kGemvPrefetchBytes, long TASK = kGemvTaskBytes, typename WT>
inline void gemm(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w, const WT* LLMC_RESTRICT bias,
                 float* LLMC_RESTRICT y, int T) {
  using O = GemmOrder<WT>;
  using XT = typename O::XT;
  constexpr int KMAIN = K / O::KS * O::KS;
  const XT* xp;
  if constexpr (O::kPrepare) {
    XT* buf = gemm_scratch<XT>((long)T * KMAIN + 1);
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
    });
    return;
  }
  static_assert(kGemvRows == 4 && kGemmR == 4, "gemm: extend the switches");
  constexpr int C = gemm_cols(kGemmR);
  // bf16 weights without a bf16 dot: a widened panel pays from more than kGemmPanelRows rows on (SmolLM-135M's
  // gate_up, 1 thread, bf16 by CPU time: at 8 rows tiles on the bf16 weights are 16% faster, even at 16, the
  // panel 7-12% faster at 64 and 128; both bit-identical).
  constexpr bool kWiden = std::is_same<WT, uint16_t>::value && !LLMC_BF16_DOT;
  constexpr int NB = std::max(2 * C, CH0 / (2 * C) * (2 * C));  // whole tiles of C and of C - 1 = 2 (AVX2)
  constexpr int NBLK = (N + NB - 1) / NB;
  constexpr int TC_MAX = (int)std::max<long>(kGemmR, kGemmXBytes / ((long)K * sizeof(float)) / kGemmR * kGemmR);
  const int ntc = (T + TC_MAX - 1) / TC_MAX;
  const int tc_rows = ((T + ntc - 1) / ntc + kGemmR - 1) / kGemmR * kGemmR;
  parallel_for(ntc * NBLK, par, [&](int task) {
    const int tc = task / NBLK, nb = task % NBLK;
    const int t0 = tc * tc_rows, t1 = std::min(T, t0 + tc_rows);
    const int j0 = nb * NB, j1 = std::min(N, j0 + NB);
    if (t0 >= t1) return;
    if (kWiden && t1 - t0 > kGemmPanelRows) {
      gemm_block<O, kWiden, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, t0, t1, j0, j1);
    } else {
      gemm_block<O, false, N, K, HAS_BIAS, PF>(xp, x, w, bias, y, t0, t1, j0, j1);
    }
  });
}

}  // namespace llmc
