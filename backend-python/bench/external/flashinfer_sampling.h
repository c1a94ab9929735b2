// Launchers of FlashInfer's sampling kernels, in plain CUDA types: flashinfer_sampling_kernels.cu
// (FlashInfer headers, no torch headers, so nvcc stays fast) defines them and
// flashinfer_sampling.cpp (torch headers, no FlashInfer) binds them as torch ops.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace albatross_bench {

// The kernels are built for vocabularies that are a multiple of this (4-wide fp32 loads).
constexpr uint32_t kFlashinferVec = 4;

// probs = softmax(logits / temperature), rows x vocab, through FlashInfer's OnlineSoftmax (its
// small-batch path splits the vocabulary and needs `workspace`, 1 MiB is plenty).
cudaError_t flashinfer_softmax(const float* logits, float* probs, uint32_t rows, uint32_t vocab, float temperature,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

// One id per row from probs, keeping a token when fewer than top_k[row] tokens are more likely and
// their mass is below top_p[row] (FlashInfer's "joint" filter). Philox seed and offset per row;
// valid[row] is false when the kernel found no token.
cudaError_t flashinfer_top_k_top_p(const float* probs, const int32_t* top_k, const float* top_p, int32_t* ids,
                                   bool* valid, uint32_t rows, uint32_t vocab, const uint64_t* seed,
                                   const uint64_t* offset, cudaStream_t stream);

// The same with the top-p filter only.
cudaError_t flashinfer_top_p(const float* probs, const float* top_p, int32_t* ids, bool* valid, uint32_t rows,
                             uint32_t vocab, const uint64_t* seed, const uint64_t* offset, cudaStream_t stream);

}  // namespace albatross_bench
