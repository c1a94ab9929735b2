// Launches FlashInfer's header-only sampling kernels (flashinfer/sampling.cuh, Apache-2.0; the
// headers travel in .whl-ext/flashinfer-include and are never committed) for
// bench/bench_external.py. Nothing in the server uses this.
//
// The sampling kernels are launched in the one instantiation an H200 takes: 1024 threads (what
// FlashInfer picks for sm >= 80), 4-wide fp32 loads, deterministic scans (FlashInfer's Python
// default). FlashInfer's own host launchers instantiate every block size x vector width x
// determinism, which multiplies the build time for nothing here.

#include <flashinfer/sampling.cuh>

#include "flashinfer_sampling.h"

namespace albatross_bench {
namespace {

namespace fs = flashinfer::sampling;

constexpr uint32_t kThreads = 1024;
constexpr bool kDeterministic = true;
using Storage = fs::SamplingTempStorage<kThreads, fs::SCAN_ALGO, fs::REDUCE_ALGO>;

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Storage));
}

}  // namespace

cudaError_t flashinfer_softmax(const float* logits, float* probs, uint32_t rows, uint32_t vocab, float temperature,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return fs::OnlineSoftmax<float>(const_cast<float*>(logits), probs, rows, vocab, /*temperature_arr=*/nullptr,
                                  temperature, workspace, workspace_bytes, /*enable_pdl=*/false, stream);
}

cudaError_t flashinfer_top_k_top_p(const float* probs, const int32_t* top_k, const float* top_p, int32_t* ids,
                                   bool* valid, uint32_t rows, uint32_t vocab, const uint64_t* seed,
                                   const uint64_t* offset, cudaStream_t stream) {
  if (vocab % kFlashinferVec != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  auto kernel = fs::TopKTopPSamplingFromProbKernel<kThreads, fs::SCAN_ALGO, fs::REDUCE_ALGO, kFlashinferVec,
                                                   kDeterministic, float, int32_t>;
  if (cudaError_t status = allow_smem(kernel); status != cudaSuccess) return status;
  // seed/offset stride 1: one Philox stream per row; top_k_val/top_p_val unused (arrays given)
  kernel<<<rows, kThreads, sizeof(Storage), stream>>>(
      const_cast<float*>(probs), const_cast<int32_t*>(top_k), const_cast<float*>(top_p), ids, valid,
      /*indices=*/nullptr, /*top_k_val=*/0, /*top_p_val=*/0.f, vocab, const_cast<uint64_t*>(seed), /*seed_val=*/0,
      const_cast<uint64_t*>(offset), /*offset_val=*/0, /*seed_stride=*/1u, /*offset_stride=*/1u);
  return cudaGetLastError();
}

cudaError_t flashinfer_top_p(const float* probs, const float* top_p, int32_t* ids, bool* valid, uint32_t rows,
                             uint32_t vocab, const uint64_t* seed, const uint64_t* offset, cudaStream_t stream) {
  if (vocab % kFlashinferVec != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  auto kernel = fs::TopPSamplingFromProbKernel<kThreads, fs::SCAN_ALGO, fs::REDUCE_ALGO, kFlashinferVec,
                                               kDeterministic, float, int32_t>;
  if (cudaError_t status = allow_smem(kernel); status != cudaSuccess) return status;
  kernel<<<rows, kThreads, sizeof(Storage), stream>>>(
      const_cast<float*>(probs), ids, valid, /*indices=*/nullptr, const_cast<float*>(top_p), /*top_p_val=*/0.f, vocab,
      const_cast<uint64_t*>(seed), /*seed_val=*/0, const_cast<uint64_t*>(offset), /*offset_val=*/0,
      /*seed_stride=*/1u, /*offset_stride=*/1u);
  return cudaGetLastError();
}

}  // namespace albatross_bench
