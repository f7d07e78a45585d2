// llmc_moe.cuh: a mixture-of-experts MLP on CUDA, as the CPU target's kernels (templates/cpu/include/llmc_moe.h
// and compiler/frontend/model.py moe_reference have the maths): moe_route picks each token's experts, the expert
// GEMMs (moe_gemm / moe_qgemm) run each chosen expert over the rows that chose it, moe_combine sums a token's
// expert outputs by their routing weights.
//
// route [T, 2 * TOPK] (A): each token's experts by falling probability (exact integers: bf16 holds them up to
// 256, which compile checks), then their weights.
//
// An expert GEMM launch:
//  - MoeSort groups the step's (token, slot) rows, r = t * TOPK + j, by expert on the device: a counting sort in
//    one block, giving start[E + 1] and the rows in expert order (each expert's in increasing r).
//  - The GEMM is Gemm's / QGemm's own gemv or tiled code over each expert's rows, ExpertRows gathering their x
//    rows and scattering their y rows. At T <= kGemvMaxT tokens: grid (gemv blocks, E); a block of an expert
//    that no row chose returns before it reads a weight. Else tiled: grid (n tiles, expert_tiles_bound), each
//    block finding its (expert, m tile) from start (expert_tile). So each chosen expert's weights stream once
//    a launch however many rows chose it, and an unchosen expert's are never read.
//  - SwiGLU (gate_up): two launches over the same sorted rows, the gate half of each expert's rows and then the
//    up half, whose epilogue turns the gate the first stored and its own up into silu(gate) * up (ExpertRows'
//    GATED). Every weight is read once, no [rows, 2I] product goes to memory, and each output is what
//    gemm + silu_mul give: gate and up rounded to A as those store them.
//  - A step of more than kSortRows rows runs in chunks of whole tokens.
// Batch-invariant: a row's route, each of its expert outputs and its combine are computed alone in a fixed order
// (gemv or tiled, chosen by the step's token count, as the dense GEMM chooses).
#pragma once

#include "llmc_common.cuh"
#include "llmc_elementwise.cuh"

namespace llmc {

// route: one block per token. Each warp takes every kWarps-th expert, lanes striding the hidden size, fp32; then
// one thread: softmax over the E logits, the TOPK largest (ties: the lower expert), renormalized with NORM.
template <int E, int H, int TOPK, bool NORM, typename W, typename A>
struct MoeRoute {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;

