// llmc CPU target: paged attention over the KV cache.
#pragma once

#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// paged attention over a ragged batch (docs/contracts.md, "The step").
// 1. Write this step's k/v rows (kv heads [0, NKV) of k/v + t*row_stride) to their cache slots;
//    a negative slot (padding) is skipped. Cache layout: [num_blocks, BS, NKV, D] each.
// 2. For each query token t of sequence b at position p and each head h: causal attention over
//    cache positions 0..p of b (W > 0, a sliding window: p-W+1..p) through its block table, kv head
//    h / (NH / NKV), online softmax in float32 (one rescale per cache block). One (t, h) is one task:
//    no reduction is split.
template <int NH, int NKV, int D, int BS, int W>
inline void paged_attention(const float* q, const float* k, const float* v, int row_stride, float* k_cache,
                            float* v_cache, const int64_t* slot_mapping, const int32_t* query_start_loc,
                            const int32_t* seq_lens, const int32_t* block_tables, int max_blocks, int B,
                            float* out, float scale) {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  constexpr int GROUP = NH / NKV;
  constexpr long SLOT = (long)NKV * D;  // floats per cache slot
  const int T = query_start_loc[B];

  parallel_for(T, (long)T * SLOT >= kParallelWork, [&](int t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;
    std::memcpy(k_cache + slot * SLOT, k + (long)t * row_stride, sizeof(float) * SLOT);
    std::memcpy(v_cache + slot * SLOT, v + (long)t * row_stride, sizeof(float) * SLOT);
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
