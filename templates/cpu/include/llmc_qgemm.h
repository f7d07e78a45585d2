// llmc CPU target: the quantized GEMM / GEMV of a linear layer with int8, int6 (Q6_K), int5, int4, int3 (Q3_K) or
// IQ4 weights.
#pragma once

#include <type_traits>
#include <vector>

#include "llmc_elementwise.h"
#include "llmc_pool.h"
#include "llmc_qsimd.h"

namespace llmc {

// qgemm: y[T, N] = x[T, K] @ dequant(w)[N, K]^T (+ bias[N]), w[n, k] = q[n, k] * scale[n, g] - min[n, g],
// g = k / GS (compiler/quant.py; packed layout in compiler/quant_pack.py):
//   BITS 8: qweight row n = K bytes u = q + 128;  BITS 4: K/2 bytes, per 32-element chunk byte j = u[j] | u[j + 16] << 4,
//   u = q + 8 (symmetric) or q (ASYM, with mins);  BITS 6: 3K/4 bytes, per chunk int4's 16 bytes of the low
//   nibbles of u = q + 32, then 8 bytes of the top 2 bits (byte j: element j + 8i's at bits 2i);  BITS 5: 5K/8
//   bytes, per chunk int4's 16 bytes of the low nibbles of u = q + 16 (symmetric) or q (ASYM), then 4 bytes
//   of the fifth bits (bit i of byte r: element 4i + r);  BITS 3 (Q3_K): 3K/8 bytes, per chunk 8 bytes of the low 2
//   bits of u = q + 4 (byte j: element j + 8i's at bits 2i), then the third bits as int5's fifth;  BITS 2 (Q2_K):
//   K/4 bytes, per chunk int3's 8 bytes of u = q (with mins);  BITS kIq4 (IQ4_NL / IQ4_XS's codebook): int4's K/2 bytes,
//   u the index of q's level (kIq4LevelsU);  scales / mins
//   SC [N, ceil(K / GS)], SC float, or uint16_t holding fp16 bits (converted exactly to float in registers as a
//   tile goes; fp16 cuts int4 g32's bytes by 10%), or KScales: the K-quants' superblock records [N, K / 256],
//   which hold the mins (mins null; see KScales), or KScales6: Q6_K's records [N, K / 256] (int6 and int3, GS 16), or
//   Iq4Scales: IQ4_XS's [N, K / 256], or KScales2: Q2_K's [N, K / 256], which hold the mins (int2, GS 16).
//
// Activations are quantized to int8 first, llama.cpp Q8_0-style: per block of 32 of a row, d = amax / 127,
// q = round-to-nearest-even(x * (127 / amax)) in [-127, 127] (so the AVX2 sign trick below never meets
// -128). The manifest records this as "activations": "int8 per 32". The dot products are then exact
// integer sums, turned into float once per block.
//
// Numerics. A row is walked in steps: int8, int6, int5, int3, int2 and IQ4, one block of 32; int4, a pair of blocks (2i, 2i + 1), whose 16
// packed bytes each load as one 32-byte vector (the second block absent at an odd tail). Each step gives
// 8 int32 lanes P[l], exact: int8 / int6 / int5 / int3 / int2 / IQ4, lane l sums elements 4l..4l+3 of the block; int4, lanes 0-3 hold block
// 2i and lanes 4-7 block 2i + 1, lane l sums elements {4l', 16 + 4l'} + 0..3 (l' = l % 4). DX[l] is the
// lane's activation scale, S[l] its weight scale. When a step spans two weight groups (int8 g16, int4 g32):
// acc[l] += float(P[l]) * (DX[l] * S[l]) per step. Otherwise, per group g in order: gacc[l] = sum over the
// group's steps of float(P[l]) * DX[l], then acc[l] += gacc[l] * S_g (one multiply-add per group, not per
// step: per-channel int8 has one group). Each += is an FMA where the ISA has one. Then y = hsum(acc) (one
// fixed tree) - sum over pieces b of min[g(b)] * xs[b] (ASYM; xs[b] = d * sum of q over piece b: a block of
// 32, or for 16-element groups each half of one; summed 8 pieces a vector FMA and one hsum where each piece has
// its own min, as K-quant records' do, else in row order: min_term) + bias. Every (row, output) is computed by that one sequence whatever T, the tile it lands in,
// or the thread: results never depend on them.
// The AVX2, AVX-VNNI and AVX-512 VNNI paths differ only in how they form the exact integer P, so they
// agree bit for bit (so does the AVX-512 VNNI prefill, LLMC_QGEMM_PAIRS: two rows per zmm); the portable path
// may differ from them in FMA contraction only.
//
// Work split: T <= kQgemmRows (decode) is a GEMV in tasks of ~kQgemvTaskBytes of packed
// weights, each streamed once by its thread, kQgemmCols rows in flight, prefetched kQgemvPrefetchBytes
// ahead; larger T (prefill) runs register tiles of kQgemmRows rows x kQgemmCols outputs (on AVX-512 VNNI with
// symmetric weights, kQgemmPairRows row pairs x kQgemmPairCols) over blocks of kQgemmTChunk rows x
// ~kQgemmBlockBytes of weights (kept in L2).

// BITS of the codebook types IQ4_NL and IQ4_XS: not a width but a kind (4 bits an element, an index into
// kIq4LevelsU); their steps are int8's, one block of 32 decoded by a byte shuffle (qsimd::decode_iq4).
constexpr int kIq4 = 104;
constexpr int stored_bits(int bits) { return bits == kIq4 ? 4 : bits; }
// The u a q of 0 is stored as (u = q + it): half the range for symmetric widths, 0 with mins but for int8 (always
// q + 128); IQ4's decoded u (level + 128) as int8's.
template <int BITS, bool ASYM>
constexpr int kZeroU = BITS == 8 || BITS == kIq4 ? 128 : ASYM ? 0 : 1 << (BITS - 1);
// A 32-element chunk of the widths whose steps are int8's (int6, int5, int3, int2, IQ4) -> its u in order.
template <int BITS>
LLMC_INLINE qsimd::Bytes decode_chunk(const uint8_t* p) {
  if constexpr (BITS == 6)
    return qsimd::decode6(p);
  else if constexpr (BITS == 5)
    return qsimd::decode5(p);
  else if constexpr (BITS == 3)
    return qsimd::decode3(p);
  else if constexpr (BITS == 2)
    return qsimd::decode2(p);
  else
    return qsimd::decode_iq4(p);
}

constexpr int kQgemmRows = 4;
constexpr int kQgemmCols = 2;  // 4 x 2 float accumulators + 2 weight vectors + temporaries in 16 ymm registers
// Outputs in flight at T = 1 (decode at batch 1), each one's weight row its own stream: tunable (qgemm.tune.toml
// gemv_cols). 4 keeps more misses in flight: int4 from DRAM at K = 2048-8192 1.04-1.18x, at K = 576 0.95-0.98x;
// int8 at K = 8192 0.93x (2-core Xeon, benchmarks/cpu_qgemm.py --only gemv,gemv1b).
constexpr int kQgemvCols = 2;
constexpr long kQgemvTaskBytes = 32 * 1024;  // packed weights + scales per parallel task in decode
constexpr int kQgemvPrefetchBytes = 16 * 1024;
constexpr int kQgemmTChunk = 64;
constexpr long kQgemmBlockBytes = 128 * 1024;

// ---------------------------------------------------------------------------------------------
// The quantized activations of one row, step by step (see Numerics): x bytes in the order the step's
// weight vectors hold their elements, the 8 lanes' activation scales, and for int4 symmetric -8 x the lane
// sums of x (u = q + 8, so sum x * q = sum x * u - 8 * sum x; int8's -128 x them, the kernels form from x:
// one 64-byte step stays one cache line).
template <int BITS>
struct QStep;
template <>
struct QStep<8> {
  int8_t x[32];
  float dx[8];
};
template <>
struct QStep<6> : QStep<8> {};  // int6 and int5 steps are int8's: one block of 32 in order
template <>
struct QStep<5> : QStep<8> {};
template <>
struct QStep<3> : QStep<8> {};
template <>
struct QStep<2> : QStep<8> {};
template <>
struct QStep<kIq4> : QStep<8> {};
template <>
struct QStep<4> {
  int8_t x[64];  // xlo = [block 2i elements 0..15, block 2i + 1 elements 0..15], xhi = the elements 16..31
  float dx[8];
  int32_t neg8[8];
};

template <int K, int BITS, int GS>
struct QShape {
  static_assert(K % 32 == 0, "qgemm: K must be a multiple of 32");
  static_assert(BITS == 8 || BITS == 6 || BITS == 5 || BITS == 4 || BITS == 3 || BITS == 2 || BITS == kIq4,
                "qgemm: 8, 6, 5, 4, 3, 2 bits or IQ4");
  static_assert(GS == 16 || GS % 32 == 0, "qgemm: group size 16 or a multiple of 32");
  static constexpr int NB = K / 32;                     // blocks of 32 per row
  static constexpr int NS = BITS == 4 ? (NB + 1) / 2 : NB;  // steps per row
  static constexpr int G = (K + GS - 1) / GS;               // groups per row
  static constexpr long RB = (long)K * stored_bits(BITS) / 8;  // packed bytes per row
  static constexpr int SE = BITS == 4 ? 64 : 32;            // row elements per step
  static constexpr int SB = BITS == 4 ? 32 : 4 * stored_bits(BITS);  // packed bytes per step
  // The two weight-scale groups of a step's lanes 0-3 and 4-7 differ for int8 / int6 g16 and int4 g32.
  static constexpr bool SPLIT = GS < SE;
  static LLMC_INLINE int group_lo(int s) { return s * SE / GS; }
  static constexpr int XU = GS < 32 ? GS : 32;  // elements per xs piece (ASYM): one weight group's min each
  static constexpr int NX = K / XU;             // xs pieces per row
};

// Quantize row x[K] into steps[NS] and xs[NX] (d * sum of q, per piece; ASYM only).
template <int K, int BITS, int GS, bool ASYM>
inline void quantize_row_q8(const float* LLMC_RESTRICT x, QStep<BITS>* LLMC_RESTRICT steps, float* LLMC_RESTRICT xs) {
  constexpr int NB = K / 32, XU = QShape<K, BITS, GS>::XU;
  int8_t q[32];
  for (int b = 0; b < NB; ++b) {
    const float* xb = x + 32 * b;
    const float amax = qsimd::absmax32(xb);
    const float d = amax / 127.0f;
    qsimd::round32(xb, amax != 0.0f ? 127.0f / amax : 0.0f, q);
    if constexpr (ASYM) {
      for (int h = 0; h < 32 / XU; ++h) {
        int sum = 0;
        for (int i = h * XU; i < (h + 1) * XU; ++i) sum += q[i];
        xs[b * (32 / XU) + h] = d * float(sum);
      }
    }
    if constexpr (BITS != 4) {
      std::memcpy(steps[b].x, q, 32);
      for (float& f : steps[b].dx) f = d;
    } else {
      QStep<4>& s = steps[b / 2];
      const int h = b % 2;  // which half of the step's lanes
      if (h == 0) std::memset(&s, 0, sizeof s);  // an odd tail keeps zeros in its second half
      std::memcpy(s.x + 16 * h, q, 16);
      std::memcpy(s.x + 32 + 16 * h, q + 16, 16);
      for (int l = 0; l < 4; ++l) s.dx[4 * h + l] = d;
      if (h == 1 || b == NB - 1) {  // the step is complete: its lanes' sums of x times -8
        const qsimd::Bytes e8 = qsimd::splat_bytes(8);
        const qsimd::Ints sum8 = qsimd::dot_nib(qsimd::zero_ints(), e8, qsimd::load32(s.x), e8, qsimd::load32(s.x + 32));
        qsimd::store_ints(s.neg8, qsimd::sub(qsimd::zero_ints(), sum8));
      }
    }
  }
}

// The mins' term an ASYM result subtracts (see Numerics), for one row's xs x and one output's mins m as floats.
// Where each piece has its own min (groups of 16 or 32, K-quant records' too): 8 independent sums, a vector FMA
// per 8 pieces, then the scalar tail (one FMA chain took longer than the dot: 128 dependent FMAs a result at
// K = 2048, g16); else the scalar sum in row order. qdot_tile's K-quant path forms the same sum beside its
// records' scales, so that a record is decoded once; the row-pair prefill subtracts it after its tile, from
// mins decoded once per task.
template <int K, int BITS, int GS>
LLMC_INLINE float min_term(const float* LLMC_RESTRICT x, const float* LLMC_RESTRICT m) {
  using S = QShape<K, BITS, GS>;
  if constexpr (GS == S::XU) {
    constexpr int V = S::NX / 8 * 8;
    qsimd::Floats acc = qsimd::zero_floats();
    for (int b = 0; b < V; b += 8) acc = qsimd::fma(qsimd::load_floats(m + b), qsimd::load_floats(x + b), acc);
    float sm = qsimd::hsum(acc);
    for (int b = V; b < S::NX; ++b) sm = qsimd::madd(m[b], x[b], sm);
    return sm;
  } else {
    float sm = 0.0f;
    // an explicit FMA: left to contraction, tiles of different R vectorized this loop differently
    for (int b = 0; b < S::NX; ++b) sm = qsimd::madd(m[b * S::XU / GS], x[b], sm);
    return sm;
  }
}

// out[r * C + c] = the (row t0 + r, output j + c) result before bias, r < R, c < C (see Numerics). ZU: the u of q = 0,
// the width's own but where BITS 8 reads a narrower width widened to bytes (widen_to_bytes keeps its u).
template <int R, int C, int K, int BITS, int GS, bool ASYM, int PF, int ZU = kZeroU<BITS, ASYM>, typename SC>
LLMC_INLINE void qdot_tile(const QStep<BITS>* LLMC_RESTRICT steps, const float* LLMC_RESTRICT xs,
                           const uint8_t* LLMC_RESTRICT w, const SC* LLMC_RESTRICT scales,
                           const SC* LLMC_RESTRICT mins, int j, float* LLMC_RESTRICT out) {
  using S = QShape<K, BITS, GS>;
  using namespace qsimd;
  Floats acc[R][C];
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = zero_floats();
  }
  const uint8_t* wr = w + (long)j * S::RB;
  constexpr bool HALF = std::is_same_v<SC, uint16_t>;
  // K-quant records: decoded in registers a record (8 groups) at a time; their mins' term summed 8 groups a
  // vector (kq_record), where the other schemes sum min * xs one piece at a time after the tile
  constexpr bool KQ = std::is_same_v<SC, KScales>;
  static_assert(!KQ || (GS == 32 && ASYM && S::G % 8 == 0), "qgemm: K-quant records need K % 256 == 0");
  // Q6_K records: decoded in registers a record (16 groups, 8 steps) at a time
  constexpr bool KQ6 = std::is_same_v<SC, KScales6>;
  static_assert(!KQ6 || (GS == 16 && !ASYM && S::G % 16 == 0), "qgemm: Q6_K records need K % 256 == 0");
  // Q2_K records: as Q6_K's, with their mins' term summed as K-quant records' (kq_record)
  constexpr bool KQ2 = std::is_same_v<SC, KScales2>;
  static_assert(!KQ2 || (GS == 16 && ASYM && S::G % 16 == 0), "qgemm: Q2_K records need K % 256 == 0");
  constexpr bool RECORD_MINS = KQ || KQ2;
  // IQ4_XS records: a record's 8 scales decoded in registers as its first group is reached
  constexpr bool IQ4R = std::is_same_v<SC, Iq4Scales>;
  static_assert(!IQ4R || (GS == 32 && !ASYM && S::G % 8 == 0), "qgemm: IQ4_XS records need K % 256 == 0");
  static_assert((BITS != 6 && BITS != 3 && BITS != kIq4) || !ASYM, "qgemm: int6, int3 and IQ4 weights are symmetric");
  constexpr int SROW = S::G / groups_per_scale<SC>;  // a row's scales: G values, or its records
  const SC* sp = scales + (long)j * SROW;
  float mbuf[HALF && ASYM ? C * S::G : 1];
  const float* mr = nullptr;
  if constexpr (ASYM && !RECORD_MINS) mr = scales_as_float(mins + (long)j * S::G, C * S::G, mbuf);
  Floats k8[KQ ? C : 1], macc[RECORD_MINS ? R : 1][RECORD_MINS ? C : 1];  // a record's scales; the mins' term
  if constexpr (RECORD_MINS) {
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      LLMC_UNROLL for (int c = 0; c < C; ++c) macc[r][c] = zero_floats();
    }
  }
  // output c's record of groups g..g + 7 (g % 8 == 0) into k8[c], its mins times the rows' xs into macc
  auto kq_record = [&](int c, int g) {
    if constexpr (KQ) {
      Floats m8;
      k8[c] = kscales8(sp[c * SROW + g / 8], m8);
      LLMC_UNROLL for (int r = 0; r < R; ++r) macc[r][c] = fma(m8, load_floats(xs + (long)r * S::NX + g), macc[r][c]);
    }
  };
  constexpr int SB = S::SB;
  constexpr bool ODD_TAIL = BITS == 4 && S::NB % 2 == 1;
  constexpr int FULL = ODD_TAIL ? S::NS - 1 : S::NS;
  // One step: into(r, c, P, DX) for every (row, output), with P the step's integer lanes and DX the lanes'
  // activation scales.
  auto step = [&](int s, auto tail, auto into) {
    Bytes wlo[C], whi[C];
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const uint8_t* p = wr + c * S::RB + (long)s * SB;
      if constexpr (PF > 0 && BITS != 8 && BITS != 4) {
        if ((s * SB) % 64 < SB) __builtin_prefetch(p + PF, 0, 3);  // one per 64-byte line the step starts
      } else if constexpr (PF > 0) {
        if (s % 2 == 0) {  // one per 64-byte line: in address order over a tile shorter than PF (llmc_gemm.h)
          // Into L1, unlike the dense GEMV's prefetch_l2: into L2 measured mixed per kernel (int8 at K = 576
          // 0.65-0.75x, int4 1.05-1.18x, both 1.4-1.6x at K = 8192) and within noise end to end on SmolLM-135M
          // (2-core Zen 4 EPYC).
          constexpr bool kAddressOrder = (long)C * S::RB < PF;
          __builtin_prefetch((kAddressOrder ? wr + ((long)(s / 2) * C + c) * 64 : p) + PF, 0, 3);
        }
      }
      if constexpr (BITS == 8) {
        wlo[c] = load32(p);
      } else if constexpr (BITS != 4) {
        wlo[c] = decode_chunk<BITS>(p);
      } else if constexpr (decltype(tail)::value) {
        nibbles16(p, wlo[c], whi[c]);
      } else {
        nibbles32(p, wlo[c], whi[c]);
      }
    }
    LLMC_UNROLL for (int r = 0; r < R; ++r) {
      const QStep<BITS>& a = steps[(long)r * S::NS + s];
      const Floats dx = load_floats(a.dx);
      if constexpr (BITS != 4) {
        const Bytes xv = load32(a.x);
        const Ints base = neg_bias_of<ZU>(xv);
        LLMC_UNROLL for (int c = 0; c < C; ++c) into(r, c, dot_biased<ZU>(base, wlo[c], xv), dx);
      } else {
        const Ints base = ASYM ? zero_ints() : load_ints(a.neg8);
        const Bytes xlo = load32(a.x), xhi = load32(a.x + 32);
        LLMC_UNROLL for (int c = 0; c < C; ++c) into(r, c, dot_nib(base, wlo[c], xlo, whi[c], xhi), dx);
      }
    }
  };
  if constexpr (S::SPLIT) {
    // a step spans two groups: acc += P * (DX * S), S = [scale of lanes 0-3 | of lanes 4-7]
    if constexpr (KQ6) {
      // a record's 8 steps unrolled: its pairs of scales are fixed lanes
      for (int s0 = 0; s0 < FULL; s0 += 8) {
        Floats k16[C][2];
        LLMC_UNROLL for (int c = 0; c < C; ++c) kscales16(sp[c * SROW + s0 / 8], k16[c][0], k16[c][1]);
        LLMC_UNROLL for (int i = 0; i < 8; ++i) {
          Floats sc[C];
          LLMC_UNROLL for (int c = 0; c < C; ++c) sc[c] = pair(k16[c][i / 4], i % 4);
          step(s0 + i, std::false_type{}, [&](int r, int c, Ints p, Floats dx) {
            acc[r][c] = fma_ints(p, mul(dx, sc[c]), acc[r][c]);
          });
        }
      }
    } else if constexpr (KQ2) {
      // as KQ6's, the record's 16 mins times the rows' xs into macc as it is reached
      for (int s0 = 0; s0 < FULL; s0 += 8) {
        Floats k16[C][2];
        LLMC_UNROLL for (int c = 0; c < C; ++c) {
          Floats m16[2];
          kscales2(sp[c * SROW + s0 / 8], k16[c], m16);
          LLMC_UNROLL for (int r = 0; r < R; ++r) {
            const float* x = xs + (long)r * S::NX + 2 * s0;
            macc[r][c] = fma(m16[1], load_floats(x + 8), fma(m16[0], load_floats(x), macc[r][c]));
          }
        }
        LLMC_UNROLL for (int i = 0; i < 8; ++i) {
          Floats sc[C];
          LLMC_UNROLL for (int c = 0; c < C; ++c) sc[c] = pair(k16[c][i / 4], i % 4);
          step(s0 + i, std::false_type{}, [&](int r, int c, Ints p, Floats dx) {
            acc[r][c] = fma_ints(p, mul(dx, sc[c]), acc[r][c]);
          });
        }
      }
    } else if constexpr (KQ) {
      // a record's 4 steps unrolled: its pairs of scales are fixed lanes
      for (int s0 = 0; s0 < FULL; s0 += 4) {
        LLMC_UNROLL for (int c = 0; c < C; ++c) kq_record(c, 2 * s0);
        LLMC_UNROLL for (int i = 0; i < 4; ++i) {
          Floats sc[C];
          LLMC_UNROLL for (int c = 0; c < C; ++c) sc[c] = pair(k8[c], i);
          step(s0 + i, std::false_type{}, [&](int r, int c, Ints p, Floats dx) {
            acc[r][c] = fma_ints(p, mul(dx, sc[c]), acc[r][c]);
          });
        }
      }
    } else {
      for (int s = 0; s < FULL; ++s) {
        Floats sc[C];
        LLMC_UNROLL for (int c = 0; c < C; ++c) sc[c] = splat2(sp + c * S::G + S::group_lo(s));  // groups 2s, 2s + 1
        step(s, std::false_type{}, [&](int r, int c, Ints p, Floats dx) {
          acc[r][c] = fma_ints(p, mul(dx, sc[c]), acc[r][c]);
        });
      }
    }
    if constexpr (ODD_TAIL) {
      Floats sc[C];
      LLMC_UNROLL for (int c = 0; c < C; ++c) sc[c] = splat(scale_value(sp[c * S::G + S::group_lo(S::NS - 1)]));
      step(S::NS - 1, std::true_type{}, [&](int r, int c, Ints p, Floats dx) {
        acc[r][c] = fma_ints(p, mul(dx, sc[c]), acc[r][c]);
      });
    }
  } else {
    // whole steps per group: gacc = sum of P * DX over the group's steps, then acc += gacc * S
    constexpr int SPG = GS / S::SE;
    Floats s8[C];  // fp16 scales or an IQ4_XS record: groups g - g % 8 .. + 7 of each output, as floats
    for (int g = 0; g < S::G; ++g) {
      Floats gacc[R][C];
      LLMC_UNROLL for (int r = 0; r < R; ++r) {
        LLMC_UNROLL for (int c = 0; c < C; ++c) gacc[r][c] = zero_floats();
      }
      auto into = [&](int r, int c, Ints p, Floats dx) { gacc[r][c] = fma_ints(p, dx, gacc[r][c]); };
      const int s1 = std::min(FULL, (g + 1) * SPG);
      for (int s = g * SPG; s < s1; ++s) step(s, std::false_type{}, into);
      if constexpr (ODD_TAIL) {
        if (g == S::G - 1) step(S::NS - 1, std::true_type{}, into);
      }
      LLMC_UNROLL for (int c = 0; c < C; ++c) {
        Floats sc;
        if constexpr (KQ) {
          if (g % 8 == 0) kq_record(c, g);
          sc = lane(k8[c], g % 8);
        } else if constexpr (IQ4R) {
          if (g % 8 == 0) s8[c] = iq4_scales8(sp[c * SROW + g / 8]);
          sc = lane(s8[c], g % 8);
        } else if constexpr (HALF) {
          if (g % 8 == 0) s8[c] = widen8(sp + c * S::G + g, std::min(8, S::G - g));
          sc = lane(s8[c], g % 8);
        } else {
          sc = splat(sp[c * S::G + g]);
        }
        LLMC_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = fma(gacc[r][c], sc, acc[r][c]);
      }
    }
  }
  LLMC_UNROLL for (int r = 0; r < R; ++r) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      float y = hsum(acc[r][c]);
      if constexpr (RECORD_MINS) {
        y -= hsum(macc[r][c]);
      } else if constexpr (ASYM) {
        y -= min_term<K, BITS, GS>(xs + (long)r * S::NX, mr + c * S::G);
      }
      out[r * C + c] = y;
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define LLMC_QGEMM_PAIRS 1
// Prefill on AVX-512 VNNI: the same sequence as qdot_tile, two rows per 512-bit vector (row 2p in lanes 0-7, row
// 2p + 1 in lanes 8-15, each output's weights in both halves), so each instruction does the work of two ymm ones.
// The integer lanes are formed as in qdot_tile's VNNI path: P = dpbusd(-ZU * sum4(x), u, x) for bytes (ZU: 128 for
// int8, a widened width's own u of q = 0; -ZU * sum4(x) once per row pair and step), dpbusd twice from -8 * sum4(x)
// over the nibbles for int4 (from 0 with mins: u is q). Scales come as floats (scales_as_float: fp16 ones and
// K-quant records decoded once per task); with mins, qgemm_pairs_rows subtracts each result's min_term after the
// tile.
template <int BITS>
struct QPair;
template <>
struct QPair<8> {
  int8_t x[64];  // QStep<8>'s x of rows 2p, 2p + 1
  float dx[16];  // their lanes' activation scales
};
template <>
struct QPair<4> {
  int8_t xlo[64], xhi[64];  // QStep<4>'s x halves of rows 2p, 2p + 1
  float dx[16];
  int32_t neg8[16];
};
constexpr int kQgemmPairRows = 2;  // row pairs per register tile
constexpr int kQgemmPairCols = 4;  // outputs per register tile: 2 x 4 accumulators (+ 2 x 4 per group) in 32 zmm

