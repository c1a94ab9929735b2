// RWKV-7 WKV recurrence over state slots (decode rows and prefill chunks in one launch; a launch
// whose every slot has exactly one token can take the decode kernel instead, see below).
//
// One block per (slot, head), one thread per state row (value index i), or one per two rows when
// the caller asks (`rows_per_thread`, see wkv7_rows_kernel). A thread keeps its rows of 64 key
// entries in registers for the whole chunk, so the two row reductions of a step (S @ a and S @ r)
// are thread-local and a step needs a single barrier (double-buffered per-token vectors).
// The state tile is staged through shared memory so that global loads and stores are coalesced,
// or, at two rows a thread when the caller asks (`direct_rows`), each thread loads and stores its
// own rows straight to and from its registers, which lets more blocks share an SM.
// Per token:  S = S * exp(-exp(w))[None, :] + (S @ a)[:, None] * b[None, :] + v[:, None] * k[None, :]
//             y = S @ r
// Math is fp32; the state is stored as fp32 (default) or 16-bit, the activations in any float type.

#include "wkv_rows.cuh"

namespace albatross {
namespace {

template <typename act_t>
struct WkvInputs {
  const act_t* ptr[6];  // r, w, k, v, a, b
  int64_t stride[6];    // row strides (elements)
};

// The state tile through shared memory by THREADS threads: 16-byte coalesced, streamed (each
// slot's state is touched once per launch).
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

// ROWS state rows a thread, N / ROWS threads a (slot, head), one block per (slot, head); the rows in
// registers for the whole chunk, one barrier a token with the per-token vectors double-buffered in
// shared memory. Every warp reads the token's five 64-wide vectors from shared memory, 80 16-byte
// loads a token; with ROWS = 2 (one warp a (slot, head)) those loads serve 64 rows instead of 32,
// with two independent rows of FMAs a thread, but a (slot, head) has half the threads. Each row's
// arithmetic is the same in the same order, so results are bit-identical across ROWS. The caller
// picks ROWS (`rows_per_thread`; albatross/wkv_dispatch.py says when 2 pays).
// With DIRECT rows, a thread's own state rows go straight between global memory and its registers
// (wkv_rows.cuh's load_row and store_row, 16-byte loads of whole rows): no staging tile in shared
// memory, whose 16.6 KB limited an SM to 11 blocks. Each load touches a different row, so it pays
// only when many blocks share an SM (wkv_dispatch.py). The token's arithmetic is rows_step
// (wkv_rows.cuh).

// Blocks an SM the register budget is cut for, with DIRECT rows (two rows a thread only: one row
// direct lost to the tile wherever two rows direct did not win, docs/performance.md "Session 19"):
// ptxas fits ROWS = 2 (one warp a block) in 168 registers without spills, 12 warps an SM instead
// of 10.
template <int ROWS, bool DIRECT>
constexpr int rows_min_blocks() {
  static_assert(!DIRECT || ROWS == 2, "direct rows are built for two rows a thread");
  return DIRECT ? 12 : 1;
}

// The SCALED walk (two rows a thread, either layout; `scaled_rows`): the rows hold S~ = S / P,
// P per key entry the product of the decays since the walk last folded them into the rows, so a
// token's update is two FMAs an entry instead of three and reads four vectors, not five
// (wkv_rows.cuh's rows_step<ROWS, true>). The thread that owns key entry j keeps P_j and writes the
// token's vectors already scaled (P r, k / P, P_prev a, b / P). A token whose P would fall below
// SCALED_FLOOR anywhere in the block, and a chunk's first token, folds instead: the plain step
// with decay P_prev * exp(-exp(w)) and a = P_prev a, after which P = 1 again. So a one-token
// slot gives the plain bits (the decode kernel's), a decay of 0 or NaN inputs behave as in the
// plain walk, and 1 / P stays below 2**20. The chunk ends by folding P into the rows.
constexpr float SCALED_FLOOR = 9.5367431640625e-07f;  // 2**-20

// 1 / x for SCALED_FLOOR <= x <= 1 in one MUFU.RCP (within an ulp or two; the error only rounds
// k / P and b / P once more): IEEE division, or __fdividef's range checks, would run every token.
__device__ __forceinline__ float reciprocal(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.f / x;
#endif
}

template <typename act_t, typename state_t, int ROWS, bool DIRECT, bool SCALED>
__global__ void __launch_bounds__(N / ROWS, (rows_min_blocks<ROWS, DIRECT>())) wkv7_rows_kernel(state_t* __restrict__ state, const int* __restrict__ slot_idx,
                                                            const int* __restrict__ cu_seqlens, const WkvInputs<act_t> in,
                                                            act_t* __restrict__ y, const int64_t y_stride, const int H) {
  static_assert(!SCALED || ROWS == 2, "the scaled walk's vote over the block is one warp's");
  constexpr int T = N / ROWS;  // threads; thread x owns rows x, x + T, ...
  const int s = blockIdx.x, h = blockIdx.y, x = threadIdx.x;
  const int t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
  if (t1 <= t0) return;
  state_t* S = state + ((int64_t)slot_idx[s] * H + h) * (N * N);

  __shared__ float tile[DIRECT ? 1 : N][N + 1];    // +1: row reads by different threads hit different banks
  __shared__ __align__(16) float vec[2][5][N];     // per token: r, decay, k, a, b (double-buffered)

  float st[ROWS][N];
  if constexpr (DIRECT) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) load_row(S + (x + m * T) * N, st[m]);
  } else {
    load_tile_by<state_t, T>(S, tile);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < N; ++j) st[m][j] = tile[x + m * T][j];
  }

  auto fetch = [&](int t, float (*out)[6]) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int q = 0; q < 6; ++q) out[m][q] = to_float(in.ptr[q][(int64_t)t * in.stride[q] + h * N + x + m * T]);
  };
  float next[ROWS][6];
  float scale[ROWS];  // SCALED: P of key entries x + m * T
