// llmc CPU target: helpers shared by every kernel of a generated model.cc.
//
// The kernel templates (templates/cpu/*.cc.j2) are thin: each renders one `static void name(...)`
// that fixes the compile-time sizes and calls one inline function of the headers included below.
//
// Numerics. Activations are float32; weights are float32 or bf16 (uint16_t, widened with `<< 16`).
// Built without -ffast-math: every reduction has one fixed order. A dot product of length K is
// always summed the same way (one accumulator of Vec::W lanes, a masked tail, a fixed horizontal
// sum), whether it runs alone (T = 1, decode) or in a register tile (prefill), on whichever thread.
// Work is split across rows / outputs / heads, never inside one reduction, so a row's result does not
// depend on T, on its neighbours in the batch, or on the thread count.
//
// SIMD: AVX-512 (F+BW+VL) intrinsics, else AVX2+FMA intrinsics, else a portable 8-lane fallback. bf16 GEMMs
// run on AMX tiles where the host has them (llmc_gemm_amx.h), in that instruction's own order.
// Threads: llmc's own small pool (parallel_for, llmc_pool.h), sized by OpenMP's thread count.
#pragma once

#include "llmc_pool.h"
#include "llmc_simd.h"
#include "llmc_elementwise.h"
#include "llmc_gemm.h"
#include "llmc_gemm_amx.h"
#include "llmc_qgemm.h"
#include "llmc_qembedding.h"
#include "llmc_moe.h"
#include "llmc_attention.h"
#include "llmc_tvm_abi.h"