// steps of rows [0, T) -> pairs[(t / 2) * NS + s]; an absent odd row is x = 0 with scale 0.
template <int BITS, int NS>
inline void qpack_pairs(const QStep<BITS>* steps, int T, QPair<BITS>* pairs) {
  for (int t = 0; t < T; t += 2) {
    for (int s = 0; s < NS; ++s) {
      QPair<BITS>& q = pairs[(long)(t / 2) * NS + s];
      for (int h = 0; h < 2; ++h) {
        const bool real = t + h < T;
        const QStep<BITS>& a = steps[(long)(real ? t + h : t) * NS + s];
        if constexpr (BITS == 8) {
          for (int i = 0; i < 32; ++i) q.x[32 * h + i] = real ? a.x[i] : 0;
        } else {
          for (int i = 0; i < 32; ++i) q.xlo[32 * h + i] = real ? a.x[i] : 0;
          for (int i = 0; i < 32; ++i) q.xhi[32 * h + i] = real ? a.x[32 + i] : 0;
          for (int l = 0; l < 8; ++l) q.neg8[8 * h + l] = real ? a.neg8[l] : 0;
        }
        for (int l = 0; l < 8; ++l) q.dx[8 * h + l] = real ? a.dx[l] : 0.0f;
      }
    }
  }
}

