// llmc CPU target: the standard headers, intrinsics and macros every kernel header uses.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || \
    (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define LLMC_RESTRICT __restrict__
#define LLMC_INLINE inline __attribute__((always_inline))
#define LLMC_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define LLMC_UNROLL LLMC_PRAGMA(unroll)
#else
#define LLMC_UNROLL LLMC_PRAGMA(GCC unroll 16)
#endif
