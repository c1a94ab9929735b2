// RWKV-7 WKV recurrence over state slots (decode rows and prefill chunks in one launch; a launch
// whose every slot has exactly one token can take the decode kernel instead, see below).
//
// One block per (slot, head), one thread per state row (value index i). A thread keeps its row of
// 64 key entries in registers for the whole chunk, so the two row reductions of a step (S @ a and
// S @ r) are thread-local and a step needs a single barrier (double-buffered per-token vectors).
// The state tile is staged through shared memory so that global loads and stores are coalesced.
// Per token:  S = S * exp(-exp(w))[None, :] + (S @ a)[:, None] * b[None, :] + v[:, None] * k[None, :]
//             y = S @ r
// Math is fp32; the state is stored as fp32 (default) or 16-bit, the activations in any float type.

#include <cstdlib>

#include "wkv_decode.cuh"

namespace albatross {
namespace {

template <typename act_t>
struct WkvInputs {
  const act_t* ptr[6];  // r, w, k, v, a, b
  int64_t stride[6];    // row strides (elements)
};

template <typename state_t>
__device__ __forceinline__ void load_tile(const state_t* __restrict__ src, float (*tile)[N + 1]) {
  constexpr int VEC = 16 / sizeof(state_t);
  const uint4* vsrc = reinterpret_cast<const uint4*>(src);
#pragma unroll 4
  for (int c = threadIdx.x; c < N * N / VEC; c += N) {
    uint4 raw = __ldcs(vsrc + c);  // streamed: each slot's state is touched once per launch
    const state_t* vals = reinterpret_cast<const state_t*>(&raw);
    const int row = (c * VEC) / N, col = (c * VEC) % N;
#pragma unroll
    for (int q = 0; q < VEC; ++q) tile[row][col + q] = to_float(vals[q]);
  }
}

template <typename state_t>
__device__ __forceinline__ void store_tile(state_t* __restrict__ dst, float (*tile)[N + 1]) {
  constexpr int VEC = 16 / sizeof(state_t);
  uint4* vdst = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
  for (int c = threadIdx.x; c < N * N / VEC; c += N) {
    uint4 raw;
    state_t* vals = reinterpret_cast<state_t*>(&raw);
    const int row = (c * VEC) / N, col = (c * VEC) % N;
#pragma unroll
    for (int q = 0; q < VEC; ++q) vals[q] = from_float<state_t>(tile[row][col + q]);
    __stcs(vdst + c, raw);
  }
}

template <typename act_t, typename state_t>
__global__ void __launch_bounds__(N) wkv7_kernel(state_t* __restrict__ state, const int* __restrict__ slot_idx,
                                                 const int* __restrict__ cu_seqlens, const WkvInputs<act_t> in,
                                                 act_t* __restrict__ y, const int64_t y_stride, const int H) {
  const int s = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
  const int t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
  if (t1 <= t0) return;
  state_t* S = state + ((int64_t)slot_idx[s] * H + h) * (N * N);

  __shared__ float tile[N][N + 1];                 // +1: row reads by different threads hit different banks
  __shared__ __align__(16) float vec[2][5][N];     // per token: r, decay, k, a, b (double-buffered)

  load_tile(S, tile);
  __syncthreads();
  float st[N];
#pragma unroll
  for (int j = 0; j < N; ++j) st[j] = tile[i][j];

  const int col = h * N + i;
  auto fetch = [&](int t, float* out) {
#pragma unroll
    for (int q = 0; q < 6; ++q) out[q] = to_float(in.ptr[q][(int64_t)t * in.stride[q] + col]);
  };
  float next[6];
  fetch(t0, next);
  int buf = 0;
  for (int t = t0; t < t1; ++t) {
    vec[buf][0][i] = next[0];
    vec[buf][1][i] = expf(-expf(next[1]));
    vec[buf][2][i] = next[2];
    vec[buf][3][i] = next[4];
    vec[buf][4][i] = next[5];
    const float vi = next[3];
    if (t + 1 < t1) fetch(t + 1, next);  // in flight while this token computes
    __syncthreads();

    const float4* R = reinterpret_cast<const float4*>(vec[buf][0]);
    const float4* D = reinterpret_cast<const float4*>(vec[buf][1]);
    const float4* K = reinterpret_cast<const float4*>(vec[buf][2]);
    const float4* A = reinterpret_cast<const float4*>(vec[buf][3]);
    const float4* B = reinterpret_cast<const float4*>(vec[buf][4]);
    float sa[4] = {0.f, 0.f, 0.f, 0.f};  // four partial sums: shorter dependency chains
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const float4 av = A[j];
      sa[0] = fmaf(st[4 * j + 0], av.x, sa[0]);
      sa[1] = fmaf(st[4 * j + 1], av.y, sa[1]);
      sa[2] = fmaf(st[4 * j + 2], av.z, sa[2]);
      sa[3] = fmaf(st[4 * j + 3], av.w, sa[3]);
    }
    const float sav = (sa[0] + sa[1]) + (sa[2] + sa[3]);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const float4 dv = D[j], bv = B[j], kv = K[j], rv = R[j];
      st[4 * j + 0] = update(st[4 * j + 0], dv.x, sav, bv.x, vi, kv.x);
      st[4 * j + 1] = update(st[4 * j + 1], dv.y, sav, bv.y, vi, kv.y);
      st[4 * j + 2] = update(st[4 * j + 2], dv.z, sav, bv.z, vi, kv.z);
      st[4 * j + 3] = update(st[4 * j + 3], dv.w, sav, bv.w, vi, kv.w);
      acc[0] = fmaf(st[4 * j + 0], rv.x, acc[0]);
      acc[1] = fmaf(st[4 * j + 1], rv.y, acc[1]);
      acc[2] = fmaf(st[4 * j + 2], rv.z, acc[2]);
      acc[3] = fmaf(st[4 * j + 3], rv.w, acc[3]);
    }
    y[(int64_t)t * y_stride + col] = from_float<act_t>((acc[0] + acc[1]) + (acc[2] + acc[3]));
    buf ^= 1;
  }

#pragma unroll
  for (int j = 0; j < N; ++j) tile[i][j] = st[j];  // own row only: no barrier needed before
  __syncthreads();
  store_tile(S, tile);
}