  static __device__ __forceinline__ void run(const A* x, const W* router, A* route) {
    __shared__ float p[E];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.x;
    const A* xt = x + static_cast<int64_t>(t) * H;
    for (int e = warp; e < E; e += kWarps) {
      const W* we = router + static_cast<int64_t>(e) * H;
      float acc = 0.0f;
      for (int h = lane; h < H; h += 32) acc += wload(xt[h]) * wload(we[h]);
      acc = warp_sum(acc);
      if (lane == 0) p[e] = acc;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    float top = p[0];
    for (int e = 1; e < E; ++e) top = fmaxf(top, p[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += p[e] = expf(p[e] - top);
    for (int e = 0; e < E; ++e) p[e] /= sum;
    float w[TOPK], chosen = 0.0f;
    A* r = route + static_cast<int64_t>(t) * 2 * TOPK;
    for (int j = 0; j < TOPK; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
      chosen += w[j] = p[best];
      p[best] = -1.0f;  // taken
      astore(r + j, static_cast<float>(best));
    }
    for (int j = 0; j < TOPK; ++j) astore(r + TOPK + j, NORM ? w[j] / chosen : w[j]);
  }
};

// The counting sort of a chunk's rows by expert: one block. The rows' experts go to shared memory once; thread e
// counts expert e's rows, one thread takes the prefix sums, and thread e writes its rows in increasing order.
template <int E, int TOPK, typename A>
struct MoeSort {
  static constexpr int kThreads = 256;
  static constexpr int kSortRows = 8192;  // rows a launch sorts: a step of more runs in chunks of whole tokens
  static constexpr int kChunkTokens = kSortRows / TOPK;
  static_assert(E < 32768, "moe: expert ids are held as int16");

  // activated (gate_up's, else null) += the experts the rows chose: `llmc bench`'s count, which the device keeps
  // so that a CUDA graph's replays count too
  static __device__ __forceinline__ void run(const A* route, int T, int* start, int* order,
                                             unsigned long long* activated) {
    __shared__ int16_t expert[kSortRows];
    __shared__ int first[E + 1];
    const int rows = T * TOPK;
    for (int r = threadIdx.x; r < rows; r += kThreads)
      expert[r] = static_cast<int16_t>(wload(route[static_cast<int64_t>(r / TOPK) * 2 * TOPK + r % TOPK]));
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) {
      int c = 0;
      for (int r = 0; r < rows; ++r) c += expert[r] == e;
      first[e + 1] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long chosen = 0;
      for (int e = 0; e < E; ++e) chosen += first[e + 1] > 0;
      if (activated) atomicAdd(activated, chosen);
      first[0] = 0;
      for (int e = 0; e < E; ++e) first[e + 1] += first[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += kThreads) start[e] = first[e];
    for (int e = threadIdx.x; e < E; e += kThreads) {
      int at = first[e];
      for (int r = 0; r < rows; ++r)
        if (expert[r] == e) order[at++] = r;
    }
  }
};

// The rows of one expert's block (llmc_common.cuh DenseRows' interface): rows[i] = t * TOPK + j, sorted; x holds
// a row per token, or per (token, slot) with PER_SLOT; y a row per (token, slot). GATED: y holds the gate this
// launch's up multiplies into, silu(gate) * up.
template <int TOPK, bool PER_SLOT, bool GATED>
struct ExpertRows {
  static constexpr bool kGathered = true;
  const int* rows;
  __device__ __forceinline__ int64_t x_row(int r) const { return PER_SLOT ? rows[r] : rows[r] / TOPK; }
  __device__ __forceinline__ int64_t y_row(int r) const { return rows[r]; }
  template <typename A>
  __device__ __forceinline__ void store(A* p, float v) const {
    if constexpr (GATED)
      astore(p, gated_mul<false>(wload(*p), act_round<A>(v)));
    else
      astore(p, v);
  }
  template <typename A>
  __device__ __forceinline__ void store2(A* p, float a, float b) const {
    store(p, a);
    store(p + 1, b);
  }
};

// Grid row `tile` of a tiled expert GEMM of BM-row tiles: its expert e and that expert's sorted rows [first,
// first + count); false past the last tile.
template <int E, int BM>
__device__ __forceinline__ bool expert_tile(const int* start, int tile, int& e, int& first, int& count) {
#pragma unroll 1  // unrolled over 128 experts, ptxas spilled in the GEMM after it (sm_89, int4 K-quant down)
  for (e = 0; e < E; ++e) {
    const int c = start[e + 1] - start[e], tiles = ceil_div(c, BM);
    if (tile < tiles) {
      first = start[e] + tile * BM;
      count = min(BM, c - tile * BM);
      return true;
    }
    tile -= tiles;
  }
  return false;
}
// The most BM-row tiles that `rows` rows over E experts can need: each expert's last tile may be partial.
__host__ __device__ constexpr int expert_tiles_bound(int rows, int E, int BM) { return rows / BM + (E < rows ? E : rows); }

// Host, while `llmc profile` times the launches: the experts the last sort found rows for (start: its device
// array). The copy back waits for the stream, which only a timed step (no CUDA graph) pays.
template <int E1>
inline int experts_chosen(const int (&start)[E1], cudaStream_t stream) {
  int host[E1];
  cudaMemcpyFromSymbolAsync(host, start, sizeof host, 0, cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  int n = 0;
  for (int e = 0; e + 1 < E1; ++e) n += host[e + 1] > host[e];
  return n;
}

// The (layer, expert) pairs the gate/up GEMMs have read since the module loaded, for llmc_experts_activated:
// each gate/up kernel's device counter, registered by its launcher's first call.
inline std::vector<unsigned long long*>& experts_counters() {
  static std::vector<unsigned long long*> counters;
  return counters;
}
template <class Counter>
inline void register_experts_counter(const Counter& symbol) {
  void* p = nullptr;
  cudaGetSymbolAddress(&p, symbol);
  experts_counters().push_back(static_cast<unsigned long long*>(p));
}
inline void reset_experts_counters() {
  for (unsigned long long* c : experts_counters()) cudaMemset(c, 0, sizeof *c);
}
inline long long experts_activated() {
  unsigned long long total = 0;
  for (unsigned long long* c : experts_counters()) {
    unsigned long long v = 0;
    cudaMemcpy(&v, c, sizeof v, cudaMemcpyDeviceToHost);
    total += v;
  }
  return static_cast<long long>(total);
}

// combine: out[t] = sum over j of route's weight j times y's slot j, in slot order. A thread per output.
template <int H, int TOPK, typename A>
struct MoeCombine {
  static constexpr int kThreads = 256;

  static __device__ __forceinline__ void run(const A* y, const A* route, A* out, int T) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (i >= static_cast<int64_t>(T) * H) return;
    const int64_t t = i / H, h = i % H;
    const A* w = route + t * 2 * TOPK + TOPK;
    const A* yt = y + t * TOPK * H + h;
    float o = wload(w[0]) * wload(yt[0]);
#pragma unroll
    for (int j = 1; j < TOPK; ++j) o += wload(w[j]) * wload(yt[static_cast<int64_t>(j) * H]);
    astore(out + i, o);
  }
};

}  // namespace llmc
