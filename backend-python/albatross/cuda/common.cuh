// Shared helpers for the albatross CUDA kernels: dtype conversion and argument checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

namespace albatross {

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
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
}

inline void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  check_cuda(t, name);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols,
              "], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, name, " must have unit stride along its last dimension");
}

}  // namespace albatross

// Dispatch over fp32 / fp16 / bf16 with the CUDA type bound to NAME inside the body.
#define ALBATROSS_DISPATCH_FLOAT(DTYPE, NAME, WHAT, ...)                                   \
  [&] {                                                                                    \
    switch (DTYPE) {                                                                       \
      case at::kFloat: { using NAME = float; return __VA_ARGS__(); }                       \
      case at::kHalf: { using NAME = __half; return __VA_ARGS__(); }                       \
      case at::kBFloat16: { using NAME = __nv_bfloat16; return __VA_ARGS__(); }            \
      default: TORCH_CHECK(false, WHAT, " must be float32, float16 or bfloat16, got ", DTYPE); \
    }                                                                                      \
  }()
