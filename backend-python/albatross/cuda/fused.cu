// Fused elementwise kernels around the RWKV-7 matmuls. Each replaces a chain of small torch ops
// (one read and one write of a [T, C] tensor per op) with a single pass; math is fp32, inputs and
// outputs are in the activation dtype. The torch twins in albatross/ops.py define the results.
//
//   add_layer_norm   x += delta (optional, in place), h = layer_norm(x)         one block per row
//                    (8 channels per access when C is a multiple of 8 and the rows are aligned)
//   shift_mix        token shift + K lerp mixes, shift vectors updated in place   one thread per (row, 8 channels)
//   norm_mix_decode  add_layer_norm + shift_mix for decode rows, one launch        one block per row
//   norm_mix_rows    the same for prompt chunks, the residual out of place          one block per 8 rows (fp16) or 4
//   wkv_prep         k/v/w/a/b of the WKV op from the matmul and LoRA outputs     8 lanes per (row, head)
//   gn_bonus_gate    (group_norm(y) + bonus) * g                                  8 lanes per (row, head)
//   wkv_decode_step  wkv_prep + the WKV decode step + gn_bonus_gate in one launch one block per (row, head)
//   relu_square      relu(x)^2                                                    one thread per 8 elements
//
// All but add_layer_norm move 8 channels per thread with 16-byte loads and stores (the kernels are
// bandwidth-bound), so rows must be 16-byte aligned and C a multiple of 8 (checked on the host);
// a head's 64 channels then sit in 8 adjacent lanes and its sums are warp shuffles, no barriers.
//
// Each kernel first lets the next kernel in the stream launch (pdl.cuh): at batch 1 that is often
// a weight product, which then streams its weights while this kernel runs. A kernel launched the
// ordinary way after one of these still waits for it to finish.

#include <type_traits>

#include "pdl.cuh"
#include "wkv_decode.cuh"

namespace albatross {
namespace {

constexpr int kThreads = 256;
constexpr int kRowRegs = 32;  // add_layer_norm keeps a row in registers: C <= kThreads * kRowRegs
constexpr int kHead = 64;
constexpr int kVec = 8;                                // channels per thread in the vectorised kernels
constexpr int kHeadsPerBlock = kThreads * kVec / kHead;  // 32

// 8 consecutive elements as floats through 16-byte accesses (p must be 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[kVec]) {
  constexpr int kWords = kVec * sizeof(T) / 16;
  uint4 raw[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w) raw[w] = reinterpret_cast<const uint4*>(p)[w];
  const T* v = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int q = 0; q < kVec; ++q) f[q] = to_float(v[q]);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&f)[kVec]) {
  constexpr int kWords = kVec * sizeof(T) / 16;
  uint4 raw[kWords];
  T* v = reinterpret_cast<T*>(raw);
#pragma unroll
  for (int q = 0; q < kVec; ++q) v[q] = from_float<T>(f[q]);
#pragma unroll
  for (int w = 0; w < kWords; ++w) reinterpret_cast<uint4*>(p)[w] = raw[w];
}

// 8 consecutive elements as they are in memory (16-byte accesses), converted later by unpack8:
// prep8 and gn8 issue every global read before their first store or shuffle, so a lane waits for
// memory once instead of once per group of loads (a store to k or v, which the compiler cannot
// prove distinct from the other inputs, would otherwise keep later loads from moving above it).
template <typename T>
struct Raw8 {
  uint4 w[kVec * sizeof(T) / 16];
};

template <typename T>
__device__ __forceinline__ Raw8<T> fetch8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int w = 0; w < static_cast<int>(kVec * sizeof(T) / 16); ++w) r.w[w] = reinterpret_cast<const uint4*>(p)[w];
  return r;
}

template <typename T>
__device__ __forceinline__ void unpack8(const Raw8<T>& r, float (&f)[kVec]) {
  const T* v = reinterpret_cast<const T*>(r.w);
#pragma unroll
  for (int q = 0; q < kVec; ++q) f[q] = to_float(v[q]);
}

// A row's 8 values between a norm's passes (norm_rows8): as floats for one row, converted once; as
// they are in memory for several rows at once, half the registers (unpacked again at each pass).
struct Floats8 {
  float f[kVec];
};

template <typename T>
__device__ __forceinline__ void hold8(Floats8& held, const Raw8<T>&, const float (&f)[kVec]) {
#pragma unroll
  for (int q = 0; q < kVec; ++q) held.f[q] = f[q];
}

template <typename T>
__device__ __forceinline__ void hold8(Raw8<T>& held, const Raw8<T>& raw, const float (&)[kVec]) {
  held = raw;
}

// The same from a norm's floats, rounded to T first (as add_layer_norm stores them).
template <typename T>
__device__ __forceinline__ void hold8(Floats8& held, const float (&f)[kVec]) {
#pragma unroll
  for (int q = 0; q < kVec; ++q) held.f[q] = to_float(from_float<T>(f[q]));
}

template <typename T>
__device__ __forceinline__ void hold8(Raw8<T>& held, const float (&f)[kVec]) {
  T* packed = reinterpret_cast<T*>(held.w);
#pragma unroll
  for (int q = 0; q < kVec; ++q) packed[q] = from_float<T>(f[q]);
}

// The same read from memory.
template <typename T>
__device__ __forceinline__ void fetch8(Floats8& held, const T* p) {
  load8(p, held.f);
}

template <typename T>
__device__ __forceinline__ void fetch8(Raw8<T>& held, const T* p) {
  held = fetch8(p);
}

__device__ __forceinline__ void view8(const Floats8& held, float (&f)[kVec]) {
#pragma unroll
  for (int q = 0; q < kVec; ++q) f[q] = held.f[q];
}

template <typename T>
__device__ __forceinline__ void view8(const Raw8<T>& held, float (&f)[kVec]) {
  unpack8(held, f);
}

// Sum over the 8 adjacent lanes that hold one head (every lane of the warp must call it).
__device__ __forceinline__ float head_sum8(float v) {
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums over the whole block, in a fixed order (deterministic): kR of them for the price of one's
// two barriers, each the bits of its sum alone. scratch holds kR * kThreads / 32 floats. Every
// thread must call it.
template <int kR>
__device__ __forceinline__ void block_sums(float (&v)[kR], float* scratch) {
#pragma unroll
  for (int r = 0; r < kR; ++r) v[r] = warp_sum(v[r]);
  __syncthreads();  // scratch may still be read by the previous call
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < kR; ++r) scratch[r * (kThreads / 32) + (threadIdx.x >> 5)] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[r * (kThreads / 32) + w];
    v[r] = total;
  }
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  float sums[1] = {v};
  block_sums<1>(sums, scratch);
  return sums[0];
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }

// ---------------------------------------------------------------------------------------------
// add_layer_norm

template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_layer_norm_kernel(T* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ weight,
                          const T* __restrict__ bias, T* __restrict__ h, const int C, const float eps) {
  allow_dependents_to_launch();
  __shared__ float scratch[kThreads / 32];
  const int64_t base = (int64_t)blockIdx.x * C;
  float vals[kRowRegs];
  float sum = 0.f;
#pragma unroll
  for (int q = 0; q < kRowRegs; ++q) {
    const int c = threadIdx.x + q * kThreads;
    float val = 0.f;
    if (c < C) {
      if (delta != nullptr) {
        // Round the new residual to the activation dtype first: the norm sees what is stored.
        const T stored = from_float<T>(to_float(x[base + c]) + to_float(delta[base + c]));
        x[base + c] = stored;
        val = to_float(stored);
      } else {
        val = to_float(x[base + c]);
      }
    }
    vals[q] = val;
    sum += val;
  }
  const float mean = block_sum(sum, scratch) / C;
  float sq = 0.f;
#pragma unroll
  for (int q = 0; q < kRowRegs; ++q) {
    const int c = threadIdx.x + q * kThreads;
    if (c < C) sq += (vals[q] - mean) * (vals[q] - mean);
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / C + eps);
#pragma unroll
  for (int q = 0; q < kRowRegs; ++q) {
    const int c = threadIdx.x + q * kThreads;
    if (c < C) h[base + c] = from_float<T>((vals[q] - mean) * rstd * to_float(weight[c]) + to_float(bias[c]));
  }
}

