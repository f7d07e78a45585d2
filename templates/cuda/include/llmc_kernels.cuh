// llmc_kernels.cuh: the device code of the CUDA kernel templates (templates/cuda/*.cu.j2).
//
// The templates are thin: each renders `__global__` wrappers that call the static device functions of one
// config struct of the headers below (its template arguments are the op's compile-time parameters), plus one
// host launcher `static void name(<the CPU signature>, cudaStream_t stream)` that takes its grid and block from
// the same struct and launches through LLMC_LAUNCH. A generated model.cu includes this header once, before the
// kernels.
//
// Numerics: every accumulation is float32. Activations (the A of each config: the step's buffers), weights and
// the KV cache are float or uint16_t (bf16 bits), widened to float on load; a bf16 activation is rounded to
// nearest even where it is stored, at the points where transformers' bf16 modules round (a GEMM's output, the
// residual sum, the normalized row before its weight), and the tensor-core paths take it as it is (a float x
// is rounded to bf16 there). With float activations nothing rounds. Every result is
// computed by one thread, one warp or one block in a fixed order; the one split reduction (paged attention's
// KV splits) is combined in split order whichever block finishes last, its only atomic a counter. So a run is
// bit-reproducible (and seed-independent under the simulator). expf/sincosf/sqrtf/division are the accurate
// (non-fast-math) versions.
//
// Headers: llmc_common.cuh (shared helpers), llmc_elementwise.cuh (embedding, rmsnorm, rope, silu_mul,
// gather_rows), llmc_gemm.cuh (gemm, gemm_swiglu), llmc_attention.cuh (paged_attention), llmc_qgemm.cuh (qgemm),
// llmc_moe.cuh (moe_route, moe_gemm, moe_qgemm, moe_combine).
#pragma once

#include "llmc_common.cuh"
#include "llmc_elementwise.cuh"
#include "llmc_gemm.cuh"
#include "llmc_attention.cuh"
#include "llmc_qgemm.cuh"  // quantized GEMMs (w8a16 / w4a16)
#include "llmc_moe.cuh"
