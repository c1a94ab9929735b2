// Split-K int8 GEMV for decode at small batch (W8A16): y[b, r, n] = scale[b, n] * sum_k x[b, r, k] * q[b, k, n]
// for 1-4 rows r; q [K, N] int8 row-major (the model stores its matrices [in, out]), scale [N] fp32
// (one per output channel, so it leaves the sum), x and y fp16 or bf16, fp32 accumulation.
//
// The fp16 GEMV's scheme (gemv.cu) with one-byte weights: a batch-1 step streams every weight
// once, so reading 1 byte instead of 2 is the whole gain. Each thread owns 16 adjacent output
// columns (one 16-byte load of a q row) and a warp spans 512 columns of one row, so a warp's load
// is 512 contiguous bytes; the 8 warps of a block walk interleaved rows of the block's K range,
// UNROLL rows in flight each. A matrix is cut into 512-column tiles and its K range into `splits`
// pieces so every SM has a few blocks. Each block writes its partial sums to a workspace; the
// block that finishes a tile last (an atomic counter per tile) adds the partials in split order
// (the result does not depend on which block came last), multiplies by the scale, writes y and
// resets the counter (the caller keeps one zeroed counter buffer per device). One launch.
//
// Launched to overlap the kernel before it (pdl.cuh): before waiting for that kernel, each warp
// loads its first group of weight rows into registers and every block pulls its next
// kPrefetchRows rows into L2, so at batch 1 the weights stream while the preceding layer norm or
// token shift runs. Only x (and the workspace, written after the wait) depends on that kernel.
//
// Bytes become floats without the int-to-float conversion unit (a quarter of the FMA rate, which
// would cap the stream below the copy bandwidth): a byte b, biased to b + 128, is placed in the low
// mantissa byte of 2^23 (one byte permute), and 2^23 + 128 is subtracted (one add). Exact.

#include "pdl.cuh"
#include "split_k.cuh"

namespace albatross {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 16;                     // int8 columns per thread: one 16-byte load
constexpr int kWarps = kThreads / 32;        // interleaved k rows of a block
constexpr int kTileN = 32 * kVec;            // 512 columns per tile
constexpr int kUnroll = 4;                   // rows in flight per warp
constexpr int kKStep = kWarps * kUnroll;     // a split's K range is a multiple of this
constexpr int kMaxRows = 4;
constexpr int kMaxSplitK = 2048;             // x slice in shared memory: 4 rows x 2048 fp32 = 32 KB
// A split's least rows (128 KB of weights a block), above split_rows' ~4 blocks an SM: a small
// matrix's blocks then stream enough rows to hide their fixed chain (first weights, x slice,
// reduction, partial's store, fence, counter) and the last block adds fewer partials. On an H100,
// 4096 x 4096 at 1 row: 15.3 us in 64 splits of 64 rows, 12.3 us in 16 of 256; the larger shapes
// already got 256 and were slower with 128 (docs/performance.md, session 12).
constexpr int kMinSplitK = 256;
static_assert(kMinSplitK % kKStep == 0 && kMinSplitK <= kMaxSplitK, "the floor is a whole number of k steps within the cap");
constexpr int kReduceBytes = kWarps * kTileN * 4;  // one row's warp sums at a time: 16 KB
constexpr float kMagic = 8388736.f;          // 2^23 + 128
constexpr int kPrefetchRows = 64;            // rows per block pulled into L2 before the wait: 32 KB

// The four signed bytes of `word` as floats, in byte order.
__device__ __forceinline__ void bytes_to_floats(uint32_t word, float* out) {
  const uint32_t biased = word ^ 0x80808080u;  // b + 128 as an unsigned byte
  out[0] = __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7540)) - kMagic;
  out[1] = __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7541)) - kMagic;
  out[2] = __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7542)) - kMagic;
  out[3] = __int_as_float(__byte_perm(biased, 0x4B000000u, 0x7543)) - kMagic;
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads) int8_gemv_kernel(const T* __restrict__ x, const int64_t x_batch_stride,
                                                             const int64_t x_row_stride, const int8_t* __restrict__ q,
                                                             const float* __restrict__ scale, float* __restrict__ partial,
                                                             int* __restrict__ counters, T* __restrict__ y, const int K,
                                                             const int N, const int k_per_split, const int splits) {
  const int tile = blockIdx.x, split = blockIdx.y, batch = blockIdx.z, tiles = gridDim.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k_begin = split * k_per_split;
  const int k_count = min(K, k_begin + k_per_split) - k_begin;
  x += batch * x_batch_stride;
  q += (int64_t)batch * K * N;
  scale += (int64_t)batch * N;

  const int n0 = tile * kTileN + lane * kVec;
  const int8_t* column = q + (int64_t)k_begin * N + n0;
  // Before the wait: nothing here reads what the preceding kernel writes.
  int kk = warp;
  const bool full = n0 < N && kk + (kUnroll - 1) * kWarps < k_count;
  uint4 current[kUnroll], next[kUnroll];
  auto load_group = [&](int first, uint4* raw) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(reinterpret_cast<const uint4*>(column + (int64_t)(first + u * kWarps) * N));
  };
  if (full) load_group(kk, current);
  if (n0 < N && (lane & 7) == 0) {  // one thread per 128-byte line of a row's 512 bytes
    const int last = min(k_count, kKStep + kPrefetchRows);
    for (int row = kKStep + warp; row < last; row += kWarps) prefetch_l2(column + (int64_t)row * N);
  }
  wait_for_preceding_grid();

  extern __shared__ __align__(16) float smem[];  // the x slice [R][k_count], later one row's warp sums
  for (int i = threadIdx.x; i < R * k_count; i += kThreads) {
    const int r = i / k_count, k = i - r * k_count;
    smem[r * k_per_split + k] = to_float(x[r * x_row_stride + k_begin + k]);
  }
  __syncthreads();

  float acc[R][kVec];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < kVec; ++c) acc[r][c] = 0.f;
  if (n0 < N) {  // N is a multiple of 16 (checked): a thread's 16 columns are all in range or all out
    auto accumulate = [&](const uint4& raw, int row) {
      float w[kVec];
      bytes_to_floats(raw.x, w);
      bytes_to_floats(raw.y, w + 4);
      bytes_to_floats(raw.z, w + 8);
      bytes_to_floats(raw.w, w + 12);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float xv = smem[r * k_per_split + row];  // one address for the whole warp: a broadcast
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc[r][c] = fmaf(xv, w[c], acc[r][c]);
      }
    };
    // Software-pipelined: the next group's kUnroll loads are issued before this group's sums, so
    // a warp keeps 2 * kUnroll rows in flight and the loads' latency hides behind the arithmetic.
    // The first group was loaded before the wait.
    while (full) {
      const int following = kk + kKStep;
      const bool more = following + (kUnroll - 1) * kWarps < k_count;
      if (more) load_group(following, next);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) accumulate(current[u], kk + u * kWarps);
      kk = following;
      if (!more) break;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) current[u] = next[u];
    }
    for (; kk < k_count; kk += kWarps) accumulate(__ldcs(reinterpret_cast<const uint4*>(column + (int64_t)kk * N)), kk);
  }

  // The block's sum over its warps, in warp order, one row at a time (all rows at once would need
  // 64 KB of shared memory), then this split's partial for the tile.
  float* mine = partial + ((int64_t)(batch * splits + split) * R) * N;
  float* sums = smem;  // [kWarps][kTileN]