// The same with 16-byte accesses, 8 channels at a time, when C is a multiple of 8 and every
// pointer is aligned (the model's rows always are): a quarter of the memory instructions of the
// per-channel loop. At batch 1 on the H200 that loop took 6.2 us a call, 65 calls a 7.2B step.
// The row's work is norm_rows8 (norm_row8 for one row), which norm_mix_decode_kernel and
// norm_mix_rows_kernel run too, for kR consecutive rows at once (rows base, base + C, ...; the
// first `live` exist). Every row's x and delta are read before anything else (a later group's
// loads could not move above the first residual's store: one wait on memory instead of one a
// group), and the rows' means and variances take one pair of block sums for all of them, so a
// block waits on memory and on its barriers once for kR rows. Each row's arithmetic is the same
// whatever kR: the same bits. Between the passes a row's values are held as floats for one row
// and as T for several (x, or x + delta rounded to T: exact; half the registers), so the one-row
// kernels compile to the SASS they had when norm_row8 was a function of its own.
// `emit(r, g, c, out)` receives row r's norm of channels c..c+7 (the thread's group g) before its
// rounding to T, group by group, and within a group row by row. The new residual goes to x in
// place, or with kOutOfPlace to x_out (nowhere when null; x is then only read). kGroups: the
// groups of 8 channels a thread holds (C <= kThreads * 8 * kGroups). Every thread of the block
// must call it (block sums).
template <bool kOutOfPlace, int kGroups, int kR, typename T, typename Emit>
__device__ __forceinline__ void norm_rows8(T* __restrict__ x, T* __restrict__ x_out, const T* __restrict__ delta,
                                           const T* __restrict__ weight, const T* __restrict__ bias, const int C,
                                           const float eps, float* scratch, const int64_t base, const int live,
                                           Emit&& emit) {
  static_assert(kGroups >= 1 && kGroups <= kRowRegs / kVec, "a row's groups of 8 channels a thread: C <= kThreads * kRowRegs");
  Raw8<T> vals[kR][kGroups], delta_raw[kR][kGroups];
  std::conditional_t<kR == 1, Floats8, Raw8<T>> held[kR][kGroups];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int c = (threadIdx.x + g * kThreads) * kVec;
      if (r < live && c < C) {
        vals[r][g] = fetch8(static_cast<const T*>(x) + base + r * C + c);
        if (delta != nullptr) delta_raw[r][g] = fetch8(delta + base + r * C + c);
      }
    }
  }
  float sum[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    sum[r] = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int c = (threadIdx.x + g * kThreads) * kVec;
      float f[kVec];
      if (r < live && c < C) {
        unpack8(vals[r][g], f);
        if (delta != nullptr) {
          float d[kVec];
          unpack8(delta_raw[r][g], d);
          // Round the new residual to the activation dtype first: the norm sees what is stored.
          T* packed = reinterpret_cast<T*>(vals[r][g].w);
#pragma unroll
          for (int q = 0; q < kVec; ++q) {
            packed[q] = from_float<T>(f[q] + d[q]);
            f[q] = to_float(packed[q]);
          }
          if constexpr (!kOutOfPlace) {
            store8(x + base + r * C + c, f);
          } else if (x_out != nullptr) {
            store8(x_out + base + r * C + c, f);
          }
        }
      } else {
#pragma unroll
        for (int q = 0; q < kVec; ++q) f[q] = 0.f;
      }
      hold8(held[r][g], vals[r][g], f);
#pragma unroll
      for (int q = 0; q < kVec; ++q) sum[r] += f[q];
    }
  }
  block_sums<kR>(sum, scratch);
  float mean[kR], sq[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    mean[r] = sum[r] / C;
    sq[r] = 0.f;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (r < live && (threadIdx.x + g * kThreads) * kVec < C) {
        float f[kVec];
        view8(held[r][g], f);
#pragma unroll
        for (int q = 0; q < kVec; ++q) sq[r] += (f[q] - mean[r]) * (f[q] - mean[r]);
      }
    }
  }
  block_sums<kR>(sq, scratch);
  float rstd[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) rstd[r] = rsqrtf(sq[r] / C + eps);
  // Group by group, the rows of a group together: its weight, bias (and whatever emit reads by
  // channel) are read once for all of them. A row's groups are independent, so the order is free.
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int c = (threadIdx.x + g * kThreads) * kVec;
    if (c < C) {
      float w[kVec], b[kVec];
      load8(weight + c, w);
      load8(bias + c, b);
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if (r < live) {
          float out[kVec], f[kVec];
          view8(held[r][g], f);
#pragma unroll
          for (int q = 0; q < kVec; ++q) out[q] = (f[q] - mean[r]) * rstd[r] * w[q] + b[q];
          emit(r, g, c, out);
        }
      }
    }
  }
}

