// llmc CPU target: calling TVM-generated fallback kernels.
#pragma once

#include "llmc_base.h"

namespace llmc {

// --- calling TVM-generated fallback kernels (tvm_call.cc.j2) ---------------------------------------
// TVM's C backend exports `int32_t f(void* self, TVMFFIAny* args, int32_t num_args, TVMFFIAny* result)`,
// where each tensor argument is a DLTensor pointer. These mirror dlpack's DLTensor and tvm-ffi's TVMFFIAny
// (both fixed C ABIs), so model.cc needs neither project's headers.
struct DLTensorABI {
  void* data;
  int32_t device_type, device_id;  // DLDevice
  int32_t ndim;
  uint8_t code, bits;  // DLDataType
  uint16_t lanes;
  const int64_t* shape;
  const int64_t* strides;
  uint64_t byte_offset;
};
static_assert(sizeof(DLTensorABI) == 48, "DLTensor is 48 bytes");
struct FFIAnyABI {
  int32_t type_index;
  uint32_t zero_padding;
  void* v_ptr;
};
static_assert(sizeof(FFIAnyABI) == 16, "TVMFFIAny is 16 bytes");
using TvmFunc = int32_t (*)(void*, void*, int32_t, void*);
constexpr int32_t kFFIDLTensorPtr = 7, kDLCPU = 1, kDLFloat = 2;

// Calls f on N float32 CPU tensors; nonzero when TVM's argument checks fail (message on stderr).
template <int N>
inline int call_tvm(TvmFunc f, float* const (&data)[N], const int64_t* const (&shapes)[N], const int (&ndims)[N]) {
  DLTensorABI tensors[N];
  FFIAnyABI args[N];
  for (int i = 0; i < N; ++i) {
    tensors[i] = DLTensorABI{data[i], kDLCPU, 0, ndims[i], kDLFloat, 32, 1, shapes[i], nullptr, 0};
    args[i] = FFIAnyABI{kFFIDLTensorPtr, 0, &tensors[i]};
  }
  FFIAnyABI result{0, 0, nullptr};
  return f(nullptr, args, N, &result);
}

}  // namespace llmc