// out[r * C + c], r < 2 RP, c < C: as qdot_tile<2 RP, C, K, BITS, GS, ASYM> gives them before the mins' term;
// pairs: RP row pairs of stride NS.
template <int RP, int C, int K, int BITS, int GS, bool ASYM, int ZU>
LLMC_INLINE void qdot_pairs_tile(const QPair<BITS>* LLMC_RESTRICT pairs, const uint8_t* LLMC_RESTRICT w,
                                 const float* LLMC_RESTRICT scales, int j, float* LLMC_RESTRICT out) {
  using S = QShape<K, BITS, GS>;
  constexpr bool ODD_TAIL = BITS == 4 && S::NB % 2 == 1;
  constexpr int FULL = ODD_TAIL ? S::NS - 1 : S::NS;
  __m512 acc[RP][C];
  LLMC_UNROLL for (int p = 0; p < RP; ++p) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) acc[p][c] = _mm512_setzero_ps();
  }
  const uint8_t* wr = w + (long)j * S::RB;
  const float* sr = scales + (long)j * S::G;
  // One step: into(p, c, P, DX) for every (row pair, output).
  auto step = [&](int s, bool tail, auto into) {
    __m512i wa[C], wb[C];  // int8: u (wb unused); int4: low nibbles, high nibbles
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const uint8_t* q = wr + c * S::RB + 32L * s;
      if constexpr (BITS == 8) {
        wa[c] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      } else {
        // the last chunk of an odd count: 16 bytes (32 could pass the end of the matrix), zeros after
        const __m512i b = tail ? _mm512_broadcast_i64x4(_mm256_zextsi128_si256(
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))))
                               : _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
        const __m512i m = _mm512_set1_epi8(0x0F);
        wa[c] = _mm512_and_si512(b, m);
        wb[c] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
      }
    }
    LLMC_UNROLL for (int p = 0; p < RP; ++p) {
      const QPair<BITS>& a = pairs[(long)p * S::NS + s];
      const __m512 dx = _mm512_loadu_ps(a.dx);
      if constexpr (BITS == 8) {
        const __m512i zero = _mm512_setzero_si512(), xv = _mm512_loadu_si512(a.x);
        const __m512i base =
            ZU == 0 ? zero : _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(int8_t(ZU)), xv));
        LLMC_UNROLL for (int c = 0; c < C; ++c) into(p, c, _mm512_dpbusd_epi32(base, wa[c], xv), dx);
      } else {
        const __m512i base = ASYM ? _mm512_setzero_si512() : _mm512_loadu_si512(a.neg8);
        const __m512i xlo = _mm512_loadu_si512(a.xlo), xhi = _mm512_loadu_si512(a.xhi);
        LLMC_UNROLL for (int c = 0; c < C; ++c)
          into(p, c, _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(base, wa[c], xlo), wb[c], xhi), dx);
      }
    }
  };
  if constexpr (S::SPLIT) {
    // a step spans two groups: acc += P * (DX * S), S = [scale of lanes 0-3 | of lanes 4-7] in both halves
    auto split = [&](int s, bool tail) {
      __m512 sc[C];
      LLMC_UNROLL for (int c = 0; c < C; ++c) {
        const float* sg = sr + c * S::G + S::group_lo(s);
        sc[c] = tail ? _mm512_set1_ps(sg[0])
                     : _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(qsimd::splat2(sg))));
      }
      step(s, tail, [&](int p, int c, __m512i P, __m512 dx) {
        acc[p][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), _mm512_mul_ps(dx, sc[c]), acc[p][c]);
      });
    };
    for (int s = 0; s < FULL; ++s) split(s, false);
    if constexpr (ODD_TAIL) split(S::NS - 1, true);
  } else {
    // whole steps per group: gacc = sum of P * DX over the group's steps, then acc += gacc * S
    constexpr int SPG = GS / S::SE;
    for (int g = 0; g < S::G; ++g) {
      __m512 gacc[RP][C];
      LLMC_UNROLL for (int p = 0; p < RP; ++p) {
        LLMC_UNROLL for (int c = 0; c < C; ++c) gacc[p][c] = _mm512_setzero_ps();
      }
      auto into = [&](int p, int c, __m512i P, __m512 dx) {
        gacc[p][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), dx, gacc[p][c]);
      };
      const int s1 = std::min(FULL, (g + 1) * SPG);
      for (int s = g * SPG; s < s1; ++s) step(s, false, into);
      if constexpr (ODD_TAIL) {
        if (g == S::G - 1) step(S::NS - 1, true, into);
      }
      LLMC_UNROLL for (int c = 0; c < C; ++c) {
        const __m512 sc = _mm512_set1_ps(sr[c * S::G + g]);
        LLMC_UNROLL for (int p = 0; p < RP; ++p) acc[p][c] = _mm512_fmadd_ps(gacc[p][c], sc, acc[p][c]);
      }
    }
  }
  LLMC_UNROLL for (int p = 0; p < RP; ++p) {
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      out[(2 * p) * C + c] = qsimd::hsum(_mm512_castps512_ps256(acc[p][c]));
      out[(2 * p + 1) * C + c] = qsimd::hsum(_mm512_extractf32x8_ps(acc[p][c], 1));
    }
  }
}

