// llmc_sim_math.h (part of llmc_sim.h): the device math intrinsics and integer/bit helpers that CUDA's
// headers declare for the device only, on the host: the fast approximations are the exact libm functions.
#pragma once

// math intrinsics (exact libm versions of the fast approximations)
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f)); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(floorf(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(ceilf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(static_cast<unsigned>(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll(static_cast<unsigned long long>(x)) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((static_cast<uint64_t>(hi) << 32) | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return static_cast<unsigned>((((static_cast<uint64_t>(hi) << 32) | lo) >> (s & 31)));
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((1ull * a * b) >> 32); }
inline int __mulhi(int a, int b) { return static_cast<int>((1ll * a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline int __mul24(int a, int b) { return (a << 8 >> 8) * (b << 8 >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffff) * (b & 0xffffff); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// fp16 / bf16 math that CUDA's headers declare for the device only: computed in float, rounded once
#define LLMC_SIM_HMATH(name, name2, expr)                                                        \
  inline __half name(__half a) { const float x = __half2float(a); return __float2half(expr); }   \
  inline __nv_bfloat16 name(__nv_bfloat16 a) {                                                   \
    const float x = __bfloat162float(a);                                                         \
    return __float2bfloat16(expr);                                                               \
  }                                                                                              \
  inline __half2 name2(__half2 a) {                                                              \
    const float lo = [](float x) { return expr; }(__low2float(a));                               \
    const float hi = [](float x) { return expr; }(__high2float(a));                              \
    return __floats2half2_rn(lo, hi);                                                            \
  }                                                                                              \
  inline __nv_bfloat162 name2(__nv_bfloat162 a) {                                                \
    const float lo = [](float x) { return expr; }(__low2float(a));                               \
    const float hi = [](float x) { return expr; }(__high2float(a));                              \
    return __floats2bfloat162_rn(lo, hi);                                                        \
  }
LLMC_SIM_HMATH(hexp, h2exp, expf(x))
LLMC_SIM_HMATH(hexp2, h2exp2, exp2f(x))
LLMC_SIM_HMATH(hlog, h2log, logf(x))
LLMC_SIM_HMATH(hlog2, h2log2, log2f(x))
LLMC_SIM_HMATH(hsqrt, h2sqrt, sqrtf(x))
LLMC_SIM_HMATH(hrsqrt, h2rsqrt, 1.0f / sqrtf(x))
LLMC_SIM_HMATH(hrcp, h2rcp, 1.0f / x)
LLMC_SIM_HMATH(hsin, h2sin, sinf(x))
LLMC_SIM_HMATH(hcos, h2cos, cosf(x))
#undef LLMC_SIM_HMATH
inline __half __hfma(__half a, __half b, __half c) {
  return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c)));
}
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16(fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  return __floats2half2_rn(fmaf(__low2float(a), __low2float(b), __low2float(c)),
                           fmaf(__high2float(a), __high2float(b), __high2float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __floats2bfloat162_rn(fmaf(__low2float(a), __low2float(b), __low2float(c)),
                               fmaf(__high2float(a), __high2float(b), __high2float(c)));
}
