// Small kernels that exercise the simulator and the device header. Built by test_simulator.py with g++
// (simulator) and with nvcc -cubin for sm_80 / sm_89 / sm_90 (ptxas spill check). The extern "C" host
// functions take host pointers: under the simulator device memory is host memory.
#include "llmc_device.cuh"

// ---- block reduction: per block, the sum and max of its n inputs -----------------------------------
__global__ void block_reduce_kernel(const float* x, int n, float* out) {
  const float* row = x + static_cast<size_t>(blockIdx.x) * n;
  float s = 0.0f, m = -INFINITY;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    s += row[i];
    m = fmaxf(m, row[i]);
  }
  s = llmc::block_sum(s);
  m = llmc::block_max(m);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = s;
    out[2 * blockIdx.x + 1] = m;
  }
}

// ---- warp shuffles and votes, and the counting barriers: 15 results per thread --------------------------------------------------
constexpr int kWarpOut = 15;
__global__ void warp_ops_kernel(int* out) {
  const unsigned lane = threadIdx.x & 31u;
  int* o = out + threadIdx.x * kWarpOut;
  const int v = static_cast<int>(threadIdx.x) * 10;
  o[0] = __shfl_sync(0xffffffffu, v, (lane + 3) % 32);
  o[1] = __shfl_up_sync(0xffffffffu, v, 2);
  o[2] = __shfl_down_sync(0xffffffffu, v, 5, 16);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 7, 8);
  o[4] = __shfl_xor_sync(0xffffffffu, v, 16, 16);  // target in a later segment: own value
  o[5] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[6] = __any_sync(0xffffffffu, lane == 31) + 2 * __all_sync(0xffffffffu, lane < 32) + 4 * __all_sync(0xffffffffu, lane < 31);
  o[7] = static_cast<int>(__reduce_add_sync(0xffffffffu, lane));
  o[8] = (lane < 16) ? __shfl_sync(0x0000ffffu, v, 15 - lane) : -1;  // half-warp mask
  const double d = __shfl_sync(0xffffffffu, 0.5 + threadIdx.x * 1e10, 31 - lane);  // 64-bit value
  o[9] = static_cast<int>((d - 0.5) / 1e10);
  o[10] = static_cast<int>(llmc::warp_sum(static_cast<float>(lane)));
  o[11] = static_cast<int>(llmc::warp_max(static_cast<float>((lane * 7) % 32)));
  o[12] = __syncthreads_count(lane % 2);
  o[13] = __syncthreads_and(threadIdx.x < 64) + 2 * __syncthreads_and(threadIdx.x != 3);
  o[14] = __syncthreads_or(threadIdx.x == 5) + 2 * __syncthreads_or(0);
}

// ---- dynamic shared memory: reverse each block's slice --------------------------------------------
__global__ void reverse_kernel(const float* x, float* y) {
  LLMC_DYNAMIC_SMEM(float, buf);
  const int n = blockDim.x, base = blockIdx.x * n;
  buf[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  y[base + threadIdx.x] = buf[n - 1 - threadIdx.x];
}

// ---- mma.sync m16n8k16: fragments loaded straight from global by the PTX formulas --------------------
// A [16][16] row-major, Bt [8][16] (B transposed: K contiguous), C, D [16][8] f32.
__global__ void mma_kernel(const uint16_t* A, const uint16_t* Bt, const float* C, float* D, int is_f16) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  uint32_t a[4], b[2];
  float c[4];
  for (int r = 0; r < 4; ++r)
    a[r] = *reinterpret_cast<const uint32_t*>(&A[(g + 8 * (r & 1)) * 16 + 2 * t + 8 * (r >> 1)]);
  for (int r = 0; r < 2; ++r) b[r] = *reinterpret_cast<const uint32_t*>(&Bt[g * 16 + 2 * t + 8 * r]);
  for (int i = 0; i < 4; ++i) c[i] = C[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  if (is_f16) llmc::mma_m16n8k16_f16(c, a, b, c);
  else llmc::mma_m16n8k16_bf16(c, a, b, c);
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = c[i];
}

// ---- a tiled GEMM as real kernels write it: cp.async -> smem, ldmatrix A (x4) and B (x4.trans) -> mma.
// A [M][K] row-major bf16, B [K][N] row-major bf16 (N contiguous), D [M][N] f32. One warp per 16x16
// output tile, K a multiple of 16; blockDim = 32 * (M/16), gridDim = N/16.
template <int M, int K>
__global__ void gemm_kernel(const uint16_t* A, const uint16_t* B, float* D, int N) {
  __shared__ __align__(16) uint16_t sa[M * K];
  __shared__ __align__(16) uint16_t sb[K * 16];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n0 = blockIdx.x * 16;
  for (int c = tid; c < M * K / 8; c += blockDim.x) llmc::cp_async_16(&sa[c * 8], &A[c * 8]);
  for (int c = tid; c < K * 2; c += blockDim.x) llmc::cp_async_16(&sb[c * 8], &B[(c / 2) * N + n0 + (c % 2) * 8]);
  llmc::cp_async_commit();
  llmc::cp_async_wait<0>();
  __syncthreads();
  float acc[2][4] = {};
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4], b[4];
    llmc::ldmatrix_x4(a, &sa[(warp * 16 + lane % 16) * K + k0 + (lane / 16) * 8]);
    llmc::ldmatrix_x4_trans(b, &sb[(k0 + lane % 16) * 16 + (lane / 16) * 8]);
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    llmc::mma_m16n8k16_bf16(acc[0], a, b0, acc[0]);
    llmc::mma_m16n8k16_bf16(acc[1], a, b1, acc[1]);
  }
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < 4; ++i) D[(warp * 16 + g + 8 * (i >> 1)) * N + n0 + j * 8 + 2 * t + (i & 1)] = acc[j][i];
}

