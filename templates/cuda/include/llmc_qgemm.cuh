// llmc_qgemm.cuh: quantized GEMMs (w8a16 / w4a16): y[T, N] = x[T, K] @ dequant(qweight)[N, K]^T (+ bias[N]),
// with dequant(w)[n, k] = q[n, k] * scales[n, g] - mins[n, g] (mins: asymmetric only), g = k / G.
//
// qweight is compiler/quant_pack.py's CUDA layout (pack_cuda): rows of K * BITS / 8 bytes, biased u = q - LO,
// 64-byte blocks in which lane t (of 4) of an mma B fragment finds its 32-bit words at 4 * (t * nw + w); a
// word holds the lane's B registers of one k16 step (int8) or two (int4), register j as the u16 halves of
// `(word >> BITS * j) & MASK`. scales / mins SC [N, NG] (float, or uint16_t holding fp16 bits), x and y A
// (the activation element: float, or bf16 bits, y rounded to it), bias float32.
//
//  - decode (T <= kGemvMaxT): gemv(). A warp per (NR output rows, k slice): every lane loads the same
//    16-byte piece of its NR rows (NR loads in flight; consecutive lanes, consecutive pieces: 512 bytes of a
//    row per warp load), turns each u into a float with one OR and one subtract (0x4b000000 | u = 2^23 + u),
//    loads each x pair once for the NR rows, sums q * x per word in fp32 for all T rows, then applies the
//    word's group scale (and min, times the word's sum of x). kSplit warps of a block share the rows when
//    they are few (every SM gets work); their sums meet in shared memory in a fixed order.
//    Grid (kGemvBlocks), block kGemvThreads.
//  - prefill: tiled(). A BM x BN block tile, 4 warps side by side along N (BN / 4 columns each), every warp
//    over all BM rows. Per 64-byte row block of the weights: x[BM, k block] goes to shared memory as bf16
//    (a float x rounded to nearest even; zero past T), A fragments come from ldmatrix.x4, and each warp loads its
//    weight words straight from global memory into B fragments: int4 with `| 0x43004300` (bf16 128 + u) and
//    one bf16x2 subtract, int8 through the fp32 magic number (bf16 = the float's high half, exact). The
//    mma runs on the integer q itself (exact in bf16), fp32 accumulate, and each group's partial sum is
//    scaled in fp32 when the group ends; asymmetric mins use the group's row sums of the same bf16 x, taken
//    by one more mma against a B of ones. So weights stay exact and x's bf16 rounding is the only
//    approximation. Grid (kTilesN, ceil(T / BM)), block kTileThreads.
// Both paths: every output is summed by one thread, warp or block in a fixed order, so results do not depend
// on scheduling (and are seed-independent under the simulator).
#pragma once

#include "llmc_common.cuh"