#pragma unroll
  for (int r = 0; r < R; ++r) {
    __syncthreads();  // the x slice (or the previous row's sums) is no longer read
    float4* row_sums = reinterpret_cast<float4*>(sums + warp * kTileN + lane * kVec);
#pragma unroll
    for (int c = 0; c < kVec / 4; ++c) row_sums[c] = make_float4(acc[r][4 * c], acc[r][4 * c + 1], acc[r][4 * c + 2], acc[r][4 * c + 3]);
    __syncthreads();
    for (int col = threadIdx.x; col < kTileN; col += kThreads) {
      const int n = tile * kTileN + col;
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += sums[w * kTileN + col];
      if (n < N) mine[(int64_t)r * N + n] = s;
    }
  }

  // The last block of this tile to get here adds every split's partial, in split order.
  __threadfence();  // this block's partial is visible to the block that sums
  __shared__ bool last;
  __syncthreads();
  int* counter = counters + batch * tiles + tile;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const float* all = partial + (int64_t)batch * splits * R * N;
  for (int i = threadIdx.x; i < R * kTileN; i += kThreads) {
    const int r = i / kTileN, n = tile * kTileN + (i - r * kTileN);
    if (n >= N) continue;
    float s = 0.f;
    for (int p = 0; p < splits; ++p) s += __ldcg(all + ((int64_t)p * R + r) * N + n);  // L2: written by other SMs
    y[((int64_t)batch * R + r) * N + n] = from_float<T>(s * scale[n]);
  }
  if (threadIdx.x == 0) *counter = 0;  // stream order makes the next call see zero
}

