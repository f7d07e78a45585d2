// llmc CPU target: a mixture-of-experts MLP as three kernels (compiler/frontend/model.py moe_reference has its
// maths): moe_route picks each token's experts, moe_experts runs each chosen expert's linear over the tokens that
// chose it, and moe_combine sums a token's expert outputs by their routing weights.
//
// route, one row per token: [TOPK expert ids (as floats, exact) | TOPK weights], the experts by falling
// probability. An expert's rows are gathered into one block, so its weights stream once a step however many
// tokens chose it, and an expert no token chose is not read. Batch-invariant: the router's GEMM, each expert's
// GEMM and the combine treat each row alone in a fixed order, and a token's outputs are summed in its own slot
// order, whatever else the step holds.
#pragma once

#include <algorithm>
#include <cmath>

#include "llmc_elementwise.h"
#include "llmc_gemm.h"

namespace llmc {

namespace {
// gemm_scratch's uses (llmc_gemm.h), after the GEMM's own
enum { kScratchMoeLogits = kScratchGemmEnd, kScratchMoeOrder, kScratchMoeRows, kScratchMoeOut };
// (layer, expert) pairs the gate/up GEMMs have read since the module was loaded: llmc_experts_activated, for
// `llmc bench`'s experts a step
long long experts_activated = 0;
}  // namespace

// Router probabilities softmax(x @ router^T) in float32, each row's TOPK largest (ties: the lower expert),
// renormalized to sum 1 with NORM.
template <int E, int H, int TOPK, bool NORM, typename WT>
inline void moe_route(const float* LLMC_RESTRICT x, const WT* LLMC_RESTRICT router, float* LLMC_RESTRICT route,
                      int T) {
  float* logits = gemm_scratch<float, kScratchMoeLogits>((long)T * E);
  gemm<E, H, false>(x, router, (const WT*)nullptr, logits, T);
  parallel_for(T, (long)T * E * TOPK >= kParallelWork, [&](int t) {
    float* p = logits + (long)t * E;
    float top = p[0];
    for (int e = 1; e < E; ++e) top = std::max(top, p[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
    for (int e = 0; e < E; ++e) p[e] /= sum;
    float* ids = route + (long)t * 2 * TOPK;
    float* w = ids + TOPK;
    bool taken[E] = {};
    float chosen = 0.0f;
    for (int j = 0; j < TOPK; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = true;
      ids[j] = (float)best;
      chosen += w[j] = p[best];
    }
    if (NORM)
      for (int j = 0; j < TOPK; ++j) w[j] /= chosen;
  });
}

// out[t, j] = act(x[t(, j)] @ W_e^T), e = route's j-th expert of token t; W_e the e-th [N, K] block of the
// stacked weights (run(e, rows, y, count) applies it to `count` gathered rows). PER_SLOT: x holds one K-row per
// (t, j) (the down projection's input), else one per token. SWIGLU: N = 2I, gate then up, and out holds
// silu(gate) * up, I per slot; else the N outputs.
template <int E, int K, int N, int TOPK, bool PER_SLOT, bool SWIGLU, class Run>
inline void moe_experts(const float* LLMC_RESTRICT x, const float* LLMC_RESTRICT route, float* LLMC_RESTRICT out,
                        int T, Run run) {
  constexpr int OUT = SWIGLU ? N / 2 : N;
  const int rows = T * TOPK;
  // row r = (token r / TOPK, slot r % TOPK); its expert, then the rows in expert order (a counting sort)
  auto expert = [&](int r) { return (int)route[(long)(r / TOPK) * 2 * TOPK + r % TOPK]; };
  int start[E + 1] = {};
  for (int r = 0; r < rows; ++r) ++start[expert(r) + 1];
  for (int e = 0; e < E; ++e) start[e + 1] += start[e];
  int fill[E];
  std::copy(start, start + E, fill);
  int* order = gemm_scratch<int, kScratchMoeOrder>(rows);
  for (int r = 0; r < rows; ++r) order[fill[expert(r)]++] = r;
  float* xs = gemm_scratch<float, kScratchMoeRows>((long)rows * K);
  float* ys = gemm_scratch<float, kScratchMoeOut>((long)rows * N);
  const bool par = (long)rows * (K + N) >= kParallelWork;
  parallel_for(rows, par, [&](int i) {
    const int r = order[i], t = r / TOPK, j = r % TOPK;
    std::memcpy(xs + (long)i * K, x + (PER_SLOT ? (long)t * TOPK * K + (long)j * K : (long)t * K), K * sizeof(float));
  });
  int read = 0;
  for (int e = 0; e < E; ++e) {
    const int count = start[e + 1] - start[e];
    if (count) run(e, xs + (long)start[e] * K, ys + (long)start[e] * N, count);
    read += count > 0;
  }
  if (launch_timing.on) launch_timing.experts = read;  // for `llmc profile`
  if constexpr (SWIGLU) experts_activated += read;
  parallel_for(rows, par, [&](int i) {
    const int r = order[i];
    float* o = out + (long)(r / TOPK) * TOPK * OUT + (long)(r % TOPK) * OUT;
    if constexpr (SWIGLU)
      silu_mul<OUT>(ys + (long)i * N, o, 1);
    else
      std::memcpy(o, ys + (long)i * N, N * sizeof(float));
  });
}

// out[t] = sum over j of w[t, j] * y[t, j], in slot order.
template <int H, int TOPK>
inline void moe_combine(const float* LLMC_RESTRICT y, const float* LLMC_RESTRICT route, float* LLMC_RESTRICT out,
                        int T) {
  parallel_for(T, (long)T * TOPK * H >= kParallelWork, [&](int t) {
    const float* w = route + (long)t * 2 * TOPK + TOPK;
    const float* yt = y + (long)t * TOPK * H;
    float* o = out + (long)t * H;
    for (int h = 0; h < H; ++h) o[h] = w[0] * yt[h];
    for (int j = 1; j < TOPK; ++j)
      for (int h = 0; h < H; ++h) o[h] += w[j] * yt[(long)j * H + h];
  });
}

}  // namespace llmc
