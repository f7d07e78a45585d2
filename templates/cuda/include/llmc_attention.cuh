// llmc_attention.cuh: paged attention over the KV cache (paged_attention.cu.j2): the cache write, the split-KV
// decode kernel and the flash-attention prefill on tensor cores.
#pragma once

#include <type_traits>

#include "llmc_common.cuh"

namespace llmc {

// paged attention over a ragged batch (docs/contracts.md, "The step"). KV cache [num_blocks, BS, NKV, D]
// each, of KV: float, or uint16_t bf16 bits (rounded to nearest even when written, widened to float when read);
// q, k, v and out of A, the activation element.
// The launcher takes the step's T from the host (the kernels read their own copy, query_start_loc[B]) and
// sizes the grids by it, capped at kMaxGrid; the kernels loop over their items.
//  1. write(): token t's k/v rows (kv heads [0, NKV)) go to cache slot slot_mapping[t] (< 0: skipped).
//     Grid (write_grid()), block kWriteThreads; one block per token.
//  2. attend(): one warp per (token t, head h, KV split); a block holds HPB heads of one token that share a kv head
//     (HPB divides NH / NKV), so their K/V reads meet in L1. Causal over cache positions 0..p of t's
//     sequence (W > 0, a sliding window: p-W+1..p), through its block table. Per 32 cache positions: the
//     scores, then warp_max / warp_sum for the online softmax (fp32, one rescale per 32 positions), then every
//     lane accumulates D/32 output dims over the 32 positions' V rows (coalesced). Scores, where a K row is
//     whole 16-byte vectors (kRowVec): LPR lanes share a row, each a 16-byte piece at a time (a warp access
//     reads 32 / LPR whole rows: full sectors), its part of q in registers, summed over the LPR lanes by a
//     butterfly; otherwise lane j takes position c0 + j alone (a full D-long dot with the q row staged in
//     shared memory).
//     Split-KV (flash-decoding), so that a few decoding tokens still give every SM work: a token's positions
//     [first, ctx) are cut into St = min(kMaxSplits, ceil(len / kSplitChunk)) splits of ceil(len / St), each
//     a unit of work of its own (block: token, HPB heads, split). A split writes its (m, l, unnormalized
//     acc) per head to `partials`; the block whose split completes the token's set (a counter per (token,
//     head block) in `done`, which it resets) combines them in split order: O = sum_s acc_s e^(m_s - M) /
//     sum_s l_s e^(m_s - M), M = max_s m_s. St depends on the token's own context alone, and the combination
//     order is fixed, so results are bit-reproducible whatever the block order. A launch splits when its
//     partials fit the scratch (T * NH * S <= kScratchHeads, S = max_splits(max_blocks)); otherwise (large
//     prefill steps) every token takes one split, whose result differs from a split one in the last bits.
//     Grid (attend_grid()), block kThreads.
//  3. prefill() (kFlash: a bf16 cache, D % 16 == 0, D <= 128): the sequences with kFlashMinRows or more new
//     tokens, which attend() skips, on tensor cores, flash-attention style. A block takes 64 of a sequence's
//     new tokens for one head (4 warps of 16 rows; q rounded to bf16 into A fragments), and walks the key
//     positions its rows can see (causal, the window) in tiles of FN through its block table: K and V rows
//     go to shared memory by cp.async (double-buffered; positions past the context zero-filled), S = Q K^T by
//     mma.sync m16n8k16 with K's B fragments from ldmatrix, the mask, an fp32 online softmax per row (each
//     lane keeps its own part of l; the quad sums it once at the end), then O += P V with P's bf16 A fragments
//     straight from S's accumulators and V's B fragments from ldmatrix.trans. Rows padded by 16 bytes: no
//     bank replays. Grid (prefill_grid()), block kFlashThreads.
template <int NH, int NKV, int D, int BS, int W, typename KV, typename A = float>
struct PagedAttention {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  static constexpr int GROUP = NH / NKV;
  static constexpr int HPB = largest_divisor_le(GROUP, 8);  // heads (warps) per block
  static constexpr int kThreads = 32 * HPB;
  static constexpr int kHeadBlocks = NH / HPB;
  static constexpr int DPL = ceil_div(D, 32);  // output dims per lane
  static constexpr int SLOT = NKV * D;         // values per cache slot
  // int8 and fp8 (uint8_t: e4m3 bits): a block's [NKV][BS] float scales follow its values, the block padded to 16
  // bytes (llmc/dtypes.py kv_block_bytes); kBlock: the KV elements of a block
  static constexpr bool kScaled = std::is_same_v<KV, int8_t> || std::is_same_v<KV, uint8_t>;
  static constexpr int64_t kBlock = kScaled ? (static_cast<int64_t>(BS) * NKV * (D + 4) + 15) / 16 * 16
                                            : static_cast<int64_t>(BS) * SLOT;
  static constexpr int kWriteThreads = row_threads(SLOT, 256);
  static constexpr int64_t kMaxGrid = 1024;
  static constexpr int VW = Vec16<KV>::N;                  // values per 16-byte piece of a K row
  static constexpr bool kRowVec = D % VW == 0 && (D / VW <= 32 ? 32 % (D / VW) == 0 : (D / VW) % 32 == 0);
  static constexpr int LPR = kRowVec ? (D / VW < 32 ? D / VW : 32) : 1;  // lanes per K row
  static constexpr int RPA = 32 / LPR;                                   // K rows per warp access
  static constexpr int PPL = kRowVec ? D / (VW * LPR) : 1;               // pieces per lane and row

