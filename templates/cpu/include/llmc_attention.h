// llmc CPU target: paged attention over the KV cache.
#pragma once

#include "llmc_elementwise.h"
#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// The KV cache element: float32, bf16 (uint16_t bits) at half the bytes, or int8 at a quarter with a float32 scale
// per (position, kv head). A bf16 cache holds each k/v value rounded to nearest even when it is written; attention
// widens it back to float32 (exactly) as it reads. An int8 cache holds a head's row as q = round(x / s) (ties to
// even), s = max |x| / 127 (0 for a zero row), and attention reads q * s: the score of a key is s times its dot
// with q, and a value's softmax weight p becomes p * s.
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

// A cache block (model_abi's kKvBlockBytes): [BS][NKV][D] values, then for int8 [NKV][BS] float scales (a kv head's
// in one run: a cache line at block size 16, which attention reads beside the head's rows), padded to 16 bytes
// (CUDA's rows stay 16-byte aligned). kElems: the KV elements of one block.
template <typename KV, int BS, int NKV, int D>
struct KvLayout {
  static constexpr bool kScaled = std::is_same_v<KV, int8_t>;
  static constexpr long kSlot = (long)NKV * D;  // values per cache slot
  static constexpr long kValues = BS * kSlot;
  static constexpr long kElems = kScaled ? (kValues + (long)sizeof(float) * BS * NKV + 15) / 16 * 16 : kValues;
  // the [NKV][BS] scales of block `block`
  static LLMC_INLINE float* scales(KV* cache, long block) {
    return reinterpret_cast<float*>(cache + block * kElems + kValues);
  }
  static LLMC_INLINE const float* scales(const KV* cache, long block) {
    return reinterpret_cast<const float*>(cache + block * kElems + kValues);
  }
  // One token's k or v rows (NKV heads of D) into cache slot `slot`.
  static LLMC_INLINE void write(KV* cache, int64_t slot, const float* src) {
    const long block = slot / BS, off = slot % BS;
    KV* dst = cache + block * kElems + off * kSlot;
    if constexpr (kScaled) {
      float* scale = scales(cache, block) + off;
      for (int h = 0; h < NKV; ++h) {
        const float* x = src + h * D;
        float amax = 0.0f;
        for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
        const float s = amax / 127.0f;
        for (int d = 0; d < D; ++d) dst[h * D + d] = s > 0.0f ? int8_t(std::nearbyint(x[d] / s)) : int8_t(0);
        scale[h * BS] = s;
      }
    } else {
      store_kv(dst, src, kSlot);
    }
  }
};

// dst[0, D) = src's int8 values times s, float32.
template <int D>
LLMC_INLINE void widen_scaled(const int8_t* LLMC_RESTRICT src, float s, float* LLMC_RESTRICT dst) {
  constexpr int VW = Vec::W, DV = D / VW * VW;
  const Vec sv = Vec::splat(s);
  for (int d = 0; d < DV; d += VW) (Vec::load(src + d) * sv).store(dst + d);
  for (int d = DV; d < D; ++d) dst[d] = float(src[d]) * s;
}

// The vectors of a V row that attend<> accumulates at once for G heads: the largest divisor of the row's nv vectors
// with G x it accumulators, at most half the vector registers (32 with AVX-512, 16 with AVX2).
constexpr int v_chunk(int nv, int g) {
  const int max_acc = Vec::W >= 16 ? 16 : 8;
  for (int c = nv; c > 1; --c)
    if (nv % c == 0 && g * c <= max_acc) return c;
  return 1;
}