template <bool kOutOfPlace, int kGroups = kRowRegs / kVec, typename T, typename Emit>
__device__ __forceinline__ void norm_row8(T* __restrict__ x, T* __restrict__ x_out, const T* __restrict__ delta,
                                          const T* __restrict__ weight, const T* __restrict__ bias, const int C,
                                          const float eps, float* scratch, const int64_t base, Emit&& emit) {
  norm_rows8<kOutOfPlace, kGroups, 1>(x, x_out, delta, weight, bias, C, eps, scratch, base, 1,
                                      [&](int, const int g, const int c, const float (&out)[kVec]) { emit(g, c, out); });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_layer_norm_vec_kernel(T* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ weight,
                              const T* __restrict__ bias, T* __restrict__ h, const int C, const float eps) {
  allow_dependents_to_launch();
  __shared__ float scratch[kThreads / 32];
  const int64_t base = (int64_t)blockIdx.x * C;
  norm_row8<false>(x, static_cast<T*>(nullptr), delta, weight, bias, C, eps, scratch, base, [&](int, const int c, const float (&out)[kVec]) { store8(h + base + c, out); });
}

// ---------------------------------------------------------------------------------------------
// shift_mix

// Row `row`'s K mixes of channels c..c+7: out[q, row] = x + (prev - x) * coef[q]. shift_mix_kernel
// and norm_mix_decode_kernel both run it.
template <typename T>
__device__ __forceinline__ void mix8(const float (&xv)[kVec], const float (&prev)[kVec], const T* __restrict__ coef,
                                     const int K, T* __restrict__ out, const int64_t rows, const int64_t row, const int C,
                                     const int c) {
  float m[kVec], o[kVec];
  // Up to kHoisted coefficient vectors are read before the first store (the compiler cannot move
  // a load above a store that might alias it, so each load would wait after the store before
  // it): one wait instead of K.
  constexpr int kHoisted = 6;  // a time-mix block's six mixes
  if (K <= kHoisted) {
    Raw8<T> raw[kHoisted];
#pragma unroll
    for (int q = 0; q < kHoisted; ++q)
      if (q < K) raw[q] = fetch8(coef + (int64_t)q * C + c);
#pragma unroll
    for (int q = 0; q < kHoisted; ++q) {
      if (q < K) {
        unpack8(raw[q], m);
#pragma unroll
        for (int j = 0; j < kVec; ++j) o[j] = xv[j] + (prev[j] - xv[j]) * m[j];
        store8(out + ((int64_t)q * rows + row) * C + c, o);
      }
    }
    return;
  }
  for (int q = 0; q < K; ++q) {
    load8(coef + (int64_t)q * C + c, m);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = xv[j] + (prev[j] - xv[j]) * m[j];
    store8(out + ((int64_t)q * rows + row) * C + c, o);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    shift_mix_kernel(const T* __restrict__ x, T* __restrict__ shift, const int64_t shift_stride,
                     const int* __restrict__ slot_idx, const int* __restrict__ cu_seqlens, const int S,
                     const T* __restrict__ coef, const int K, T* __restrict__ out, const int64_t rows, const int C) {
  allow_dependents_to_launch();
  const int64_t t = blockIdx.x;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * kVec;
  if (c >= C) return;
  // The slot owning row t: the last s with cu_seqlens[s] <= t.
  int lo = 0, hi = S - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t first = cu_seqlens[lo], last = cu_seqlens[lo + 1] - 1;
  auto emit = [&](int64_t row, const float (&prev)[kVec]) {
    float xv[kVec];
    load8(x + row * C + c, xv);
    mix8(xv, prev, coef, K, out, rows, row, C, c);
  };
  float prev[kVec];
  if (t == first) {
    // This thread also does the slot's last row, so the saved shift vector is read before it is
    // overwritten without any cross-thread ordering.
    T* saved = shift + (int64_t)slot_idx[lo] * shift_stride + c;
    load8(saved, prev);
    emit(t, prev);
    if (last > first) {
      load8(x + (last - 1) * C + c, prev);
      emit(last, prev);
    }
    float newest[kVec];
    load8(x + last * C + c, newest);
    store8(saved, newest);  // exact: a value of T converts to float and back unchanged
  } else if (t != last) {
    load8(x + (t - 1) * C + c, prev);
    emit(t, prev);
  }
}

// ---------------------------------------------------------------------------------------------
// norm_mix_decode: add_layer_norm then shift_mix for rows that are each one slot's single token, in
// one launch instead of two, one block per row. norm_row8 (add_layer_norm_vec_kernel's code) gives
// each thread the norm of its channel groups; rounded to T as add_layer_norm stores h, they are
// the x of mix8 (shift_mix_kernel's code), with the slot's saved shift vector as prev, and then
// become the slot's shift vector, as shift_mix stores a single-token slot's row. So the mixes and
// the shift vectors are bit-identical to the two ops' (their vectorised kernels, which the model's
// aligned rows always take), at any batch size; h itself is never stored.

template <typename T>
__global__ void __launch_bounds__(kThreads)
    norm_mix_decode_kernel(T* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ weight,
                           const T* __restrict__ bias, T* __restrict__ shift, const int64_t shift_stride,
                           const int* __restrict__ slot_idx, const T* __restrict__ coef, const int K,
                           T* __restrict__ out, const int64_t rows, const int C, const float eps, const bool prefetch) {
  allow_dependents_to_launch();
  __shared__ float scratch[kThreads / 32];
  const int64_t t = blockIdx.x, base = t * C;
  T* saved = shift + (int64_t)slot_idx[t] * shift_stride;
  // At a few rows, every 128-byte line of the norm's weight and bias, the K mix coefficients and
  // the slot's shift row is requested into L2 first, so the loads that follow one after another
  // wait on L2 rather than on DRAM.
  constexpr int kPerLine = 128 / (kVec * static_cast<int>(sizeof(T)));
  if (prefetch && threadIdx.x % kPerLine == 0) {
    for (int c = threadIdx.x * kVec; c < C; c += kThreads * kVec) {
      prefetch_l2(weight + c);
      prefetch_l2(bias + c);
      prefetch_l2(saved + c);
      for (int q = 0; q < K; ++q) prefetch_l2(coef + (int64_t)q * C + c);
    }
  }
  norm_row8<false>(x, static_cast<T*>(nullptr), delta, weight, bias, C, eps, scratch, base, [&](int, const int c, const float (&h)[kVec]) {
    float xv[kVec], prev[kVec];
#pragma unroll
    for (int q = 0; q < kVec; ++q) xv[q] = to_float(from_float<T>(h[q]));
    load8(saved + c, prev);
    mix8(xv, prev, coef, K, out, rows, t, C, c);
    store8(saved + c, h);  // rounds h as add_layer_norm stored it: the slot's newest row
  });
}

// ---------------------------------------------------------------------------------------------
// norm_mix_rows: add_layer_norm then shift_mix for the rows of prompt chunks, in one launch, the
// residual written out of place. One block walks kNormRows consecutive rows of the call in order,
// each thread on the same channel groups of every row, so a row's token-shift predecessor (the
// previous row's norm) is still in the thread's registers; only a block's first row, unless it
// starts its slot, recomputes its predecessor's norm from that row's x and delta. That is why the
// residual goes out of place: another block may read a row's x and delta while this one writes
// the row's new residual. A slot's first row reads the slot's saved shift vector from a copy
// gathered before the launch (shift_first), because the block of its last row overwrites it.
// For fp16, rows are normed two at a time (norm_rows8), a block walking 8 rows: on an H100 that
// made the op 4-12% faster than one at a time with four rows a block (64 x 512 rows, 7.2B width:
// 947 -> 894 us with six mixes, 525 -> 464 us with one; docs/performance.md, session 29): half the
// barriers, and a block's recomputed predecessor is 1/8 of its reads instead of 1/4. bf16 and
// fp32 keep one row at a time, four a block: under the two-row form's register bound bf16 spills
// at the 7.2B width and its six-mix op took 957 -> 1,186 us (session 29).
//
// Why so: a 7.2B block's two norms move 19 [rows, C] vectors through memory in the two ops (add
// and norm: x and delta in, x and h out; shift and mix: h in, K mixes out, K = 6 and 1) and 13
// here (x and delta in, the new x and the K mixes out). Each piece is norm_row8 and mix8, on h
// rounded to T as add_layer_norm stores it, so outputs and shift vectors are bit-identical to
// the two ops.

template <typename T>
constexpr int kNormAtOnce = std::is_same_v<T, __half> ? 2 : 1;  // rows normed together (norm_rows8)
template <typename T>
constexpr int kNormRows = 4 * kNormAtOnce<T>;  // rows a block walks
// The least blocks an SM the registers must allow: two for two rows at once (128 registers a
// thread); none for one row, whose registers stay as they were (a bound of one block lets bf16
// take 154 registers at 2 groups instead of 128, and so one block an SM instead of two).
template <typename T>
constexpr int kNormMinBlocks = kNormAtOnce<T> == 2 ? 2 : 0;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const T* __restrict__ src, const int64_t src_stride, const int* __restrict__ index,
                       T* __restrict__ dst, const int C) {
  allow_dependents_to_launch();
  const int64_t row = blockIdx.x;
  const T* from = src + (int64_t)index[row] * src_stride;
  for (int c = threadIdx.x * kVec; c < C; c += kThreads * kVec) {
    float f[kVec];
    load8(from + c, f);
    store8(dst + row * C + c, f);  // exact: a value of T converts to float and back unchanged
  }
}

// kGroups: the channel groups of 8 a thread holds, the fewest that cover C (the registers of the
// rows and a predecessor are what limit the blocks an SM; for two rows the predecessor is held as
// T, half the registers).
template <typename T, int kGroups>
__global__ void __launch_bounds__(kThreads, kNormMinBlocks<T>)
    norm_mix_rows_kernel(T* __restrict__ x, const T* __restrict__ delta, T* __restrict__ x_out,
                         const T* __restrict__ weight, const T* __restrict__ bias, const T* __restrict__ shift_first,
                         T* __restrict__ shift, const int64_t shift_stride, const int* __restrict__ slot_idx,
                         const int* __restrict__ cu_seqlens, const int S, const T* __restrict__ coef, const int K,
                         T* __restrict__ out, const int64_t rows, const int C, const float eps) {
  constexpr int kAtOnce = kNormAtOnce<T>;
  allow_dependents_to_launch();
  __shared__ float scratch[kAtOnce * kThreads / 32];
  const int64_t r0 = (int64_t)blockIdx.x * kNormRows<T>, r1 = min(rows, r0 + kNormRows<T>);
  // The slot owning row r0: the last s with cu_seqlens[s] <= r0.
  int slot = 0, hi = S - 1;
  while (slot < hi) {
    const int mid = (slot + hi + 1) >> 1;
    if (cu_seqlens[mid] <= r0) slot = mid; else hi = mid - 1;
  }
  std::conditional_t<kAtOnce == 1, Floats8, Raw8<T>> prev[kGroups];  // the predecessor row's norm, rounded to T
  auto keep = [&](const int g, int, const float (&h)[kVec]) { hold8<T>(prev[g], h); };
  if (r0 > cu_seqlens[slot])  // the slot's previous row belongs to another block: its norm again, nothing stored
    norm_row8<true, kGroups>(x, static_cast<T*>(nullptr), delta, weight, bias, C, eps, scratch, (r0 - 1) * C, keep);
  for (int64_t t = r0; t < r1; t += kAtOnce) {
    const int live = kAtOnce == 1 ? 1 : static_cast<int>(min(static_cast<int64_t>(kAtOnce), r1 - t));  // t < r1
    bool first[kAtOnce], last[kAtOnce];
    int owner[kAtOnce];
#pragma unroll
    for (int r = 0; r < kAtOnce; ++r) {
      while (slot + 1 < S && cu_seqlens[slot + 1] <= t + r) ++slot;  // bounded: rows past the last slot's end stay in it
      owner[r] = slot;
      first[r] = t + r == cu_seqlens[slot];
      last[r] = t + r == cu_seqlens[slot + 1] - 1;
    }
    norm_rows8<true, kGroups, kAtOnce>(x, x_out, delta, weight, bias, C, eps, scratch, t * C, live,
                                       [&](const int r, const int g, const int c, const float (&h)[kVec]) {
      float xv[kVec], pv[kVec];
#pragma unroll
      for (int q = 0; q < kVec; ++q) xv[q] = to_float(from_float<T>(h[q]));
      if (first[r]) fetch8(prev[g], shift_first + (int64_t)owner[r] * C + c);
      view8(prev[g], pv);
      mix8(xv, pv, coef, K, out, rows, t + r, C, c);
      if (last[r]) store8(shift + (int64_t)slot_idx[owner[r]] * shift_stride + c, h);  // rounds h as add_layer_norm stored it
      hold8<T>(prev[g], h);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// wkv_prep

template <typename T>
struct PrepArgs {
  T* k;             // [T, C] in place: k * (1 + (a - 1) * k_a)
  T* v;             // [T, C] in place: v + (v_first - v) * sigmoid(v0 + v_lora) (unless layer 0)
  const T* w_lora;  // [T, C]
  const T* a_lora;  // [T, C]
  const T* v_lora;  // [T, C] or null (layer 0)
  const T* v_first; // [T, C] or null (layer 0)
  const T* w0;
  const T* a0;
  const T* v0;      // or null
  const T* k_k;
  const T* k_a;
  T* w_out;  // log decay: -softplus(-(w0 + w_lora)) - 0.5
  T* a_out;  // -kk
  T* b_out;  // kk * a
  int H;
};

// One lane's 8 channels of one row, every pointer of `p` already at them (a PrepArgs whose H is
// not read; v_lora null in layer 0): the WKV op's inputs, k and v updated in place, w, a and b
// stored where w_out, a_out and b_out point. A head's 64 channels are 8 adjacent lanes, and every
// lane of the warp must call it (the kk norm is a shuffle sum), `live` false for lanes past the
// row's end. wkv_prep_kernel and wkv_decode_step_kernel both run it, so their outputs are
// bit-identical.
//
// k_copy and v_copy, where given (wkv_decode_step_kernel's shared memory), get the same k and v
// that go to global memory, so the step reads them without another round trip to memory.
template <typename T>
__device__ __forceinline__ void prep8(const PrepArgs<T>& p, const bool live, T* k_copy = nullptr, T* v_copy = nullptr) {
  // Every read first (one round trip to memory instead of four): the op's inputs never alias k or
  // v (the host check refuses that), so reading them before k and v are stored reads the same values.
  const bool residual = p.v_lora != nullptr;
  Raw8<T> k_raw, k_k_raw, a0_raw, a_lora_raw, k_a_raw, v_raw, v0_raw, v_lora_raw, v_first_raw, w0_raw, w_lora_raw;
  if (live) {
    k_raw = fetch8(p.k);
    k_k_raw = fetch8(p.k_k);
    a0_raw = fetch8(p.a0);
    a_lora_raw = fetch8(p.a_lora);
    k_a_raw = fetch8(p.k_a);
    if (residual || v_copy != nullptr) v_raw = fetch8(static_cast<const T*>(p.v));
    if (residual) {
      v0_raw = fetch8(p.v0);
      v_lora_raw = fetch8(p.v_lora);
      v_first_raw = fetch8(p.v_first);
    }
    w0_raw = fetch8(p.w0);
    w_lora_raw = fetch8(p.w_lora);
  }
  float k[kVec], kk[kVec], tmp[kVec];
  float ss = 0.f;
  if (live) {
    unpack8(k_raw, k);
    unpack8(k_k_raw, tmp);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      kk[j] = k[j] * tmp[j];
      ss += kk[j] * kk[j];
    }
  }
  const float norm = sqrtf(head_sum8(ss));
  if (!live) return;  // after the warp's only shuffles
  const float inv = 1.f / fmaxf(norm, 1e-12f);
  float a[kVec], a0[kVec], out[kVec];
  unpack8(a0_raw, a0);
  unpack8(a_lora_raw, tmp);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    a[j] = sigmoidf(a0[j] + tmp[j]);
    kk[j] = kk[j] * inv;
  }
  unpack8(k_a_raw, tmp);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = k[j] * (1.f + (a[j] - 1.f) * tmp[j]);
  store8(p.k, out);
  if (k_copy != nullptr) store8(k_copy, out);
  if (!residual && v_copy != nullptr) *reinterpret_cast<Raw8<T>*>(v_copy) = v_raw;  // layer 0: v as it came
  if (residual) {
    float v[kVec], gate[kVec], first[kVec];
    unpack8(v_raw, v);
    unpack8(v0_raw, gate);
    unpack8(v_lora_raw, tmp);
    unpack8(v_first_raw, first);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = v[j] + (first[j] - v[j]) * sigmoidf(gate[j] + tmp[j]);
    store8(p.v, out);
    if (v_copy != nullptr) store8(v_copy, out);
  }
  unpack8(w0_raw, a0);
  unpack8(w_lora_raw, tmp);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float z = -(a0[j] + tmp[j]);
    const float softplus = z > 20.f ? z : log1pf(expf(z));  // torch's softplus threshold
    out[j] = -softplus - 0.5f;
  }
  store8(p.w_out, out);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = -kk[j];
  store8(p.a_out, out);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = kk[j] * a[j];
  store8(p.b_out, out);
}

// Row o / 8 channels c of the [rows, C] operands (vectors of C at c), the outputs where given.
template <typename T>
__device__ __forceinline__ PrepArgs<T> prep_row(const PrepArgs<T>& p, const int64_t o, const int c, T* w_out, T* a_out,
                                                T* b_out) {
  const bool residual = p.v_lora != nullptr;  // the three value-residual operands are null together (layer 0)
  return {p.k + o,     p.v + o,     p.w_lora + o, p.a_lora + o, residual ? p.v_lora + o : nullptr,
          residual ? p.v_first + o : nullptr, p.w0 + c, p.a0 + c, residual ? p.v0 + c : nullptr, p.k_k + c,
          p.k_a + c, w_out, a_out, b_out, p.H};
}

template <typename T>
__global__ void __launch_bounds__(kThreads) wkv_prep_kernel(const PrepArgs<T> p) {
  allow_dependents_to_launch();
  const int C = p.H * kHead;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * kVec;
  const bool live = c < C;  // C is a multiple of 64: a head's 8 lanes are all live or all not
  const int64_t o = (int64_t)blockIdx.x * C + c;
  prep8(prep_row(p, o, c, p.w_out + o, p.a_out + o, p.b_out + o), live);
}

// ---------------------------------------------------------------------------------------------
// gn_bonus_gate

// (group_norm(y) + sum(r * k * r_k) * v) * g for one lane's 8 channels of one row, every pointer
// already at them; the same lane layout and calling rule as prep8. gn_bonus_gate_kernel and
// wkv_decode_step_kernel both run it.
template <typename T>
__device__ __forceinline__ void gn8(const T* y, const T* r, const T* k, const T* v, const T* g, const T* r_k,
                                    const T* weight, const T* bias, T* out, const bool live, const float eps) {
  Raw8<T> y_raw, r_raw, k_raw, r_k_raw, v_raw, g_raw, weight_raw, bias_raw;  // every read first: one round trip
  if (live) {
    y_raw = fetch8(y);
    r_raw = fetch8(r);
    k_raw = fetch8(k);
    r_k_raw = fetch8(r_k);
    v_raw = fetch8(v);
    g_raw = fetch8(g);
    weight_raw = fetch8(weight);
    bias_raw = fetch8(bias);
  }
  float yv[kVec], a[kVec], b[kVec];
  float sum = 0.f, rk = 0.f;
  if (live) {
    unpack8(y_raw, yv);
    unpack8(r_raw, a);
    unpack8(k_raw, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum += yv[j];
    float w[kVec];
    unpack8(r_k_raw, w);
#pragma unroll
    for (int j = 0; j < kVec; ++j) rk += a[j] * b[j] * w[j];
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) yv[j] = 0.f;
  }
  const float mean = head_sum8(sum) * (1.f / kHead);
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kVec; ++j) sq += (yv[j] - mean) * (yv[j] - mean);
  const float rstd = rsqrtf(head_sum8(live ? sq : 0.f) * (1.f / kHead) + eps);
  const float bonus = head_sum8(rk);
  if (!live) return;
  float vv[kVec], gv[kVec], res[kVec];
  unpack8(v_raw, vv);
  unpack8(g_raw, gv);
  unpack8(weight_raw, a);
  unpack8(bias_raw, b);
#pragma unroll
  for (int j = 0; j < kVec; ++j) res[j] = ((yv[j] - mean) * rstd * a[j] + b[j] + bonus * vv[j]) * gv[j];
  store8(out, res);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gn_bonus_gate_kernel(const T* __restrict__ y, const T* __restrict__ r, const T* __restrict__ k,
                         const T* __restrict__ v, const T* __restrict__ g, const T* __restrict__ r_k,
                         const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ out, const int H,
                         const float eps) {
  allow_dependents_to_launch();
  const int C = H * kHead;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * kVec;
  const bool live = c < C;
  const int64_t o = (int64_t)blockIdx.x * C + c;
  gn8(y + o, r + o, k + o, v + o, g + o, r_k + c, weight + c, bias + c, out + o, live, eps);
}

// ---------------------------------------------------------------------------------------------
// wkv_decode_step: a block's WKV step for rows that are each one slot's single token, in one launch
// instead of three (wkv_prep, the WKV op's decode kernel, gn_bonus_gate). One block of N threads
// per (kItems rows, head). Everything the block reads from global memory is requested at its start:
// the rows' state tiles and gn8's operands (g and the three weight vectors) through cp.async (no
// registers held while in flight), r and prep8's operands into registers. Lanes 8j..8j+7 of warp 0
// run prep8 for row j (k and v updated in place in global memory and copied to shared memory; w, a
// and b into shared memory in the activation dtype, rounded where wkv_prep rounds them on their way
// to global memory); then every thread runs the decode step (wkv_decode.cuh) on its state row of
// each tile, y to shared memory in the activation dtype; then the same lanes run gn8 on shared
// memory alone. Each piece is the function the separate kernels run, on the same rounded values,
// so the result is bit-identical to the three ops at any batch size.
//
// Why so: the step is bound by the state's traffic, and an SM keeps in flight only the tiles its
// blocks have requested. Reading r, k and v back from global memory after prep, and gn8's operands
// after the step, made a block wait on memory three times in a row (an H100 at batch 960: 418 us a
// layer, 401 with everything up front). Two rows a block keep 18 tiles of a 16-bit state requested
// an SM (9 blocks, by shared memory) instead of 12 (12 blocks, by registers): on an H100 cut to 96
// SMs by a green context, which gives each SM the H200's share of memory bandwidth, 443 -> 408 us
// (docs/performance.md, "Session 17"; bench/bench_decode_step_sms.py). An fp32 tile is twice the
// size, so two rows a block would keep fewer tiles in flight (10 against 11): one row there.

template <typename T>
struct StepArgs {
  PrepArgs<T> prep;  // w_out, a_out and b_out unused: w, a and b stay in shared memory
  const T* r;
  const T* g;
  const T* r_k;
  const T* ln_w;
  const T* ln_b;
  T* out;
  float eps;
  int rows;
};

// 8 elements global -> shared through cp.async (16-byte aligned on both sides).
template <typename T>
__device__ __forceinline__ void fetch8_async(T* smem, const T* gmem) {
#pragma unroll
  for (int w = 0; w < static_cast<int>(kVec * sizeof(T) / 16); ++w)
    cp_async16(reinterpret_cast<uint4*>(smem) + w, reinterpret_cast<const uint4*>(gmem) + w);
}

// A row's vectors of one head in the step's shared memory, in the activation dtype.
enum StepVec { kW, kA, kB, kK, kV, kY, kR, kG, kRK, kLW, kLB, kStepVecs };

// 1 row a block (fp32 states): 12 blocks an SM by registers, 78-80 with 16-bit activations, no
// spills (16, the decode kernel's, spilled prep8's arrays). 2 rows (16-bit states): 10 blocks an
// SM by shared memory with 16-bit activations (21.25 KiB a block: two unpadded tiles), registers
// held to 102 by the bound.
template <typename T, typename state_t, int kItems>
__global__ void __launch_bounds__(N, kItems == 1 ? 12 : 10) wkv_decode_step_kernel(const StepArgs<T> p, state_t* __restrict__ state,
                                                                                  const int* __restrict__ slot_idx) {
  allow_dependents_to_launch();
  constexpr int kLanes = kHead / kVec;  // lanes of warp 0 per row
  const int h = blockIdx.y, i = threadIdx.x, s0 = blockIdx.x * kItems;
  const int items = min(kItems, p.rows - s0);  // the same for the whole block
  const PrepArgs<T>& q = p.prep;
  __shared__ __align__(16) state_t tile[kItems][DecodeTile<state_t>::ENTRIES];
  __shared__ __align__(16) float vec[kItems][5][N];
  __shared__ __align__(16) T io[kItems][kStepVecs][N];

  const int64_t C = (int64_t)q.H * kHead;
  const bool live = i < kLanes * items;  // lane 8j + l of warp 0: row j's channels c..c+7
  const int j0 = live ? i / kLanes : 0;
  const int lc = (i % kLanes) * kVec;
  const int c = h * kHead + lc;
  const int64_t o = (s0 + j0) * C + c;
  if (live) {
    fetch8_async(io[j0][kG] + lc, p.g + o);
    fetch8_async(io[j0][kRK] + lc, p.r_k + c);
    fetch8_async(io[j0][kLW] + lc, p.ln_w + c);
    fetch8_async(io[j0][kLB] + lc, p.ln_b + c);
  }
  state_t* S[kItems];
  T r[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (j < items) {
      S[j] = state + ((int64_t)slot_idx[s0 + j] * q.H + h) * (N * N);
      decode_fetch(S[j], tile[j], i);
      r[j] = p.r[(s0 + j) * C + h * kHead + i];
    }
  }
  if (i < 32)  // warp 0 whole: prep8's norm is a shuffle sum
    prep8(prep_row(q, o, c, io[j0][kW] + lc, io[j0][kA] + lc, io[j0][kB] + lc), live, io[j0][kK] + lc, io[j0][kV] + lc);
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (j < items) io[j][kR][i] = r[j];
  __syncthreads();  // w, a, b, k, v and r in shared memory for every thread

#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (j < items) {
      float x[6];  // r, w, k, v, a, b: what the decode kernel reads from global memory
      x[0] = to_float(io[j][kR][i]);
      x[1] = to_float(io[j][kW][i]);
      x[2] = to_float(io[j][kK][i]);
      x[3] = to_float(io[j][kV][i]);
      x[4] = to_float(io[j][kA][i]);
      x[5] = to_float(io[j][kB][i]);
      io[j][kY][i] = from_float<T>(decode_update(tile[j], vec[j], x, i));  // its wait covers gn8's cp.async too
      decode_store(S[j], tile[j], i);  // its barrier also publishes y
    }
  }

  if (i < 32)
    gn8(io[j0][kY] + lc, io[j0][kR] + lc, io[j0][kK] + lc, io[j0][kV] + lc, io[j0][kG] + lc, io[j0][kRK] + lc,
        io[j0][kLW] + lc, io[j0][kLB] + lc, p.out + o, live, p.eps);
}

// ---------------------------------------------------------------------------------------------
// relu_square

template <typename T>
__global__ void __launch_bounds__(kThreads) relu_square_kernel(const T* __restrict__ x, T* __restrict__ out, const int64_t n) {
  allow_dependents_to_launch();
  const int64_t chunks = n / kVec;
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  const int64_t start = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  for (int64_t i = start; i < chunks; i += stride) {
    float f[kVec];
    load8(x + i * kVec, f);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float v = fmaxf(f[j], 0.f);
      f[j] = v * v;
    }
    store8(out + i * kVec, f);
  }
  for (int64_t i = chunks * kVec + start; i < n; i += stride) {  // the tail when n % 8 != 0
    const float v = fmaxf(to_float(x[i]), 0.f);
    out[i] = from_float<T>(v * v);
  }
}

