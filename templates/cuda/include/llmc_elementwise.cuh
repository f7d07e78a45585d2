// llmc_elementwise.cuh: the row-wise CUDA kernels: embedding, RMSNorm, RoPE, SiLU-and-multiply, row gather.
// One block per row (per token); each config struct gives its launch shape (kThreads, and for silu_mul kChunks).
#pragma once

#include "llmc_common.cuh"

namespace llmc {

// embedding: out[t, :] = table[ids[t], :] * scale (Granite and Gemma scale it). Grid (T), block kThreads;
// 16-byte loads when rows are aligned.
template <int H, typename W, typename A = float>
struct Embedding {
  static constexpr int V = Vec16<W>::N;
  static constexpr bool kVec = H % V == 0;
  static constexpr int kThreads = row_threads(ceil_div(H, kVec ? V : 1), 256);

  static __device__ __forceinline__ void run(const int32_t* ids, const W* table, A* out, float scale = 1.0f) {
    const int t = blockIdx.x;
    const W* src = table + static_cast<int64_t>(ids[t]) * H;
    A* dst = out + static_cast<int64_t>(t) * H;
    if constexpr (kVec) {
      for (int i = threadIdx.x * V; i < H; i += kThreads * V) {
        float f[V];
        Vec16<W>::load(src + i, f);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] *= scale;
        store_acts<V>(dst + i, f);
      }
    } else {
      for (int i = threadIdx.x; i < H; i += kThreads) astore(dst + i, wload(src[i]) * scale);
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// rmsnorm, as transformers' LlamaRMSNorm: y = w * A(h * (1 / sqrt(mean(h^2) + eps))), in float32, A() the
// rounding to the activation type (bf16: as LlamaRMSNorm casts back to the input dtype before the weight).
// ADD: h = residual_out = A(x + residual_in) first (residual_out may alias x or residual_in: each element is
// read and written by the same thread). Grid (T), block kThreads; a thread keeps its PER elements in
// registers (element i = j * kThreads + tid: coalesced), one block_sum. The added branch residual_in is first
// scaled by residual_scale (Granite), and with RNORM (Gemma's norm of each branch) first RMS-normalized by the
// same eps and scaled by residual_w, rounded to A as that norm's output is: one more block_sum. OUT = false
// (OLMo 2, whose sum no norm reads): residual_out alone is written; w and y are null.
template <int H, bool ADD, typename W, typename A = float, bool RNORM = false, bool OUT = true>
struct RmsNorm {
  static_assert(OUT || (ADD && RNORM), "rmsnorm: only the add of a normed branch skips the output norm");
  static constexpr int kThreads = row_threads(ceil_div(H, 8), 512);
  static constexpr int PER = ceil_div(H, kThreads);

  static __device__ __forceinline__ void run(const A* x, const A* residual_in, A* residual_out, const W* w, A* y,
                                             float eps, float residual_scale = 1.0f, const W* residual_w = nullptr) {
    const int64_t base = static_cast<int64_t>(blockIdx.x) * H;
    float b[RNORM ? PER : 1];
    float rr = 1.0f;
    if constexpr (RNORM) {
      float bs = 0.0f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int i = j * kThreads + threadIdx.x;
        b[j] = i < H ? wload(residual_in[base + i]) : 0.0f;
        bs += b[j] * b[j];
      }
      rr = 1.0f / sqrtf(block_sum(bs) / static_cast<float>(H) + eps);
    }
    float h[PER];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = j * kThreads + threadIdx.x;
      float v = 0.0f;
      if (i < H) {
        v = wload(x[base + i]);
        if constexpr (ADD) {
          const float branch = RNORM ? act_round<A>(wload(residual_w[i]) * (b[j] * rr)) : wload(residual_in[base + i]);
          v = act_round<A>(v + residual_scale * branch);
          astore(residual_out + base + i, v);
        }
      }
      h[j] = v;
      ss += v * v;
    }
    if constexpr (!OUT) return;
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = j * kThreads + threadIdx.x;
      if (i < H) astore(y + base + i, wload(w[i]) * act_round<A>(h[j] * r));
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// rope, rotate-half (transformers' Llama), in place on heads [0, NH) of each row: with c, s = cos, sin of
// float(pos) * inv_freq[i],  x[i] = x[i] c - x[i + R/2] s,  x[i + R/2] = x[i + R/2] c + x[i] s,  i < R/2; R < D
// (Phi-4-mini's partial rotary) leaves each head's dims [R, D) as they are.
// Grid (T), block kThreads: the token's R/2 (cos, sin) pairs once into shared memory (accurate sincosf),
// then one thread per (head, i) pair. NORM (Qwen3's q_norm / k_norm): each head is first RMS-normalized over
// its D values and scaled by norm_w [D] (float32), as the rmsnorm kernel does a row: a thread per head sums
// its squares in order (deterministic), before any value is rotated. WHOLE (OLMo 2's): the NH * D values
// together, scaled by norm_w [NH * D]: thread 0 adds the heads' sums in head order.
// Phi-3's LongRoPE: the runtime marks each token of a sequence past the original length with kLongRopeFlag in its
// position (StepBatch); those rotate by long_inv_freq. cos and sin scale by `factor` either way. The default: none.
constexpr int32_t kLongRopeFlag = 1 << 30;
struct LongRope {
  const float* long_inv_freq = nullptr;
  float factor = 1.0f;
};

template <int NH, int D, typename A = float, bool NORM = false, bool WHOLE = false, int R = D>
struct Rope {
  static_assert(R % 2 == 0 && R <= D, "rope: the rotated dims are an even count of at most head_dim");
  static_assert(!NORM || R == D, "rope: the norm is applied as the dims rotate, so it takes a whole-head rotation");
  static constexpr int HALF = R / 2;
  static constexpr int kThreads = row_threads(NH * HALF, 256);

  static __device__ __forceinline__ void run(A* x, int row_stride, const int32_t* positions, const float* inv_freq,
                                             const float* norm_w = nullptr, float eps = 0.0f,
                                             const LongRope& longrope = {}) {
    __shared__ float cos_s[HALF], sin_s[HALF];
    __shared__ float scale_s[NORM ? NH : 1];
    const int t = blockIdx.x;
    const bool past = longrope.long_inv_freq != nullptr && (positions[t] & kLongRopeFlag);  // block-uniform
    const float p = static_cast<float>(positions[t] & ~kLongRopeFlag);
    A* row = x + static_cast<int64_t>(t) * row_stride;
    const float* f = past ? longrope.long_inv_freq : inv_freq;
    for (int i = threadIdx.x; i < HALF; i += kThreads) {
      sincosf(p * f[i], &sin_s[i], &cos_s[i]);
      sin_s[i] *= longrope.factor, cos_s[i] *= longrope.factor;
    }
    if constexpr (NORM) {
      for (int h = threadIdx.x; h < NH; h += kThreads) {
        float ss = 0.0f;
        for (int j = 0; j < D; ++j) {
          const float v = wload(row[h * D + j]);
          ss += v * v;
        }
        scale_s[h] = WHOLE ? ss : 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
      }
      if constexpr (WHOLE) {
        __syncthreads();
        if (threadIdx.x == 0) {
          float ss = 0.0f;
          for (int h = 0; h < NH; ++h) ss += scale_s[h];
          scale_s[0] = 1.0f / sqrtf(ss / static_cast<float>(NH * D) + eps);
        }
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NH * HALF; idx += kThreads) {
      const int h = idx / HALF, i = idx % HALF;
      const float c = cos_s[i], s = sin_s[i];
      A* x1 = row + h * D + i;
      float a = wload(x1[0]), b = wload(x1[HALF]);
      if constexpr (NORM) {
        const float r = scale_s[WHOLE ? 0 : h];
        const int w0 = WHOLE ? h * D + i : i;
        a = act_round<A>(norm_w[w0] * act_round<A>(a * r));  // as torch's bf16 RMSNorm rounds twice
        b = act_round<A>(norm_w[w0 + HALF] * act_round<A>(b * r));
      }
      A* y1 = store_ptr(x1);
      astore(y1, a * c - b * s);
      astore(y1 + HALF, b * c + a * s);
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// silu_mul: out[t, i] = silu(gate[t, i]) * up[t, i] (GELU: gelu_tanh, Gemma's GeGLU), gate_up = [gate | up] per
// row. Grid (T, kChunks), block kThreads, V elements per thread.
template <int I, typename A = float, bool GELU = false>
struct SiluMul {
  static constexpr int V = I % 4 == 0 ? 4 : 1;
  static constexpr int kThreads = row_threads(ceil_div(I, V), 256);
  static constexpr int kChunks = ceil_div(I, kThreads * V);

  static __device__ __forceinline__ void run(const A* gate_up, A* out) {
    const int64_t t = blockIdx.x;
    const int i = (blockIdx.y * kThreads + threadIdx.x) * V;
    if (i >= I) return;
    const A* g = gate_up + t * 2 * I + i;
    A* o = out + t * I + i;
    if constexpr (V == 4) {
      float gv[4], uv[4];
      load_act4(g, gv);
      load_act4(g + I, uv);
      store_act4(o, gated_mul<GELU>(gv[0], uv[0]), gated_mul<GELU>(gv[1], uv[1]), gated_mul<GELU>(gv[2], uv[2]),
                 gated_mul<GELU>(gv[3], uv[3]));
    } else {
      astore(o, gated_mul<GELU>(wload(g[0]), wload(g[I])));
    }
  }
};

// ---------------------------------------------------------------------------------------------------
// gather_rows: out[i, :] = x[rows[i], :]. Grid (n), block kThreads.
template <int C, typename A = float>
struct GatherRows {
  static constexpr int kThreads = row_threads(row_pieces<A, C>() > 0 ? row_pieces<A, C>() : C, 256);

  static __device__ __forceinline__ void run(const A* x, const int32_t* rows, A* out) {
    const int i = blockIdx.x;
    copy_row<A, C, kThreads>(x + static_cast<int64_t>(rows[i]) * C, out + static_cast<int64_t>(i) * C);
  }
};

}  // namespace llmc
