// Split-K GEMV for decode at small batch: y[b, r, n] = sum_k x[b, r, k] * W[b, k, n] for 1-4 rows r,
// W [K, N] row-major in fp16 or bf16 (the model stores its matrices [in, out]), fp32 accumulation.
//
// At batch 1 a decode step reads every weight once and does two flops per byte, so it is bound by
// how fast the weights stream in. Each thread owns 8 adjacent output columns (one 16-byte load of a
// W row) and a warp spans 256 columns of one row, so a warp's load is 512 contiguous bytes; the 8
// warps of a block walk interleaved rows of the block's K range, UNROLL rows in flight each. A
// matrix is cut into 256-column tiles and its K range into `splits` pieces so that every SM has a
// few blocks (a 4096 x 4096 matrix is only 16 tiles). Each block writes its partial sums to a
// workspace; the block that finishes a tile last (an atomic counter per tile) adds the tile's
// partials (split_k.cuh: the result does not depend on which block came last), writes y and
// resets the counter to zero for the next call (the caller keeps one zeroed counter buffer per
// device). No second launch: at batch 1 a launch costs about as much as a small matrix's bytes.
// Launched to overlap the kernel before it (pdl.cuh): every block pulls its first kPrefetchRows
// rows into L2 before it waits for that kernel, whose output x is the only input it writes.

#include "pdl.cuh"
#include "split_k.cuh"

namespace albatross {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;                                 // columns per thread: one 16-byte load
constexpr int kWarps = kThreads / 32;                   // interleaved k rows of a block
constexpr int kTileN = 32 * kVec;                       // 256 columns per tile
constexpr int kUnroll = 4;                              // rows in flight per warp
constexpr int kKStep = kWarps * kUnroll;                // a split's K range is a multiple of this
constexpr int kMaxRows = 4;
constexpr int kPrefetchRows = 64;                       // rows per block pulled into L2 before the wait: 32 KB
constexpr int kMaxSplitK = 2048;                        // x slice in shared memory: 4 rows x 2048 fp32 = 32 KB
constexpr int kReduceBytes = kWarps * kMaxRows * kTileN * 4;  // 32 KB

template <typename T, int R>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const T* __restrict__ x, const int64_t x_batch_stride,
                                                        const int64_t x_row_stride, const T* __restrict__ W,
                                                        const int64_t w_batch_stride, float* __restrict__ partial,
                                                        int* __restrict__ counters, T* __restrict__ y, const int K,
                                                        const int N, const int k_per_split, const int splits) {
  const int tile = blockIdx.x, split = blockIdx.y, batch = blockIdx.z, tiles = gridDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k_begin = split * k_per_split;
  const int k_count = min(K, k_begin + k_per_split) - k_begin;
  x += batch * x_batch_stride;
  W += batch * w_batch_stride;

  const int n0 = tile * kTileN + lane * kVec;
  if (n0 < N && (lane & 7) == 0) {  // before the wait: one thread per 128-byte line of a row's 512 bytes
    const T* first = W + (int64_t)k_begin * N + n0;
    for (int row = warp; row < min(k_count, kPrefetchRows); row += kWarps) prefetch_l2(first + (int64_t)row * N);
  }
  wait_for_preceding_grid();

  extern __shared__ __align__(16) float smem[];  // the x slice [R][k_count], later the warps' sums
  for (int i = threadIdx.x; i < R * k_count; i += kThreads) {
    const int r = i / k_count, kk = i - r * k_count;
    smem[r * k_per_split + kk] = to_float(x[r * x_row_stride + k_begin + kk]);
  }
  __syncthreads();

  float acc[R][kVec];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < kVec; ++c) acc[r][c] = 0.f;
  if (n0 < N) {  // N is a multiple of 8 (checked): a thread's 8 columns are all in range or all out
    const T* column = W + (int64_t)k_begin * N + n0;
    auto accumulate = [&](const uint4& raw, int kk) {
      const T* w = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float xv = smem[r * k_per_split + kk];  // one address for the whole warp: a broadcast
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[r][c] = fmaf(xv, to_float(w[c]), acc[r][c]);
      }
    };
    int kk = warp;
    for (; kk + (kUnroll - 1) * kWarps < k_count; kk += kKStep) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(reinterpret_cast<const uint4*>(column + (int64_t)(kk + u * kWarps) * N));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) accumulate(raw[u], kk + u * kWarps);
    }
    for (; kk < k_count; kk += kWarps) accumulate(__ldcs(reinterpret_cast<const uint4*>(column + (int64_t)kk * N)), kk);
  }

  // Sums over the block's warps, in warp order: first this split's partial for the tile, then, in
  // the tile's last block, y.
  float* sums = smem;  // [kWarps][R][kTileN]
  auto sum_warps = [&](auto emit) {
    __syncthreads();  // the x slice (or the partials' sums) is no longer read
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < kVec; ++c) sums[(warp * R + r) * kTileN + lane * kVec + c] = acc[r][c];
    __syncthreads();
    for (int i = threadIdx.x; i < R * kTileN; i += kThreads) {
      const int r = i / kTileN, col = i - r * kTileN, n = tile * kTileN + col;
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < kWarps; ++q) s += sums[(q * R + r) * kTileN + col];
      if (n < N) emit(r, n, s);
    }
  };
  float* mine = partial + ((int64_t)(batch * splits + split) * R) * N;
  sum_warps([&](int r, int n, float s) { mine[(int64_t)r * N + n] = s; });

  // The last block of this tile to get here adds every split's partial.
  __threadfence();  // this block's partial is visible to the block that sums
  __shared__ bool last;
  __syncthreads();
  int* counter = counters + batch * tiles + tile;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < kVec; ++c) acc[r][c] = 0.f;
  if (n0 < N) add_partials_by_warp<R, kVec, kWarps>(partial + (int64_t)batch * splits * R * N, splits, N, n0, warp, acc);
  T* out = y + (int64_t)batch * R * N;
  sum_warps([&](int r, int n, float s) { out[(int64_t)r * N + n] = from_float<T>(s); });
  if (threadIdx.x == 0) *counter = 0;  // stream order makes the next call see zero
}

