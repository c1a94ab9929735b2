// Shared pieces of the albatross CUDA kernels: the glue to torch (argument checks, allocation, the
// current stream), dtype conversion and warp reductions.
//
// Host code speaks to torch only through its stable C ABI (torch/csrc/stable and the aoti_torch_*
// C functions, targeting torch 2.11): no C++ type crosses into libtorch, so one binary serves
// torch 2.11 and every later 2.x release, whatever the C++ compiler or CPython
// (docs/kernels.md, "One binary for several torch releases"). The ops' schemas are declared in
// Python (albatross/ops.py); a library registers only its CUDA kernels.
#pragma once

// The CUDA entry points of torch's C shim (the current stream) are declared under USE_CUDA.
#ifndef USE_CUDA
#define USE_CUDA
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

namespace albatross {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;
using OptionalTensor = std::optional<Tensor>;
using Sizes = torch::headeronly::IntHeaderOnlyArrayRef;

inline std::string device_name(const Tensor& t) {
  if (t.is_cuda()) return "cuda:" + std::to_string(t.get_device_index());
  if (t.is_cpu()) return "cpu";
  return "device type " + std::to_string(static_cast<int>(t.device().type()));
}

// Argument-check messages are built here with std::to_string rather than streamed: on the H200
// image, checks whose message streamed an integer (a size, a shape) once crashed the process with
// a segfault instead of raising (test_bad_kernel_arguments_raise_instead_of_crashing).
namespace detail {
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, ScalarType type) { out += torch::headeronly::toString(type); }
inline void append(std::string& out, Sizes sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  out += "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& out, T value) { out += std::to_string(value); }

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}
}  // namespace detail

// A failed check raises RuntimeError in Python with this message.
#define ALBATROSS_CHECK(COND, ...) STD_TORCH_CHECK(COND, ::albatross::detail::message(__VA_ARGS__))

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Inclusive prefix sum over the lanes of a warp, in lane order (every lane must call it).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T other = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += other;
  }
  return v;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---------------------------------------------------------------------------------------------
// Host side

inline void check_cuda(const Tensor& t, const char* name) {
  ALBATROSS_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", device_name(t));
}

inline void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_cuda(t, name);
  ALBATROSS_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols,
                  "], got ", t.sizes());
  ALBATROSS_CHECK(t.stride(1) == 1, name, " must have unit stride along its last dimension");
}

// The flat-batch row bookkeeping every slot-indexed op takes; returns the number of slots.
inline int64_t check_slots(const Tensor& slot_idx, const Tensor& cu_seqlens) {
  check_cuda(slot_idx, "slot_idx");
  check_cuda(cu_seqlens, "cu_seqlens");
  ALBATROSS_CHECK(slot_idx.scalar_type() == ScalarType::Int && slot_idx.dim() == 1 && slot_idx.is_contiguous(),
                  "slot_idx must be a contiguous int32 vector");
  const int64_t S = slot_idx.size(0);
  ALBATROSS_CHECK(cu_seqlens.scalar_type() == ScalarType::Int && cu_seqlens.dim() == 1 &&
                      cu_seqlens.size(0) == S + 1 && cu_seqlens.is_contiguous(),
                  "cu_seqlens must be a contiguous int32 vector of length len(slot_idx) + 1");
  return S;
}

// A new contiguous tensor on `like`'s device, with `like`'s dtype unless another is given. It comes
// from torch's caching allocator on the current stream, so it is safe inside a CUDA graph capture.
// (aoti_torch_empty_strided rather than a dispatcher call: a quarter of the host time.) A failure,
// such as running out of GPU memory, crosses the C ABI as an error code: torch logs its reason and
// this raises RuntimeError (not torch.OutOfMemoryError) naming the allocation.
inline Tensor new_empty(const Tensor& like, Sizes sizes, std::optional<ScalarType> dtype = std::nullopt) {
  constexpr int64_t kMaxDims = 8;
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  ALBATROSS_CHECK(ndim <= kMaxDims, "new_empty supports up to 8 dimensions, got ", ndim);
  int64_t strides[kMaxDims];
  int64_t step = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    strides[d] = step;
    step *= std::max<int64_t>(sizes[d], 1);
  }
  int32_t dtype_code = 0, device_type = 0;
  if (dtype.has_value()) {
    dtype_code = torch::stable::detail::to<int32_t>(torch::stable::detail::from(*dtype));
  } else {
    TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype_code));
  }
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  AtenTensorHandle handle = nullptr;
  const AOTITorchError status = aoti_torch_empty_strided(ndim, sizes.data(), strides, dtype_code, device_type,
                                                         like.get_device_index(), &handle);
  ALBATROSS_CHECK(status == AOTI_TORCH_SUCCESS, "could not allocate a ", sizes, " output on ", device_name(like),
                  " (out of memory? torch logged the reason)");
  return Tensor(handle);
}

inline Tensor new_empty(const Tensor& like, std::initializer_list<int64_t> sizes,
                        std::optional<ScalarType> dtype = std::nullopt) {
  return new_empty(like, Sizes(sizes.begin(), sizes.size()), dtype);
}

// A contiguous tensor of `like`'s shape, dtype and device (the inputs it is used for are contiguous).
inline Tensor empty_like(const Tensor& like) { return new_empty(like, like.sizes()); }

// The stream torch has made current for `t`'s device (the capture stream inside a CUDA graph capture).
inline cudaStream_t current_stream(const Tensor& t) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return static_cast<cudaStream_t>(stream);
}

// Makes `t`'s device current for the launch and restores the previous one afterwards.
using DeviceGuard = torch::stable::accelerator::DeviceGuard;

inline void check_launch() {
  const cudaError_t error = cudaGetLastError();
  ALBATROSS_CHECK(error == cudaSuccess, "CUDA kernel launch failed: ", cudaGetErrorString(error));
}

}  // namespace albatross

// Dispatch over fp32 / fp16 / bf16 with the CUDA type bound to NAME inside the body.
#define ALBATROSS_DISPATCH_FLOAT(DTYPE, NAME, WHAT, ...)                                            \
  [&] {                                                                                             \
    switch (DTYPE) {                                                                                \
      case ::albatross::ScalarType::Float: { using NAME = float; return __VA_ARGS__(); }            \
      case ::albatross::ScalarType::Half: { using NAME = __half; return __VA_ARGS__(); }            \
      case ::albatross::ScalarType::BFloat16: { using NAME = __nv_bfloat16; return __VA_ARGS__(); } \
      default: ALBATROSS_CHECK(false, WHAT, " must be float32, float16 or bfloat16, got ", DTYPE);  \
    }                                                                                               \
  }()
