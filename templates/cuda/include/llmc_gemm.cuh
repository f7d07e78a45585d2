// llmc_gemm.cuh: the dense GEMM / GEMV of every linear layer (gemm.cu.j2), and the MLP's gate and up projections
// with their SwiGLU epilogue (gemm_swiglu.cu.j2).
#pragma once

#include "llmc_common.cuh"

namespace llmc {

// gemm: y[T, N] = x[T, K] @ w[N, K]^T (+ bias[N]); w in HF Linear layout, one row per output.
//  - decode (T <= kGemvMaxT): gemv(). kSplit warps per output row j (1 unless N is small), each a k slice;
//    lanes stride it 4 values at a time (float4 of x, 16 or 8 bytes of w; scalar loads when K % 4 != 0),
//    kGemvRows rows of x per pass over the weight row, one warp_sum per (row, output, slice), the slices
//    added in order through shared memory. Grid (kGemvBlocks), block kGemvThreads.
//  - prefill: tiled(), a BM x BN output tile per block, BK-deep k steps. Grid (kTilesN, ceil(T / BM)), block
//    kTileThreads.
//    - bf16 weights with 16-byte rows (kMma): on tensor cores, tiled_mma(). Four warps in 2 x 2, each a
//      (BM / 2) x (BN / 2) tile of mma.sync m16n8k16 (bf16 in, fp32 accumulate). x and w (bf16) tiles go
//      global -> shared by cp.async 16 bytes at a time, STAGES k steps in flight (rows past T or N and
//      chunks past K zero-filled); B fragments come from ldmatrix.x4 on w's [n][k] rows; A fragments from
//      ldmatrix.x4 on x's [m][k] rows (bf16 x), or from fp32 x pairs rounded to bf16 in registers (nearest
//      even, as the CPU's vdpbf16ps path rounds x). Rows are padded (+16 bytes; fp32 x: +4 floats) so that
//      ldmatrix, the x pair reads and the cp.async stores touch every bank equally: no replays. The output is
//      summed in k order by one mma chain per element.
//    - otherwise tiled_simt(): x and w staged k-major in shared memory (w widened to float), 4 x 4 outputs
//      per thread, fp32 accumulate; zero-filled tails.
// GEMV_WARPS, BM, BN, BK and STAGES are tunable (templates/cuda/gemm.tune.toml). None changes the numbers:
// each output is kSplit warps' sums added in slice order (GEMV; kSplit follows N and K alone), one thread's
// k-ordered sum (SIMT) or one k-ordered mma chain whatever the block shape.
// SWIGLU (gemm_swiglu.cu.j2): the MLP's gate and up projections with silu(gate) * up as the epilogue, so the
// [T, N] product never goes to memory. w's N rows are the gate and up rows interleaved 8 at a time (rows
// 16q..16q+7: gate rows 8q..8q+7; rows 16q+8..16q+15: their up rows; the compiler packs them so), so that an
// mma warp's n8 tiles 2j and 2j + 1 hold gate and up of the same 8 outputs, and y is [T, N / 2]: y[t, o] =
// silu(gate_o . x_t) * (up_o . x_t). The GEMV's warp takes both rows of its output. Each sum is the unfused
// GEMM's, in its order, and is rounded to A as the unfused GEMM stores it, so the result equals gemm +
// silu_mul bit for bit. bf16 weights with 16-byte rows only. GELU: gelu_tanh(gate) * up instead (GeGLU).
// A: the activation element of x and y.
template <int N, int K, bool BIAS, typename W, int GEMV_WARPS = 4, int TILE_M = 64, int TILE_N = 64,
          int TILE_K = 32, int STAGES = 3, bool SWIGLU = false, typename A = float, bool GELU = false>
struct Gemm {
  static constexpr int kOut = SWIGLU ? N / 2 : N;  // y's columns
  static constexpr int kRowsPerOut = SWIGLU ? 2 : 1;
  // The weight row of output o's gate (r = 0) or up (r = 1) under SWIGLU; else o.
  static __host__ __device__ constexpr int weight_row(int o, int r) {
    return SWIGLU ? 16 * (o / 8) + o % 8 + 8 * r : o;
  }
  // GEMV: each lane access takes 4 values of a row (x and w: 16 or 8 bytes), so that both x's and w's warp
  // accesses are contiguous (full sectors); rows of 4k values keep them aligned. A block holds GEMV_WARPS
  // output rows of kSplit warps each (split-K where N is small: gemv_split, slices of whole warp sweeps of at
  // least 256 values; at most 4, so a block stays within 1024 threads).
  static constexpr bool kVec = K % 4 == 0;
  static constexpr int kSweep = kVec ? 128 : 32;  // the values one warp access covers
  static constexpr int kSplit = gemv_split(kOut, clamp_int(K / 256, 1, 4));
  static constexpr int kSlice = round_up(ceil_div(K, kSplit), kSweep);
  static constexpr int kGemvWarps = GEMV_WARPS, kGemvThreads = 32 * kGemvWarps * kSplit, kGemvRows = 4;
  static constexpr int kGemvMaxT = 8, kGemvBlocks = ceil_div(kOut, kGemvWarps);
  static constexpr bool kMma = sizeof(W) == 2 && K % 8 == 0;  // bf16 rows of whole 16-byte pieces
  static_assert(!SWIGLU || (kMma && !BIAS && N % 16 == 0), "gemm: SWIGLU takes bf16 16-byte rows, whole groups");
  static constexpr int BM = TILE_M, BN = TILE_N, BK = TILE_K;
  static constexpr int kTileThreads = kMma ? 128 : (BM / 4) * (BN / 4);
  static constexpr int kTilesN = ceil_div(N, BN);