// Rows [0, 2 RP) (pairs from row 0; rows: how many are real; xs: theirs, ASYM) x outputs [j0, j1), stored with bias;
// scales (and mins, ASYM: for each result's min_term) as floats.
template <int RP, int LDY, int K, int BITS, int GS, bool ASYM, bool HAS_BIAS, int ZU>
LLMC_INLINE void qgemm_pairs_rows(int rows, const QPair<BITS>* pairs, const float* xs, const uint8_t* w,
                                  const float* scales, const float* mins, const float* bias, float* y, int j0, int j1) {
  using S = QShape<K, BITS, GS>;
  auto tile = [&](auto cols, int j) {
    constexpr int C = decltype(cols)::value;
    float s[2 * RP * C];
    qdot_pairs_tile<RP, C, K, BITS, GS, ASYM, ZU>(pairs, w, scales, j, s);
    if constexpr (ASYM) {
      for (int r = 0; r < rows; ++r) {
        LLMC_UNROLL for (int c = 0; c < C; ++c)
          s[r * C + c] -= min_term<K, BITS, GS>(xs + (long)r * S::NX, mins + (long)(j + c) * S::G);
      }
    }
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const float b = HAS_BIAS ? bias[j + c] : 0.0f;
      for (int r = 0; r < rows; ++r) y[(long)r * LDY + j + c] = HAS_BIAS ? s[r * C + c] + b : s[r * C + c];
    }
  };
  int j = j0;
  for (; j + kQgemmPairCols <= j1; j += kQgemmPairCols) tile(std::integral_constant<int, kQgemmPairCols>{}, j);
  for (; j < j1; ++j) tile(std::integral_constant<int, 1>{}, j);
}
#else
#define LLMC_QGEMM_PAIRS 0
#endif