// The same recurrence with SPLIT threads per state row (SPLIT = 2 or 4): thread (i, g) keeps the
// keys of segment g of row i in registers, and the two row sums of a token (S @ a, S @ r) are
// finished across the row's SPLIT neighbouring lanes with shuffles. Half or a quarter of the
// registers of wkv7_kernel (124 there: 8 blocks of 2 warps an SM) and chains of 32 or 16 FMAs
// instead of 64, so more tokens are in flight per SM; the sums are added in another order, so a
// slot of several tokens differs from wkv7_kernel in the last bits. A slot of one token (a decode
// row riding in a prefill call) takes wkv7_kernel's arithmetic on its first N threads, so a
// request's decode rows stay bit-identical whichever kind of step carried them.
template <int SPLIT>
struct SplitLayout {
  static constexpr int THREADS = N * SPLIT;
  static constexpr int SEG = N / SPLIT;                     // keys a thread owns
  static constexpr int PITCH = N + 4 * SPLIT;               // a vector's padded length in shared memory
  static constexpr int FETCH = (6 + SPLIT - 1) / SPLIT;     // input values a thread loads per token
  // Segments 16 bytes apart in banks: the SPLIT lanes of a row read their quads conflict-free.
  __device__ static constexpr int at(int j) { return j + (j / SEG) * 4; }
};

template <typename state_t, int THREADS>
__device__ __forceinline__ void load_tile_by(const state_t* __restrict__ src, float (*tile)[N + 1]) {
  constexpr int VEC = 16 / sizeof(state_t);
  const uint4* vsrc = reinterpret_cast<const uint4*>(src);
#pragma unroll 4
  for (int c = threadIdx.x; c < N * N / VEC; c += THREADS) {
    uint4 raw = __ldcs(vsrc + c);
    const state_t* vals = reinterpret_cast<const state_t*>(&raw);
    const int row = (c * VEC) / N, col = (c * VEC) % N;
#pragma unroll
    for (int q = 0; q < VEC; ++q) tile[row][col + q] = to_float(vals[q]);
  }
}