#pragma unroll
  for (int m = 0; m < ROWS; ++m) scale[m] = 1.f;
  fetch(t0, next);
  int buf = 0;
  for (int t = t0; t < t1; ++t) {
    float vi[ROWS];
    bool fold = true;
    if constexpr (SCALED) {
      float decay[ROWS], product[ROWS];
      bool low = t == t0;
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        decay[m] = expf(-expf(next[m][1]));
        product[m] = scale[m] * decay[m];
        low |= !(product[m] >= SCALED_FLOOR);  // NaN folds too
      }
      fold = __any_sync(0xffffffffu, low);
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        const int i = x + m * T;
        vec[buf][3][i] = scale[m] * next[m][4];
        if (fold) {
          vec[buf][0][i] = next[m][0];
          vec[buf][1][i] = product[m];
          vec[buf][2][i] = next[m][2];
          vec[buf][4][i] = next[m][5];
          scale[m] = 1.f;
        } else {
          const float inverse = reciprocal(product[m]);
          vec[buf][0][i] = product[m] * next[m][0];
          vec[buf][2][i] = next[m][2] * inverse;
          vec[buf][4][i] = next[m][5] * inverse;
          scale[m] = product[m];
        }
        vi[m] = next[m][3];
      }
    } else {
#pragma unroll
      for (int m = 0; m < ROWS; ++m) {
        const int i = x + m * T;
        vec[buf][0][i] = next[m][0];
        vec[buf][1][i] = expf(-expf(next[m][1]));
        vec[buf][2][i] = next[m][2];
        vec[buf][3][i] = next[m][4];
        vec[buf][4][i] = next[m][5];
        vi[m] = next[m][3];
      }
    }
    if (t + 1 < t1) fetch(t + 1, next);  // in flight while this token computes
    __syncthreads();

    float yv[ROWS];
    if (fold) {
      rows_step<ROWS>(st, vec[buf], vi, yv);
    } else {
      rows_step<ROWS, true>(st, vec[buf], vi, yv);
    }
#pragma unroll
    for (int m = 0; m < ROWS; ++m) y[(int64_t)t * y_stride + h * N + x + m * T] = from_float<act_t>(yv[m]);
    buf ^= 1;
  }

  if constexpr (SCALED) {  // S = S~ * P (vec[buf] was last read two tokens ago, before the last barrier)
#pragma unroll
    for (int m = 0; m < ROWS; ++m) vec[buf][1][x + m * T] = scale[m];
    __syncthreads();
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < N; ++j) st[m][j] *= vec[buf][1][j];
  }

  if constexpr (DIRECT) {
#pragma unroll
    for (int m = 0; m < ROWS; ++m) store_row(S + (x + m * T) * N, st[m]);
  } else {
#pragma unroll
    for (int m = 0; m < ROWS; ++m)
#pragma unroll
      for (int j = 0; j < N; ++j) tile[x + m * T][j] = st[m][j];  // own rows only
    __syncthreads();
    store_tile_by<state_t, T>(S, tile);
  }
}

// Decode: one token per slot (row s of the inputs belongs to slot_idx[s]), the pieces of
// wkv_decode.cuh. Same arithmetic, in the same order, as wkv7_rows_kernel.
template <typename act_t, typename state_t>
__global__ void __launch_bounds__(N, 16) wkv7_decode_kernel(state_t* __restrict__ state, const int* __restrict__ slot_idx,
                                                        const WkvInputs<act_t> in, act_t* __restrict__ y,
                                                        const int64_t y_stride, const int H) {
  const int s = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
  state_t* S = state + ((int64_t)slot_idx[s] * H + h) * (N * N);

  __shared__ __align__(16) state_t tile[DecodeTile<state_t>::ENTRIES];
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
                 const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b, bool single_token,
                 int64_t rows_per_thread, bool direct_rows, bool scaled_rows) {
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
  ALBATROSS_CHECK(rows_per_thread == 1 || rows_per_thread == 2, "rows_per_thread must be 1 or 2, got ", rows_per_thread);
  ALBATROSS_CHECK(!direct_rows || rows_per_thread == 2, "direct_rows needs rows_per_thread 2");
  ALBATROSS_CHECK(!scaled_rows || rows_per_thread == 2, "scaled_rows needs rows_per_thread 2");

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
        const int* slots = slot_idx.const_data_ptr<int>();
        const int* cu = cu_seqlens.const_data_ptr<int>();
        const auto launch = [&](auto kernel, int threads) {
          kernel<<<grid, threads, 0, stream>>>(state_ptr, slots, cu, in, y_ptr, y.stride(0), static_cast<int>(H));
        };
        if (rows_per_thread == 1) {
          launch(wkv7_rows_kernel<act_t, state_t, 1, false, false>, N);
        } else if (direct_rows && scaled_rows) {
          launch(wkv7_rows_kernel<act_t, state_t, 2, true, true>, N / 2);
        } else if (direct_rows) {
          launch(wkv7_rows_kernel<act_t, state_t, 2, true, false>, N / 2);
        } else if (scaled_rows) {
          launch(wkv7_rows_kernel<act_t, state_t, 2, false, true>, N / 2);
        } else {
          launch(wkv7_rows_kernel<act_t, state_t, 2, false, false>, N / 2);
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