// ---- ldmatrix: lane 8j+r points at row rows[8j+r] (8 u16 each) of a [32][8] u16 table ----------------
template <int NUM, bool TRANS>
__global__ void ldmatrix_kernel(const uint16_t* table, const int* rows, uint32_t* out) {
  __shared__ __align__(16) uint16_t s[32 * 8];
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * 8; i += 32) s[i] = table[i];
  __syncwarp();
  uint32_t r[NUM];
  const uint16_t* row = &s[rows[lane] * 8];
  if constexpr (NUM == 1) { if (TRANS) llmc::ldmatrix_x1_trans(r, row); else llmc::ldmatrix_x1(r, row); }
  if constexpr (NUM == 2) { if (TRANS) llmc::ldmatrix_x2_trans(r, row); else llmc::ldmatrix_x2(r, row); }
  if constexpr (NUM == 4) { if (TRANS) llmc::ldmatrix_x4_trans(r, row); else llmc::ldmatrix_x4(r, row); }
  for (int j = 0; j < NUM; ++j) out[lane * NUM + j] = r[j];
}

// ---- cp.async: zero-fill, and two groups retired one at a time ---------------------------------------
// Thread i copies 16 bytes (4 floats) of x into chunk i of stage 0 with src_bytes = zfill[i], and chunk i of
// stage 1 in a second group. out0: stage 0 after wait<1> (the older group), read by the thread to its right
// after a __syncthreads; out1: the thread's own stage-1 chunk before its group is waited for (the simulator
// shows 0xFF bytes there); out2: stage 1 after wait<0>.
__global__ void cp_async_kernel(const float* x, const int* zfill, float* out0, float* out1, float* out2) {
  __shared__ __align__(16) float stage[2][64 * 4];
  const int i = threadIdx.x, n = blockDim.x, right = (i + 1) % n;
  llmc::cp_async_16_zfill(&stage[0][4 * i], &x[4 * i], zfill[i]);
  llmc::cp_async_commit();
  llmc::cp_async_16(&stage[1][4 * i], &x[4 * (n + i)]);
  llmc::cp_async_commit();
  llmc::cp_async_wait<1>();
  __syncthreads();
  for (int e = 0; e < 4; ++e) out0[4 * i + e] = stage[0][4 * right + e];
  for (int e = 0; e < 4; ++e) out1[4 * i + e] = stage[1][4 * i + e];
  llmc::cp_async_wait<0>();
  for (int e = 0; e < 4; ++e) out2[4 * i + e] = stage[1][4 * i + e];
}

// ---- a race: each thread reads its neighbour's shared slot with no barrier in between -----------------
__global__ void racy_kernel(const float* x, float* y, int sync) {
  __shared__ float s[64];
  const int i = threadIdx.x, n = blockDim.x;
  s[i] = x[blockIdx.x * n + i];
  if (sync) __syncthreads();
  y[blockIdx.x * n + i] = s[(i + 1) % n];
  if (sync) __syncthreads();
  s[i] = -1.0f;  // makes a stale read visible too
}