namespace {  // internal linkage: each model.so has its own buffers (see the pool in llmc_pool.h)
// The quantized activations of a call (USE: as steps, or packed in row pairs for LLMC_QGEMM_PAIRS), 64-byte
// aligned, reused by the next call on the same thread.
enum { kQScratchSteps, kQScratchPairs, kQScratchScales, kQScratchMins, kQScratchTwoPass, kQScratchWiden };
template <int USE>
LLMC_INLINE unsigned char* qgemm_scratch(size_t bytes) {
  thread_local std::vector<unsigned char> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  return buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
}
}  // namespace

// rows [0, n) of int5 / int6 / int3 / int2 / IQ4 packed weights w as bytes of their u in order, K a row: int8's layout,
// read by BITS 8 tiles with ZU the width's u of q = 0. The u stay small but IQ4's (level + 128), so without VNNI
// their dots skip the sign trick (qsimd::dot_biased).
template <int K, int BITS>
inline void widen_to_bytes(const uint8_t* LLMC_RESTRICT w, int n, uint8_t* LLMC_RESTRICT out) {
  using S = QShape<K, BITS, 32>;
  for (long r = 0; r < n; ++r) {
    for (int c = 0; c < S::NB; ++c) qsimd::store32(out + r * K + 32 * c, decode_chunk<BITS>(w + r * S::RB + (long)c * S::SB));
  }
}