namespace llmc {

// A scale or min as float: SC float, or uint16_t fp16 bits (exact either way).
__device__ __forceinline__ float scale_value(float s) { return s; }
__device__ __forceinline__ float scale_value(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// K-quant superblock scales (SC = KScales; compiler/kquant.py): one 16-byte record per 8 groups of 32, fp16 d
// and dmin and eight 6-bit scale and min codes; group j's scale is d * sc[j] and its min dmin * m[j], exact
// float products. The record holds the mins: the mins pointer is null.
struct KScales {
  uint16_t d, dmin;
  uint8_t codes[12];
};
static_assert(sizeof(KScales) == 16, "a K-quant record is 16 bytes");

// Group gi's scale and min (0 without mins), whatever SC.
template <typename SC>
__device__ __forceinline__ void group_scale_min(const SC* scales, const SC* mins, int64_t gi, float& scale, float& min) {
  scale = scale_value(scales[gi]);
  min = mins ? scale_value(mins[gi]) : 0.0f;
}
__device__ __forceinline__ void group_scale_min(const KScales* scales, const KScales*, int64_t gi, float& scale,
                                                float& min) {
  const KScales& r = scales[gi / 8];
  const int j = static_cast<int>(gi % 8);
  const uint8_t* c = r.codes;
  const int sc = j < 4 ? c[j] & 63 : (c[j + 4] & 0xF) | ((c[j - 4] >> 6) << 4);
  const int m = j < 4 ? c[j + 4] & 63 : (c[j + 4] >> 4) | ((c[j] >> 6) << 4);
  scale = __fmul_rn(scale_value(r.d), static_cast<float>(sc));
  min = __fmul_rn(scale_value(r.dmin), static_cast<float>(m));
}

template <int N, int K, int BITS, int G, bool ASYM, bool BIAS, typename SC, typename A = float>
struct QGemm {
  static_assert(BITS == 4 || BITS == 8, "qgemm: int4 or int8");
  static_assert(K % 32 == 0 && G % 16 == 0 && (BITS == 8 || G % 32 == 0), "qgemm: groups align to words");
  static constexpr int LO = BITS == 8 ? -128 : (ASYM ? 0 : -8);  // q = u + LO
  static constexpr uint32_t MASK = BITS == 8 ? 0x00ff00ffu : 0x000f000fu;
  static constexpr int KW = BITS == 4 ? 32 : 16;  // k per word
  static constexpr int PAIRS = KW / 8;           // bf16x2 registers per word
  static constexpr int BW = 4;                   // words per lane in a full block
  static constexpr int KB = BW * KW;             // k per full block (64 bytes of a row)
  static constexpr int ROW_BYTES = K * BITS / 8;
  static constexpr int NB = K / KB;                  // full blocks per row
  static constexpr int TAIL_WORDS = (K % KB) / KW;  // words per lane in the short last block, 0 if none
  static constexpr int NG = (K + G - 1) / G;         // groups per row

  // decode: NR output rows per warp; kSplit warps share them (each a k slice of >= 8 full blocks, a warp's
  // width) where fewer row groups than kGemvTargetWarps (about 16 warps on each SM of an H100) leave SMs idle
  static constexpr int kGemvMaxT = 8, NR = 4, kGemvWarps = 8, kGemvThreads = 32 * kGemvWarps;
  static constexpr int kRowGroups = ceil_div(N, NR);
  static constexpr int kSplit = gemv_split(kRowGroups, clamp_int(NB / 8, 1, 8));
  static constexpr int kGroupsPerBlock = kGemvWarps / kSplit;
  static constexpr int kGemvBlocks = ceil_div(kRowGroups, kGroupsPerBlock);
  // prefill. BM: asymmetric keeps 16 more accumulators (the row sums of x) per m16 tile; 32 rows keep it within 128 registers
  static constexpr int BM = ASYM ? 32 : 64, BN = 64, kTileThreads = 128, WN = BN / 4, NT = WN / 8;  // NT: n8 tiles per warp
  static constexpr int kTilesN = ceil_div(N, BN);
  static constexpr int XS = KB + 8;  // bf16 per shared x row: +16 bytes moves each ldmatrix row to other banks

  // u of a u16 half -> q as float: (2^23 + u) - (2^23 - LO), both exact.
  static __device__ __forceinline__ float q_float(uint32_t u16) {
    return __uint_as_float(0x4b000000u | u16) - static_cast<float>(8388608 - LO);
  }

  // ----------------------------------------------------------------------------------------------------
  // gemv: the words w < nw of lane slot t in row block b, one per output row i (wd[i][w]), added to
  // acc[i][r] for the rows r < rows of x (x's row rows_of.x_row(r)). Each word's q become floats once; each x pair
  // is loaded once for all NR output rows (x[r, k0 + 16 (j >> 1) + 8 (j & 1) + 2t + {0, 1}] for pair j).
  template <class Rows>
  static __device__ __forceinline__ void gemv_words(const uint32_t (&wd)[NR][BW], int nw, int b, int t,
                                                    const int (&n)[NR], const A* x, Rows rows_of, int rows,
                                                    const SC* scales, const SC* mins,
                                                    float (&acc)[NR][kGemvMaxT]) {
#pragma unroll
    for (int w = 0; w < BW; ++w) {
      if (w >= nw) break;
      const int k0 = (b * BW + w) * KW;
      float qf[NR][2 * PAIRS], s[NR], m[NR];
#pragma unroll
      for (int i = 0; i < NR; ++i) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
          const uint32_t pr = (wd[i][w] >> (BITS * j)) & MASK;
          qf[i][2 * j] = q_float(pr & 0xffffu);
          qf[i][2 * j + 1] = q_float(pr >> 16);
        }
        group_scale_min(scales, mins, static_cast<int64_t>(n[i]) * NG + k0 / G, s[i], m[i]);
      }
#pragma unroll
      for (int r = 0; r < kGemvMaxT; ++r) {
        if (r < rows) {  // warp-uniform
          float2 xv[PAIRS];
          float xs = 0.0f;
#pragma unroll
          for (int j = 0; j < PAIRS; ++j) {
            const A* xp = x + rows_of.x_row(r) * K + k0 + 2 * t + 16 * (j >> 1) + 8 * (j & 1);
            if constexpr (sizeof(A) == 2)
              xv[j] = load_bf16x2(xp);
            else
              xv[j] = vload<float2>(xp);
            if constexpr (ASYM) xs += xv[j].x + xv[j].y;
          }
#pragma unroll
          for (int i = 0; i < NR; ++i) {
            float p = 0.0f;
#pragma unroll
            for (int j = 0; j < PAIRS; ++j) p = fmaf(xv[j].y, qf[i][2 * j + 1], fmaf(xv[j].x, qf[i][2 * j], p));
            acc[i][r] = fmaf(p, s[i], acc[i][r]);
            if constexpr (ASYM) acc[i][r] = fmaf(-m[i], xs, acc[i][r]);
          }
        }
      }
    }
  }

