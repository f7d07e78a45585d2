// llmc CPU target: the row-wise kernels: embedding, RMSNorm, RoPE, SiLU-and-multiply, row gather, soft-capping.
#pragma once

#include "llmc_pool.h"
#include "llmc_simd.h"

namespace llmc {

// embedding: out[t, :] = table[ids[t], :] * scale (bf16 widened; Granite and Gemma scale the embedding).
template <int H, typename WT>
inline void embedding(const int32_t* ids, int T, const WT* LLMC_RESTRICT table, float* LLMC_RESTRICT out,
                      float scale = 1.0f) {
  parallel_for(T, (long)T * H >= kParallelWork, [&](int t) {
    const WT* src = table + (long)ids[t] * H;
    float* dst = out + (long)t * H;
    for (int i = 0; i < H; ++i) dst[i] = load_w(src[i]) * scale;
  });
}

// rmsnorm, as transformers' LlamaRMSNorm in float32: y = w * (h * (1 / sqrt(mean(h^2) + eps))).
// ADD: h = residual_out = x + residual_scale * b first (residual_out may alias residual_in or x), where b is
// residual_in, or with RNORM (Gemma's norm of each branch before its add) residual_in RMS-normalized by the
// same eps and scaled by residual_w.
// OUT = false (OLMo 2, whose sum no norm reads): residual_out alone is written; w and y are null.
template <int H, bool ADD, typename WT, bool RNORM = false, bool OUT = true>
inline void rmsnorm(const float* x, const float* residual_in, float* residual_out, const WT* w, float* y,
                    int T, float eps, float residual_scale = 1.0f, const WT* residual_w = nullptr) {
  static_assert(OUT || (ADD && RNORM), "rmsnorm: only the add of a normed branch skips the output norm");
  parallel_for(T, (long)T * H >= kParallelWork, [&](int t) {
    const float* h = x + (long)t * H;
    if constexpr (ADD) {
      const float* ri = residual_in + (long)t * H;
      float* ro = residual_out + (long)t * H;
      if constexpr (RNORM) {
        const float rr = 1.0f / std::sqrt(dot<H>(ri, ri) / float(H) + eps);
        for (int i = 0; i < H; ++i) ro[i] = h[i] + residual_scale * (load_w(residual_w[i]) * (ri[i] * rr));
      } else {
        for (int i = 0; i < H; ++i) ro[i] = h[i] + residual_scale * ri[i];
      }
      h = ro;
    }
    if constexpr (!OUT) return;
    const float ss = dot<H>(h, h);
    const float r = 1.0f / std::sqrt(ss / float(H) + eps);
    float* out = y + (long)t * H;
    for (int i = 0; i < H; ++i) out[i] = load_w(w[i]) * (h[i] * r);
  });
}

// Phi-3's LongRoPE: the runtime marks each token of a sequence past the original length with kLongRopeFlag in its
// position (StepBatch); those rotate by long_inv_freq. cos and sin scale by `factor` either way. The default: none.
constexpr int32_t kLongRopeFlag = 1 << 30;
struct LongRope {
  const float* long_inv_freq = nullptr;
  float factor = 1.0f;
};

// rope, rotate-half convention (transformers' Llama): with c, s = cos, sin(float(pos) * inv_freq[i]),
//   x[i] = x[i] * c - x[i + R/2] * s,   x[i + R/2] = x[i + R/2] * c + x[i] * s,   i < R/2,
// in place on heads [0, NH) of each row (row t starts at x + t * row_stride); R < D (Phi-4-mini's partial rotary)
// leaves each head's dims [R, D) as they are. NORM (Qwen3's q_norm / k_norm):
// first each head is RMS-normalized over its D values and scaled by norm_w [D], as RMSNorm does at fp32;
// with WHOLE (OLMo 2's), the NH * D values together, scaled by norm_w [NH * D].
template <int NH, int D, int R = D, bool NORM = false, bool WHOLE = false>
inline void rope(float* x, int row_stride, const int32_t* positions, int T, const float* inv_freq,
                 const float* norm_w = nullptr, float eps = 0.0f, const LongRope& longrope = {}) {
  static_assert(R % 2 == 0 && R <= D, "rope: the rotated dims are an even count of at most head_dim");
  constexpr int HALF = R / 2;
  parallel_for(T, (long)T * NH * D >= kParallelWork, [&](int t) {
    float c[HALF], s[HALF];
    const bool past = longrope.long_inv_freq != nullptr && (positions[t] & kLongRopeFlag);
    const float p = float(positions[t] & ~kLongRopeFlag);
    const float* f = past ? longrope.long_inv_freq : inv_freq;
    for (int i = 0; i < HALF; ++i) {
      const float a = p * f[i];
      c[i] = std::cos(a) * longrope.factor;
      s[i] = std::sin(a) * longrope.factor;
    }
    float* row = x + (long)t * row_stride;
    if constexpr (NORM && WHOLE) {
      const float r = 1.0f / std::sqrt(dot<NH * D>(row, row) / float(NH * D) + eps);
      for (int i = 0; i < NH * D; ++i) row[i] = norm_w[i] * (row[i] * r);
    }
    for (int h = 0; h < NH; ++h) {
      float* x1 = row + h * D;
      float* x2 = x1 + HALF;
      if constexpr (NORM && !WHOLE) {
        const float r = 1.0f / std::sqrt(dot<D>(x1, x1) / float(D) + eps);
        for (int i = 0; i < D; ++i) x1[i] = norm_w[i] * (x1[i] * r);
      }
      for (int i = 0; i < HALF; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  });
}

// gelu_tanh(g) * u, torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3).
// Computed as g u / (1 + exp(-2z)), the same function (0.5 (1 + tanh z) is the logistic of 2z), so Vec::exp's
// polynomial serves it: libm's tanhf an element cost Gemma 3 14% of a SmolLM-135M-shape decode step.
LLMC_INLINE Vec gelu_tanh_mul(Vec g, Vec u) {
  constexpr float kTwoBeta = 2.0f * 0.7978845608028654f, kKappa = 0.044715f;
  const Vec two_z = g * (Vec::splat(kTwoBeta) + Vec::splat(kTwoBeta * kKappa) * (g * g));
  return g * u / (Vec::splat(1.0f) + Vec::exp(Vec::zero() - two_z));
}

// Gemma 2's soft-capping, cap * tanh(x / cap), as cap - 2 cap / (1 + exp(2 x / cap)): Vec::exp's polynomial where
// libm's tanhf is a call per element. Vec::exp clamps its argument, so an x far past the cap lands on +-cap.
LLMC_INLINE Vec soft_cap(Vec x, float cap) {
  return Vec::splat(cap) - Vec::splat(2.0f * cap) / (Vec::splat(1.0f) + Vec::exp(x * Vec::splat(2.0f / cap)));
}

// silu_mul: out[t, i] = silu(gate[t, i]) * up[t, i], gate_up = [gate | up] per row;
// silu(g) = g / (1 + exp(-g)) as torch computes it, exp by Vec::silu_mul's SIMD exp_poly: libm's expf, one call
// per element, cost a SmolLM-135M decode step ~0.5 ms of CPU (of ~25), a 16-row step ~4 ms. The last partial
// vector is masked, so every element goes through the same formula. GELU: gelu_tanh(gate) * up (Gemma's
// GeGLU), as gelu_tanh_mul above.
template <int I, bool GELU = false>
inline void silu_mul(const float* LLMC_RESTRICT gate_up, float* LLMC_RESTRICT out, int T) {
  constexpr int W = Vec::W, IMAIN = I / W * W;
  parallel_for(T, (long)T * I >= kParallelWork, [&](int t) {
    const float* g = gate_up + (long)t * 2 * I;
    const float* u = g + I;
    float* o = out + (long)t * I;
    const auto act = [](Vec gv, Vec uv) {
      if constexpr (GELU) return gelu_tanh_mul(gv, uv);
      else return Vec::silu_mul(gv, uv);
    };
    for (int i = 0; i < IMAIN; i += W) act(Vec::load(g + i), Vec::load(u + i)).store(o + i);
    if constexpr (IMAIN < I) {
      act(Vec::load_part(g + IMAIN, I - IMAIN), Vec::load_part(u + IMAIN, I - IMAIN)).store_part(o + IMAIN, I - IMAIN);
    }
  });
}

// gather_rows: out[i, :] = x[rows[i], :] for i < n (e.g. the rows that produce logits).
template <int C>
inline void gather_rows(const float* LLMC_RESTRICT x, const int32_t* rows, int n, float* LLMC_RESTRICT out) {
  for (int i = 0; i < n; ++i) std::memcpy(out + (long)i * C, x + (long)rows[i] * C, sizeof(float) * C);
}

// y[r, c] = soft_cap(y[r, c]) in place for r0 <= r < r1, c0 <= c < c1 (row stride ld): Gemma 2's final-logit
// soft-capping as the lm_head GEMM's epilogue, on a task's outputs while they are still in cache.
inline void softcap_block(float* LLMC_RESTRICT y, long ld, int r0, int r1, int c0, int c1, float cap) {
  constexpr int W = Vec::W;
  for (int r = r0; r < r1; ++r) {
    float* row = y + (long)r * ld;
    int c = c0;
    for (; c + W <= c1; c += W) soft_cap(Vec::load(row + c), cap).store(row + c);
    if (c < c1) soft_cap(Vec::load_part(row + c, c1 - c), cap).store_part(row + c, c1 - c);
  }
}

}  // namespace llmc
