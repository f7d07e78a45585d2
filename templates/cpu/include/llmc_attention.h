// llmc CPU target: paged attention over the KV cache.
#pragma once

#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// The KV cache element: float32, or bf16 (uint16_t bits) at half the bytes. A bf16 cache holds each k/v value
// rounded to nearest even when it is written; attention widens it back to float32 (exactly) as it reads.
LLMC_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN: the carry could make it inf
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
LLMC_INLINE void store_kv(float* dst, const float* src, long n) { std::memcpy(dst, src, sizeof(float) * n); }
LLMC_INLINE void store_kv(uint16_t* dst, const float* src, long n) {
  for (long i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// llmc_simd.h's axpy over a bf16 cache row: y[i] += a * x[i], x widened (element-wise: order-free).
template <int N>
LLMC_INLINE void axpy(float a, const uint16_t* LLMC_RESTRICT x, float* LLMC_RESTRICT y) {
  for (int i = 0; i < N; ++i) y[i] += a * bf16_to_f32(x[i]);
}

// paged attention over a ragged batch (docs/contracts.md, "The step").
// 1. Write this step's k/v rows (kv heads [0, NKV) of k/v + t*row_stride) to their cache slots, as KV
//    (float, or uint16_t bf16 bits); a negative slot (padding) is skipped. Cache layout: [num_blocks, BS, NKV, D]
//    each.
// 2. For each query token t of sequence b at position p and each head h: causal attention over
//    cache positions 0..p of b (W > 0, a sliding window: p-W+1..p) through its block table, kv head
//    h / (NH / NKV), online softmax in float32 (one rescale per cache block). One (t, h) is one task:
//    no reduction is split.
template <int NH, int NKV, int D, int BS, int W, typename KV>
inline void paged_attention(const float* q, const float* k, const float* v, int row_stride, KV* k_cache,
                            KV* v_cache, const int64_t* slot_mapping, const int32_t* query_start_loc,
                            const int32_t* seq_lens, const int32_t* block_tables, int max_blocks, int B,
                            float* out, float scale) {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  static_assert(std::is_same_v<KV, float> || std::is_same_v<KV, uint16_t>, "paged_attention: KV is float or bf16");
  constexpr int GROUP = NH / NKV;
  constexpr long SLOT = (long)NKV * D;  // values per cache slot
  const int T = query_start_loc[B];

  parallel_for(T, (long)T * SLOT >= kParallelWork, [&](int t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;
    store_kv(k_cache + slot * SLOT, k + (long)t * row_stride, SLOT);
    store_kv(v_cache + slot * SLOT, v + (long)t * row_stride, SLOT);
  });

  long work = 0;  // rough multiply-adds, to decide whether to go parallel
  for (int b = 0; b < B; ++b) work += (long)(query_start_loc[b + 1] - query_start_loc[b]) * seq_lens[b];
  parallel_for(T * NH, work * NH * D >= kParallelWork, [&](int task) {
    const int t = task / NH, h = task % NH;
    // sequence of token t: the last b with query_start_loc[b] <= t
    const int b = int(std::upper_bound(query_start_loc, query_start_loc + B + 1, t) - query_start_loc) - 1;
    const int n_new = query_start_loc[b + 1] - query_start_loc[b];
    const int ctx = seq_lens[b] - n_new + (t - query_start_loc[b]) + 1;  // positions 0..p
    const int first = W > 0 ? std::max(0, ctx - W) : 0;                   // the window's first position
    const float* qh = q + (long)t * row_stride + h * D;
    const long kvo = (long)(h / GROUP) * D;
    const int32_t* table = block_tables + (long)b * max_blocks;

    float acc[D] = {};
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    for (int j0 = first - first % BS; j0 < ctx; j0 += BS) {
      const int lo = std::max(0, first - j0), n = std::min(BS, ctx - j0);  // this block's positions [lo, n)
      const long base = (long)table[j0 / BS] * BS * SLOT + kvo;
      float sc[BS];
      float mb = m;
      int i = lo;
      for (; i + 4 <= n; i += 4) dot_block<1, 4, D>(qh, 0, k_cache + base + i * SLOT, SLOT, sc + i);
      for (; i < n; ++i) sc[i] = dot<D>(qh, k_cache + base + i * SLOT);
      for (i = lo; i < n; ++i) {
        sc[i] *= scale;
        mb = std::max(mb, sc[i]);
      }
      if (mb > m) {  // new running max: rescale what we have (exp(-inf) = 0 on the first block)
        const float corr = std::exp(m - mb);
        l *= corr;
        scale_inplace<D>(corr, acc);
        m = mb;
      }
      for (int i = lo; i < n; ++i) {
        const float p = std::exp(sc[i] - m);
        l += p;
        axpy<D>(p, v_cache + base + i * SLOT, acc);
      }
    }
    float* o = out + (long)t * NH * D + h * D;
    const float inv = 1.0f / l;
    for (int d = 0; d < D; ++d) o[d] = acc[d] * inv;
  });
}

}  // namespace llmc
