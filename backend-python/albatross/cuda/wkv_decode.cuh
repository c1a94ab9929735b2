// The WKV decode step of one (slot, head), in pieces that two kernels share: wkv7.cu's
// wkv7_decode_kernel (the WKV op for single-token rows) and fused.cu's wkv_decode_step_kernel
// (prep, WKV step and gated group norm in one launch). Both run these functions, so a row's
// state and output are bit-identical whichever kernel computed them.
//
// One block of N threads per (slot, head), thread i owning state row i (value index). Bound by the
// state's traffic, so it is built for bytes in flight: the whole tile is requested at once with
// cp.async (no registers held while it is in flight), the tile stays in its storage type in shared
// memory, and a thread keeps only partial sums, not its row, so many blocks fit on an SM. Rows are
// not padded: 16-byte chunk c of row i sits at chunk c ^ (i % 8) of the row, so thread i reading
// chunk c of its row i hits distinct banks within each quarter warp, and the tile is exactly the
// state's N x N entries (a padded 16-bit tile was 1 KB larger, which kept the fused step at 9
// blocks an SM instead of 10).
#pragma once

#include "common.cuh"

namespace albatross {
namespace {

constexpr int N = 64;  // head size

// One state entry's update, with the rounding fixed by explicit FMAs: every WKV kernel uses it, so
// a decode row gives bit-identical results whichever kernel runs it.
__device__ __forceinline__ float update(float s, float decay, float sa, float b, float v, float k) {
  return fmaf(s, decay, fmaf(sa, b, v * k));
}

// 16 bytes global -> shared without holding registers while in flight (cp.async, sm80+); older
// chips (and HIP) take a plain copy, made visible by the barrier that follows the wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
#else
  *reinterpret_cast<uint4*>(smem) = __ldcs(reinterpret_cast<const uint4*>(gmem));
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

template <typename state_t>
struct DecodeTile {
  static constexpr int VEC = 16 / sizeof(state_t);  // state entries per 16-byte chunk
  static constexpr int CHUNKS = N / VEC;            // chunks per row (8 or 16: the swizzle stays in the row)
  static constexpr int ENTRIES = N * N;             // the tile's size (entries)
  // Where chunk `chunk` of row `row` sits in the tile (entries).
  static __device__ __forceinline__ int at(const int row, const int chunk) { return row * N + (chunk ^ (row & 7)) * VEC; }
};

// Request the slot's N x N tile S into `tile` (shared, ENTRIES entries); the first thing a block does.
template <typename state_t>
__device__ __forceinline__ void decode_fetch(const state_t* S, state_t* tile, const int i) {
  using D = DecodeTile<state_t>;
#pragma unroll
  for (int q = 0; q < D::CHUNKS; ++q) {
    const int c = i + N * q;
    cp_async16(tile + D::at(c / D::CHUNKS, c % D::CHUNKS), S + (int64_t)c * D::VEC);
  }
}

// Thread i's channel of the token's inputs x = (r, w, k, v, a, b) in, the updated row i of the tile
// written back to the tile, y_i = (S @ r)_i returned. `vec` is shared scratch for the token's
// vectors. Ends with every thread's row updated only in its own part of the tile (no barrier).
template <typename state_t>
__device__ __forceinline__ float decode_update(state_t* tile, float (*vec)[N], const float (&x)[6], const int i) {
  using D = DecodeTile<state_t>;
  vec[0][i] = x[0];
  vec[1][i] = expf(-expf(x[1]));
  vec[2][i] = x[2];
  vec[3][i] = x[4];
  vec[4][i] = x[5];
  const float vi = x[3];
  cp_async_wait_all();
  __syncthreads();

  float sa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
  for (int c = 0; c < D::CHUNKS; ++c) {
    const uint4 raw = *reinterpret_cast<const uint4*>(tile + D::at(i, c));
    const state_t* vals = reinterpret_cast<const state_t*>(&raw);
#pragma unroll
    for (int q = 0; q < D::VEC; ++q) sa[q % 4] = fmaf(to_float(vals[q]), vec[3][c * D::VEC + q], sa[q % 4]);
  }
  const float sav = (sa[0] + sa[1]) + (sa[2] + sa[3]);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
  for (int c = 0; c < D::CHUNKS; ++c) {
    uint4 raw = *reinterpret_cast<const uint4*>(tile + D::at(i, c));
    state_t* vals = reinterpret_cast<state_t*>(&raw);
#pragma unroll
    for (int q = 0; q < D::VEC; ++q) {
      const int j = c * D::VEC + q;
      const float next = update(to_float(vals[q]), vec[1][j], sav, vec[4][j], vi, vec[2][j]);
      acc[q % 4] = fmaf(next, vec[0][j], acc[q % 4]);
      vals[q] = from_float<state_t>(next);
    }
    *reinterpret_cast<uint4*>(tile + D::at(i, c)) = raw;  // own row: no other thread reads it before the barrier
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Write the updated tile back to S (a barrier first: rows were updated by their own threads).
template <typename state_t>
__device__ __forceinline__ void decode_store(state_t* S, const state_t* tile, const int i) {
  using D = DecodeTile<state_t>;
  __syncthreads();
  uint4* out = reinterpret_cast<uint4*>(S);
#pragma unroll
  for (int q = 0; q < D::CHUNKS; ++q) {
    const int c = i + N * q;
    __stcs(out + c, *reinterpret_cast<const uint4*>(tile + D::at(c / D::CHUNKS, c % D::CHUNKS)));
  }
}

}  // namespace
}  // namespace albatross