  static __device__ __forceinline__ void load_w4(const float* p, float (&o)[4]) { Vec16<float>::load(p, o); }
  static __device__ __forceinline__ void load_w4(const uint16_t* p, float (&o)[4]) { load_bf16x4(p, o); }

  // One output's value from its row sums (slice sums added): SWIGLU: silu(gate) * up; else the sum + bias,
  // soft-capped when cap > 0.
  static __device__ __forceinline__ float gemv_out(const float (&s)[kRowsPerOut], float b, float cap) {
    if constexpr (SWIGLU)
      return gated_mul<GELU>(act_round<A>(s[0]), act_round<A>(s[1]));
    else
      return soft_cap(s[0] + b, cap);
  }

  // cap > 0: every output soft-capped (Gemma 2's final logits), as it is stored. rows: which rows of x and y
  // (llmc_common.cuh DenseRows).
  template <class Rows = DenseRows>
  static __device__ __forceinline__ void gemv(const A* x, const W* w, const W* bias, A* y, int T, float cap = 0.0f,
                                              Rows rows_of = {}) {
    constexpr int R = kGemvRows, NR = kRowsPerOut;
    __shared__ float part[kSplit > 1 ? kGemvWarps * kSplit : 1][NR][R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % kSplit;
    const int j = blockIdx.x * kGemvWarps + warp / kSplit;
    if (kSplit == 1 && j >= kOut) return;  // whole warps only; a split block keeps every warp for its barriers
    const bool live = j < kOut;  // a warp past the outputs adds no terms but still reaches the barriers
    const W* wr[NR];
#pragma unroll
    for (int q = 0; q < NR; ++q) wr[q] = w + static_cast<int64_t>(live ? weight_row(j, q) : 0) * K;
    const int k_lo = slice * kSlice, k_hi = live ? min(K, k_lo + kSlice) : k_lo;
    const float b = BIAS && live ? wload(bias[j]) : 0.0f;
    for (int t0 = 0; t0 < T; t0 += R) {
      const int rows = min(R, T - t0);
      float acc[NR][R];
#pragma unroll
      for (int q = 0; q < NR; ++q)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[q][r] = 0.0f;
      if constexpr (kVec) {
        // Two sweeps in flight; a slice of at most two fully unrolled left ptxas spilling (bf16 at K = 136).
#pragma unroll(kSlice > 2 * kSweep ? 2 : 1)
        for (int k = k_lo + lane * 4; k < k_hi; k += 32 * 4) {
          float wv[NR][4];
#pragma unroll
          for (int q = 0; q < NR; ++q) load_w4(wr[q] + k, wv[q]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r < rows) {
              float xv[4];
              load_act4(x + rows_of.x_row(t0 + r) * K + k, xv);
#pragma unroll
              for (int q = 0; q < NR; ++q)
                acc[q][r] += xv[0] * wv[q][0] + xv[1] * wv[q][1] + xv[2] * wv[q][2] + xv[3] * wv[q][3];
            }
          }
        }
      } else {
        for (int k = k_lo + lane; k < k_hi; k += 32) {
          float wv[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) wv[q] = wload(wr[q][k]);
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (r < rows) {
#pragma unroll
              for (int q = 0; q < NR; ++q) acc[q][r] += wload(x[rows_of.x_row(t0 + r) * K + k]) * wv[q];
            }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < rows) {  // warp-uniform
          float s[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) s[q] = warp_sum(acc[q][r]);
          if constexpr (kSplit == 1) {
            if (lane == 0) rows_of.store(y + rows_of.y_row(t0 + r) * kOut + j, gemv_out(s, b, cap));
          } else if (lane == 0) {
#pragma unroll
            for (int q = 0; q < NR; ++q) part[warp][q][r] = s[q];
          }
        }
      }
      if constexpr (kSplit > 1) {
        __syncthreads();
        if (slice == 0 && live && lane < rows) {  // lane r of the row's first warp adds its slices in order
          float v[NR];
#pragma unroll
          for (int q = 0; q < NR; ++q) {
            v[q] = 0.0f;
#pragma unroll
            for (int sl = 0; sl < kSplit; ++sl) v[q] += part[warp + sl][q][lane];
          }
          rows_of.store(y + rows_of.y_row(t0 + lane) * kOut + j, gemv_out(v, b, cap));
        }
        __syncthreads();  // part is rewritten by the next rows
      }
    }
  }

