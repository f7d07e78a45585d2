// Kernels with bugs the simulator must report. test_simulator.py runs each entry point in a subprocess,
// because the report ends the process (ASan, or llmc_sim's abort()).
#include "llmc_device.cuh"

__global__ void oob_write_kernel(float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  y[i] = 1.0f;  // no bounds check: the last block writes past the end of y
  (void)n;
}

// Everything synchronising, to show that fibers under ASan give no false reports.
__global__ void busy_kernel(const float* x, float* y) {
  LLMC_DYNAMIC_SMEM(float, buf);
  const int i = threadIdx.x;
  buf[i] = x[i];
  __syncthreads();
  float v = llmc::block_sum(buf[(i + 1) % blockDim.x]);
  v += llmc::warp_max(v);
  y[i] = v;
}

__global__ void half_barrier_kernel(float* y) {
  if (threadIdx.x < 16) return;  // 16 threads exit ...
  __syncthreads();               // ... and the others wait here for them
  y[threadIdx.x] = 1.0f;
}

__global__ void warp_divergent_kernel(float* y) {
  float v = threadIdx.x;
  if (threadIdx.x % 32 < 31) v = __shfl_xor_sync(0xffffffffu, v, 1);  // lane 31 never arrives
  __syncthreads();
  y[threadIdx.x] = v;
}

__global__ void racy_sum_kernel(const float* x, float* y) {
  __shared__ float s[64];
  s[threadIdx.x] = x[threadIdx.x];
  y[threadIdx.x] = s[(threadIdx.x + 7) % 64];  // no __syncthreads
}

extern "C" {
int oob_write(int n) {  // writes y[n] .. of an n-float buffer
  float* y;
  cudaMalloc(&y, n * sizeof(float));
  LLMC_LAUNCH(oob_write_kernel, (n + 31) / 32 + 1, 32, 0, 0, y, n);
  cudaFree(y);
  return cudaGetLastError();
}
int busy() {
  float *x, *y;
  cudaMalloc(&x, 128 * sizeof(float));
  cudaMalloc(&y, 128 * sizeof(float));
  for (int i = 0; i < 128; ++i) x[i] = static_cast<float>(i);
  for (int rep = 0; rep < 3; ++rep) LLMC_LAUNCH(busy_kernel, 4, 128, 128 * sizeof(float), 0, x, y);
  const int ok = y[0] == 2.0f * 8128.0f;
  cudaFree(x);
  cudaFree(y);
  return ok ? cudaGetLastError() : -1;
}
int half_barrier() {
  float y[64];
  LLMC_LAUNCH(half_barrier_kernel, 1, 64, 0, 0, y);
  return cudaGetLastError();
}
int warp_divergent() {
  float y[64];
  LLMC_LAUNCH(warp_divergent_kernel, 1, 64, 0, 0, y);
  return cudaGetLastError();
}
float racy_sum() {  // a checksum that depends on the thread order
  float x[64], y[64];
  for (int i = 0; i < 64; ++i) x[i] = static_cast<float>(i + 1);
  LLMC_LAUNCH(racy_sum_kernel, 1, 64, 0, 0, x, y);
  float s = 0.0f;
  for (int i = 0; i < 64; ++i) s += y[i] * static_cast<float>(i + 1);
  return s;
}
}
