// What the two split-K GEMVs (gemv.cu: fp16/bf16 weights, int8_gemv.cu: int8 weights) share: how a
// matrix's K range is cut into splits, and how the block that finishes a tile last adds the
// splits' partial sums.
//
// That last addition once ran one thread per column over every split in turn: a 4,096 x 4,096
// matrix at batch 1 has 64 splits, so the block waited on 64 L2 round trips one after another
// while the rest of the GPU idled, about as long as streaming the matrix itself (13.0 us for 16 MB
// of int8 on the H200, docs/performance.md, session 5). Here split p goes to warp p % warps; each
// warp issues several splits' loads before it adds them, and the warps' sums are then added in
// warp order by the caller, so the result still does not depend on which block came last.
#pragma once

#include <cstdlib>

#include "common.cuh"

namespace albatross {

inline int multiprocessors(int device) {
  // Written once per device with the same value by any thread that gets here first: a benign race.
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int count = 0;
    const cudaError_t error = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    ALBATROSS_CHECK(error == cudaSuccess, "cudaDeviceGetAttribute failed: ", cudaGetErrorString(error));
    cached[device] = count;
  }
  return cached[device];
}

// Blocks an SM is meant to hold: ALBATROSS_SPLIT_BLOCKS_PER_SM (1-32, read once), default 4. Fewer,
// larger blocks spend less of a small matrix's time on each block's fixed chain (weights' first
// round trip, the x slice, the block's reduction, the partial's store, fence and counter) and on
// the last block's addition of the splits; more keep more loads in flight. The variant's sweep
// decides (bench/variants/README.md).
inline int64_t blocks_per_sm_target() {
  static const int64_t target = [] {
    const char* value = std::getenv("ALBATROSS_SPLIT_BLOCKS_PER_SM");
    const int64_t parsed = value == nullptr ? 4 : std::atoll(value);
    return parsed >= 1 && parsed <= 32 ? parsed : 4;
  }();
  return target;
}

// Rows of K per split: enough blocks (tile_count = tiles x batch, times the splits) for every SM to
// hold blocks_per_sm_target(), a multiple of `k_step` rows, and at most `max_split` so the split's
// slice of x fits in shared memory.
inline int64_t split_rows(int64_t K, int64_t tile_count, int device, int64_t k_step, int64_t max_split) {
  const int64_t blocks = blocks_per_sm_target() * multiprocessors(device);
  const int64_t want = std::max<int64_t>((blocks + tile_count - 1) / tile_count, 1);
  const int64_t rows = (K + want - 1) / want;
  return std::min<int64_t>((rows + k_step - 1) / k_step * k_step, max_split);
}

// acc[r][c] += the partials of splits warp, warp + kWarps, ... at rows r and columns n0 + c, read
// from `all` [splits][R][N] (fp32, written by other SMs: read through L2). A lane's kVec columns
// are 16-byte aligned (N and n0 multiples of 4). About 8 float4 loads are in flight per thread: more
// would cost registers the main loop's occupancy needs (4 blocks of 256 threads an SM, 64 registers).
template <int R, int kVec, int kWarps>
__device__ __forceinline__ void add_partials_by_warp(const float* __restrict__ all, const int splits, const int N,
                                                     const int n0, const int warp, float (&acc)[R][kVec]) {
  static_assert(kVec % 4 == 0, "a lane reads whole float4s");
  constexpr int kQuads = kVec / 4;
  constexpr int kPerRound = 8 / (R * kQuads) > 0 ? 8 / (R * kQuads) : 1;  // splits loaded before adding
  for (int p0 = warp; p0 < splits; p0 += kPerRound * kWarps) {
    float4 v[kPerRound][R][kQuads];
#pragma unroll
    for (int u = 0; u < kPerRound; ++u) {
      const int p = p0 + u * kWarps;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kQuads; ++c)
          v[u][r][c] = p < splits ? __ldcg(reinterpret_cast<const float4*>(all + ((int64_t)p * R + r) * N + n0) + c)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);  // adding +0 leaves a sum as it is
    }
#pragma unroll
    for (int u = 0; u < kPerRound; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kQuads; ++c) {
          acc[r][4 * c] += v[u][r][c].x;
          acc[r][4 * c + 1] += v[u][r][c].y;
          acc[r][4 * c + 2] += v[u][r][c].z;
          acc[r][4 * c + 3] += v[u][r][c].w;
        }
  }
}

}  // namespace albatross