  // rows: as gemv's; a gathered block's rows are [0, T), else [blockIdx.y * BM, + BM).
  template <class Rows = DenseRows>
  static __device__ __forceinline__ void tiled(const A* x, const W* w, const W* bias, A* y, int T, float cap = 0.0f,
                                               Rows rows = {}) {
    if constexpr (kMma)
      tiled_mma(x, w, bias, y, T, cap, rows);
    else
      tiled_simt(x, w, bias, y, T, cap, rows);
  }

  template <class Rows>
  static __device__ __forceinline__ void tiled_mma(const A* x, const uint16_t* w, const uint16_t* bias, A* y, int T,
                                                   float cap, Rows rows) {
    static_assert(BM % 32 == 0 && BN % 32 == 0 && BK % 16 == 0 && STAGES >= 2, "gemm: mma tile shape");
    constexpr bool kBf16X = sizeof(A) == 2;
    // row strides in elements: 16-byte multiples that shift banks
    constexpr int XS = kBf16X ? BK + 8 : BK + 4, WS = BK + 8;
    constexpr int MT = BM / 32, NT = BN / 16;  // m16 and n8 tiles per warp
    constexpr int KT = ceil_div(K, BK);
    struct alignas(16) Stage {
      A x[BM][XS];
      uint16_t w[BN][WS];
    };
    __shared__ Stage sm[STAGES];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = Rows::kGathered ? 0 : blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp >> 1) * (BM / 2), wn = (warp & 1) * (BN / 2);

