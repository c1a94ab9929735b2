// Shared helpers for the albatross CUDA kernels: dtype conversion and argument checks.
#pragma once

#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace albatross {

// Argument-check messages are built here rather than by TORCH_CHECK's stream formatting: on the
// H200 image, every TORCH_CHECK in these libraries whose message streamed an integer (a size, a
// shape) crashed the process with a segfault instead of raising, while messages of strings,
// dtypes and a CPU device raised cleanly, and so did torch's own integer messages. Integers and
// shapes go through std::to_string instead (test_bad_kernel_arguments_raise_instead_of_crashing).
namespace detail {
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, c10::ScalarType type) { out += c10::toString(type); }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
inline void append(std::string& out, at::IntArrayRef sizes) {
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

// TORCH_CHECK with a message from detail::message.
#define ALBATROSS_CHECK(COND, ...) TORCH_CHECK(COND, ::albatross::detail::message(__VA_ARGS__))

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

// The CUDA type behind a torch dtype, so that kernels template on real device types.
template <typename T>
struct cuda_type { using type = T; };
template <>
struct cuda_type<at::Half> { using type = __half; };
template <>
struct cuda_type<at::BFloat16> { using type = __nv_bfloat16; };

inline void check_cuda(const at::Tensor& t, const char* name) {
  ALBATROSS_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
}

inline void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_cuda(t, name);
  ALBATROSS_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols,
              "], got ", t.sizes());
  ALBATROSS_CHECK(t.stride(1) == 1, name, " must have unit stride along its last dimension");
}

// The flat-batch row bookkeeping every slot-indexed op takes; returns the number of slots.
inline int64_t check_slots(const at::Tensor& slot_idx, const at::Tensor& cu_seqlens) {
  check_cuda(slot_idx, "slot_idx");
  check_cuda(cu_seqlens, "cu_seqlens");
  ALBATROSS_CHECK(slot_idx.scalar_type() == at::kInt && slot_idx.dim() == 1 && slot_idx.is_contiguous(),
                  "slot_idx must be a contiguous int32 vector");
  const int64_t S = slot_idx.size(0);
  ALBATROSS_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.dim() == 1 && cu_seqlens.size(0) == S + 1 &&
                      cu_seqlens.is_contiguous(),
                  "cu_seqlens must be a contiguous int32 vector of length len(slot_idx) + 1");
  return S;
}

}  // namespace albatross

// Dispatch over fp32 / fp16 / bf16 with the CUDA type bound to NAME inside the body.
#define ALBATROSS_DISPATCH_FLOAT(DTYPE, NAME, WHAT, ...)                                   \
  [&] {                                                                                    \
    switch (DTYPE) {                                                                       \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }                       \
      case at::kHalf: { using NAME = __half; return __VA_ARGS__(); }                       \
      case at::kBFloat16: { using NAME = __nv_bfloat16; return __VA_ARGS__(); }            \
      default: ALBATROSS_CHECK(false, WHAT, " must be float32, float16 or bfloat16, got ", DTYPE); \
    }                                                                                      \
  }()
