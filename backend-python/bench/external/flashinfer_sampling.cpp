// Torch ops over the FlashInfer sampling launchers (flashinfer_sampling.h), for
// bench/bench_external.py: torch.ops.albatross_bench_flashinfer.{softmax, top_k_top_p_from_probs,
// top_p_from_probs}. Inputs are checked here, so a wrong dtype or shape is an error, not a bad read.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "flashinfer_sampling.h"

namespace albatross_bench {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, what, " failed: ", cudaGetErrorString(status));
}

void check_matrix(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), name,
              " must be a contiguous fp32 CUDA matrix [rows, vocab]");
  TORCH_CHECK(x.size(1) % kFlashinferVec == 0, name, ": the vocabulary must be a multiple of ", kFlashinferVec);
}

void check_rows(const at::Tensor& x, at::ScalarType dtype, int64_t rows, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == dtype && x.dim() == 1 && x.size(0) == rows && x.is_contiguous(), name,
              " must be a contiguous CUDA vector of ", rows, " ", c10::toString(dtype));
}

// FlashInfer reads Philox seeds and offsets as uint64; int64 tensors of non-negative values have
// the same bits.
const uint64_t* as_u64(const at::Tensor& x) { return reinterpret_cast<const uint64_t*>(x.data_ptr<int64_t>()); }

at::Tensor softmax(const at::Tensor& logits, const at::Tensor& workspace, double temperature) {
  check_matrix(logits, "logits");
  TORCH_CHECK(workspace.is_cuda() && workspace.scalar_type() == at::kByte && workspace.is_contiguous(),
              "workspace must be a contiguous uint8 CUDA buffer");
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor probs = at::empty_like(logits);
  check_cuda(flashinfer_softmax(logits.data_ptr<float>(), probs.data_ptr<float>(), logits.size(0), logits.size(1),
                                static_cast<float>(temperature), workspace.data_ptr(), workspace.numel(),
                                c10::cuda::getCurrentCUDAStream()),
             "flashinfer OnlineSoftmax");
  return probs;
}

std::tuple<at::Tensor, at::Tensor> top_k_top_p_from_probs(const at::Tensor& probs, const at::Tensor& top_k,
                                                          const at::Tensor& top_p, const at::Tensor& seed,
                                                          const at::Tensor& offset) {
  check_matrix(probs, "probs");
  const int64_t rows = probs.size(0);
  check_rows(top_k, at::kInt, rows, "top_k");
  check_rows(top_p, at::kFloat, rows, "top_p");
  check_rows(seed, at::kLong, rows, "seed");
  check_rows(offset, at::kLong, rows, "offset");
  const c10::cuda::CUDAGuard guard(probs.device());
  at::Tensor ids = at::empty({rows}, probs.options().dtype(at::kInt));
  at::Tensor valid = at::empty({rows}, probs.options().dtype(at::kBool));
  check_cuda(flashinfer_top_k_top_p(probs.data_ptr<float>(), top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(),
                                    ids.data_ptr<int32_t>(), valid.data_ptr<bool>(), rows, probs.size(1),
                                    as_u64(seed), as_u64(offset), c10::cuda::getCurrentCUDAStream()),
             "flashinfer TopKTopPSamplingFromProb");
  return {ids, valid};
}

std::tuple<at::Tensor, at::Tensor> top_p_from_probs(const at::Tensor& probs, const at::Tensor& top_p,
                                                    const at::Tensor& seed, const at::Tensor& offset) {
  check_matrix(probs, "probs");
  const int64_t rows = probs.size(0);
  check_rows(top_p, at::kFloat, rows, "top_p");
  check_rows(seed, at::kLong, rows, "seed");
  check_rows(offset, at::kLong, rows, "offset");
  const c10::cuda::CUDAGuard guard(probs.device());
  at::Tensor ids = at::empty({rows}, probs.options().dtype(at::kInt));
  at::Tensor valid = at::empty({rows}, probs.options().dtype(at::kBool));
  check_cuda(flashinfer_top_p(probs.data_ptr<float>(), top_p.data_ptr<float>(), ids.data_ptr<int32_t>(),
                              valid.data_ptr<bool>(), rows, probs.size(1), as_u64(seed), as_u64(offset),
                              c10::cuda::getCurrentCUDAStream()),
             "flashinfer TopPSamplingFromProb");
  return {ids, valid};
}

}  // namespace
}  // namespace albatross_bench

TORCH_LIBRARY(albatross_bench_flashinfer, m) {
  m.def("softmax(Tensor logits, Tensor(a!) workspace, float temperature) -> Tensor");
  m.def("top_k_top_p_from_probs(Tensor probs, Tensor top_k, Tensor top_p, Tensor seed, Tensor offset) -> (Tensor, Tensor)");
  m.def("top_p_from_probs(Tensor probs, Tensor top_p, Tensor seed, Tensor offset) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(albatross_bench_flashinfer, CUDA, m) {
  m.impl("softmax", &albatross_bench::softmax);
  m.impl("top_k_top_p_from_probs", &albatross_bench::top_k_top_p_from_probs);
  m.impl("top_p_from_probs", &albatross_bench::top_p_from_probs);
}