    auto load_stage = [&](int st, int kt) {
      const int k0 = kt * BK;
      constexpr int XE = 16 / sizeof(A), XC = BK / XE, WC = BK / 8;  // elements per 16-byte chunk, chunks per row
      for (int c = tid; c < BM * XC; c += kTileThreads) {
        const int r = c / XC, kk = k0 + XE * (c % XC);
        const bool in = m0 + r < T && kk < K;  // K % 8 == 0: a chunk is wholly in or out
        cp_async_16_zfill(&sm[st].x[r][XE * (c % XC)], x + (in ? rows.x_row(m0 + r) * K + kk : 0), in ? 16 : 0);
      }
      for (int c = tid; c < BN * WC; c += kTileThreads) {
        const int r = c / WC, kk = k0 + 8 * (c % WC);
        const bool in = n0 + r < N && kk < K;
        cp_async_16_zfill(&sm[st].w[r][8 * (c % WC)], w + (in ? static_cast<int64_t>(n0 + r) * K + kk : 0), in ? 16 : 0);
      }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT) load_stage(s, s);
      cp_async_commit();  // one group per stage, empty past KT, so the wait count below holds throughout
    }
    for (int kt = 0; kt < KT; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kt is in for every thread, and every warp is done with stage kt - 1
      if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
      cp_async_commit();
      const Stage& st = sm[kt % STAGES];
#pragma unroll
      for (int ks = 0; ks < BK; ks += 16) {
        uint32_t a[MT][4], b[NT][2];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          if constexpr (kBf16X) {  // matrices: (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
            ldmatrix_x4(a[mi], &st.x[wm + 16 * mi + (lane & 7) + 8 * ((lane >> 3) & 1)][ks + 8 * (lane >> 4)]);
          } else {
            const float* r0 = &st.x[wm + 16 * mi + g][ks + 2 * t];
            const float* r1 = r0 + 8 * XS;
            const float2 v0 = vload<float2>(r0), v1 = vload<float2>(r1);
            const float2 v2 = vload<float2>(r0 + 8), v3 = vload<float2>(r1 + 8);
            a[mi][0] = pack_bf16x2(v0.x, v0.y), a[mi][1] = pack_bf16x2(v1.x, v1.y);
            a[mi][2] = pack_bf16x2(v2.x, v2.y), a[mi][3] = pack_bf16x2(v3.x, v3.y);
          }
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {  // matrices: (tile j, k 0-7), (j, k 8-15), (j + 1, 0-7), (j + 1, 8-15)
          uint32_t r[4];
          ldmatrix_x4(r, &st.w[wn + 8 * (j + (lane >> 4)) + (lane & 7)][ks + 8 * ((lane >> 3) & 1)]);
          b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
          for (int j = 0; j < NT; ++j) mma_m16n8k16_bf16(acc[mi][j], a[mi], b[j], acc[mi][j]);
      }
    }
    cp_async_wait<0>();  // no copy outlives the block (the groups past KT are empty)

    if constexpr (SWIGLU) {  // tiles j, j + 1: gate and up of outputs 8q..8q+7, q = (n0 + wn + 8j) / 16
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          const int col = (n0 + wn + 8 * j) / 2 + 2 * t;  // kOut % 8 == 0: the pair is wholly in or out
          if (col >= kOut) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = m0 + wm + 16 * mi + g + 8 * h;
            if (row >= T) continue;
            const float* gate = acc[mi][j];
            const float* up = acc[mi][j + 1];
            rows.store2(y + rows.y_row(row) * kOut + col,
                       gated_mul<GELU>(act_round<A>(gate[2 * h]), act_round<A>(up[2 * h])),
                       gated_mul<GELU>(act_round<A>(gate[2 * h + 1]), act_round<A>(up[2 * h + 1])));
          }
        }
      }
      return;
    }
    constexpr bool kPairs = N % 2 == 0;  // each (row, col pair) aligned to its size: one store
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = n0 + wn + 8 * j + 2 * t;
        const float b0 = BIAS && col < N ? wload(bias[col]) : 0.0f, b1 = BIAS && col + 1 < N ? wload(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + wm + 16 * mi + g + 8 * h;
          if (row >= T) continue;
          A* yr = y + rows.y_row(row) * N + col;
          const float v0 = soft_cap(acc[mi][j][2 * h] + b0, cap), v1 = soft_cap(acc[mi][j][2 * h + 1] + b1, cap);
          if (kPairs && col + 1 < N) {
            rows.store2(yr, v0, v1);
          } else {
            if (col < N) rows.store(yr, v0);
            if (col + 1 < N) rows.store(yr + 1, v1);
          }
        }
      }
    }
  }

  template <class Rows>
  static __device__ __forceinline__ void tiled_simt(const A* x, const W* w, const W* bias, A* y, int T, float cap,
                                                    Rows rows) {
    static_assert(BM * BK % kTileThreads == 0 && BN * BK % kTileThreads == 0, "gemm: tile loads");
    static_assert((BM / 4) * (BN / 4) == kTileThreads, "gemm: 4 x 4 outputs per thread");
    struct alignas(16) Smem {
      float x[BK][BM + 4];  // k-major; +4 keeps rows 16-byte aligned and spreads the transposing stores
      float w[BK][BN + 4];
    };
    __shared__ Smem sm;
    const int tid = threadIdx.x;
    const int tx = tid % (BN / 4), ty = tid / (BN / 4);
    const int m0 = Rows::kGathered ? 0 : blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) acc[i][jj] = 0.0f;

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
      for (int e = 0; e < BM * BK / kTileThreads; ++e) {  // consecutive threads read consecutive k
        const int idx = tid + e * kTileThreads, r = idx / BK, c = idx % BK;
        const int gm = m0 + r, gk = k0 + c;
        sm.x[c][r] = (gm < T && gk < K) ? wload(x[rows.x_row(gm) * K + gk]) : 0.0f;
      }
#pragma unroll
      for (int e = 0; e < BN * BK / kTileThreads; ++e) {
        const int idx = tid + e * kTileThreads, r = idx / BK, c = idx % BK;
        const int gn = n0 + r, gk = k0 + c;
        sm.w[c][r] = (gn < N && gk < K) ? wload(w[static_cast<int64_t>(gn) * K + gk]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        const float4 a = load4(&sm.x[kk][ty * 4]);
        const float4 bv = load4(&sm.w[kk][tx * 4]);
        const float av[4] = {a.x, a.y, a.z, a.w}, bw[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[i][jj] += av[i] * bw[jj];
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int gm = m0 + ty * 4 + i;
      if (gm >= T) break;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int gn = n0 + tx * 4 + jj;
        if (gn < N) rows.store(y + rows.y_row(gm) * N + gn, soft_cap(BIAS ? acc[i][jj] + wload(bias[gn]) : acc[i][jj], cap));
      }
    }
  }
};

}  // namespace llmc