#ifdef LLMC_SIMULATOR
// ---- a fiber stack overflow (simulator only): a 1 MB local array in a 64 KB stack ----------------------
__global__ void big_stack_kernel(float* y) {
  volatile float big[256 * 1024];
  for (int i = 0; i < 256 * 1024; i += 1024) big[i] = static_cast<float>(i);
  y[threadIdx.x] = big[1024 * threadIdx.x];
}
extern "C" int stack_overflow(float* y) {
  LLMC_LAUNCH(big_stack_kernel, 1, 32, 0, 0, y);
  return cudaGetLastError();
}
#endif

// ---- host entry points ---------------------------------------------------------------------------
extern "C" {
int block_reduce(const float* x, int rows, int n, int threads, float* out) {
  LLMC_LAUNCH(block_reduce_kernel, rows, threads, 0, 0, x, n, out);
  return cudaGetLastError();
}
int warp_ops(int threads, int* out) {
  LLMC_LAUNCH(warp_ops_kernel, 1, threads, 0, 0, out);
  return cudaGetLastError();
}
// Goes through cudaMalloc / cudaMemcpy like real host code. max_smem > 0 sets the kernel attribute first.
int reverse(const float* x, float* y, int blocks, int threads, int max_smem) {
  float *dx, *dy;
  const size_t bytes = sizeof(float) * blocks * threads;
  cudaMalloc(&dx, bytes);
  cudaMalloc(&dy, bytes);
  cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice);
  cudaMemset(dy, 0, bytes);
  if (max_smem > 0) cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  const size_t smem = max_smem > 0 ? max_smem : sizeof(float) * threads;
  LLMC_LAUNCH(reverse_kernel, blocks, threads, smem, 0, dx, dy);
  const int err = cudaGetLastError();
  cudaDeviceSynchronize();
  cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(dy);
  return err;
}
int reverse_too_much_smem(const float* x, float* y) {
  LLMC_LAUNCH(reverse_kernel, 1, 32, 64 * 1024, 0, x, y);
  return cudaGetLastError();
}
int mma(const uint16_t* A, const uint16_t* Bt, const float* C, float* D, int is_f16) {
  LLMC_LAUNCH(mma_kernel, 1, 32, 0, 0, A, Bt, C, D, is_f16);
  return cudaGetLastError();
}
int gemm_32x48(const uint16_t* A, const uint16_t* B, float* D, int N) {  // M = 32, K = 48, N % 16 == 0
  LLMC_LAUNCH((gemm_kernel<32, 48>), N / 16, 64, 0, 0, A, B, D, N);
  return cudaGetLastError();
}
int ldmatrix(int num, int trans, const uint16_t* table, const int* rows, uint32_t* out) {
  if (num == 1 && !trans) LLMC_LAUNCH((ldmatrix_kernel<1, false>), 1, 32, 0, 0, table, rows, out);
  if (num == 2 && !trans) LLMC_LAUNCH((ldmatrix_kernel<2, false>), 1, 32, 0, 0, table, rows, out);
  if (num == 4 && !trans) LLMC_LAUNCH((ldmatrix_kernel<4, false>), 1, 32, 0, 0, table, rows, out);
  if (num == 1 && trans) LLMC_LAUNCH((ldmatrix_kernel<1, true>), 1, 32, 0, 0, table, rows, out);
  if (num == 2 && trans) LLMC_LAUNCH((ldmatrix_kernel<2, true>), 1, 32, 0, 0, table, rows, out);
  if (num == 4 && trans) LLMC_LAUNCH((ldmatrix_kernel<4, true>), 1, 32, 0, 0, table, rows, out);
  return cudaGetLastError();
}
int cp_async(const float* x, const int* zfill, int threads, float* out0, float* out1, float* out2) {
  LLMC_LAUNCH(cp_async_kernel, 1, threads, 0, 0, x, zfill, out0, out1, out2);
  return cudaGetLastError();
}
int racy(const float* x, float* y, int blocks, int threads, int sync) {
  LLMC_LAUNCH(racy_kernel, blocks, threads, 0, 0, x, y, sync);
  return cudaGetLastError();
}
}