template <int R, int LDY, int K, int BITS, int GS, bool ASYM, bool HAS_BIAS, int PF, int GEMV_COLS, int ZU, typename SC>
LLMC_INLINE void qgemm_tile_rows(const QStep<BITS>* steps, const float* xs, const uint8_t* w, const SC* scales,
                                 const SC* mins, const float* bias, float* y, int j0, int j1) {
  constexpr int C = R == 1 ? GEMV_COLS : kQgemmCols;
  int j = j0;
  for (; j + C <= j1; j += C) {
    float s[R * C];
    qdot_tile<R, C, K, BITS, GS, ASYM, PF, ZU>(steps, xs, w, scales, mins, j, s);
    LLMC_UNROLL for (int c = 0; c < C; ++c) {
      const float b = HAS_BIAS ? bias[j + c] : 0.0f;
      LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * LDY + j + c] = HAS_BIAS ? s[r * C + c] + b : s[r * C + c];
    }
  }
  for (; j < j1; ++j) {
    float s[R];
    qdot_tile<R, 1, K, BITS, GS, ASYM, PF, ZU>(steps, xs, w, scales, mins, j, s);
    LLMC_UNROLL for (int r = 0; r < R; ++r) y[(long)r * LDY + j] = HAS_BIAS ? s[r] + bias[j] : s[r];
  }
}

template <int LDY, int K, int BITS, int GS, bool ASYM, bool HAS_BIAS, int PF, int GEMV_COLS,
          int ZU = kZeroU<BITS, ASYM>, typename SC>
