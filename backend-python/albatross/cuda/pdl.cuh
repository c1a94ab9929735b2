// Programmatic dependent launch (compute capability 9.0+): a kernel launched with
// `launch_after_preceding` may start while the kernel before it in the stream is still running, if
// that kernel has called `allow_dependents_to_launch` (or as its blocks exit). Everything it does
// before `wait_for_preceding_grid` must not read what the preceding kernel writes, nor write what
// that kernel reads; after it, the preceding grid has completed and its writes are visible.
//
// Why: at batch 1 a decode step is ~550 short kernels, and between two weight products the
// device's memory idles while one or two of them (layer norm, token shift, group norm) run. A
// product launched this way starts streaming its weights (which no kernel writes) during them.
// Stream capture turns such launches into programmatic edges, so CUDA graphs keep the overlap.
// On older devices both device calls compile to nothing and the launch is an ordinary one.
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include "common.cuh"

namespace albatross {

__device__ __forceinline__ void allow_dependents_to_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Pulls the 128-byte line holding `p` into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Whether launches on `device` may overlap their predecessor: compute capability 9.0+, unless
// ALBATROSS_PDL=0 (read once; comparisons and a way out if a driver mishandles the edges).
inline bool overlap_allowed(int device) {
  static const bool enabled = [] {
    const char* value = std::getenv("ALBATROSS_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  // Written once per device with the same value by any thread that gets here first: a benign race.
  static int major[64] = {0};
  if (!enabled || device < 0 || device >= 64) return false;
  if (major[device] == 0) {
    int value = 0;
    const cudaError_t error = cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device);
    ALBATROSS_CHECK(error == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(error));
    major[device] = value;
  }
  return major[device] >= 9;
}

// kernel<<<grid, block, shared, stream>>>(args...), allowed to overlap the preceding kernel where
// overlap_allowed says so. The caller checks the launch (check_launch).
template <typename... Params, typename... Args>
void launch_after_preceding(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream, int device,
                            Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = overlap_allowed(device) ? 1 : 0;
  const cudaError_t error = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  ALBATROSS_CHECK(error == cudaSuccess, "CUDA kernel launch failed: ", cudaGetErrorString(error));
}

}  // namespace albatross
