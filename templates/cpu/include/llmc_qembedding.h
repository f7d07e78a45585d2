// llmc CPU target: the token embedding's gather from a quantized table, packed as the qgemm's weights
// (llmc_qgemm.h): a tied head's qgemm reads the same table.
#pragma once

#include "llmc_qgemm.h"

namespace llmc {

// qembedding: out[t, :] = dequant(table)[ids[t], :] * scale, the table packed as qgemm's weight (a tied head's
// is that weight): w = q * scale[g] - min[g] as compiler/quant.py's dequantize rounds it, the product and then
// the difference (not contracted into one FMA), so a GGUF table's rows come out bit for bit.
template <int H, int BITS, int GS, bool ASYM, typename SC>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
inline void qembedding(const int32_t* ids, int T, const uint8_t* LLMC_RESTRICT qweight, const SC* LLMC_RESTRICT scales,
                       const SC* LLMC_RESTRICT mins, float* LLMC_RESTRICT out, float scale = 1.0f) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  static_assert(H % 32 == 0, "qembedding: a quantized table's rows are whole blocks of 32");
  constexpr int G = (H + GS - 1) / GS;
  constexpr int RB = H * stored_bits(BITS) / 8;
  // the q stored as u = 0 (IQ4: u is an index, its level kIq4LevelsU[u] - 128)
  constexpr int LO = BITS == kIq4 ? 0 : -kZeroU<BITS, ASYM>;
  parallel_for(T, (long)T * H >= kParallelWork, [&](int t) {
    const long row = ids[t];
    const uint8_t* u = qweight + row * RB;
    float* dst = out + (long)t * H;
    for (int k = 0; k < H; ++k) {
      // int4: chunk c's byte j holds elements 32c + j (low nibble) and 32c + j + 16 (high); int6: the same
      // nibbles in 24-byte chunks, then element 32c + j + 8i's top 2 bits at bits 2i of byte 16 + j; int5: in
      // 20-byte chunks, then element 32c + 4i + r's fifth bit at bit i of byte 16 + r; IQ4: int4's nibbles
      const int cb = k / 32 * (BITS == 4 ? 16 : 4 * stored_bits(BITS)), e = k % 32;
      int q = LO;
      if constexpr (BITS == 8) {
        q += u[k];
      } else if constexpr (BITS == 2) {  // 8-byte chunks: element 32c + j + 8i at bits 2i of byte j
        q += (u[cb + e % 8] >> (2 * (e / 8))) & 3;
      } else if constexpr (BITS == 3) {  // 12-byte chunks: the low 2 bits of element 32c + j + 8i at bits 2i of
        // byte j, then the third bits as int5's fifth, from byte 8
        q += ((u[cb + e % 8] >> (2 * (e / 8))) & 3) | (((u[cb + 8 + e % 4] >> (e / 4)) & 1) << 2);
      } else {
        q += (u[cb + e % 16] >> (e / 16 * 4)) & 0xF;
        if constexpr (BITS == 6) q += ((u[cb + 16 + e % 8] >> (2 * (e / 8))) & 3) << 4;
        if constexpr (BITS == 5) q += ((u[cb + 16 + e % 4] >> (e / 4)) & 1) << 4;
        if constexpr (BITS == kIq4) q = int(kIq4LevelsU[q]) - 128;
      }
      float s, m;
      group_scale_min(scales, mins, row * G + k / GS, s, m);
      const float w = float(q) * s;
      dst[k] = (ASYM ? w - m : w) * scale;
    }
  });
}

}  // namespace llmc