// ---------------------------------------------------------------------------------------------
// host side

void check_same(const Tensor& t, const Tensor& like, const char* name) {
  check_cuda(t, name);
  ALBATROSS_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", got ",
                  t.scalar_type());
  ALBATROSS_CHECK(t.device() == like.device(), name, " must be on ", device_name(like));
  ALBATROSS_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_vector(const Tensor& t, const Tensor& like, const char* name, int64_t C) {
  check_same(t, like, name);
  ALBATROSS_CHECK(t.numel() == C, name, " must have ", C, " elements, got ", t.numel());
}

void check_matrix(const Tensor& t, const Tensor& like, const char* name, int64_t rows, int64_t C) {
  check_same(t, like, name);
  ALBATROSS_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == C, name, " must be [", rows, ", ", C, "], got ",
                  t.sizes());
}

// The leading activation of a per-head op: a contiguous [T, H * 64] matrix.
void check_head_matrix(const Tensor& t, const char* name) {
  check_cuda(t, name);
  ALBATROSS_CHECK(t.dim() == 2 && t.is_contiguous() && t.size(1) % kHead == 0, name,
                  " must be a contiguous [T, H * 64] matrix, got ", t.sizes());
}

void check_aligned(const Tensor& t, const char* name) {
  ALBATROSS_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                  " must be 16-byte aligned (8-channel vector access)");
}