  static int clamp_grid(int64_t bound) { return static_cast<int>(bound < kMaxGrid ? (bound > 0 ? bound : 1) : kMaxGrid); }
  static constexpr int kSplitChunk = 64, kMaxSplits = 32;
  static constexpr int64_t kScratchHeads = 16384;          // (token, head, split) partials of one launch
  static constexpr int kPartial = round_up(D + 2, 8);      // acc[D], m, l: records of whole 32-byte sectors
  static constexpr int64_t kScratchFloats = kScratchHeads * kPartial, kDoneCounters = kScratchHeads / 2;
  __host__ __device__ static int max_splits(int max_blocks) {
    return clamp_int(ceil_div(max_blocks * BS, kSplitChunk), 1, kMaxSplits);
  }
  static int write_grid(int T) { return clamp_grid(T); }
  static dim3 attend_grid(int T, int max_blocks) {
    return dim3(clamp_grid(static_cast<int64_t>(T) * kHeadBlocks), max_splits(max_blocks));
  }

  static constexpr bool kFlash = sizeof(KV) == 2 && D % 16 == 0 && D <= 128;  // D <= 128: O and Q in registers
  static constexpr int kFlashMinRows = 16, FM = 64, FN = 32, kFlashThreads = 128;
  static constexpr int FS = D + 8;  // bf16 per shared K/V row
  // bounds the units (sequence, 64-row tile, head): each sequence has <= max_blocks * BS new tokens, all of
  // them T, so at most ceil(T / FM) + B tiles
  static int prefill_grid(int B, int max_blocks, int T) {
    const int64_t by_tables = static_cast<int64_t>(B) * ceil_div(max_blocks * BS, FM), by_tokens = ceil_div(T, FM) + B;
    return clamp_grid((by_tables < by_tokens ? by_tables : by_tokens) * NH);
  }

