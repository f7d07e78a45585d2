// llmc CPU target: bf16 GEMMs on AMX tiles (tdpbf16ps), where the host has them (Sapphire Rapids and later).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include "llmc_gemm.h"

#if LLMC_AMX

namespace llmc {

// gemm_amx: y[T, N] = x[T, K] @ w[N, K]^T (+ bias) for bf16 w, every T, on AMX tiles.
//
// Roles. tdpbf16ps multiplies a row-major A tile (16 rows x 32 bf16) by a B tile in "VNNI" order (16 rows of 16
// bf16 pairs: two consecutive k of one column). The weights, in HF Linear layout, are A as they lie (16 output
// rows, 32 k of each, a row stride of K), so they need no packing at load or at compile and a tied embedding's
// gather reads the same table. x takes B's place: each call rounds it to bf16 (as the vdpbf16ps path does)
// and lays it out as B tiles, 16 rows at a time, T x K elements against the N x K of the weights. A C tile is
// then y^T: 16 outputs x 16 rows, stored transposed.
//
// Numerics. tdpbf16ps's own order (not the vdpbf16ps path's: the two differ in rounding, so no AVX-512
// kernel reproduces it). Each output of each row is the chain of K / 32 tdpbf16ps over its k tiles, the same
// instructions whatever T is (a row's B column never meets another's) and whichever thread runs it, so a row
// never depends on T, on its neighbours or on the thread count, as with the AVX-512 kernels ("Numerics" in
// llmc_gemm.h). The tail k >= K / 32 * 32 is summed in fp32 over the fp32 x, in order, then added.
//
// Blocking. A task is a range of 32-output blocks (two A tiles) over a chunk of rows; per k tile two weight
// tiles and two x tiles feed four C tiles (all eight tile registers). The weights stream from memory once per
// row chunk (amx_block says how they are prefetched); x's chunk stays in L2 (kGemmXBytes).
constexpr int kAmxRows = 16;  // tile rows, and the outputs or x rows a tile covers

// Linux hands out AMX state on request, per process (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Whether bf16 GEMMs run on AMX: where permitted, unless LLMC_CPU_BF16_GEMM forces an AVX-512 path (dot or
// fma, llmc_gemm.h), read at every call so tests can take each.
inline bool bf16_gemm_uses_amx() {
  const char* force = std::getenv("LLMC_CPU_BF16_GEMM");
  if (force && (std::strcmp(force, "dot") == 0 || std::strcmp(force, "fma") == 0)) return false;
  return amx_permitted();
}

// Tiles 0-3 are C (16 outputs x `cols` rows), 4-5 weights (A: 16 outputs x 32 k), 6-7 x (B: 16 pairs x `cols`
// rows). Loaded at the start of each task: the configuration is per thread, and another library on the thread
// may have changed it. Below 16 rows a call's tiles are that narrow: the packed x needs no zero padding, and
// each C element is computed alike whatever the width (a row never depends on T).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
LLMC_INLINE void amx_configure(int cols) {
  AmxTileConfig c;
  for (int i = 0; i < 8; ++i) c.colsb[i] = i == 4 || i == 5 ? 64 : 4 * cols, c.rows[i] = kAmxRows;
  asm volatile("" : : "m"(c));  // g++ 12's ldtilecfg does not tell the optimizer it reads c: keep c's stores
  _tile_loadconfig(&c);
}

// x rows [t0, t1) of K, their k < KMAIN -> B tiles: [row block][k tile][16 pairs][16 rows] of bf16 pairs
// (uint32). The last block's columns past T are left as they are: a C column reads only its own.
template <int K, int KMAIN>
void amx_pack_x(const float* x, int t0, int t1, uint32_t* out) {
  constexpr int KT = KMAIN / kAmxK, PAIRS = kAmxK / 2;
  alignas(64) uint16_t row[KT * kAmxK + 1];
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(row);
  for (int t = t0; t < t1; ++t) {
    GemmOrder<uint16_t>::prepare(x + (long)t * K, row, KMAIN);
    uint32_t* blk = out + (long)(t / kAmxRows) * KT * PAIRS * kAmxRows + t % kAmxRows;
    for (int kt = 0; kt < KT; ++kt) {
      uint32_t* tile = blk + (long)kt * PAIRS * kAmxRows;
      for (int p = 0; p < PAIRS; ++p) tile[p * kAmxRows] = pairs[kt * PAIRS + p];
    }
  }
}

// One block of A_TILES x 16 outputs from w (stride K; its k < KMAIN) by B_TILES x 16 rows of packed x (xb: the
// first row block's tiles): c[a * 2 + b] = the 16 x 16 C tile of weight tile a and x tile b (outputs x rows).
// pf_lines > 0: also prefetch that many cache lines from pf on per k tile, in address order (into L2). Else, rows
// of up to kAmxRowPrefetchK prefetch each weight row kAmxRowPrefetchBytes ahead into L1, running on into the same
// row of the next block: the hardware prefetchers alone leave short rows' streams behind (2-core Xeon, bf16 GEMVs
// at T = 1 streamed from DRAM, interleaved A/B: K = 576 1.07-1.12x, K = 1536 1.03x, K = 2048 1.00x, K = 8192
// 0.92-0.94x; benchmarks/cpu_kernels.py --only gemv,gemv1b --baseline).
constexpr int kAmxRowPrefetchK = 2048;
constexpr int kAmxRowPrefetchBytes = 256;
template <int A_TILES, int B_TILES, int K, int KMAIN>
LLMC_INLINE void amx_block(const uint16_t* w, const uint32_t* xb, float (*c)[kAmxRows * kAmxRows], const char* pf,
                           int pf_lines) {
  constexpr int KT = KMAIN / kAmxK;
  constexpr long XTILE = (long)kAmxK / 2 * kAmxRows;  // uint32 per x tile
  constexpr long LDW = (long)K * sizeof(uint16_t);
  _tile_zero(0);
  if constexpr (B_TILES > 1) _tile_zero(1);
  if constexpr (A_TILES > 1) _tile_zero(2);
  if constexpr (A_TILES > 1 && B_TILES > 1) _tile_zero(3);
  for (int kt = 0; kt < KT; ++kt) {
    const uint16_t* wk = w + kt * kAmxK;
    for (int i = 0; i < pf_lines; ++i) prefetch_l2(pf + ((long)kt * pf_lines + i) * 64);
    if constexpr (K <= kAmxRowPrefetchK) {
      if (pf_lines == 0) {
        constexpr int ROWS = A_TILES * kAmxRows;
        const long at = (long)kt * kAmxK + kAmxRowPrefetchBytes / (long)sizeof(uint16_t);
        const uint16_t* p = w + at / K * ROWS * K + at % K;
        LLMC_UNROLL for (int r = 0; r < ROWS; ++r) __builtin_prefetch(p + (long)r * K, 0, 3);
      }
    }
    _tile_loadd(4, wk, LDW);
    _tile_loadd(6, xb + kt * XTILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (B_TILES > 1) {
      _tile_loadd(7, xb + (KT + kt) * XTILE, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (A_TILES > 1) {
      _tile_loadd(5, wk + (long)kAmxRows * K, LDW);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (B_TILES > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (B_TILES > 1) _tile_stored(1, c[1], 64);
  if constexpr (A_TILES > 1) _tile_stored(2, c[2], 64);
  if constexpr (A_TILES > 1 && B_TILES > 1) _tile_stored(3, c[3], 64);
}

// r[i] holds row i of a 16 x 16 matrix; afterwards r[i] holds its column i.
LLMC_INLINE void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// y[t0 + i, j + o] = c[o][i] + the tail k >= KMAIN + bias, for outputs o < no and rows i < nt of one C tile. A
// whole tile with no tail is transposed in registers; every path adds the same terms in the same order.
template <int N, int K, int KMAIN, bool HAS_BIAS>
LLMC_INLINE void amx_store(const float* c, const float* x, const uint16_t* w, const uint16_t* bias, float* y, int t0,
                           int nt, int j, int no) {
  if (K == KMAIN && nt == kAmxRows && no == kAmxRows) {
    __m512 r[kAmxRows];
    for (int o = 0; o < kAmxRows; ++o) r[o] = _mm512_load_ps(c + o * kAmxRows);
    transpose16(r);
    const __m512 b = HAS_BIAS ? Vec::load(bias + j).v : _mm512_setzero_ps();
    for (int i = 0; i < kAmxRows; ++i)
      _mm512_storeu_ps(y + (long)(t0 + i) * N + j, HAS_BIAS ? _mm512_add_ps(r[i], b) : r[i]);
    return;
  }
  for (int i = 0; i < nt; ++i) {
    const float* xt = x + (long)(t0 + i) * K;
    float* yt = y + (long)(t0 + i) * N + j;
    for (int o = 0; o < no; ++o) {
      float s = c[o * kAmxRows + i];
      if constexpr (K > KMAIN) {
        const uint16_t* wo = w + (long)(j + o) * K;
        float tail = 0.0f;
        for (int k = KMAIN; k < K; ++k) tail = std::fma(xt[k], bf16_to_f32(wo[k]), tail);
        s += tail;
      }
      yt[o] = HAS_BIAS ? s + bf16_to_f32(bias[j + o]) : s;
    }
  }
}

template <int N, int K, bool HAS_BIAS, long TASK>
void gemm_amx(const float* x, const uint16_t* w, const uint16_t* bias, float* y, int T, float cap) {
  constexpr int KMAIN = K / kAmxK * kAmxK;
  constexpr int KT = KMAIN / kAmxK;
  constexpr long XROW = (long)KMAIN * sizeof(uint16_t);  // one packed x row
  constexpr int BLOCK = 2 * kAmxRows;                    // outputs per weight block
  static_assert(KT > 0, "gemm_amx: K below one tile");
  const int TB = (T + kAmxRows - 1) / kAmxRows;
  uint32_t* xb = gemm_scratch<uint32_t, kScratchAmxX>((long)TB * kAmxRows * KMAIN / 2);
  const bool par = (long)T * N * K >= kParallelWork;
  parallel_for(TB, par && TB > 1, [&](int tb) {
    amx_pack_x<K, KMAIN>(x, tb * kAmxRows, std::min(T, (tb + 1) * kAmxRows), xb);
  });
  // The last block, where N is no multiple of 16 (a tile load would read past the weights): its rows copied,
  // zero padded to the block.
  constexpr int JLAST = (N - 1) / BLOCK * BLOCK;
  const uint16_t* wlast = w + (long)JLAST * K;
  if constexpr (N % kAmxRows != 0) {
    uint16_t* pad = gemm_scratch<uint16_t, kScratchAmxTail>((long)BLOCK * K);
    std::memcpy(pad, wlast, (size_t)(N - JLAST) * K * sizeof(uint16_t));
    std::memset(pad + (long)(N - JLAST) * K, 0, (size_t)(JLAST + BLOCK - N) * K * sizeof(uint16_t));
    wlast = pad;
  }
  // Row chunks whose packed x stays in L2 (kGemmXBytes), in whole row blocks of 16; tasks of about TASK weight
  // bytes, and at least four output blocks to a tile configuration.
  constexpr int TB_MAX = (int)std::max<long>(1, kGemmXBytes / (XROW * kAmxRows));
  const int nrc = (TB + TB_MAX - 1) / TB_MAX;
  const int rc_blocks = (TB + nrc - 1) / nrc;
  constexpr int BPT = (int)std::max<long>(4, TASK / (BLOCK * (long)K * sizeof(uint16_t)));
  constexpr int NBLK = (N + BLOCK - 1) / BLOCK;
  constexpr int NTASK = (NBLK + BPT - 1) / BPT;
  parallel_for(nrc * NTASK, par, [&](int task) {
    const int rc = task / NTASK, nt = task % NTASK;
    const int tb0 = rc * rc_blocks, tb1 = std::min(TB, tb0 + rc_blocks);
    if (tb0 >= tb1) return;
    amx_configure(std::min(T, kAmxRows));
    alignas(64) float c[4][kAmxRows * kAmxRows];
    const int jb1 = std::min(NBLK, (nt + 1) * BPT);
    for (int jb = nt * BPT; jb < jb1; ++jb) {
      const int j = jb * BLOCK;
      const int outs = std::min(BLOCK, N - j);
      const uint16_t* wj = j == JLAST ? wlast : w + (long)j * K;
      const int a_tiles = outs > kAmxRows ? 2 : 1;
      // With several passes over the block (more than 32 rows), they prefetch the next block's weights between
      // them, so its stream from memory overlaps this block's tiles; one pass streams alone (the hardware
      // prefetchers keep up with a GEMV).
      const int passes = (tb1 - tb0 + 1) / 2;
      const int pf_lines = passes > 1 ? (int)((BLOCK * (long)K * 2 / 64 + passes * KT - 1) / (passes * KT)) : 0;
      const char* next = reinterpret_cast<const char*>(w + (long)(j + BLOCK) * K);
      for (int tb = tb0; tb < tb1; tb += 2) {
        const uint32_t* xt = xb + (long)tb * KT * (kAmxK / 2) * kAmxRows;
        const int b_tiles = tb + 1 < tb1 ? 2 : 1;
        const char* pf = next + (long)(tb - tb0) / 2 * KT * pf_lines * 64;
        if (a_tiles == 2) {
          b_tiles == 2 ? amx_block<2, 2, K, KMAIN>(wj, xt, c, pf, pf_lines)
                       : amx_block<2, 1, K, KMAIN>(wj, xt, c, pf, pf_lines);
        } else {
          b_tiles == 2 ? amx_block<1, 2, K, KMAIN>(wj, xt, c, pf, pf_lines)
                       : amx_block<1, 1, K, KMAIN>(wj, xt, c, pf, pf_lines);
        }
        for (int b = 0; b < b_tiles; ++b) {
          const int t0 = (tb + b) * kAmxRows, rows = std::min(kAmxRows, T - t0);
          for (int a = 0; a < a_tiles; ++a)
            amx_store<N, K, KMAIN, HAS_BIAS>(c[a * 2 + b], x, w, bias, y, t0, rows, j + a * kAmxRows,
                                             std::min(kAmxRows, outs - a * kAmxRows));
        }
      }
    }
    _tile_release();
    if (cap > 0.0f) {
      const int j0 = nt * BPT * BLOCK, j1 = std::min(N, jb1 * BLOCK);
      softcap_block(y, N, tb0 * kAmxRows, std::min(T, tb1 * kAmxRows), j0, j1, cap);
    }
  });
}

}  // namespace llmc
#endif