unsigned row_blocks(int64_t rows) {
  ALBATROSS_CHECK(rows <= INT_MAX, "too many rows for one launch: ", rows);
  return static_cast<unsigned>(rows);
}

template <typename T>
T* pointer(const Tensor& t) { return static_cast<T*>(t.data_ptr()); }

Tensor add_layer_norm_cuda(Tensor x, const OptionalTensor& delta, const Tensor& weight, const Tensor& bias,
                           double eps) {
  check_cuda(x, "x");
  ALBATROSS_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, C] matrix, got ", x.sizes());
  const int64_t rows = x.size(0), C = x.size(1);
  ALBATROSS_CHECK(C <= kThreads * kRowRegs, "add_layer_norm supports C <= ", kThreads * kRowRegs, ", got ", C);
  if (delta.has_value()) check_matrix(*delta, x, "delta", rows, C);
  check_vector(weight, x, "weight", C);
  check_vector(bias, x, "bias", C);
  const DeviceGuard guard(x.get_device_index());
  Tensor h = empty_like(x);
  if (rows == 0) return h;
  const cudaStream_t stream = current_stream(x);
  auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool vectorised = C % kVec == 0 && aligned(x) && aligned(h) && aligned(weight) && aligned(bias) &&
                          (!delta.has_value() || aligned(*delta));
  ALBATROSS_DISPATCH_FLOAT(x.scalar_type(), T, "x", [&] {
    const T* delta_ptr = delta.has_value() ? pointer<const T>(*delta) : nullptr;
    if (vectorised) {
      add_layer_norm_vec_kernel<T><<<row_blocks(rows), kThreads, 0, stream>>>(
          pointer<T>(x), delta_ptr, pointer<const T>(weight), pointer<const T>(bias), pointer<T>(h), static_cast<int>(C),
          static_cast<float>(eps));
    } else {
      add_layer_norm_kernel<T><<<row_blocks(rows), kThreads, 0, stream>>>(
          pointer<T>(x), delta_ptr, pointer<const T>(weight), pointer<const T>(bias), pointer<T>(h), static_cast<int>(C),
          static_cast<float>(eps));
    }
    check_launch();
  });
  return h;
}

