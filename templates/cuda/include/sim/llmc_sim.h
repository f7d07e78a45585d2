// sim/llmc_sim.h: the llmc CUDA simulator. A .cu file compiled by g++ with -DLLMC_SIMULATOR includes this
// header (through llmc_device.cuh) instead of the CUDA runtime, and runs its kernels on the host CPU.
//
// Model:
// - The threads of a block run as ucontext fibers on the calling OS thread; blocks run one at a time, in an
//   order shuffled with the seed. threadIdx/blockIdx/blockDim/gridDim are globals set by the scheduler.
// - A thread runs until it reaches a sync point (__syncthreads, a warp primitive, __nanosleep) or exits.
//   Which runnable thread goes next is chosen at random from the seed (LLMC_SIM_SEED, or
//   llmc_sim_set_seed()), so a data race shows up as a result that changes with the seed.
// - Warp primitives (shuffles, votes, __syncwarp, mma, ldmatrix) are barriers among the lanes of the mask:
//   all of them arrive, the values are exchanged, then all continue. The lanes must agree on the op, the
//   mask and the call site; .aligned ops (mma, ldmatrix) need all 32 lanes.
// - __syncthreads completes when every thread of the block waits at the same __syncthreads. A thread that
//   exited before it, a warp op that can never complete, or threads at different barriers are reported as an
//   error ("llmc_sim: error: ...") and abort() instead of hanging.
// - Static __shared__ variables are C++ statics (blocks run one at a time, so all threads of the block see
//   the same storage); they start zeroed and keep their values from block to block. The dynamic shared
//   memory buffer (LLMC_DYNAMIC_SMEM) is filled with 0xFF bytes before every block, so reading dynamic
//   shared memory the block did not write gives NaN / -1.
// - cp.async (llmc_device.cuh wrappers) reads its source at issue, fills the destination with 0xFF bytes,
//   and writes the data only at the cp_async_wait that retires its group, so a read before the wait shows.
// - mma.sync / ldmatrix gather the operands of all 32 lanes by the PTX fragment layouts; mma products are
//   exact and summed in double (hardware differs in the last bits: compare with a tolerance).
// - Built with -fsanitize=address, fiber switches are annotated for ASan. Fiber stacks are 64 KB (256 KB under
//   ASan), or LLMC_SIM_STACK_KB / llmc_sim_set_stack_size(bytes); an overflow is reported as such.
// - cudaMalloc & co. work on host memory, so host code compiles unchanged. Launches are serialized; a bad
//   launch configuration sets the error that cudaGetLastError() returns, as on a GPU.
//
// Parts, in this folder (templates/cuda/include/sim), included below in dependency order:
//   llmc_sim_fibers.h   state, threads as fibers, fatal errors, the seeded random choice
//   llmc_sim_mma.h      tensor-core emulation (mma.sync, ldmatrix) from the PTX fragment layouts
//   llmc_sim_warp.h     warp collectives: shuffles, votes, reduces, __syncwarp
//   llmc_sim_memory.h   dynamic shared memory, cp.async, the stack-overflow report, the host runtime API
//   llmc_sim_launch.h   the block scheduler, kernel launch, built-in variables, __syncthreads
//   llmc_sim_math.h     device math and bit intrinsics on the host
//   llmc_sim_profile.h  the counters of `llmc profile --simulate` (only with -DLLMC_SIM_PROFILE)
// Build: compiler/codegen/simulator.py build_simulated() (g++ -x c++ -std=c++17 -O1 -DLLMC_SIMULATOR
// -I templates/cuda/include -I <cuda>/include -fPIC -shared).
// Limits: no preemption between sync points (a thread spinning on a value another thread of the block
// writes must call __nanosleep in the loop, or it hangs); no inter-block waiting; memory visibility is
// sequentially consistent (weak-memory bugs other than missing barriers are not exposed).
#pragma once
#ifndef LLMC_SIMULATOR
#error "llmc_sim.h is the g++ simulator header: compile with -DLLMC_SIMULATOR, or include llmc_device.cuh"
#endif

#include <ucontext.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>  // before __noinline__ is defined: shared_ptr_base.h spells __attribute__((__noinline__))
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) && !defined(LLMC_SIM_PROFILE)  // the profiling build's kernel-address
#define LLMC_SIM_ASAN 1                                               // hooks count, they check nothing
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// counters of the profiling build (llmc_sim_profile.h): hooks that are empty in every other build
#if defined(LLMC_SIM_PROFILE)
#include <cstddef>
extern "C" {
void llmc_sim_prof_launch_begin(const void* kernel);
void llmc_sim_prof_launch_end();
void llmc_sim_prof_block_begin();
void llmc_sim_prof_block_end();
void llmc_sim_prof_alloc(const void* p, size_t n);
void llmc_sim_prof_free(const void* p);
void llmc_sim_prof_mma();
void llmc_sim_prof_ldmatrix(const void* const* rows, int num);
void llmc_sim_prof_access(const void* addr, size_t n, int store, const void* site);
}
#define LLMC_SIM_PROF(call) call
// the simulator's own data movement (cp.async, ldmatrix, mma) counts itself: not instrumented
#define LLMC_SIM_UNCOUNTED __attribute__((no_sanitize_address))
#define LLMC_SIM_SHARED_SECTION __attribute__((section("llmc_sim_smem")))
#else
#define LLMC_SIM_PROF(call) ((void)0)
#define LLMC_SIM_UNCOUNTED
#define LLMC_SIM_SHARED_SECTION
#endif


// CUDA qualifiers. Defined before CUDA's headers, which keep definitions that already exist.
#define __host__
#define __device__
#define __global__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static LLMC_SIM_SHARED_SECTION

// <cuda_runtime.h> / <cuda_runtime_api.h> become no-ops (cuda_fp16.h would pull in the latter): this header
// defines the runtime functions itself, with C++ linkage, so they never bind to a libcudart in the process.
#ifndef __CUDA_RUNTIME_H__
#define __CUDA_RUNTIME_H__
#endif
#ifndef __CUDA_RUNTIME_API_H__
#define __CUDA_RUNTIME_API_H__
#endif
#include <driver_types.h>
#include <vector_types.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "llmc_sim_fibers.h"
#include "llmc_sim_mma.h"
#include "llmc_sim_warp.h"
#include "llmc_sim_memory.h"
#include "llmc_sim_launch.h"
#include "llmc_sim_math.h"
#include "llmc_sim_profile.h"

// ---------------------------------------------------------------------------------------------------
// entry points for a host (e.g. Python through ctypes) that loads the built .so
extern "C" {
__attribute__((used, visibility("default"))) inline void llmc_sim_set_seed(unsigned long long seed) {
  llmc_sim::set_seed(seed);
}
__attribute__((used, visibility("default"))) inline void llmc_sim_set_stack_size(unsigned long long bytes) {
  llmc_sim::g.stack_request = bytes;
}
__attribute__((used, visibility("default"))) inline int llmc_sim_get_last_error() {
  return static_cast<int>(cudaGetLastError());
}
}
