// The TVM runtime functions that TVM-generated C (tvm_kernels.cc) calls, so that model.so needs no TVM
// runtime library. Built only into modules that have tvm_call kernels; linked with -Bsymbolic so these
// definitions win even in a process that has TVM loaded.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "tvm/ffi/c_api.h"
#include "tvm/runtime/c_backend_api.h"

extern "C" {

void* TVMBackendAllocWorkspace(int, int, uint64_t nbytes, int, int) {
  return std::aligned_alloc(64, (nbytes + 63) / 64 * 64 + 64);
}

int TVMBackendFreeWorkspace(int, int, void* ptr) {
  std::free(ptr);
  return 0;
}

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  std::fprintf(stderr, "llmc: TVM fallback kernel: %s: ", kind);
  for (int32_t i = 0; i < num_parts; ++i) std::fputs(parts[i], stderr);
  std::fputc('\n', stderr);
}

void TVMFFIErrorSetRaisedFromCStr(const char* kind, const char* message) {
  std::fprintf(stderr, "llmc: TVM fallback kernel: %s: %s\n", kind, message);
}

}  // extern "C"