LLMC_INLINE void qgemm_rows(int rows, const QStep<BITS>* steps, const float* xs, const uint8_t* w,
                            const SC* scales, const SC* mins, const float* bias, float* y, int j0, int j1) {
  static_assert(kQgemmRows == 4, "qgemm_rows: extend the switch");
  constexpr int GC = GEMV_COLS;
  switch (rows) {
    case 1: qgemm_tile_rows<1, LDY, K, BITS, GS, ASYM, HAS_BIAS, PF, GC, ZU>(steps, xs, w, scales, mins, bias, y, j0, j1); break;
    case 2: qgemm_tile_rows<2, LDY, K, BITS, GS, ASYM, HAS_BIAS, PF, GC, ZU>(steps, xs, w, scales, mins, bias, y, j0, j1); break;
    case 3: qgemm_tile_rows<3, LDY, K, BITS, GS, ASYM, HAS_BIAS, PF, GC, ZU>(steps, xs, w, scales, mins, bias, y, j0, j1); break;
    case 4: qgemm_tile_rows<4, LDY, K, BITS, GS, ASYM, HAS_BIAS, PF, GC, ZU>(steps, xs, w, scales, mins, bias, y, j0, j1); break;
  }
}

// PF, TASK and GEMV_COLS (the decode GEMV's prefetch distance, bytes per task and outputs in flight at T = 1) are
// tunable (templates/cpu/qgemm.tune.toml); they change the speed, never the numbers. cap > 0: each output
// soft-capped (softcap_block), a task's own once it has them. LDY: y's row stride, > N where this GEMM writes a
// column range of a wider output (a fused q / k / v whose parts are quantized differently, one launch a scheme).
template <int N, int K, int BITS, int GS, bool ASYM, bool HAS_BIAS, int PF = kQgemvPrefetchBytes,
          long TASK = kQgemvTaskBytes, int GEMV_COLS = kQgemvCols, int LDY = N, typename SC>
inline void qgemm(const float* LLMC_RESTRICT x, const uint8_t* LLMC_RESTRICT qweight, const SC* LLMC_RESTRICT scales,
                  const SC* LLMC_RESTRICT mins, const float* LLMC_RESTRICT bias, float* LLMC_RESTRICT y, int T,
                  float cap = 0.0f) {
  using S = QShape<K, BITS, GS>;
  constexpr int R = kQgemmRows;
  const bool par = (long)T * N * K >= kParallelWork;
  // [T, NS] steps, then [T, NX] xs
  unsigned char* buf =
      qgemm_scratch<kQScratchSteps>((size_t)T * (S::NS * sizeof(QStep<BITS>) + S::NX * sizeof(float)));
  QStep<BITS>* steps = reinterpret_cast<QStep<BITS>*>(buf);
  float* xs = reinterpret_cast<float*>(buf + (size_t)T * S::NS * sizeof(QStep<BITS>));
  parallel_for(T, par && T > 1, [&](int t) {
    quantize_row_q8<K, BITS, GS, ASYM>(x + (long)t * K, steps + (long)t * S::NS, xs + (long)t * S::NX);
  });
  // per output: packed weights, its scales (and mins)
  constexpr long RB = S::RB + scale_row_bytes<SC>(S::G, ASYM);
  if (T <= R) {
    constexpr int CH = (int)std::max<long>(8, TASK / RB / 8 * 8);
    constexpr int NCH = (N + CH - 1) / CH;
    parallel_for(NCH, par, [&](int ch) {
      const int j0 = ch * CH, j1 = std::min(N, j0 + CH);
      qgemm_rows<LDY, K, BITS, GS, ASYM, HAS_BIAS, PF, GEMV_COLS>(T, steps, xs, qweight, scales, mins, bias, y, j0, j1);
      if (cap > 0.0f) softcap_block(y, LDY, 0, T, j0, j1, cap);
    });
    return;
  }
  // Prefill: tasks of kQgemmTChunk rows x a block of outputs whose weights stay in L2, each output at index j - j0
  // of its block (block_weights). int5 / int6 / int3 / int2 / IQ4 blocks are widened to bytes there, once per task,
  // and run by the byte tiles: the same integer dots as their decode tiles (so the same numbers), without decoding
  // a weight vector again for every few rows (decoding per tile made SmolLM-135M Q4_K_M's 128-token prefill 1.3x
  // slower).
  constexpr int KB = BITS == 4 ? 4 : 8;  // the bits the prefill's tiles read: int4's own, else int8's
  constexpr int WZU = kZeroU<BITS, ASYM>;  // and the u of q = 0 in them: the width's own, kept by widen_to_bytes
  using SK = QShape<K, KB, GS>;
  const QStep<KB>* ksteps = steps;
  constexpr int NB0 = (int)std::max<long>(16, kQgemmBlockBytes / RB) / 8 * 8;
  constexpr int NBLK_N = NB0 < N ? NB0 : N;
  constexpr int NBLK = (N + NBLK_N - 1) / NBLK_N;
  constexpr int SROW = S::G / groups_per_scale<SC>;  // SC items per output
  constexpr bool KQ = std::is_same_v<SC, KScales>;  // K-quant records, which hold the mins
  const int ntc = (T + kQgemmTChunk - 1) / kQgemmTChunk;
  auto block_weights = [&](int j0, int j1) -> const uint8_t* {
    if constexpr (KB == BITS) {
      return qweight + (long)j0 * S::RB;
    } else {
      uint8_t* wide = reinterpret_cast<uint8_t*>(qgemm_scratch<kQScratchWiden>((size_t)NBLK_N * K));
      widen_to_bytes<K, BITS>(qweight + (long)j0 * S::RB, j1 - j0, wide);
      return wide;
    }
  };
#if LLMC_QGEMM_PAIRS
  {
    static_assert(kQgemmTChunk % (2 * kQgemmPairRows) == 0, "qgemm: whole row-pair tiles per chunk");
    constexpr int RT = 2 * kQgemmPairRows;  // rows per tile
    QPair<KB>* pairs = reinterpret_cast<QPair<KB>*>(
        qgemm_scratch<kQScratchPairs>((size_t)(T + 1) / 2 * SK::NS * sizeof(QPair<KB>)));
    qpack_pairs<KB, SK::NS>(ksteps, T, pairs);
    parallel_for(ntc * NBLK, par, [&](int task) {
      const int tc = task / NBLK, nb = task % NBLK;
      const int t1 = std::min(T, (tc + 1) * kQgemmTChunk);
      const int j0 = nb * NBLK_N, j1 = std::min(N, j0 + NBLK_N);
      // outputs [j0, j1) of the block, as outputs [0, j1 - j0) of these, with the scales as floats
      const uint8_t* wb = block_weights(j0, j1);
      float* sbuf = nullptr;
      if constexpr (!std::is_same_v<SC, float>)
        sbuf = reinterpret_cast<float*>(qgemm_scratch<kQScratchScales>((size_t)NBLK_N * S::G * sizeof(float)));
      const SC* sc = scales + (long)j0 * SROW;
      const float* sb = scales_as_float(sc, (long)(j1 - j0) * S::G, sbuf);
      const float* mb = nullptr;  // the mins as floats, for the results' min_term
      if constexpr (ASYM) {
        float* mbuf = reinterpret_cast<float*>(qgemm_scratch<kQScratchMins>((size_t)NBLK_N * S::G * sizeof(float)));
        if constexpr (groups_per_scale<SC> > 1)  // records that hold the mins
          mb = mins_as_float(sc, (long)(j1 - j0) * S::G, mbuf);
        else
          mb = scales_as_float(mins + (long)j0 * S::G, (long)(j1 - j0) * S::G, mbuf);
      }
      const float* bb = HAS_BIAS ? bias + j0 : nullptr;
      for (int t = tc * kQgemmTChunk; t < t1; t += RT) {
        const QPair<KB>* pt = pairs + (long)(t / 2) * SK::NS;
        const float* xt = xs + (long)t * SK::NX;
        float* yt = y + (long)t * LDY + j0;
        if (t1 - t > 2)
          qgemm_pairs_rows<kQgemmPairRows, LDY, K, KB, GS, ASYM, HAS_BIAS, WZU>(std::min(RT, t1 - t), pt, xt, wb, sb, mb, bb,
                                                                          yt, 0, j1 - j0);
        else
          qgemm_pairs_rows<1, LDY, K, KB, GS, ASYM, HAS_BIAS, WZU>(t1 - t, pt, xt, wb, sb, mb, bb, yt, 0, j1 - j0);
      }
      if (cap > 0.0f) softcap_block(y, LDY, tc * kQgemmTChunk, t1, j0, j1, cap);
    });
    return;
  }
#endif
  parallel_for(ntc * NBLK, par, [&](int task) {
    const int tc = task / NBLK, nb = task % NBLK;
    const int t1 = std::min(T, (tc + 1) * kQgemmTChunk);
    const int j0 = nb * NBLK_N, j1 = std::min(N, j0 + NBLK_N);
    const uint8_t* wb = block_weights(j0, j1);
    const SC* sb = scales + (long)j0 * SROW;
    const SC* mb = mins ? mins + (long)j0 * S::G : nullptr;
    const float* bb = HAS_BIAS ? bias + j0 : nullptr;
    for (int t = tc * kQgemmTChunk; t < t1; t += R)
      qgemm_rows<LDY, K, KB, GS, ASYM, HAS_BIAS, 0, kQgemvCols, WZU>(std::min(R, t1 - t), ksteps + (long)t * SK::NS,
                                                             xs + (long)t * SK::NX, wb, sb, mb, bb, y + (long)t * LDY + j0,
                                                           0, j1 - j0);
    if (cap > 0.0f) softcap_block(y, LDY, tc * kQgemmTChunk, t1, j0, j1, cap);
  });
}