Tensor shift_mix_cuda(const Tensor& x, Tensor shift, const Tensor& slot_idx, const Tensor& cu_seqlens,
                      const Tensor& coefficients) {
  check_cuda(x, "x");
  ALBATROSS_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, C] matrix, got ", x.sizes());
  const int64_t rows = x.size(0), C = x.size(1);
  check_cuda(shift, "shift_state");
  ALBATROSS_CHECK(shift.scalar_type() == x.scalar_type() && shift.dim() == 2 && shift.size(1) == C &&
                      shift.stride(1) == 1,
                  "shift_state must be [B, ", C, "] with unit channel stride and x's dtype, got ", shift.sizes());
  check_same(coefficients, x, "coefficients");
  const bool single = coefficients.dim() == 1;  // one [T, C] mix instead of [K, T, C]
  ALBATROSS_CHECK((single && coefficients.size(0) == C) || (coefficients.dim() == 2 && coefficients.size(1) == C),
                  "coefficients must be [K, ", C, "] or [", C, "], got ", coefficients.sizes());
  const int64_t S = check_slots(slot_idx, cu_seqlens);
  const int64_t K = single ? 1 : coefficients.size(0);
  ALBATROSS_CHECK(C % kVec == 0 && shift.stride(0) % kVec == 0,
                  "shift_mix needs C and the shift row stride to be multiples of 8");
  check_aligned(x, "x");
  check_aligned(shift, "shift_state");
  check_aligned(coefficients, "coefficients");
  const DeviceGuard guard(x.get_device_index());
  Tensor out = single ? new_empty(x, {rows, C}) : new_empty(x, {K, rows, C});
  if (rows == 0 || S == 0 || K == 0) return out;
  const dim3 grid(row_blocks(rows), static_cast<unsigned>((C / kVec + kThreads - 1) / kThreads));
  const cudaStream_t stream = current_stream(x);
  ALBATROSS_DISPATCH_FLOAT(x.scalar_type(), T, "x", [&] {
    shift_mix_kernel<T><<<grid, kThreads, 0, stream>>>(
        pointer<const T>(x), pointer<T>(shift), shift.stride(0), slot_idx.const_data_ptr<int>(),
        cu_seqlens.const_data_ptr<int>(), static_cast<int>(S), pointer<const T>(coefficients), static_cast<int>(K),
        pointer<T>(out), rows, static_cast<int>(C));
    check_launch();
  });
  return out;
}

// The operands both one-launch norm + mix ops share: x a contiguous [T, C] matrix (C a multiple of
// 8 up to 8192), the norm's weight and bias [C], the shift pool's layer [B, C] with x's dtype, and
// the mix coefficients ([K, C] or one [C] vector). Returns K. Each op then checks its own (delta,
// slot_idx, cu_seqlens); every pointer 16-byte aligned, so the vectorised kernels are the ones matched.
int64_t check_norm_mix_operands(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& shift,
                                const Tensor& coefficients, const char* op) {
  check_cuda(x, "x");
  ALBATROSS_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, C] matrix, got ", x.sizes());
  const int64_t C = x.size(1);
  ALBATROSS_CHECK(C % kVec == 0 && C <= kThreads * kRowRegs, op, " needs C a multiple of 8 up to ", kThreads * kRowRegs,
                  ", got ", C);
  check_vector(weight, x, "weight", C);
  check_vector(bias, x, "bias", C);
  check_cuda(shift, "shift_state");
  ALBATROSS_CHECK(shift.scalar_type() == x.scalar_type() && shift.dim() == 2 && shift.size(1) == C &&
                      shift.stride(1) == 1 && shift.stride(0) % kVec == 0 && shift.device() == x.device(),
                  "shift_state must be [B, ", C, "] on x's device with x's dtype, unit channel stride and a row stride "
                  "that is a multiple of 8, got ", shift.sizes());
  check_same(coefficients, x, "coefficients");
  const bool single = coefficients.dim() == 1;  // one [T, C] mix instead of [K, T, C]
  ALBATROSS_CHECK((single && coefficients.size(0) == C) || (coefficients.dim() == 2 && coefficients.size(1) == C),
                  "coefficients must be [K, ", C, "] or [", C, "], got ", coefficients.sizes());
  return single ? 1 : coefficients.size(0);
}