  // cap > 0: every output soft-capped (Gemma 2's final logits), as it is stored. rows: which rows of x and y
  // (llmc_common.cuh DenseRows).
  template <class Rows = DenseRows>
  static __device__ __forceinline__ void gemv(const A* x, const uint8_t* qweight, const SC* scales,
                                              const SC* mins, const float* bias, A* y, int T, float cap = 0.0f,
                                              Rows rows = {}) {
    __shared__ float part[kGemvWarps][NR][kGemvMaxT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp % kSplit, n0 = (blockIdx.x * kGroupsPerBlock + warp / kSplit) * NR;
    float acc[NR][kGemvMaxT];
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int r = 0; r < kGemvMaxT; ++r) acc[i][r] = 0.0f;
    if (n0 < N) {  // warp-uniform; the barrier below is reached by every thread
      int n[NR];  // rows past N read row N - 1; their sums are dropped
      const uint8_t* row[NR];
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        n[i] = min(n0 + i, N - 1);
        row[i] = qweight + static_cast<int64_t>(n[i]) * ROW_BYTES;
      }
      // pieces (block b, lane slot t) = index 4b + t: 16 bytes each, consecutive in the row
      const int p_lo = 4 * (slice * NB / kSplit), p_hi = 4 * ((slice + 1) * NB / kSplit);
      for (int p = p_lo + lane; p < p_hi; p += 32) {
        uint32_t wd[NR][BW];
#pragma unroll
        for (int i = 0; i < NR; ++i) {  // NR 16-byte loads in flight
          LLMC_CHECK_ALIGNED16(row[i] + 16 * p);
          const uint4 v = vload<uint4>(row[i] + 16 * p);
          wd[i][0] = v.x, wd[i][1] = v.y, wd[i][2] = v.z, wd[i][3] = v.w;
        }
        gemv_words(wd, BW, p >> 2, p & 3, n, x, rows, T, scales, mins, acc);
      }
      if constexpr (TAIL_WORDS > 0) {
        if (slice == kSplit - 1 && lane < 4) {
          uint32_t wd[NR][BW];
#pragma unroll
          for (int i = 0; i < NR; ++i) {
            const uint32_t* tw = reinterpret_cast<const uint32_t*>(row[i] + 64 * NB) + lane * TAIL_WORDS;
#pragma unroll
            for (int w = 0; w < BW; ++w) wd[i][w] = w < TAIL_WORDS ? tw[w] : 0u;
          }
          gemv_words(wd, TAIL_WORDS, NB, lane, n, x, rows, T, scales, mins, acc);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
#pragma unroll
      for (int r = 0; r < kGemvMaxT; ++r) {
        if (r < T) {
          const float v = warp_sum(acc[i][r]);
          if (lane == 0) part[warp][i][r] = v;
        }
      }
    }
    __syncthreads();
    const int tid = threadIdx.x, grp = tid / (NR * kGemvMaxT), i = (tid / kGemvMaxT) % NR, r = tid % kGemvMaxT;
    const int ni = (blockIdx.x * kGroupsPerBlock + grp) * NR + i;
    if (grp < kGroupsPerBlock && r < T && ni < N) {
      float v = 0.0f;
#pragma unroll
      for (int sl = 0; sl < kSplit; ++sl) v += part[grp * kSplit + sl][i][r];
      rows.store(y + rows.y_row(r) * N + ni, soft_cap(BIAS ? v + bias[ni] : v, cap));
    }
  }

  // ----------------------------------------------------------------------------------------------------
  // tiled: the B registers (bf16x2 of q) of pair j of a word.
  static __device__ __forceinline__ uint32_t b_reg(uint32_t wd, int j) {
    const uint32_t pr = (wd >> (BITS * j)) & MASK;
    if constexpr (BITS == 4) {
      constexpr uint32_t kBias = 0x43004300u | (static_cast<uint32_t>(-LO) * 0x00010001u);  // bf16 128 - LO, twice
      const uint32_t v = pr | 0x43004300u, bias = kBias;                                       // bf16 128 + u, twice
      const __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                       *reinterpret_cast<const __nv_bfloat162*>(&bias));  // q, exact
      return *reinterpret_cast<const uint32_t*>(&d);
    } else {
      const float lo = q_float(pr & 0xffffu), hi = q_float(pr >> 16);  // integers |q| <= 128: bf16 exact
      return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
    }
  }