// qgemm with x's int8 rounding taken twice (a template's act_passes = 2: the lm_head, whose logits int8 activations
// move most): row t runs as two rows, x_t's blocks as quantized_row_q8 rounds them and what that rounding leaves,
// r = x - q * d (|r| <= d / 2 a block, so its own rounding errs 1/254 as much), and y_t = y(x_t part) + y(r part)
// (+ bias, then the cap). The weights are read once for both: a GEMV of 2 rows costs its integer dots twice.
// Rows go in chunks of kQgemm2PassRows, so the doubled rows and their outputs stay small at a large vocabulary;
// each row's result is that of qgemm's one sequence, whatever T.
constexpr int kQgemm2PassRows = 32;
template <int N, int K, int BITS, int GS, bool ASYM, bool HAS_BIAS, int PF = kQgemvPrefetchBytes,
          long TASK = kQgemvTaskBytes, int GEMV_COLS = kQgemvCols, int LDY = N, typename SC>
inline void qgemm_two_pass(const float* LLMC_RESTRICT x, const uint8_t* LLMC_RESTRICT qweight,
                           const SC* LLMC_RESTRICT scales, const SC* LLMC_RESTRICT mins, const float* LLMC_RESTRICT bias,
                           float* LLMC_RESTRICT y, int T, float cap = 0.0f) {
  constexpr int TC = kQgemm2PassRows;
  // the chunk's [2 TC, K] rows, then their [2 TC, N] outputs
  float* x2 = reinterpret_cast<float*>(qgemm_scratch<kQScratchTwoPass>((size_t)2 * TC * (K + N) * sizeof(float)));
  float* y2 = x2 + (size_t)2 * TC * K;
  for (int t0 = 0; t0 < T; t0 += TC) {
    const int rows = std::min(TC, T - t0);
    for (int t = 0; t < rows; ++t) {
      const float* xt = x + (long)(t0 + t) * K;
      float* hi = x2 + (long)2 * t * K;
      float* lo = hi + K;
      int8_t q[32];
      for (int b = 0; b < K / 32; ++b) {
        const float* xb = xt + 32 * b;
        const float amax = qsimd::absmax32(xb);
        qsimd::round32(xb, amax != 0.0f ? 127.0f / amax : 0.0f, q);
        const float d = amax / 127.0f;
        for (int i = 0; i < 32; ++i) {
          hi[32 * b + i] = xb[i];
          lo[32 * b + i] = xb[i] - float(q[i]) * d;
        }
      }
    }
    qgemm<N, K, BITS, GS, ASYM, false, PF, TASK, GEMV_COLS>(x2, qweight, scales, mins, nullptr, y2, 2 * rows);
    for (int t = 0; t < rows; ++t) {
      const float* a = y2 + (long)2 * t * N;
      float* yt = y + (long)(t0 + t) * LDY;
      for (int j = 0; j < N; ++j) yt[j] = HAS_BIAS ? (a[j] + a[N + j]) + bias[j] : a[j] + a[N + j];
    }
  }
  if (cap > 0.0f) softcap_block(y, LDY, 0, T, 0, N, cap);
}

}  // namespace llmc