Tensor norm_mix_decode_cuda(Tensor x, const OptionalTensor& delta, const Tensor& weight, const Tensor& bias,
                            Tensor shift, const Tensor& slot_idx, const Tensor& coefficients, double eps) {
  const int64_t K = check_norm_mix_operands(x, weight, bias, shift, coefficients, "norm_mix_decode");
  const int64_t rows = x.size(0), C = x.size(1);
  const bool single = coefficients.dim() == 1;
  if (delta.has_value()) check_matrix(*delta, x, "delta", rows, C);
  check_cuda(slot_idx, "slot_idx");
  ALBATROSS_CHECK(slot_idx.scalar_type() == ScalarType::Int && slot_idx.dim() == 1 && slot_idx.is_contiguous() &&
                      slot_idx.size(0) == rows && slot_idx.device() == x.device(),
                  "slot_idx must be a contiguous int32 vector with one slot per row (", rows, ") on ", device_name(x));
  check_aligned(x, "x");
  if (delta.has_value()) check_aligned(*delta, "delta");
  check_aligned(weight, "weight");
  check_aligned(bias, "bias");
  check_aligned(shift, "shift_state");
  check_aligned(coefficients, "coefficients");
  ALBATROSS_CHECK(K <= INT_MAX, "too many mixes");
  const DeviceGuard guard(x.get_device_index());
  Tensor out = single ? new_empty(x, {rows, C}) : new_empty(x, {K, rows, C});
  if (rows == 0 || K == 0) return out;
  const cudaStream_t stream = current_stream(x);
  ALBATROSS_DISPATCH_FLOAT(x.scalar_type(), T, "x", [&] {
    norm_mix_decode_kernel<T><<<row_blocks(rows), kThreads, 0, stream>>>(
        pointer<T>(x), delta.has_value() ? pointer<const T>(*delta) : nullptr, pointer<const T>(weight),
        pointer<const T>(bias), pointer<T>(shift), shift.stride(0), slot_idx.const_data_ptr<int>(),
        pointer<const T>(coefficients), static_cast<int>(K), pointer<T>(out), rows, static_cast<int>(C),
        static_cast<float>(eps), rows <= 8);
    check_launch();
  });
  return out;
}

std::tuple<Tensor, Tensor> norm_mix_rows_cuda(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                              const Tensor& bias, Tensor shift, const Tensor& slot_idx,
                                              const Tensor& cu_seqlens, const Tensor& coefficients, double eps) {
  const int64_t K = check_norm_mix_operands(x, weight, bias, shift, coefficients, "norm_mix_rows");
  const int64_t rows = x.size(0), C = x.size(1);
  const bool single = coefficients.dim() == 1;
  check_matrix(delta, x, "delta", rows, C);
  const int64_t S = check_slots(slot_idx, cu_seqlens);
  ALBATROSS_CHECK(slot_idx.device() == x.device() && cu_seqlens.device() == x.device(),
                  "slot_idx and cu_seqlens must be on ", device_name(x));
  using Tensors = std::initializer_list<const Tensor*>;
  for (const Tensor* t : Tensors{&x, &delta, &weight, &bias, &shift, &coefficients}) check_aligned(*t, "norm_mix_rows inputs");
  ALBATROSS_CHECK(K <= INT_MAX && S <= INT_MAX, "too many mixes or slots");
  const DeviceGuard guard(x.get_device_index());
  Tensor x_new = empty_like(x);
  Tensor out = single ? new_empty(x, {rows, C}) : new_empty(x, {K, rows, C});
  if (rows == 0 || S == 0 || K == 0) return {x_new, out};
  Tensor first = new_empty(x, {S, C});
  const cudaStream_t stream = current_stream(x);
  ALBATROSS_DISPATCH_FLOAT(x.scalar_type(), T, "x", [&] {
    gather_rows_kernel<T><<<row_blocks(S), kThreads, 0, stream>>>(pointer<const T>(shift), shift.stride(0),
                                                                  slot_idx.const_data_ptr<int>(), pointer<T>(first),
                                                                  static_cast<int>(C));
    check_launch();
    const unsigned blocks = row_blocks((rows + kNormRows<T> - 1) / kNormRows<T>);
    const auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, stream>>>(pointer<T>(x), pointer<const T>(delta), pointer<T>(x_new),
                                             pointer<const T>(weight), pointer<const T>(bias), pointer<const T>(first),
                                             pointer<T>(shift), shift.stride(0), slot_idx.const_data_ptr<int>(),
                                             cu_seqlens.const_data_ptr<int>(), static_cast<int>(S),
                                             pointer<const T>(coefficients), static_cast<int>(K), pointer<T>(out), rows,
                                             static_cast<int>(C), static_cast<float>(eps));
    };
    constexpr int64_t kGroupChannels = kThreads * kVec;  // 2,048
    if (C <= kGroupChannels) {
      launch(norm_mix_rows_kernel<T, 1>);
    } else if (C <= 2 * kGroupChannels) {
      launch(norm_mix_rows_kernel<T, 2>);
    } else {
      launch(norm_mix_rows_kernel<T, 4>);
    }
    check_launch();
  });
  return {x_new, out};
}

// wkv_prep's inputs (k a contiguous [rows, H * 64] matrix, the others matching it, 16-byte
// aligned); returns whether the value residual (v_lora, v_first, v0) is given.
bool check_prep_inputs(const Tensor& k, const Tensor& v, const Tensor& w_lora, const Tensor& a_lora,
                       const OptionalTensor& v_lora, const OptionalTensor& v_first, const Tensor& w0, const Tensor& a0,
                       const OptionalTensor& v0, const Tensor& k_k, const Tensor& k_a, const char* what) {
  check_head_matrix(k, "k");
  const int64_t rows = k.size(0), C = k.size(1);
  check_matrix(v, k, "v", rows, C);
  check_matrix(w_lora, k, "w_lora", rows, C);
  check_matrix(a_lora, k, "a_lora", rows, C);
  const bool residual = v_lora.has_value();
  ALBATROSS_CHECK(residual == v_first.has_value() && residual == v0.has_value(),
                  "v_lora, v_first and v0 must be given together (value residual) or all omitted (layer 0)");
  if (residual) {
    check_matrix(*v_lora, k, "v_lora", rows, C);
    check_matrix(*v_first, k, "v_first", rows, C);
    check_vector(*v0, k, "v0", C);
  }
  check_vector(w0, k, "w0", C);
  check_vector(a0, k, "a0", C);
  check_vector(k_k, k, "k_k", C);
  check_vector(k_a, k, "k_a", C);
  using Tensors = std::initializer_list<const Tensor*>;
  for (const Tensor* t : Tensors{&k, &v, &w_lora, &a_lora, &w0, &a0, &k_k, &k_a}) check_aligned(*t, what);
  if (residual)
    for (const Tensor* t : Tensors{&*v_lora, &*v_first, &*v0}) check_aligned(*t, what);
  // prep8 reads every input before it writes k and v in place: no input may share their memory.
  const auto bytes = [](const Tensor& t) {
    const auto* begin = static_cast<const char*>(t.data_ptr());
    return std::make_pair(begin, begin + t.numel() * static_cast<int64_t>(t.element_size()));
  };
  const auto overlap = [&](const Tensor& a, const Tensor& b) {
    const auto [a0_, a1_] = bytes(a);
    const auto [b0_, b1_] = bytes(b);
    return a0_ < b1_ && b0_ < a1_;
  };
  ALBATROSS_CHECK(!overlap(k, v), what, ": k and v must not share memory");
  for (const Tensor* t : Tensors{&w_lora, &a_lora, &w0, &a0, &k_k, &k_a})
    ALBATROSS_CHECK(!overlap(k, *t) && !overlap(v, *t), what, ": k and v (updated in place) must not share memory with another input");
  if (residual)
    for (const Tensor* t : Tensors{&*v_lora, &*v_first, &*v0})
      ALBATROSS_CHECK(!overlap(k, *t) && !overlap(v, *t), what, ": k and v (updated in place) must not share memory with another input");
  return residual;
}

template <typename T>
PrepArgs<T> prep_args(const Tensor& k, const Tensor& v, const Tensor& w_lora, const Tensor& a_lora,
                      const OptionalTensor& v_lora, const OptionalTensor& v_first, const Tensor& w0, const Tensor& a0,
                      const OptionalTensor& v0, const Tensor& k_k, const Tensor& k_a, T* w_out, T* a_out, T* b_out) {
  const bool residual = v_lora.has_value();
  PrepArgs<T> p;
  p.k = pointer<T>(k);
  p.v = pointer<T>(v);
  p.w_lora = pointer<const T>(w_lora);
  p.a_lora = pointer<const T>(a_lora);
  p.v_lora = residual ? pointer<const T>(*v_lora) : nullptr;
  p.v_first = residual ? pointer<const T>(*v_first) : nullptr;
  p.w0 = pointer<const T>(w0);
  p.a0 = pointer<const T>(a0);
  p.v0 = residual ? pointer<const T>(*v0) : nullptr;
  p.k_k = pointer<const T>(k_k);
  p.k_a = pointer<const T>(k_a);
  p.w_out = w_out;
  p.a_out = a_out;
  p.b_out = b_out;
  p.H = static_cast<int>(k.size(1) / kHead);
  return p;
}