// x [B, R, K] (or [R, K]), W [B, K, N] (or [K, N]) -> y [B, R, N] (or [R, N]).
Tensor gemv_cuda(const Tensor& x, const Tensor& W, Tensor counters) {
  check_cuda(x, "x");
  check_cuda(W, "W");
  check_cuda(counters, "counters");
  const bool batched = W.dim() == 3;
  ALBATROSS_CHECK(W.dim() == 2 || batched, "W must be [K, N] or [B, K, N], got ", W.sizes());
  ALBATROSS_CHECK(x.dim() == W.dim(), "x must be [R, K] with a [K, N] W, or [B, R, K] with a [B, K, N] W; got ",
                  x.sizes(), " and ", W.sizes());
  const int64_t d = W.dim();  // explicit indices: the stable ABI's size() takes no negative dims
  const int64_t B = batched ? W.size(0) : 1, K = W.size(d - 2), N = W.size(d - 1), R = x.size(d - 2);
  ALBATROSS_CHECK(!batched || x.size(0) == B, "x and W must have the same batch size");
  ALBATROSS_CHECK(x.size(d - 1) == K, "x has ", x.size(d - 1), " columns for a W of ", K, " rows");
  ALBATROSS_CHECK(R >= 1 && R <= kMaxRows, "gemv takes 1 to 4 rows, got ", R);
  ALBATROSS_CHECK(x.scalar_type() == W.scalar_type(), "x must have W's dtype ", W.scalar_type());
  ALBATROSS_CHECK(W.scalar_type() == ScalarType::Half || W.scalar_type() == ScalarType::BFloat16,
                  "gemv takes float16 or bfloat16, got ", W.scalar_type());
  ALBATROSS_CHECK(W.is_contiguous() && N % kVec == 0 && reinterpret_cast<uintptr_t>(W.data_ptr()) % 16 == 0,
                  "W must be contiguous, 16-byte aligned, with a multiple of 8 columns");
  ALBATROSS_CHECK(x.stride(d - 1) == 1, "x must have unit stride along its last dimension");
  ALBATROSS_CHECK(x.device() == W.device() && counters.device() == W.device(), "x, W and counters must share a device");
  ALBATROSS_CHECK(counters.scalar_type() == ScalarType::Int && counters.is_contiguous(),
                  "counters must be contiguous int32");
  ALBATROSS_CHECK(K >= 1 && K <= INT_MAX && N <= INT_MAX && B <= 65535, "matrix too large for one launch");

  const int64_t tiles = (N + kTileN - 1) / kTileN;
  ALBATROSS_CHECK(tiles * B <= counters.numel(), "counters holds ", counters.numel(), " tiles, this call needs ",
                  tiles * B);
  const DeviceGuard guard(W.get_device_index());
  if (N == 0 || B == 0) return batched ? new_empty(W, {B, R, N}) : new_empty(W, {R, N});
  const int64_t k_per_split = split_rows(K, tiles * B, W.get_device_index(), kKStep, kMaxSplitK);
  const int64_t splits = (K + k_per_split - 1) / k_per_split;
  ALBATROSS_CHECK(splits <= 65535, "K too large for one launch");

  Tensor y = batched ? new_empty(W, {B, R, N}) : new_empty(W, {R, N});
  Tensor partial = new_empty(W, {B, splits, R, N}, ScalarType::Float);
  const int64_t x_batch_stride = batched ? x.stride(0) : 0, x_row_stride = x.stride(d - 2);
  const size_t shared = std::max<size_t>(R * k_per_split * sizeof(float), kWarps * R * kTileN * sizeof(float));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  const cudaStream_t stream = current_stream(W);
  auto launch = [&](auto type_tag, auto rows_tag) {
    using T = decltype(type_tag);
    constexpr int Rows = decltype(rows_tag)::value;
    launch_after_preceding(gemv_kernel<T, Rows>, grid, dim3(kThreads), shared, stream, W.get_device_index(),
                           static_cast<const T*>(x.data_ptr()), x_batch_stride, x_row_stride, static_cast<const T*>(W.data_ptr()),
        batched ? W.stride(0) : 0, static_cast<float*>(partial.data_ptr()), static_cast<int*>(counters.data_ptr()),
        static_cast<T*>(y.data_ptr()), static_cast<int>(K), static_cast<int>(N), static_cast<int>(k_per_split),
        static_cast<int>(splits));
  };
  auto by_rows = [&](auto type_tag) {
    switch (R) {
      case 1: return launch(type_tag, std::integral_constant<int, 1>{});
      case 2: return launch(type_tag, std::integral_constant<int, 2>{});
      case 3: return launch(type_tag, std::integral_constant<int, 3>{});
      default: return launch(type_tag, std::integral_constant<int, 4>{});
    }
  };
  if (W.scalar_type() == ScalarType::Half) {
    by_rows(__half{});
  } else {
    by_rows(__nv_bfloat16{});
  }
  check_launch();
  return y;
}

static_assert(kMaxRows * kMaxSplitK * 4 <= 48 * 1024 && kReduceBytes <= 48 * 1024, "shared memory within the default limit");

}  // namespace
}  // namespace albatross

// The schema is declared in albatross/ops.py.
STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m) { m.impl("gemv", TORCH_BOX(&albatross::gemv_cuda)); }