  // rows: as gemv's; a gathered block's rows are [0, T), else [blockIdx.y * BM, + BM).
  template <class Rows = DenseRows>
  static __device__ __forceinline__ void tiled(const A* x, const uint8_t* qweight, const SC* scales,
                                               const SC* mins, const float* bias, A* y, int T, float cap = 0.0f,
                                               Rows rows = {}) {
    __shared__ __align__(16) uint16_t xs[BM][XS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = Rows::kGathered ? 0 : blockIdx.y * BM, nw0 = blockIdx.x * BN + warp * WN;
    constexpr int MT = BM / 16;
    float acc[MT][NT][4], part[MT][NT][4], xsum[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int e = 0; e < 4; ++e) xsum[mi][e] = 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][j][e] = part[mi][j][e] = 0.0f;
    }
    const uint8_t* wrow[NT];  // this lane's weight row (B column n = g) per n8 tile; past N: row N - 1, unused
#pragma unroll
    for (int j = 0; j < NT; ++j) wrow[j] = qweight + static_cast<int64_t>(min(nw0 + 8 * j + g, N - 1)) * ROW_BYTES;
    const uint32_t ones[2] = {0x3f803f80u, 0x3f803f80u};  // bf16 1.0 pairs

    for (int b = 0; b < NB + (TAIL_WORDS > 0); ++b) {
      const int nw = b < NB ? BW : TAIL_WORDS, kb0 = b * KB, kb = nw * KW;
      uint32_t wd[NT][BW];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (nw == BW) {
          LLMC_CHECK_ALIGNED16(wrow[j] + 64 * b + 16 * t);
          const uint4 v = vload<uint4>(wrow[j] + 64 * b + 16 * t);
          wd[j][0] = v.x, wd[j][1] = v.y, wd[j][2] = v.z, wd[j][3] = v.w;
        } else {
          const uint32_t* tw = reinterpret_cast<const uint32_t*>(wrow[j] + 64 * b) + t * nw;
#pragma unroll
          for (int w = 0; w < BW; ++w) wd[j][w] = w < nw ? tw[w] : 0u;
        }
      }
      __syncthreads();  // the previous block's ldmatrix reads are done
#pragma unroll 1  // unrolled, ptxas spilled around the bf16 copies (sm_80, n = 53, k = 160)
      for (int idx = tid; idx < BM * (kb / 4); idx += kTileThreads) {
        const int r = idx / (kb / 4), c = 4 * (idx % (kb / 4));
        const A* xp = x + (m0 + r < T ? rows.x_row(m0 + r) * K : 0) + kb0 + c;
        if constexpr (sizeof(A) == 2) {
          vstore(&xs[r][c], m0 + r < T ? vload<uint2>(xp) : uint2{0u, 0u});
        } else {
          float4 v = float4{0.0f, 0.0f, 0.0f, 0.0f};
          if (m0 + r < T) v = load4(xp);
          vstore(&xs[r][c], uint2{pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w)});
        }
      }
      __syncthreads();