std::tuple<Tensor, Tensor, Tensor> wkv_prep_cuda(Tensor k, Tensor v, const Tensor& w_lora, const Tensor& a_lora,
                                                 const OptionalTensor& v_lora, const OptionalTensor& v_first,
                                                 const Tensor& w0, const Tensor& a0, const OptionalTensor& v0,
                                                 const Tensor& k_k, const Tensor& k_a) {
  check_prep_inputs(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, "wkv_prep inputs");
  const int64_t rows = k.size(0), H = k.size(1) / kHead;
  const DeviceGuard guard(k.get_device_index());
  Tensor w = empty_like(k), a = empty_like(k), b = empty_like(k);
  if (rows == 0) return {w, a, b};
  const unsigned head_blocks = static_cast<unsigned>((H + kHeadsPerBlock - 1) / kHeadsPerBlock);  // 32 heads a block
  const dim3 grid(row_blocks(rows), head_blocks);
  const cudaStream_t stream = current_stream(k);
  ALBATROSS_DISPATCH_FLOAT(k.scalar_type(), T, "k", [&] {
    const PrepArgs<T> p = prep_args(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, pointer<T>(w),
                                    pointer<T>(a), pointer<T>(b));
    wkv_prep_kernel<T><<<grid, kThreads, 0, stream>>>(p);
    check_launch();
  });
  return {w, a, b};
}

Tensor gn_bonus_gate_cuda(const Tensor& y, const Tensor& r, const Tensor& k, const Tensor& v, const Tensor& g,
                          const Tensor& r_k, const Tensor& weight, const Tensor& bias, double eps) {
  check_head_matrix(y, "y");
  const int64_t rows = y.size(0), C = y.size(1), H = C / kHead;
  check_matrix(r, y, "r", rows, C);
  check_matrix(k, y, "k", rows, C);
  check_matrix(v, y, "v", rows, C);
  check_matrix(g, y, "g", rows, C);
  check_vector(r_k, y, "r_k", C);
  check_vector(weight, y, "weight", C);
  check_vector(bias, y, "bias", C);
  using Tensors = std::initializer_list<const Tensor*>;
  for (const Tensor* t : Tensors{&y, &r, &k, &v, &g, &r_k, &weight, &bias}) check_aligned(*t, "gn_bonus_gate inputs");
  const DeviceGuard guard(y.get_device_index());
  Tensor out = empty_like(y);
  if (rows == 0) return out;
  const unsigned head_blocks = static_cast<unsigned>((H + kHeadsPerBlock - 1) / kHeadsPerBlock);  // 32 heads a block
  const dim3 grid(row_blocks(rows), head_blocks);
  const cudaStream_t stream = current_stream(y);
  ALBATROSS_DISPATCH_FLOAT(y.scalar_type(), T, "y", [&] {
    gn_bonus_gate_kernel<T><<<grid, kThreads, 0, stream>>>(
        pointer<const T>(y), pointer<const T>(r), pointer<const T>(k), pointer<const T>(v), pointer<const T>(g),
        pointer<const T>(r_k), pointer<const T>(weight), pointer<const T>(bias), pointer<T>(out), static_cast<int>(H),
        static_cast<float>(eps));
    check_launch();
  });
  return out;
}

// Rows a block of wkv_decode_step for a state of `state_bytes` an entry (the kernel's comment says why).
constexpr int step_items(const size_t state_bytes) { return state_bytes == 2 ? 2 : 1; }

Tensor wkv_decode_step_cuda(Tensor state, const Tensor& slot_idx, const Tensor& r, Tensor k, Tensor v, const Tensor& g,
                           const Tensor& w_lora, const Tensor& a_lora, const OptionalTensor& v_lora,
                           const OptionalTensor& v_first, const Tensor& w0, const Tensor& a0, const OptionalTensor& v0,
                           const Tensor& k_k, const Tensor& k_a, const Tensor& r_k, const Tensor& ln_w,
                           const Tensor& ln_b, double eps) {
  const char* what = "wkv_decode_step inputs";
  check_prep_inputs(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, what);
  const int64_t rows = k.size(0), C = k.size(1), H = C / kHead;
  check_cuda(state, "state");
  ALBATROSS_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == N && state.size(3) == N &&
                      state.is_contiguous(),
                  "state must be a contiguous [slots, ", H, ", 64, 64] tensor, got ", state.sizes());
  ALBATROSS_CHECK(state.device() == k.device(), "state must be on ", device_name(k));
  check_cuda(slot_idx, "slot_idx");
  ALBATROSS_CHECK(slot_idx.scalar_type() == ScalarType::Int && slot_idx.dim() == 1 && slot_idx.is_contiguous() &&
                      slot_idx.size(0) == rows && slot_idx.device() == k.device(),
                  "slot_idx must be a contiguous int32 vector with one slot per row (", rows, ") on ", device_name(k));
  check_matrix(r, k, "r", rows, C);
  check_matrix(g, k, "g", rows, C);
  check_vector(r_k, k, "r_k", C);
  check_vector(ln_w, k, "ln_w", C);
  check_vector(ln_b, k, "ln_b", C);
  using Tensors = std::initializer_list<const Tensor*>;
  for (const Tensor* t : Tensors{&r, &g, &r_k, &ln_w, &ln_b}) check_aligned(*t, what);
  ALBATROSS_CHECK(rows <= INT_MAX && H <= 65535, "too many rows or heads for one launch");
  const DeviceGuard guard(k.get_device_index());
  Tensor out = empty_like(k);
  if (rows == 0) return out;
  const cudaStream_t stream = current_stream(k);
  ALBATROSS_DISPATCH_FLOAT(k.scalar_type(), T, "k", [&] {
    ALBATROSS_DISPATCH_FLOAT(state.scalar_type(), state_t, "state", [&] {
      StepArgs<T> p;
      p.prep = prep_args<T>(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a, nullptr, nullptr, nullptr);
      p.r = pointer<const T>(r);
      p.g = pointer<const T>(g);
      p.r_k = pointer<const T>(r_k);
      p.ln_w = pointer<const T>(ln_w);
      p.ln_b = pointer<const T>(ln_b);
      p.out = pointer<T>(out);
      p.eps = static_cast<float>(eps);
      p.rows = static_cast<int>(rows);
      constexpr int kItems = step_items(sizeof(state_t));
      const dim3 grid(static_cast<unsigned>((rows + kItems - 1) / kItems), static_cast<unsigned>(H));
      wkv_decode_step_kernel<T, state_t, kItems>
          <<<grid, N, 0, stream>>>(p, pointer<state_t>(state), slot_idx.const_data_ptr<int>());
      check_launch();
    });
  });
  return out;
}

Tensor relu_square_cuda(const Tensor& x) {
  check_cuda(x, "x");
  ALBATROSS_CHECK(x.is_contiguous(), "x must be contiguous");
  const DeviceGuard guard(x.get_device_index());
  Tensor out = empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  check_aligned(x, "x");
  const int64_t blocks = std::min<int64_t>((n / kVec + kThreads - 1) / kThreads + 1, 65536);
  const cudaStream_t stream = current_stream(x);
  ALBATROSS_DISPATCH_FLOAT(x.scalar_type(), T, "x", [&] {
    relu_square_kernel<T>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(pointer<const T>(x), pointer<T>(out), n);
    check_launch();
  });
  return out;
}

}  // namespace
}  // namespace albatross

// The schemas are declared in albatross/ops.py.
STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m) {
  m.impl("add_layer_norm", TORCH_BOX(&albatross::add_layer_norm_cuda));
  m.impl("shift_mix", TORCH_BOX(&albatross::shift_mix_cuda));
  m.impl("norm_mix_decode", TORCH_BOX(&albatross::norm_mix_decode_cuda));
  m.impl("norm_mix_rows", TORCH_BOX(&albatross::norm_mix_rows_cuda));
  m.impl("wkv_prep", TORCH_BOX(&albatross::wkv_prep_cuda));
  m.impl("gn_bonus_gate", TORCH_BOX(&albatross::gn_bonus_gate_cuda));
  m.impl("wkv_decode_step", TORCH_BOX(&albatross::wkv_decode_step_cuda));
  m.impl("relu_square", TORCH_BOX(&albatross::relu_square_cuda));
}