  // The cache offset (elements) of slot `slot`'s row of kv head kvh, and of position pos of a sequence with block
  // table `table`.
  static __device__ __forceinline__ int64_t slot_row(int64_t slot, int kvh) {
    return slot / BS * kBlock + slot % BS * SLOT + kvh * D;
  }
  static __device__ __forceinline__ int64_t pos_slot(const int32_t* table, int pos) {
    return static_cast<int64_t>(table[pos / BS]) * BS + pos % BS;
  }
  static __device__ __forceinline__ int64_t cache_row(const int32_t* table, int pos, int kvh) {
    return slot_row(pos_slot(table, pos), kvh);
  }
  // int8, fp8: where the scale of slot `slot`'s row of kv head kvh lies
  template <typename C>  // KV or const KV
  static __device__ __forceinline__ auto scale_at(C* cache, int64_t slot, int kvh) {
    using F = std::conditional_t<std::is_const_v<C>, const float, float>;
    return reinterpret_cast<F*>(cache + slot / BS * kBlock + static_cast<int64_t>(BS) * SLOT) + kvh * BS + slot % BS;
  }
  // the scale of that row: int8's or fp8's, else 1
  static __device__ __forceinline__ float row_scale(const KV* cache, int64_t slot, int kvh) {
    if constexpr (kScaled)
      return *scale_at(cache, slot, kvh);
    else
      return 1.0f;
  }

  static __device__ __forceinline__ float to_kv(float x, float*) { return x; }
  static __device__ __forceinline__ uint16_t to_kv(float x, uint16_t*) { return bf16_bits(x); }

  // int8 and fp8: one head's row (D values at src) quantized into dst and its scale, by one warp: s = max |x| /
  // the type's largest value (127, 448), q = x / s rounded to the type, ties to even (int8 as the CPU's
  // KvLayout::write).
  static __device__ __forceinline__ void write_scaled(const A* src, KV* dst, float* scale) {
    constexpr float kMax = std::is_same_v<KV, int8_t> ? 127.0f : 448.0f;
    const int lane = threadIdx.x & 31;
    float amax = 0.0f;
    for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(wload(src[d])));
    const float s = warp_max(amax) / kMax;
    for (int d = lane; d < D; d += 32) {
      const float q = s > 0.0f ? wload(src[d]) / s : 0.0f;
      if constexpr (std::is_same_v<KV, int8_t>)
        dst[d] = static_cast<int8_t>(rintf(q));
      else
        dst[d] = float_to_fp8_e4m3(q);
    }
    if (lane == 0) *scale = s;
  }

