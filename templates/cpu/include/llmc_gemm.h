// llmc CPU target: the dense GEMM / GEMV of every linear layer.
#pragma once

#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
//
// Register tiles of `rows` rows of x x gemm_cols(rows) outputs (dot_block), with 1-output tiles
// for the N tail. T <= kGemmRows (decode): a GEMV split into tasks of ~kGemvTaskBytes of weight rows,
// each weight row streamed once and shared by the T rows, with a software prefetch kGemvPrefetchBytes
// ahead (measured on SmolLM-135M's bf16 GEMVs, 1 thread: 7-9 -> 11-15 GB/s; fp32 unchanged, ~13 GB/s,
// the hardware prefetcher keeps up with its 2x longer rows). Larger T (prefill): blocks of kGemmTChunk rows x NB
// outputs (NB weight rows ~ kGemmBlockBytes, so they stay in L2), kGemmRows rows per tile.
// Every (row, output) is one dot_block accumulator over the same K, so numbers do not depend on T.
constexpr int kGemmRows = 4;
#if defined(__AVX512F__)
constexpr int gemm_cols(int rows) { return rows <= 2 ? 8 : 4; }  // <= 16 + 8 of 32 zmm registers
#else
constexpr int gemm_cols(int rows) { return rows <= 2 ? 4 : 2; }  // <= 8 + 4 of 16 ymm registers
#endif
constexpr long kGemvTaskBytes = 32 * 1024;  // weight bytes per parallel task in decode (>= 8 rows, a multiple of 8)
constexpr int kGemvPrefetchBytes = 16 * 1024;
constexpr int kGemmTChunk = 64;
constexpr long kGemmBlockBytes = 128 * 1024;

// y[r, j] for r < R and j in [j0, j1); x and y point at the first row.
template <int R, int N, int K, bool HAS_BIAS, int PF, typename WT>
LLMC_INLINE void gemm_tile_rows(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w,
                                const WT* LLMC_RESTRICT bias, float* LLMC_RESTRICT y, int j0, int j1) {
  constexpr int C = gemm_cols(R);
  int j = j0;
  for (; j + C <= j1; j += C) {
    float s[R * C];
    dot_block<R, C, K, WT, PF>(x, K, w + (long)j * K, K, s);
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const float b = HAS_BIAS ? load_w(bias[j + c]) : 0.0f;
      LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * N + j + c] = HAS_BIAS ? s[r * C + c] + b : s[r * C + c];
    }
  }
  for (; j < j1; ++j) {
    float s[R];
    dot_block<R, 1, K, WT, PF>(x, K, w + (long)j * K, K, s);
    const float b = HAS_BIAS ? load_w(bias[j]) : 0.0f;
    LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * N + j] = HAS_BIAS ? s[r] + b : s[r];
  }
}

template <int N, int K, bool HAS_BIAS, int PF = 0, typename WT>
LLMC_INLINE void gemm_rows(int rows, const float* x, const WT* w, const WT* bias, float* y, int j0, int j1) {
  static_assert(kGemmRows == 4, "gemm_rows: extend the switch");
  switch (rows) {
    case 1: gemm_tile_rows<1, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 2: gemm_tile_rows<2, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 3: gemm_tile_rows<3, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
    case 4: gemm_tile_rows<4, N, K, HAS_BIAS, PF>(x, w, bias, y, j0, j1); break;
  }
}

template <int N, int K, bool HAS_BIAS, typename WT>
inline void gemm(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT w, const WT* LLMC_RESTRICT bias,
                 float* LLMC_RESTRICT y, int T) {
  constexpr int R = kGemmRows;
  const bool par = (long)T * N * K >= kParallelWork;
  constexpr long RB = (long)K * sizeof(WT);
  if (T <= R) {
    constexpr int CH = (int)std::max<long>(8, kGemvTaskBytes / RB / 8 * 8);
    constexpr int NCH = (N + CH - 1) / CH;
    parallel_for(NCH, par, [&](int ch) {
      gemm_rows<N, K, HAS_BIAS, kGemvPrefetchBytes>(T, x, w, bias, y, ch * CH, std::min(N, (ch + 1) * CH));
    });
    return;
  }
  constexpr int NB0 = (int)std::max<long>(16, kGemmBlockBytes / RB) / 8 * 8;
  constexpr int NB = NB0 < N ? NB0 : N;
  constexpr int NBLK = (N + NB - 1) / NB;
  const int ntc = (T + kGemmTChunk - 1) / kGemmTChunk;
  parallel_for(ntc * NBLK, par, [&](int task) {
    const int tc = task / NBLK, nb = task % NBLK;
    const int t1 = std::min(T, (tc + 1) * kGemmTChunk);
    const int j0 = nb * NB, j1 = std::min(N, j0 + NB);
    for (int t = tc * kGemmTChunk; t < t1; t += R)
      gemm_rows<N, K, HAS_BIAS>(std::min(R, t1 - t), x + (long)t * K, w, bias, y + (long)t * N, j0, j1);
  });
}

}  // namespace llmc