// attend<G, ...>: G query heads of one token that share a kv head (q: G rows of D floats, one after another), over
// cache positions [first, ctx) of one sequence through its block table: out (G rows of D) = softmax(q k^T * scale) v,
// each score soft-capped (soft_cap) after the scale when softcap > 0.
// Each K and V row is read once for the G heads. Per head, the same sequence whatever G, T or thread: scores by
// dot_block (a function of D and the data only), an online softmax in float32 with one rescale per cache block
// (the running max m; the sum l gains each block's p as one vector sum), p = exp(score - m) by Vec::exp, and
// acc[d] += p * v[d] over positions in order.
// L: the cache's KvLayout; kvo: the kv head's offset in a slot (head * D).
template <int G, int D, int BS, class L, typename KV>
LLMC_INLINE void attend(const float* LLMC_RESTRICT q, const KV* LLMC_RESTRICT k_cache, const KV* LLMC_RESTRICT v_cache,
                        long kvo, const int32_t* LLMC_RESTRICT table, int first, int ctx, float scale,
                        float softcap, float* LLMC_RESTRICT out) {
  constexpr long SLOT = L::kSlot;
  constexpr int NKV = SLOT / D;
  constexpr int VW = Vec::W;
  constexpr int NP = (BS + VW - 1) / VW * VW;  // a block's scores, padded to whole vectors
  constexpr int C = G <= 4 ? 4 : 2;            // keys per dot_block: G x C accumulators
  constexpr int DV = D / VW * VW;
  constexpr int DC = v_chunk(DV / VW, G);
  alignas(64) float acc[G][D] = {};
  alignas(64) float p[G][NP];
  alignas(64) float kf[L::kScaled ? BS : 1][D];  // an int8 block's K rows, widened
  float m[G], l[G];
  for (int g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.0f;
  for (int j0 = first - first % BS; j0 < ctx; j0 += BS) {
    const int lo = std::max(0, first - j0), n = std::min(BS, ctx - j0);  // this block's positions [lo, n)
    const long block = table[j0 / BS], base = block * L::kElems + kvo;
    // The next block's rows of this kv head, into L2 (prefetch_l2): decode attention over a cold cache 1.08-1.56x
    // faster (benchmarks/cpu_attention.py --baseline, 2-core Zen 4 EPYC).
    if (j0 + BS < ctx) {
      const long next = (long)table[j0 / BS + 1] * L::kElems + kvo;
      for (int r = 0; r < BS; ++r)
        for (int b = 0; b < D * (int)sizeof(KV); b += 64) {
          prefetch_l2(reinterpret_cast<const char*>(k_cache + next + r * SLOT) + b);
          prefetch_l2(reinterpret_cast<const char*>(v_cache + next + r * SLOT) + b);
        }
      if constexpr (L::kScaled) {  // and its scales (1B, 4096 positions, 1 thread: 0.84x a bf16 cache's decode without)
        const long nb = table[j0 / BS + 1];
        for (int b = 0; b < BS * (int)sizeof(float); b += 64) {
          prefetch_l2(reinterpret_cast<const char*>(L::scales(k_cache, nb) + kvo / D * BS) + b);
          prefetch_l2(reinterpret_cast<const char*>(L::scales(v_cache, nb) + kvo / D * BS) + b);
        }
      }
    }
    // int8: each position's k and v scales (their kv head's)
    const float* vs = L::kScaled ? L::scales(v_cache, block) + kvo / D * BS : nullptr;
    // An int8 block's K rows of this kv head as float (q * s), widened once for the G heads, which read them
    // from L1: widening each row per head cost more than the bytes it saves (1B decode at context 4096, 1 thread).
    const std::conditional_t<L::kScaled, float, KV>* krows;
    long kstride = SLOT;
    if constexpr (L::kScaled) {
      const float* ks = L::scales(k_cache, block) + kvo / D * BS;
      for (int r = lo; r < n; ++r) widen_scaled<D>(k_cache + base + r * SLOT, ks[r], kf[r]);
      krows = &kf[0][0], kstride = D;
    } else {
      krows = k_cache + base;
    }
    float s[G * C];
    int i = lo;
#ifdef LLMC_SUM16
    // Whole runs of 16 keys, head by head: 16 accumulators and one sum16 where G x C sums take a shuffle tree
    // each. The same numbers as dot_block<G, C> (a head's K rows come again from L1).
    for (; i + 16 <= n; i += 16)
      for (int g = 0; g < G; ++g) dot_block<1, 16, D>(q + g * D, D, krows + i * kstride, kstride, p[g] + i);
#endif
    for (; i + C <= n; i += C) {
      dot_block<G, C, D>(q, D, krows + i * kstride, kstride, s);
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) p[g][i + c] = s[g * C + c];
    }
    for (; i < n; ++i) {
      dot_block<G, 1, D>(q, D, krows + i * kstride, kstride, s);
      for (int g = 0; g < G; ++g) p[g][i] = s[g];
    }
    // The block's softmax terms, a vector at a time: positions outside [lo, n) score -inf (no part in the max)
    // and end as 0 (none in the sum; the V loop never reads them).
    const Vec vscale = Vec::splat(scale), ninf = Vec::splat(-std::numeric_limits<float>::infinity());
    for (int g = 0; g < G; ++g) {
      Vec mv = ninf;
      if (softcap > 0.0f) {  // soft_cap(-inf) is -softcap: the positions outside are masked after it
        for (i = 0; i < NP; i += VW) soft_cap(Vec::load(p[g] + i) * vscale, softcap).store(p[g] + i);
        for (i = 0; i < lo; ++i) p[g][i] = -std::numeric_limits<float>::infinity();
        for (i = n; i < NP; ++i) p[g][i] = -std::numeric_limits<float>::infinity();
        for (i = 0; i < NP; i += VW) mv = Vec::max(mv, Vec::load(p[g] + i));
      } else {
        for (i = 0; i < lo; ++i) p[g][i] = -std::numeric_limits<float>::infinity();
        for (i = n; i < NP; ++i) p[g][i] = -std::numeric_limits<float>::infinity();
        for (i = 0; i < NP; i += VW) {
          const Vec x = Vec::load(p[g] + i) * vscale;
          x.store(p[g] + i);
          mv = Vec::max(mv, x);
        }
      }
      const float mb = mv.hmax();
      if (mb > m[g]) {  // new running max: rescale what we have (exp(-inf) = 0 on the first block)
        const float corr = std::exp(m[g] - mb);
        l[g] *= corr;
        scale_inplace<D>(corr, acc[g]);
        m[g] = mb;
      }
      const Vec mg = Vec::splat(m[g]);
      for (i = 0; i < NP; i += VW) Vec::exp(Vec::load(p[g] + i) - mg).store(p[g] + i);
      for (i = 0; i < lo; ++i) p[g][i] = 0.0f;  // Vec::exp clamps: exp(-inf) would be 2^-126
      for (i = n; i < NP; ++i) p[g][i] = 0.0f;
      Vec lv = Vec::zero();
      for (i = 0; i < NP; i += VW) lv = lv + Vec::load(p[g] + i);
      l[g] += lv.sum();
    }
    // DC vectors of each of the G rows stay in registers across the block's positions: G x DC independent FMA
    // chains. One vector at a time made each a chain of n dependent FMAs, latency-bound (4 cycles each).
    for (int d = 0; d < DV; d += DC * VW) {
      Vec a[G][DC];
      LLMC_UNROLL for (int g = 0; g < G; ++g) {
        LLMC_UNROLL for (int c = 0; c < DC; ++c) a[g][c] = Vec::load(acc[g] + d + c * VW);
      }
      for (i = lo; i < n; ++i) {
        Vec v[DC];
        LLMC_UNROLL for (int c = 0; c < DC; ++c) v[c] = Vec::load(v_cache + base + i * SLOT + d + c * VW);
        const float vscale = L::kScaled ? vs[i] : 1.0f;
        LLMC_UNROLL for (int g = 0; g < G; ++g) {
          const Vec pg = Vec::splat(L::kScaled ? p[g][i] * vscale : p[g][i]);
          LLMC_UNROLL for (int c = 0; c < DC; ++c) a[g][c].fma(pg, v[c]);
        }
      }
      LLMC_UNROLL for (int g = 0; g < G; ++g) {
        LLMC_UNROLL for (int c = 0; c < DC; ++c) a[g][c].store(acc[g] + d + c * VW);
      }
    }
    for (int d = DV; d < D; ++d) {
      for (i = lo; i < n; ++i) {
        const float v = load_w(v_cache[base + i * SLOT + d]);
        const float vscale = L::kScaled ? vs[i] : 1.0f;
        for (int g = 0; g < G; ++g) acc[g][d] = std::fma(L::kScaled ? p[g][i] * vscale : p[g][i], v, acc[g][d]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
  }
}

// The query heads attend<> takes at once: the largest divisor of the group that is at most 8.
constexpr int attend_heads(int group) {
  for (int g = 8; g > 1; --g)
    if (group % g == 0) return g;
  return 1;
}

// paged attention over a ragged batch (docs/contracts.md, "The step").
// 1. Write this step's k/v rows (kv heads [0, NKV) of k/v + t*row_stride) to their cache slots, as KV
//    (float, uint16_t bf16 bits, or int8 with its scales); a negative slot (padding) is skipped. Cache layout:
//    KvLayout's blocks, [num_blocks, BS, NKV, D] values each.
// 2. For each query token t of sequence b at position p and each head h: causal attention over
//    cache positions 0..p of b (W > 0, a sliding window: p-W+1..p) through its block table, kv head
//    h / (NH / NKV), by attend<>. One (t, kv head, attend_heads heads of its group, or one head) is one task: no
//    reduction is split.
template <int NH, int NKV, int D, int BS, int W, typename KV>
inline void paged_attention(const float* q, const float* k, const float* v, int row_stride, KV* k_cache,
                            KV* v_cache, const int64_t* slot_mapping, const int32_t* query_start_loc,
                            const int32_t* seq_lens, const int32_t* block_tables, int max_blocks, int B,
                            float* out, float scale, float softcap) {
  static_assert(NH % NKV == 0, "paged_attention: num_heads must be a multiple of num_kv_heads");
  static_assert(std::is_same_v<KV, float> || std::is_same_v<KV, uint16_t> || std::is_same_v<KV, int8_t>,
                "paged_attention: KV is float, bf16 or int8");
  using L = KvLayout<KV, BS, NKV, D>;
  constexpr int GROUP = NH / NKV;
  constexpr long SLOT = L::kSlot;
  const int T = query_start_loc[B];

  parallel_for(T, (long)T * SLOT >= kParallelWork, [&](int t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) return;
    L::write(k_cache, slot, k + (long)t * row_stride);
    L::write(v_cache, slot, v + (long)t * row_stride);
  });

  long work = 0;  // rough multiply-adds, to decide whether to go parallel
  for (int b = 0; b < B; ++b) work += (long)(query_start_loc[b + 1] - query_start_loc[b]) * seq_lens[b];
  const bool par = work * NH * D >= kParallelWork;
  auto heads = [&](auto g) {  // tasks of g heads each
    constexpr int G = decltype(g)::value, TASKS = NH / G;  // tasks per token
    parallel_for(T * TASKS, par, [&](int task) {
      const int t = task / TASKS, h = task % TASKS * G;  // heads h..h + G - 1
      // sequence of token t: the last b with query_start_loc[b] <= t
      const int b = int(std::upper_bound(query_start_loc, query_start_loc + B + 1, t) - query_start_loc) - 1;
      const int n_new = query_start_loc[b + 1] - query_start_loc[b];
      const int ctx = seq_lens[b] - n_new + (t - query_start_loc[b]) + 1;  // positions 0..p
      const int first = W > 0 ? std::max(0, ctx - W) : 0;                   // the window's first position
      attend<G, D, BS, L>(q + (long)t * row_stride + h * D, k_cache, v_cache, (long)(h / GROUP) * D,
                             block_tables + (long)b * max_blocks, first, ctx, scale, softcap,
                             out + (long)t * NH * D + h * D);
    });
  };
  // Too few tasks of G heads to keep every thread busy (decode with few kv heads): one head each, so that the
  // threads share the work evenly at the cost of reading each K/V row once per head.
  constexpr int G = attend_heads(GROUP);
  if (G > 1 && par && (long)T * (NH / G) < 2L * pool_threads())
    heads(std::integral_constant<int, 1>{});
  else
    heads(std::integral_constant<int, G>{});
}

}  // namespace llmc