template <typename state_t, int THREADS>
__device__ __forceinline__ void store_tile_by(state_t* __restrict__ dst, float (*tile)[N + 1]) {
  constexpr int VEC = 16 / sizeof(state_t);
  uint4* vdst = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
  for (int c = threadIdx.x; c < N * N / VEC; c += THREADS) {
    uint4 raw;
    state_t* vals = reinterpret_cast<state_t*>(&raw);
    const int row = (c * VEC) / N, col = (c * VEC) % N;
#pragma unroll
    for (int q = 0; q < VEC; ++q) vals[q] = from_float<state_t>(tile[row][col + q]);
    __stcs(vdst + c, raw);
  }
}

template <typename act_t, typename state_t, int SPLIT>
__global__ void __launch_bounds__(N * SPLIT) wkv7_split_kernel(state_t* __restrict__ state, const int* __restrict__ slot_idx,
                                                              const int* __restrict__ cu_seqlens, const WkvInputs<act_t> in,
                                                              act_t* __restrict__ y, const int64_t y_stride, const int H) {
  using L = SplitLayout<SPLIT>;
  const int s = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
  if (t1 <= t0) return;
  state_t* S = state + ((int64_t)slot_idx[s] * H + h) * (N * N);

  __shared__ float tile[N][N + 1];
  __shared__ __align__(16) float vec[2][6][L::PITCH];  // per token: r, decay, k, a, b, v (double-buffered);

  // Thread group tid / N loads the inputs q with q % SPLIT == group, column tid % N: q stays a
  // compile-time index into `in` (a runtime one would copy the parameters to local memory).
  const int group = tid / N, c = tid % N;
  float next[L::FETCH];
  auto fetch = [&](int t) {
#pragma unroll
    for (int q = 0; q < 6; ++q)
      if (q % SPLIT == group) next[q / SPLIT] = to_float(in.ptr[q][(int64_t)t * in.stride[q] + h * N + c]);
  };
  auto stage = [&](int buf) {
#pragma unroll
    for (int q = 0; q < 6; ++q)
      if (q % SPLIT == group) vec[buf][q == 3 ? 5 : (q > 3 ? q - 1 : q)][L::at(c)] = q == 1 ? expf(-expf(next[q / SPLIT])) : next[q / SPLIT];
  };

  fetch(t0);
  load_tile_by<state_t, L::THREADS>(S, tile);
  if (t1 - t0 == 1) {  // wkv7_kernel's arithmetic for one token, thread i < N on row i
    stage(0);
    __syncthreads();
    if (tid < N) {
      const int i = tid;
      const float vi = vec[0][5][L::at(i)];
      float sa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
      for (int j = 0; j < N / 4; ++j) {  // rolled: this path must not set the kernel's register count
        const float4 av = *reinterpret_cast<const float4*>(&vec[0][3][L::at(4 * j)]);
        sa[0] = fmaf(tile[i][4 * j + 0], av.x, sa[0]);
        sa[1] = fmaf(tile[i][4 * j + 1], av.y, sa[1]);
        sa[2] = fmaf(tile[i][4 * j + 2], av.z, sa[2]);
        sa[3] = fmaf(tile[i][4 * j + 3], av.w, sa[3]);
      }
      const float sav = (sa[0] + sa[1]) + (sa[2] + sa[3]);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
      for (int j = 0; j < N / 4; ++j) {  // rolled: this path must not set the kernel's register count
        const float4 dv = *reinterpret_cast<const float4*>(&vec[0][1][L::at(4 * j)]);
        const float4 bv = *reinterpret_cast<const float4*>(&vec[0][4][L::at(4 * j)]);
        const float4 kv = *reinterpret_cast<const float4*>(&vec[0][2][L::at(4 * j)]);
        const float4 rv = *reinterpret_cast<const float4*>(&vec[0][0][L::at(4 * j)]);
        const float d[4] = {dv.x, dv.y, dv.z, dv.w}, b[4] = {bv.x, bv.y, bv.z, bv.w};
        const float k[4] = {kv.x, kv.y, kv.z, kv.w}, r[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float updated = update(tile[i][4 * j + q], d[q], sav, b[q], vi, k[q]);
          tile[i][4 * j + q] = updated;
          acc[q] = fmaf(updated, r[q], acc[q]);
        }
      }
      y[(int64_t)t0 * y_stride + h * N + i] = from_float<act_t>((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
    __syncthreads();
    store_tile_by<state_t, L::THREADS>(S, tile);
    return;
  }

  __syncthreads();
  const int i = tid / SPLIT, g = tid % SPLIT, j0 = g * L::SEG;
  float st[L::SEG];
#pragma unroll
  for (int j = 0; j < L::SEG; ++j) st[j] = tile[i][j0 + j];

  int buf = 0;
  for (int t = t0; t < t1; ++t) {
    stage(buf);
    if (t + 1 < t1) fetch(t + 1);  // in flight while this token computes
    __syncthreads();

    const float* V = vec[buf][0];
    const float4* R = reinterpret_cast<const float4*>(vec[buf][0] + L::at(j0));
    const float4* D = reinterpret_cast<const float4*>(vec[buf][1] + L::at(j0));
    const float4* K = reinterpret_cast<const float4*>(vec[buf][2] + L::at(j0));
    const float4* A = reinterpret_cast<const float4*>(vec[buf][3] + L::at(j0));
    const float4* B = reinterpret_cast<const float4*>(vec[buf][4] + L::at(j0));
    const float vi = V[5 * L::PITCH + L::at(i)];
    float sa[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < L::SEG / 4; ++j) {
      const float4 av = A[j];
      sa[0] = fmaf(st[4 * j + 0], av.x, sa[0]);
      sa[1] = fmaf(st[4 * j + 1], av.y, sa[1]);
      sa[2] = fmaf(st[4 * j + 2], av.z, sa[2]);
      sa[3] = fmaf(st[4 * j + 3], av.w, sa[3]);
    }
    float sav = (sa[0] + sa[1]) + (sa[2] + sa[3]);
#pragma unroll
    for (int m = 1; m < SPLIT; m *= 2) sav += __shfl_xor_sync(0xffffffffu, sav, m);  // same total on every lane
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < L::SEG / 4; ++j) {
      const float4 dv = D[j], bv = B[j], kv = K[j], rv = R[j];
      st[4 * j + 0] = update(st[4 * j + 0], dv.x, sav, bv.x, vi, kv.x);
      st[4 * j + 1] = update(st[4 * j + 1], dv.y, sav, bv.y, vi, kv.y);
      st[4 * j + 2] = update(st[4 * j + 2], dv.z, sav, bv.z, vi, kv.z);
      st[4 * j + 3] = update(st[4 * j + 3], dv.w, sav, bv.w, vi, kv.w);
      acc[0] = fmaf(st[4 * j + 0], rv.x, acc[0]);
      acc[1] = fmaf(st[4 * j + 1], rv.y, acc[1]);
      acc[2] = fmaf(st[4 * j + 2], rv.z, acc[2]);
      acc[3] = fmaf(st[4 * j + 3], rv.w, acc[3]);
    }
    float yi = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
    for (int m = 1; m < SPLIT; m *= 2) yi += __shfl_xor_sync(0xffffffffu, yi, m);
    if (g == 0) y[(int64_t)t * y_stride + h * N + i] = from_float<act_t>(yi);
    buf ^= 1;
  }

#pragma unroll
  for (int j = 0; j < L::SEG; ++j) tile[i][j0 + j] = st[j];
  __syncthreads();
  store_tile_by<state_t, L::THREADS>(S, tile);
}

// ALBATROSS_WKV_SPLIT picks the prefill kernel: 1 wkv7_kernel, 2 or 4 wkv7_split_kernel (default 2).
int wkv_split() {
  static const int split = [] {
    const char* value = std::getenv("ALBATROSS_WKV_SPLIT");
    const int parsed = value ? std::atoi(value) : 2;
    return parsed == 1 || parsed == 4 ? parsed : 2;
  }();
  return split;
}

// Decode: one token per slot (row s of the inputs belongs to slot_idx[s]), the pieces of
// wkv_decode.cuh. Same arithmetic, in the same order, as wkv7_kernel.
template <typename act_t, typename state_t>
__global__ void __launch_bounds__(N, 16) wkv7_decode_kernel(state_t* __restrict__ state, const int* __restrict__ slot_idx,
                                                        const WkvInputs<act_t> in, act_t* __restrict__ y,
                                                        const int64_t y_stride, const int H) {
  const int s = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
  state_t* S = state + ((int64_t)slot_idx[s] * H + h) * (N * N);

  __shared__ __align__(16) state_t tile[N * DecodeTile<state_t>::ROW];
  __shared__ __align__(16) float vec[5][N];  // r, decay, k, a, b

  decode_fetch(S, tile, i);
  const int col = h * N + i;
  float x[6];
#pragma unroll
  for (int q = 0; q < 6; ++q) x[q] = to_float(in.ptr[q][(int64_t)s * in.stride[q] + col]);
  const float yi = decode_update(tile, vec, x, i);
  y[(int64_t)s * y_stride + col] = from_float<act_t>(yi);
  decode_store(S, tile, i);
}

Tensor wkv7_cuda(Tensor state, const Tensor& slot_idx, const Tensor& cu_seqlens, const Tensor& r, const Tensor& w,
                 const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b, bool single_token) {
  check_cuda(state, "state");
  ALBATROSS_CHECK(state.dim() == 4 && state.size(2) == N && state.size(3) == N,
                  "state must be [slots, heads, 64, 64], got ", state.sizes());
  ALBATROSS_CHECK(state.is_contiguous(), "state must be contiguous");
  const int64_t H = state.size(1), C = H * N, T = r.size(0);
  const Tensor* inputs[6] = {&r, &w, &k, &v, &a, &b};
  const char* names[6] = {"r", "w", "k", "v", "a", "b"};
  for (int q = 0; q < 6; ++q) {
    check_rows(*inputs[q], names[q], T, C);
    ALBATROSS_CHECK(inputs[q]->scalar_type() == r.scalar_type(), names[q], " must have r's dtype ", r.scalar_type());
    ALBATROSS_CHECK(inputs[q]->device() == state.device(), names[q], " must be on the state's device");
  }
  const int64_t S = check_slots(slot_idx, cu_seqlens);
  ALBATROSS_CHECK(S <= INT_MAX && H <= 65535, "too many slots or heads for one launch");
  ALBATROSS_CHECK(!single_token || T == S, "single_token needs one input row per slot, got ", T, " rows for ", S,
                  " slots");

  const DeviceGuard guard(state.get_device_index());
  Tensor y = new_empty(r, {T, C});
  if (S == 0 || T == 0) return y;
  const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(H));
  const cudaStream_t stream = current_stream(state);
  ALBATROSS_DISPATCH_FLOAT(r.scalar_type(), act_t, "activations", [&] {
    ALBATROSS_DISPATCH_FLOAT(state.scalar_type(), state_t, "state", [&] {
      WkvInputs<act_t> in;
      for (int q = 0; q < 6; ++q) {
        in.ptr[q] = static_cast<const act_t*>(inputs[q]->data_ptr());
        in.stride[q] = inputs[q]->stride(0);
      }
      auto* state_ptr = static_cast<state_t*>(state.data_ptr());
      auto* y_ptr = static_cast<act_t*>(y.data_ptr());
      if (single_token) {
        wkv7_decode_kernel<act_t, state_t><<<grid, N, 0, stream>>>(state_ptr, slot_idx.const_data_ptr<int>(), in, y_ptr,
                                                                   y.stride(0), static_cast<int>(H));
      } else {
        const int split = wkv_split();
        const int* slots = slot_idx.const_data_ptr<int>();
        const int* cu = cu_seqlens.const_data_ptr<int>();
        if (split == 4) {
          wkv7_split_kernel<act_t, state_t, 4><<<grid, N * 4, 0, stream>>>(state_ptr, slots, cu, in, y_ptr, y.stride(0),
                                                                           static_cast<int>(H));
        } else if (split == 2) {
          wkv7_split_kernel<act_t, state_t, 2><<<grid, N * 2, 0, stream>>>(state_ptr, slots, cu, in, y_ptr, y.stride(0),
                                                                           static_cast<int>(H));
        } else {
          wkv7_kernel<act_t, state_t><<<grid, N, 0, stream>>>(state_ptr, slots, cu, in, y_ptr, y.stride(0),
                                                              static_cast<int>(H));
        }
      }
      check_launch();
    });
  });
  return y;
}

}  // namespace
}  // namespace albatross

// The schema is declared in albatross/ops.py.
STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m) { m.impl("wkv7", TORCH_BOX(&albatross::wkv7_cuda)); }