#pragma unroll
      for (int s = 0; s < KB / 16; ++s) {
        if (s < kb / 16) {  // block-uniform
          const int w = s / (KW / 16), j0 = 2 * (s % (KW / 16));  // the word and its first pair for step s
          uint32_t bf[NT][2];
#pragma unroll
          for (int j = 0; j < NT; ++j) bf[j][0] = b_reg(wd[j][w], j0), bf[j][1] = b_reg(wd[j][w], j0 + 1);
#pragma unroll
          for (int mi = 0; mi < MT; ++mi) {
            uint32_t a[4];
            ldmatrix_x4(a, &xs[16 * mi + (lane & 7) + 8 * ((lane >> 3) & 1)][16 * s + 8 * (lane >> 4)]);
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_m16n8k16_bf16(part[mi][j], a, bf[j], part[mi][j]);
            if constexpr (ASYM) mma_m16n8k16_bf16(xsum[mi], a, ones, xsum[mi]);
          }
          const int kend = kb0 + 16 * (s + 1);
          if (kend % G == 0 || kend == K) {  // the group of k step s ends here: scale its partial sums
            const int grp = (kend - 1) / G;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const int c0 = min(nw0 + 8 * j + 2 * t, N - 1), c1 = min(nw0 + 8 * j + 2 * t + 1, N - 1);
              float s0, s1, n0, n1;
              group_scale_min(scales, mins, static_cast<int64_t>(c0) * NG + grp, s0, n0);
              group_scale_min(scales, mins, static_cast<int64_t>(c1) * NG + grp, s1, n1);
              n0 = -n0, n1 = -n1;
#pragma unroll
              for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  float v = fmaf(part[mi][j][e], e & 1 ? s1 : s0, acc[mi][j][e]);
                  if constexpr (ASYM) v = fmaf(e & 1 ? n1 : n0, xsum[mi][e], v);  // xsum: c0 == c1, c2 == c3
                  acc[mi][j][e] = v;
                  part[mi][j][e] = 0.0f;
                }
              }
            }
            if constexpr (ASYM) {
#pragma unroll
              for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int e = 0; e < 4; ++e) xsum[mi][e] = 0.0f;
            }
          }
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = m0 + 16 * mi + g + 8 * (e >> 1), col = nw0 + 8 * j + 2 * t + (e & 1);
          if (row < T && col < N)
            rows.store(y + rows.y_row(row) * N + col, soft_cap(BIAS ? acc[mi][j][e] + bias[col] : acc[mi][j][e], cap));
        }
      }
    }
  }
};

// qembedding: out[t, :] = dequant(table)[ids[t], :] * scale, the table in pack_cuda's layout (a tied head's is
// that weight). Grid (T), one block per token; a thread decodes whole 32-bit words: the word of unit u (32 k for
// int4, 16 for int8) for lane l sits at 4 * (16 * (u / 4) + l * nw + u % 4) bytes, nw = the block's units, and
// its element i = 4s + 2r + h (k = 16s + 8r + 2l + h of the unit) at bit BITS * (i / 2) + 16 * (i % 2).
// w = q * scale - min rounded as compiler/quant.py's dequantize does (two roundings, never one FMA).
template <int H, int BITS, int GS, bool ASYM, typename SC, typename A = float>
struct QEmbedding {
  static_assert(H % 32 == 0, "qembedding: a quantized table's rows are whole blocks of 32");
  static constexpr int kWords = H * BITS / 32;
  static constexpr int kPerWord = 32 / BITS;
  static constexpr int kUnits = H / (4 * kPerWord);
  static constexpr int NG = (H + GS - 1) / GS;
  static constexpr int LO = BITS == 8 ? -128 : (ASYM ? 0 : -8);  // the q stored as u = 0
  static constexpr uint32_t kMask = (1u << BITS) - 1;
  static constexpr int kThreads = row_threads(kWords, 256);

  static __device__ __forceinline__ void run(const int32_t* ids, const uint8_t* qweight, const SC* scales,
                                             const SC* mins, A* out, float scale = 1.0f) {
    const int64_t row = ids[blockIdx.x];
    const uint32_t* src = reinterpret_cast<const uint32_t*>(qweight + row * (H * BITS / 8));
    A* dst = out + static_cast<int64_t>(blockIdx.x) * H;
    for (int wi = threadIdx.x; wi < kWords; wi += kThreads) {
      const uint32_t word = src[wi];
      const int block = wi / 16, nw = min(4, kUnits - 4 * block);
      const int lane = wi % 16 / nw, unit = 4 * block + wi % 16 % nw;
#pragma unroll
      for (int i = 0; i < kPerWord; ++i) {
        const int k = unit * 4 * kPerWord + 16 * (i / 4) + 8 * (i / 2 % 2) + 2 * lane + i % 2;
        const int q = static_cast<int>((word >> (BITS * (i / 2) + 16 * (i % 2))) & kMask) + LO;
        float s, m;
        group_scale_min(scales, mins, row * NG + k / GS, s, m);
        float w = __fmul_rn(static_cast<float>(q), s);
        if constexpr (ASYM) w = __fsub_rn(w, m);
        astore(dst + k, __fmul_rn(w, scale));
      }
    }
  }
};

}  // namespace llmc
