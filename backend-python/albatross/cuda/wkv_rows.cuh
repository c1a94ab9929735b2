// The sequential WKV walk's pieces (wkv7.cu's wkv7_rows_kernel, the WKV op over prompt chunks):
// a state row between memory and a thread's registers, and one token's arithmetic, plain
// (rows_step) or on rows kept divided by their running decay product (rows_step<ROWS, true>, the
// scaled walk: docs/kernels.md).
//
// A thread keeps ROWS state rows (value indices x, x + N / ROWS, ...) of 64 key entries in
// registers for the whole chunk, so the two row reductions of a token (S @ a and S @ r) are
// thread-local; the token's vectors come from shared memory as floats.
#pragma once

#include "wkv_decode.cuh"

namespace albatross {
namespace {

// One state row straight between global memory and a thread's registers (16-byte loads of the
// whole row).
template <typename state_t>
__device__ __forceinline__ void load_row(const state_t* __restrict__ src, float (&row)[N]) {
  constexpr int VEC = 16 / sizeof(state_t);
  const uint4* vsrc = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    const uint4 raw = vsrc[c];
    const state_t* vals = reinterpret_cast<const state_t*>(&raw);
#pragma unroll
    for (int q = 0; q < VEC; ++q) row[c * VEC + q] = to_float(vals[q]);
  }
}

template <typename state_t>
__device__ __forceinline__ void store_row(state_t* __restrict__ dst, const float (&row)[N]) {
  constexpr int VEC = 16 / sizeof(state_t);
  uint4* vdst = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int c = 0; c < N / VEC; ++c) {
    uint4 raw;
    state_t* vals = reinterpret_cast<state_t*>(&raw);
#pragma unroll
    for (int q = 0; q < VEC; ++q) vals[q] = from_float<state_t>(row[c * VEC + q]);
    vdst[c] = raw;
  }
}

// One token for a thread's ROWS rows: `vec` is the token's r, decay (exp(-exp(w))), k, a and b,
// 64 floats each in shared memory, vi[m] row m's value. The rows advance; y[m] = (S @ r) of row m.
// Each row's arithmetic is the same in the same order at any ROWS.
//
// SCALED: the same token on a rescaled state (wkv7.cu's scaled walk). The rows hold S~ = S / P
// column by column, P the product of the decays since the walk last folded them in, so the decay
// costs no multiply: `vec` is the token's P r, (unused), k / P, P_prev a and b / P, and a row entry
// takes two FMAs instead of three: S~ += v k / P + (S @ a) b / P. y = S @ r = S~ @ (P r).
template <int ROWS, bool SCALED = false>
__device__ __forceinline__ void rows_step(float (&st)[ROWS][N], const float (*vec)[N], const float (&vi)[ROWS],
                                          float (&y)[ROWS]) {
  const float4* R = reinterpret_cast<const float4*>(vec[0]);
  const float4* D = reinterpret_cast<const float4*>(vec[1]);
  const float4* K = reinterpret_cast<const float4*>(vec[2]);
  const float4* A = reinterpret_cast<const float4*>(vec[3]);
  const float4* B = reinterpret_cast<const float4*>(vec[4]);
  float sa[ROWS][4];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) sa[m][0] = sa[m][1] = sa[m][2] = sa[m][3] = 0.f;
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const float4 av = A[j];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      sa[m][0] = fmaf(st[m][4 * j + 0], av.x, sa[m][0]);
      sa[m][1] = fmaf(st[m][4 * j + 1], av.y, sa[m][1]);
      sa[m][2] = fmaf(st[m][4 * j + 2], av.z, sa[m][2]);
      sa[m][3] = fmaf(st[m][4 * j + 3], av.w, sa[m][3]);
    }
  }
  float sav[ROWS], acc[ROWS][4];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    sav[m] = (sa[m][0] + sa[m][1]) + (sa[m][2] + sa[m][3]);
    acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
  }
  // One entry: the plain update (a multiply and two FMAs), or the scaled one (two FMAs).
  auto advance = [](float s, float d, float sa_m, float b, float v, float k) {
    if constexpr (SCALED) {
      return fmaf(sa_m, b, fmaf(v, k, s));
    } else {
      return update(s, d, sa_m, b, v, k);
    }
  };
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    float4 dv = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (!SCALED) dv = D[j];  // the scaled walk reads no decay vector
    const float4 bv = B[j], kv = K[j], rv = R[j];
#pragma unroll
    for (int m = 0; m < ROWS; ++m) {
      st[m][4 * j + 0] = advance(st[m][4 * j + 0], dv.x, sav[m], bv.x, vi[m], kv.x);
      st[m][4 * j + 1] = advance(st[m][4 * j + 1], dv.y, sav[m], bv.y, vi[m], kv.y);
      st[m][4 * j + 2] = advance(st[m][4 * j + 2], dv.z, sav[m], bv.z, vi[m], kv.z);
      st[m][4 * j + 3] = advance(st[m][4 * j + 3], dv.w, sav[m], bv.w, vi[m], kv.w);
      acc[m][0] = fmaf(st[m][4 * j + 0], rv.x, acc[m][0]);
      acc[m][1] = fmaf(st[m][4 * j + 1], rv.y, acc[m][1]);
      acc[m][2] = fmaf(st[m][4 * j + 2], rv.z, acc[m][2]);
      acc[m][3] = fmaf(st[m][4 * j + 3], rv.w, acc[m][3]);
    }
  }
#pragma unroll
  for (int m = 0; m < ROWS; ++m) y[m] = (acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]);
}

}  // namespace
}  // namespace albatross