  static __device__ __forceinline__ void write(const A* k, const A* v, int row_stride, KV* k_cache,
                                               KV* v_cache, const int64_t* slot_mapping,
                                               const int32_t* query_start_loc, int B) {
    const int T = query_start_loc[B];
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      const int64_t src = static_cast<int64_t>(t) * row_stride;
      if constexpr (kScaled) {  // a warp per (k or v, kv head)
        for (int r = threadIdx.x / 32; r < 2 * NKV; r += kWriteThreads / 32) {
          const int kvh = r % NKV;
          KV* cache = r < NKV ? k_cache : v_cache;
          write_scaled((r < NKV ? k : v) + src + kvh * D, cache + slot_row(slot, kvh), scale_at(cache, slot, kvh));
        }
      } else {
        const int64_t dst = slot_row(slot, 0);
        for (int i = threadIdx.x; i < SLOT; i += kWriteThreads) {
          k_cache[dst + i] = to_kv(wload(k[src + i]), k_cache);
          v_cache[dst + i] = to_kv(wload(v[src + i]), v_cache);
        }
      }
    }
  }

  // Where q's value d sits in shared memory. A bf16 cache gives each lane two float4s of q per piece (8 values),
  // and 8 lanes' float4s at a 32-byte stride cover only half the banks (2-way); so pieces 4-7 mod 8 keep their
  // two halves swapped, and the in-order reads of each 8-lane phase hit 8 distinct 4-bank groups.
  static __device__ __forceinline__ int q_slot(int d) {
    if constexpr (kRowVec && VW == 8) return d ^ (((d >> 5) & 1) << 2);
    return d;
  }

  static __device__ __forceinline__ float dot_q(const float* qs, const KV* kr) {
    float s = 0.0f;
    constexpr int N = Vec16<KV>::N;
    if constexpr (D % N == 0) {  // cache rows start at multiples of D values: 16-byte aligned
#pragma unroll 4
      for (int d = 0; d < D; d += N) {
        float b[N];
        Vec16<KV>::load(kr + d, b);
#pragma unroll
        for (int j = 0; j < N; j += 4) {
          const float4 a = load4(qs + d + j);
          s += a.x * b[j] + a.y * b[j + 1] + a.z * b[j + 2] + a.w * b[j + 3];
        }
      }
    } else {
      for (int d = 0; d < D; ++d) s += qs[d] * wload(kr[d]);
    }
    return s;
  }

  // The `splits` partials of head h of token t (at a stride of S per head) -> out; one warp, in the block
  // whose split came last.
  static __device__ __forceinline__ void combine(const float* partials, int t, int h, int S, int splits, A* out) {
    const int lane = threadIdx.x & 31;
    const volatile float* part = partials + (static_cast<int64_t>(t) * NH + h) * S * kPartial;  // past L1
    const float m_lane = lane < splits ? part[lane * kPartial + D] : -INFINITY;
    const float M = warp_max(m_lane);
    const float L = warp_sum(lane < splits ? part[lane * kPartial + D + 1] * expf(m_lane - M) : 0.0f);
    float o[DPL];
#pragma unroll
    for (int i = 0; i < DPL; ++i) o[i] = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
      const float e = expf(__shfl_sync(kFullMask, m_lane, sp) - M);
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (D % 32 == 0 || d < D) o[i] = fmaf(part[sp * kPartial + d], e, o[i]);
      }
    }
    store_dims(out + (static_cast<int64_t>(t) * NH + h) * D, o, 1.0f / L);
  }

  // dst[d] = acc * scale for this lane's dims d = lane + 32 i of a head (an output row, or a float partial)
  template <typename T>
  static __device__ __forceinline__ void store_dims(T* dst, const float (&acc)[DPL], float scale) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const int d = lane + 32 * i;
      if (D % 32 == 0 || d < D) astore(dst + d, acc[i] * scale);
    }
  }

  static __device__ __forceinline__ void attend(const A* q, int row_stride, const KV* k_cache,
                                                const KV* v_cache, const int32_t* query_start_loc,
                                                const int32_t* seq_lens, const int32_t* block_tables,
                                                int max_blocks, int B, A* out, float scale, float softcap,
                                                float* partials, unsigned* done) {
    struct alignas(16) Smem {
      float q[HPB][D];     // this warp's query row
      float p[HPB][32];    // softmax weights of the current 32 positions
      int64_t row[HPB][32];  // their V rows (element offsets into the cache)
      float ks[HPB][32], vs[HPB][32];  // int8, fp8: their K and V rows' scales
      int last;            // this block finished its token's last split
    };
    __shared__ Smem sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int T = query_start_loc[B];
    const int S = static_cast<int64_t>(T) * NH * gridDim.y <= kScratchHeads ? gridDim.y : 1, split = blockIdx.y;
    if (split >= S) return;  // block-uniform, before any barrier
    for (int item = blockIdx.x; item < T * kHeadBlocks; item += gridDim.x) {
      const int t = item / kHeadBlocks, h = (item % kHeadBlocks) * HPB + warp;
      int b = 0, b_hi = B;  // the last b with query_start_loc[b] <= t
      while (b_hi - b > 1) {
        const int mid = (b + b_hi) >> 1;
        if (query_start_loc[mid] <= t) b = mid; else b_hi = mid;
      }
      const int n_new = query_start_loc[b + 1] - query_start_loc[b];
      const int ctx = seq_lens[b] - n_new + (t - query_start_loc[b]) + 1;  // positions 0..p
      if (kFlash && n_new >= kFlashMinRows) continue;                      // prefill()'s; block-uniform
      const int first = W > 0 ? max(0, ctx - W) : 0;                      // the window's first position
      const int splits = min(S, ceil_div(ctx - first, kSplitChunk));        // this token's: no split is empty
      if (split >= splits) continue;                                       // block-uniform
      const int chunk = ceil_div(ctx - first, splits);
      const int lo = first + split * chunk, hi = min(ctx, lo + chunk);     // this split's positions
      const int kvh = h / GROUP;
      const int32_t* table = block_tables + static_cast<int64_t>(b) * max_blocks;
      const A* qh = q + static_cast<int64_t>(t) * row_stride + h * D;
      for (int d = lane; d < D; d += 32) sm.q[warp][q_slot(d)] = wload(qh[d]);
      __syncwarp();

      float qv[PPL][VW];  // kRowVec: this lane's pieces of q, d = (i * LPR + lane % LPR) * VW + e
      if constexpr (kRowVec) {
        const int piece = lane % LPR;
#pragma unroll
        for (int i = 0; i < PPL; ++i)
#pragma unroll
          for (int c = 0; c < VW; c += 4) {
            const float4 v = load4(&sm.q[warp][q_slot((i * LPR + piece) * VW + c)]);
            qv[i][c] = v.x, qv[i][c + 1] = v.y, qv[i][c + 2] = v.z, qv[i][c + 3] = v.w;
          }
      }
      float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
      for (int c0 = lo; c0 < hi; c0 += 32) {
        const int pos = c0 + lane;
        float s = -INFINITY;
        if constexpr (kRowVec) {
          // the chunk's cache rows, one block-table read per lane (not one per K access: 32 / RPA of them)
          if (pos < hi) {
            const int64_t slot = pos_slot(table, pos);
            sm.row[warp][lane] = slot_row(slot, kvh);
            if constexpr (kScaled) sm.ks[warp][lane] = row_scale(k_cache, slot, kvh), sm.vs[warp][lane] = row_scale(v_cache, slot, kvh);
          }
          __syncwarp();
#pragma unroll 2
          for (int r0 = 0; r0 < 32; r0 += RPA) {
            const int j = r0 + lane / LPR, pj = c0 + j;  // this lane's row of the access
            float part = 0.0f;
            if (pj < hi) {
              const int64_t row = sm.row[warp][j];
#pragma unroll
              for (int i = 0; i < PPL; ++i) {
                float kv[VW];
                Vec16<KV>::load(k_cache + row + (i * LPR + lane % LPR) * VW, kv);
#pragma unroll
                for (int e = 0; e < VW; ++e) part = fmaf(qv[i][e], kv[e], part);
              }
            }
            part = warp_sum<LPR>(part);  // every lane of the row's group: its dot
            if (lane % LPR == 0 && pj < hi) sm.p[warp][j] = kScaled ? part * sm.ks[warp][j] : part;
          }
          __syncwarp();
          if (pos < hi) s = soft_cap(sm.p[warp][lane] * scale, softcap);
          __syncwarp();  // sm.p is rewritten with the weights below
        } else if (pos < hi) {
          const int64_t slot = pos_slot(table, pos), row = slot_row(slot, kvh);
          sm.row[warp][lane] = row;
          if constexpr (kScaled) sm.vs[warp][lane] = row_scale(v_cache, slot, kvh);
          s = soft_cap(dot_q(sm.q[warp], k_cache + row) * row_scale(k_cache, slot, kvh) * scale, softcap);
        }
        const float m_new = fmaxf(m, warp_max(s));  // finite: position c0 is always < hi
        const float corr = expf(m - m_new);         // 0 on the first chunk (m = -inf)
        const float p = pos < hi ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
        sm.p[warp][lane] = p;
        __syncwarp();
        const int n = min(32, hi - c0);
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[i] *= corr;
        for (int j = 0; j < n; ++j) {
          const float pj = kScaled ? sm.p[warp][j] * sm.vs[warp][j] : sm.p[warp][j];
          const KV* vr = v_cache + sm.row[warp][j];
#pragma unroll
          for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            if (D % 32 == 0 || d < D) acc[i] += pj * wload(vr[d]);
          }
        }
        m = m_new;
        __syncwarp();  // p/row are rewritten by the next chunk, q by the next item
      }
      if (splits == 1) {
        store_dims(out + (static_cast<int64_t>(t) * NH + h) * D, acc, 1.0f / l);
        continue;
      }
      float* part = partials + ((static_cast<int64_t>(t) * NH + h) * S + split) * kPartial;
      if (lane == 0) part[D] = m, part[D + 1] = l;
      store_dims(part, acc, 1.0f);  // unnormalized: x * 1.0f is x
      __threadfence();  // this block's partials are visible before its count
      __syncthreads();
      if (threadIdx.x == 0) {
        unsigned* counter = done + static_cast<int64_t>(t) * kHeadBlocks + item % kHeadBlocks;
        sm.last = atomicAdd(counter, 1u) == static_cast<unsigned>(splits - 1);
        if (sm.last) *counter = 0;  // ready for the next launch: every split of this set has counted
      }
      __syncthreads();
      if (sm.last) {
        __threadfence();
        combine(partials, t, h, S, splits, out);
      }
      __syncthreads();  // sm.last is rewritten by the next unit
    }
  }

  static __device__ __forceinline__ void prefill(const A* q, int row_stride, const KV* k_cache,
                                                 const KV* v_cache, const int32_t* query_start_loc,
                                                 const int32_t* seq_lens, const int32_t* block_tables,
                                                 int max_blocks, int B, A* out, float scale, float softcap) {
    if constexpr (kFlash) {
      struct alignas(16) Smem {
        uint16_t k[2][FN][FS];
        uint16_t v[2][FN][FS];
      };
      __shared__ Smem sm;
      const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
      constexpr int KS = D / 16, NT = FN / 8, DT = D / 8;  // k16 steps over D, n8 tiles over FN and over D
      constexpr int CPR = D / 8;                           // 16-byte chunks per K/V row
      // units: (sequence b with >= kFlashMinRows new tokens, 64-row tile, head), counted in sequence order
      int unit = blockIdx.x;
      for (int b = 0, seen = 0; b < B; ++b) {
        const int n_new = query_start_loc[b + 1] - query_start_loc[b];
        if (n_new < kFlashMinRows) continue;
        const int tiles = ceil_div(n_new, FM) * NH;
        while (unit < seen + tiles) {
          const int m0 = (unit - seen) / NH * FM, h = (unit - seen) % NH, kvh = h / GROUP;
          const int ctx = seq_lens[b], cached = ctx - n_new;
          const int32_t* table = block_tables + static_cast<int64_t>(b) * max_blocks;
          const int t0 = query_start_loc[b];
          const int r0 = m0 + 16 * warp + g;  // this lane's rows r0 and r0 + 8 (of the sequence's new tokens)
          // Q's A fragments: a[ks][r] = Q(row g + 8 (r & 1), d = 16 ks + 2 t4 + 8 (r >> 1) + {0, 1})
          uint32_t qa[KS][4];
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int row = r0 + 8 * (r & 1), d = 16 * ks + 2 * t4 + 8 * (r >> 1);
              const A* qp = q + static_cast<int64_t>(t0 + row) * row_stride + h * D + d;
              if constexpr (sizeof(A) == 2) {  // bf16 q: the pair's bits as they are
                qa[ks][r] = row < n_new ? *reinterpret_cast<const uint32_t*>(qp) : 0u;
              } else {
                float2 v = float2{0.0f, 0.0f};
                if (row < n_new) v = vload<float2>(qp);
                qa[ks][r] = pack_bf16x2(v.x, v.y);
              }
            }
          }
          // the key positions the block's rows see
          const int q_lo = cached + m0, q_hi = min(cached + n_new, cached + m0 + FM) - 1;  // query positions
          const int k_lo = W > 0 ? max(0, q_lo - W + 1) : 0, k_hi = q_hi;
          const int ntiles = ceil_div(k_hi + 1 - k_lo, FN);
          auto load_tile = [&](int buf, int j) {
            for (int c = tid; c < FN * CPR; c += kFlashThreads) {
              const int r = c / CPR, d = 8 * (c % CPR), pos = k_lo + j * FN + r;
              const bool in = pos <= k_hi;
              const int64_t off = in ? cache_row(table, pos, kvh) + d : 0;
              cp_async_16_zfill(&sm.k[buf][r][d], k_cache + off, in ? 16 : 0);
              cp_async_16_zfill(&sm.v[buf][r][d], v_cache + off, in ? 16 : 0);
            }
          };
          float o[DT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
          for (int i = 0; i < DT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;
          load_tile(0, 0);
          cp_async_commit();
          for (int j = 0; j < ntiles; ++j) {
            if (j + 1 < ntiles) load_tile((j + 1) & 1, j + 1);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();  // tile j is in for every thread
            const int buf = j & 1, p0 = k_lo + j * FN;
            float sc[NT][4];
#pragma unroll
            for (int i = 0; i < NT; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) sc[i][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
              for (int i = 0; i < NT; i += 2) {  // matrices: (tile i, d 0-7), (i, d 8-15), (i + 1, 0-7), (i + 1, 8-15)
                uint32_t r[4];
                ldmatrix_x4(r, &sm.k[buf][8 * (i + (lane >> 4)) + (lane & 7)][16 * ks + 8 * ((lane >> 3) & 1)]);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16_bf16(sc[i], qa[ks], b0, sc[i]);
                mma_m16n8k16_bf16(sc[i + 1], qa[ks], b1, sc[i + 1]);
              }
            }
            // mask and the online softmax, per row half hr (rows r0, r0 + 8)
            float corr[2];
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const int qp = cached + r0 + 8 * hr;
              float mx = -INFINITY;
#pragma unroll
              for (int i = 0; i < NT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  const int kp = p0 + 8 * i + 2 * t4 + e;
                  const bool see = kp <= qp && kp <= k_hi && (W == 0 || kp > qp - W);
                  float& v = sc[i][2 * hr + e];
                  v = see ? soft_cap(v * scale, softcap) : -INFINITY;
                  mx = fmaxf(mx, v);
                }
              }
              const float m_new = fmaxf(m[hr], warp_max<4>(mx));  // over the row's quad
              const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row that sees nothing yet stays 0
              corr[hr] = expf(m[hr] - base);
              float ps = 0.0f;
#pragma unroll
              for (int i = 0; i < NT; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  float& v = sc[i][2 * hr + e];
                  v = expf(v - base);
                  ps += v;
                }
              }
              l[hr] = l[hr] * corr[hr] + ps;
              m[hr] = m_new;
            }
#pragma unroll
            for (int i = 0; i < DT; ++i) {
              o[i][0] *= corr[0], o[i][1] *= corr[0];
              o[i][2] *= corr[1], o[i][3] *= corr[1];
            }
            // O += P V: P's A fragment for key step kk from S's n8 tiles 2 kk and 2 kk + 1
#pragma unroll
            for (int kk = 0; kk < FN / 16; ++kk) {
              const uint32_t pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                      pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                      pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
              for (int i = 0; i < DT; i += 2) {  // matrices: (keys 0-7, d tile i), (8-15, i), (0-7, i + 1), (8-15, i + 1)
                uint32_t r[4];
                ldmatrix_x4_trans(r, &sm.v[buf][16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)][8 * (i + (lane >> 4))]);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16_bf16(o[i], pa, b0, o[i]);
                mma_m16n8k16_bf16(o[i + 1], pa, b1, o[i + 1]);
              }
            }
            __syncthreads();  // every warp is done with buffer j & 1 before tile j + 2 overwrites it
          }
          cp_async_wait<0>();
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const float lt = warp_sum<4>(l[hr]);
            const int row = r0 + 8 * hr;
            if (row < n_new) {
              const float inv = 1.0f / lt;
              A* orow = out + static_cast<int64_t>(t0 + row) * (NH * D) + h * D;
#pragma unroll
              for (int i = 0; i < DT; ++i) store_act2(orow + 8 * i + 2 * t4, o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
            }
          }
          unit += gridDim.x;
        }
        seen += tiles;
      }
    }
  }
};

}  // namespace llmc
