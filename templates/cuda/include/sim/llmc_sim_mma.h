// llmc_sim_mma.h (part of llmc_sim.h): tensor-core emulation. A warp's mma.sync or ldmatrix completes when
// all 32 lanes have arrived (llmc_sim_warp.h); then these functions gather every lane's operand registers or
// row addresses by the PTX fragment layouts and write every lane's results. The wrappers that kernels call
// are in llmc_device.cuh.
#pragma once

namespace llmc_sim {

inline float bits_to_float(uint16_t b, bool f16) {
  if (f16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 from the PTX fragment layouts:
// A: lane 4*(m%8) + (k%8)/2, reg m/8 + 2*(k/8), half k%2; B: lane 4*n + (k%8)/2, reg k/8, half k%2;
// C/D: lane 4*(m%8) + n/2, reg 2*(m/8) + n%2. Products are exact; the sum is done in double.
LLMC_SIM_UNCOUNTED inline void do_mma(unsigned w) {
  Thread* L = &g.th[32 * w];
  LLMC_SIM_PROF(llmc_sim_prof_mma());
  const bool f16 = L[0].a0 == 1;
  auto half_of = [](uint32_t reg, int h) { return static_cast<uint16_t>(h ? reg >> 16 : reg & 0xffff); };
  float A[16][16], B[16][8], C[16][8];
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const uint32_t* a = static_cast<const uint32_t*>(L[4 * (m % 8) + (k % 8) / 2].p[0]);
      A[m][k] = bits_to_float(half_of(a[m / 8 + 2 * (k / 8)], k % 2), f16);
    }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      const uint32_t* b = static_cast<const uint32_t*>(L[4 * n + (k % 8) / 2].p[1]);
      B[k][n] = bits_to_float(half_of(b[k / 8], k % 2), f16);
    }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) C[m][n] = static_cast<const float*>(L[4 * (m % 8) + n / 2].p[2])[2 * (m / 8) + n % 2];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[m][k]) * static_cast<double>(B[k][n]);
      static_cast<float*>(L[4 * (m % 8) + n / 2].q)[2 * (m / 8) + n % 2] = static_cast<float>(acc);
    }
}

// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: lane 8j+r gives the address of row r of
// matrix j; lane t's register j = {M_j[t/4][2(t%4)], M_j[t/4][2(t%4)+1]} (.trans: M_j transposed).
LLMC_SIM_UNCOUNTED inline void do_ldmatrix(unsigned w) {
  Thread* L = &g.th[32 * w];
  const int num = L[0].a0;
  const bool trans = L[0].a1 != 0;
  uint16_t M[4][8][8];
  for (int j = 0; j < num; ++j)
    for (int r = 0; r < 8; ++r) {
      const void* row = L[8 * j + r].p[0];
      if (reinterpret_cast<uintptr_t>(row) % 16)
        fatal("ldmatrix: lane %d gives a row address %p that is not 16-byte aligned (%s:%d)", 8 * j + r, row,
              L[0].file, L[0].line);
      std::memcpy(M[j][r], row, 16);
    }
#if defined(LLMC_SIM_PROFILE)
  const void* rows[32];
  for (int l = 0; l < 8 * num; ++l) rows[l] = L[l].p[0];
  llmc_sim_prof_ldmatrix(rows, num);
#endif
  for (int t = 0; t < 32; ++t) {
    uint32_t* regs = static_cast<uint32_t*>(L[t].q);
    for (int j = 0; j < num; ++j) {
      uint16_t lo, hi;
      if (!trans) {
        lo = M[j][t / 4][2 * (t % 4)];
        hi = M[j][t / 4][2 * (t % 4) + 1];
      } else {
        lo = M[j][2 * (t % 4)][t / 4];
        hi = M[j][2 * (t % 4) + 1][t / 4];
      }
      regs[j] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
}

}  // namespace llmc_sim