// x [B, R, K] (or [R, K]), q [B, K, N] (or [K, N]) int8, scale [B, N] (or [N]) fp32 -> y [B, R, N] (or [R, N]).
Tensor int8_gemv_cuda(const Tensor& x, const Tensor& q, const Tensor& scale, Tensor counters) {
  check_cuda(x, "x");
  check_cuda(q, "q");
  check_cuda(scale, "scale");
  check_cuda(counters, "counters");
  const bool batched = q.dim() == 3;
  ALBATROSS_CHECK(q.dim() == 2 || batched, "q must be [K, N] or [B, K, N], got ", q.sizes());
  ALBATROSS_CHECK(x.dim() == q.dim(), "x must be [R, K] with a [K, N] q, or [B, R, K] with a [B, K, N] q; got ", x.sizes(),
                  " and ", q.sizes());
  const int64_t d = q.dim();  // explicit indices: the stable ABI's size() takes no negative dims
  const int64_t B = batched ? q.size(0) : 1, K = q.size(d - 2), N = q.size(d - 1), R = x.size(d - 2);
  ALBATROSS_CHECK(!batched || x.size(0) == B, "x and q must have the same batch size");
  ALBATROSS_CHECK(x.size(d - 1) == K, "x has ", x.size(d - 1), " columns for a q of ", K, " rows");
  ALBATROSS_CHECK(R >= 1 && R <= kMaxRows, "int8_gemv takes 1 to 4 rows, got ", R);
  ALBATROSS_CHECK(x.scalar_type() == ScalarType::Half || x.scalar_type() == ScalarType::BFloat16,
                  "x must be float16 or bfloat16, got ", x.scalar_type());
  ALBATROSS_CHECK(q.scalar_type() == ScalarType::Char, "q must be int8, got ", q.scalar_type());
  ALBATROSS_CHECK(q.is_contiguous() && N % kVec == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
                  "q must be contiguous, 16-byte aligned, with a multiple of 16 columns");
  ALBATROSS_CHECK(scale.scalar_type() == ScalarType::Float && scale.is_contiguous() && scale.dim() == d - 1 &&
                      scale.size(d - 2) == N && (!batched || scale.size(0) == B),
                  "scale must be contiguous float32 [N] (or [B, N]) matching q");
  ALBATROSS_CHECK(x.stride(d - 1) == 1, "x must have unit stride along its last dimension");
  ALBATROSS_CHECK(x.device() == q.device() && scale.device() == q.device() && counters.device() == q.device(),
                  "x, q, scale and counters must share a device");
  ALBATROSS_CHECK(counters.scalar_type() == ScalarType::Int && counters.is_contiguous(), "counters must be contiguous int32");
  ALBATROSS_CHECK(K >= 1 && K <= INT_MAX && N <= INT_MAX && B <= 65535, "matrix too large for one launch");

  const int64_t tiles = (N + kTileN - 1) / kTileN;
  ALBATROSS_CHECK(tiles * B <= counters.numel(), "counters holds ", counters.numel(), " tiles, this call needs ", tiles * B);
  const DeviceGuard guard(q.get_device_index());
  if (N == 0 || B == 0) return batched ? new_empty(x, {B, R, N}) : new_empty(x, {R, N});
  const int64_t k_per_split =
      std::max<int64_t>(split_rows(K, tiles * B, q.get_device_index(), kKStep, kMaxSplitK), kMinSplitK);
  const int64_t splits = (K + k_per_split - 1) / k_per_split;
  ALBATROSS_CHECK(splits <= 65535, "K too large for one launch");

  Tensor y = batched ? new_empty(x, {B, R, N}) : new_empty(x, {R, N});
  Tensor partial = new_empty(x, {B, splits, R, N}, ScalarType::Float);
  const int64_t x_batch_stride = batched ? x.stride(0) : 0, x_row_stride = x.stride(d - 2);
  const size_t shared = std::max<size_t>(R * k_per_split * sizeof(float), kReduceBytes);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits), static_cast<unsigned>(B));
  const cudaStream_t stream = current_stream(q);
  auto launch = [&](auto type_tag, auto rows_tag) {
    using T = decltype(type_tag);
    constexpr int Rows = decltype(rows_tag)::value;
    launch_after_preceding(
        int8_gemv_kernel<T, Rows>, grid, dim3(kThreads), shared, stream, q.get_device_index(),
        static_cast<const T*>(x.data_ptr()), x_batch_stride, x_row_stride, static_cast<const int8_t*>(q.data_ptr()),
        static_cast<const float*>(scale.data_ptr()), static_cast<float*>(partial.data_ptr()),
        static_cast<int*>(counters.data_ptr()), static_cast<T*>(y.data_ptr()), static_cast<int>(K), static_cast<int>(N),
        static_cast<int>(k_per_split), static_cast<int>(splits));
  };
  auto by_rows = [&](auto type_tag) {
    switch (R) {
      case 1: return launch(type_tag, std::integral_constant<int, 1>{});
      case 2: return launch(type_tag, std::integral_constant<int, 2>{});
      case 3: return launch(type_tag, std::integral_constant<int, 3>{});
      default: return launch(type_tag, std::integral_constant<int, 4>{});
    }
  };
  if (x.scalar_type() == ScalarType::Half) {
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
STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m) { m.impl("int8_gemv", TORCH_BOX(&albatross::int8_gemv_cuda)); }
