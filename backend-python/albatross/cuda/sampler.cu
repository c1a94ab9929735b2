// Batched sampler: one block per logits row, the exact definition of docs/architecture.md.
//
// Every reduction is deterministic (fixed thread ownership, shuffle trees, fixed-order sums), so
// the same inputs give the same ids run after run. Thresholds are found without sorting:
//  - top_k: radix select on the bit pattern of p (non-negative floats order like their bits),
//    8 bits per pass with integer counts;
//  - top_p: the largest value t with mass(p >= t) >= top_p. First among a few candidates: the
//    top-k set when top_k <= 1024, else the 1024 largest p; these are sorted in shared memory
//    (p descending, id ascending: deterministic) and scanned. Only when that cannot decide (ties
//    overflow the candidate buffer, or the 1024 largest hold less than top_p) the full walk runs:
//    4 bits per pass over the row with per-thread mass histograms (register accumulators, so no
//    float atomics and no order dependence). Each pass re-reads the row, so narrowing first saves
//    most of the sampler's memory traffic.
// The draw walks kept mass in id order: each thread owns a contiguous id range, a block scan gives
// range offsets, and the one range where the cumulative mass reaches u * total is walked serially.
//
// Allowed-token masks and logit biases (step 0 of the definition) are a separate kernel,
// `constrain_kernel`, run first only for a call that has either: it writes each row's
// `logits - penalties + bias`, -inf outside the row's mask, into a scratch copy that the sampler
// then reads as already-adjusted logits. The search itself only has to treat -inf (p = 0) ids as
// what they are: never candidates, never kept.

#include "common.cuh"

namespace albatross {
namespace {

constexpr int THREADS = 1024;
constexpr int WARPS = THREADS / 32;
constexpr int CANDIDATES = THREADS;  // one sorted candidate per thread

struct RowParams {
  const float* temperature;
  const float* top_p;
  const int64_t* top_k;
  const float* presence;
  const float* frequency;
  const float* decay;
  const int64_t* seed32;
  const int64_t* step;
};

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  return (x >> 16) ^ x;
}

__device__ __forceinline__ float uniform01(int64_t seed32, int64_t step) {
  const uint32_t mixed = static_cast<uint32_t>(seed32) + static_cast<uint32_t>(step) * 0x9E3779B9u;
  return static_cast<float>(hash32(mixed) >> 8) * 5.9604644775390625e-08f;  // 2**-24
}

// Bitonic sort of `size` (a power of two, at most 2 * THREADS) pairs in shared memory: p descending,
// id ascending on ties, so the order does not depend on the order the pairs were written in.
// Every thread of the block must call it.
__device__ void bitonic_sort(float* p, int* id, int size) {
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += THREADS) {
        const int other = i ^ j;
        if (other > i) {
          const float pa = p[i], pb = p[other];
          const int ia = id[i], ib = id[other];
          const bool other_first = pb > pa || (pb == pa && ib < ia);
          if (other_first == ((i & k) == 0)) {
            p[i] = pb; p[other] = pa;
            id[i] = ib; id[other] = ia;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Sum over the block in a fixed order; every thread gets the result.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < WARPS ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// Row context shared by every pass: p(e) = exp(l(e)/T - mx) / Z with l = logit - penalty (penalty
// null: the logits are already adjusted by constrain_kernel).
struct Row {
  const float* logits;
  const float* penalty;
  int vocab;
  float temperature, mx, sum;
  __device__ __forceinline__ float adjusted(int e) const { return penalty ? logits[e] - penalty[e] : logits[e]; }
  __device__ __forceinline__ float prob(int e) const { return expf(adjusted(e) / temperature - mx) / sum; }
};

// The four adjusted logits of quad q (ids past the vocabulary: -inf, weight 0).
__device__ __forceinline__ float4 load_quad(const Row& row, int q, bool vector) {
  const int e = 4 * q;
  if (vector && e + 3 < row.vocab) {
    float4 l = __ldg(reinterpret_cast<const float4*>(row.logits) + q);
    if (row.penalty) {
      const float4 p = *(reinterpret_cast<const float4*>(row.penalty) + q);
      l.x -= p.x; l.y -= p.y; l.z -= p.z; l.w -= p.w;
    }
    return l;
  }
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = e + j < row.vocab ? row.adjusted(e + j) : -INFINITY;
  return make_float4(v[0], v[1], v[2], v[3]);
}

// Whether a row's logits (and penalties) can be read as float4s: quads of ids never straddle the
// end of the vocabulary and both rows start on 16 bytes.
__device__ __forceinline__ bool quad_aligned(const Row& row) {
  return row.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(row.logits) % 16 == 0 &&
         (row.penalty == nullptr || reinterpret_cast<uintptr_t>(row.penalty) % 16 == 0);
}

// Calls visit(id, adjusted logit) for every id of the row this thread owns: quad ownership (thread t
// owns ids 4q .. 4q + 3 of quads q = t, t + THREADS, ..., the rejection draw's walk order) with
// float4 loads when the row allows it, else one id at a time (ids t, t + THREADS, ...). Either way
// a thread meets its ids in ascending order, which the argmax's lowest-id tie rule relies on.
template <typename Visit>
__device__ __forceinline__ void for_each_owned(const Row& row, Visit&& visit) {
  if (quad_aligned(row)) {
    const int quads = row.vocab / 4;
    for (int q = threadIdx.x; q < quads; q += THREADS) {
      const float4 l = load_quad(row, q, true);
      visit(4 * q, l.x);
      visit(4 * q + 1, l.y);
      visit(4 * q + 2, l.z);
      visit(4 * q + 3, l.w);
    }
  } else {
    for (int e = threadIdx.x; e < row.vocab; e += THREADS) visit(e, row.adjusted(e));
  }
}

// k-th largest p (1-based k), by 8-bit radix select on the float bits.
__device__ float kth_largest(const Row& row, int k, int* hist, int* shared_int) {
  uint32_t prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += THREADS) hist[b] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < row.vocab; e += THREADS) {
      const uint32_t bits = __float_as_uint(row.prob(e));
      if ((bits & mask) == prefix) atomicAdd(&hist[(bits >> shift) & 255u], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int bin = 0;
      for (int b = 255; b >= 0; --b) {
        if (hist[b] >= remaining) { bin = b; break; }
        remaining -= hist[b];
      }
      shared_int[0] = bin;
      shared_int[1] = remaining;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(shared_int[0]) << shift;
    mask |= 255u << shift;
    remaining = shared_int[1];
  }
  return __uint_as_float(prefix);
}

// Largest value t with mass(p >= t) >= top_p (the p at which the descending cumulative sum first
// reaches top_p); the smallest positive p when rounding keeps the total below top_p.
__device__ float top_p_threshold(const Row& row, float top_p, float (*bin_mass)[16], float* mass16, float* shared_f,
                                 int* shared_int) {
  uint32_t prefix = 0, mask = 0;
  float above = 0.f;  // mass of values whose bits exceed the current prefix range
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int shift = 28; shift >= 0; shift -= 4) {
    float acc[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) acc[b] = 0.f;
    for (int e = threadIdx.x; e < row.vocab; e += THREADS) {
      const float p = row.prob(e);
      const uint32_t bits = __float_as_uint(p);
      if ((bits & mask) == prefix) {
        const uint32_t digit = (bits >> shift) & 15u;
#pragma unroll
        for (int b = 0; b < 16; ++b) acc[b] += digit == static_cast<uint32_t>(b) ? p : 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      const float s = warp_sum(acc[b]);
      if (lane == 0) bin_mass[warp][b] = s;
    }
    __syncthreads();
    if (threadIdx.x < 16) {
      float s = 0.f;
      for (int w = 0; w < WARPS; ++w) s += bin_mass[w][threadIdx.x];
      mass16[threadIdx.x] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = -1, last_nonzero = -1;
      float acc_above = above, above_last = above;
      for (int b = 15; b >= 0; --b) {
        if (mass16[b] <= 0.f) continue;
        last_nonzero = b;
        above_last = acc_above;
        if (acc_above + mass16[b] >= top_p) { chosen = b; break; }
        acc_above += mass16[b];
      }
      if (chosen < 0) chosen = last_nonzero;
      shared_int[0] = chosen < 0 ? 0 : chosen;
      shared_f[0] = chosen < 0 ? above : above_last;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(shared_int[0]) << shift;
    mask |= 15u << shift;
    above = shared_f[0];
    __syncthreads();
  }
  return __uint_as_float(prefix);
}

// Shared buffers of the candidate search.
struct Candidates {
  float p[CANDIDATES];
  int id[CANDIDATES];
  float warp_total[WARPS];
  int count;
  int first;
};

// The top-p threshold when it is at least `floor`: collects the tokens with p >= floor, sorts them
// (p descending, id ascending), and returns the p of the first one whose cumulative mass reaches
// top_p. Returns false (every thread alike) when more than CANDIDATES tokens pass the floor or
// their whole mass stays below top_p; the threshold is then below floor.
__device__ bool top_p_from_candidates(const Row& row, float floor, float top_p, Candidates& c, float* threshold) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) { c.count = 0; c.first = INT_MAX; }
  __syncthreads();
  for (int e = tid; e < row.vocab; e += THREADS) {
    const float p = row.prob(e);
    if (p >= floor) {
      const int at = atomicAdd(&c.count, 1);  // arrival order does not matter: sorted below
      if (at < CANDIDATES) { c.p[at] = p; c.id[at] = e; }
    }
  }
  __syncthreads();
  const int n = c.count;
  if (n > CANDIDATES) return false;
  if (tid >= n) { c.p[tid] = -1.f; c.id[tid] = INT_MAX; }  // padding sorts last
  __syncthreads();
  bitonic_sort(c.p, c.id, CANDIDATES);
  // Inclusive scan of the sorted masses (fixed order), then the first index reaching top_p.
  const float mine = tid < n ? c.p[tid] : 0.f;
  const float incl = warp_inclusive_scan(mine);
  if (lane == 31) c.warp_total[warp] = incl;
  __syncthreads();
  float offset = 0.f;
  for (int w = 0; w < warp; ++w) offset += c.warp_total[w];
  if (tid < n && offset + incl >= top_p) atomicMin(&c.first, tid);
  __syncthreads();
  const int first = c.first;
  if (first == INT_MAX) return false;
  *threshold = c.p[first];
  return true;
}

// ---------------------------------------------------------------------------------------------
// Fast path for a filtered row (top_k <= 1024, or top_p alone): the candidates are found from a
// histogram of the logits' order keys built in the first pass, so a row is read once (max/sum/
// histogram and the held keys; the collection pass reads it again only when a thread may hold too
// few) plus the penalty decay, instead of nine times. The kept set and the draw are
// those of the exact path: thresholds come from the sorted candidates, and the draw walks the
// kept candidates in id order. Whenever that cannot be decided from the candidates alone (too
// many ties in one histogram bin, top_p undecided, or a kept set that may reach past the
// candidates), the row takes the exact path.

constexpr int FAST_CAP = 2 * THREADS;  // candidates held in shared memory (two per thread)
constexpr int BINS = 2048;             // 11 bits of the order key per histogram level

__device__ __forceinline__ uint32_t order_key(float l) {  // larger float, larger key
  const uint32_t b = __float_as_uint(l);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct FastShared {
  float p[FAST_CAP];
  int id[FAST_CAP];
  union {
    int hist[BINS];
    float cum[FAST_CAP];  // inclusive prefix sums of the sorted candidates' p
  };
  int count;
  int bin;
  int above;  // elements in the bins above `bin`
  int first;
  int pick;
  int last;
  int complete;  // every id with a finite l is a candidate (a masked row with fewer than k_c allowed)
  int use_fast;  // the first pass built the histogram
};

// The HELD largest order keys (and ids) a thread met in the first pass, largest first (id -1:
// empty). When no thread's smallest held key reaches the candidates' histogram bin, the held keys
// are the whole candidate set and the collection pass need not read the row again. Three per
// thread: the 50-100 candidates of a top-k 50 row spread over 1,024 threads, and a thread holding
// more than three of them (about 1 row in 300 for uniformly placed candidates) reads the row.
constexpr int HELD = 3;

__device__ __forceinline__ float from_order_key(uint32_t key) {  // the inverse of order_key
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

struct Held {
  uint32_t key[HELD];
  int id[HELD];
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < HELD; ++i) { key[i] = 0u; id[i] = -1; }
  }
  // Keeps (k, e) if it is among the HELD largest so far; on equal keys the earlier (lower) id stays first.
  __device__ __forceinline__ void offer(uint32_t k, int e) {
    if (k <= key[HELD - 1]) return;
#pragma unroll
    for (int i = 0; i < HELD; ++i) {
      if (k > key[i]) {
        const uint32_t kk = key[i];
        const int ee = id[i];
        key[i] = k; id[i] = e;
        k = kk; e = ee;
      }
    }
  }
};

// The bin holding the k-th largest key, counting from the top, and how many lie above it (warp 0;
// the result is published in shared memory). With fewer than k in all, bin 0 and `complete`.
__device__ void find_bin(FastShared& f, int k) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    constexpr int PER = BINS / 32;
    const int hi = BINS - 1 - PER * lane;  // this lane's bins, highest first
    int mine = 0;
    for (int q = 0; q < PER; ++q) mine += f.hist[hi - q];
    const int incl = warp_inclusive_scan(mine);
    const unsigned reached = __ballot_sync(0xffffffffu, incl >= k);
    if (lane == 0) f.complete = reached == 0u;
    if (reached == 0u) {
      if (lane == 31) { f.bin = 0; f.above = incl - f.hist[0]; }
    } else if (lane == __ffs(reached) - 1) {
      int cumulative = incl - mine;
      for (int q = 0; q < PER; ++q) {
        const int c = f.hist[hi - q];
        if (cumulative + c >= k) { f.bin = hi - q; f.above = cumulative; break; }
        cumulative += c;
      }
    }
  }
  __syncthreads();
}

enum FastResult { FAST_NONE = 0, FAST_TOKEN = 1, FAST_THRESHOLD = 2 };

// Tries the fast path for a row whose histogram of top-11-bit order keys is in f.hist. Returns
// FAST_TOKEN (token written), FAST_THRESHOLD (*threshold set: draw over the whole row), or FAST_NONE.
__device__ __forceinline__ FastResult fast_sample(const Row& row, FastShared& f, const Held& held, int k_c, int64_t top_k,
                                                  float top_p, int64_t seed32, int64_t step, float* threshold_out,
                                                  int64_t* token) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __shared__ float warp_sums[WARPS];
  find_bin(f, k_c);
  const int bin = f.bin, above = f.above;
  int sub_bin = -1;  // -1: take the whole bin
  if (above + f.hist[bin] > FAST_CAP) {
    // Too many in one bin: histogram the next 11 bits of that bin's keys.
    __syncthreads();
    for (int b = tid; b < BINS; b += THREADS) f.hist[b] = 0;
    __syncthreads();
    for_each_owned(row, [&](int, float l) {
      const uint32_t key = order_key(l);
      if (l > -INFINITY && static_cast<int>(key >> 21) == bin) atomicAdd(&f.hist[(key >> 10) & (BINS - 1)], 1);
    });
    __syncthreads();
    find_bin(f, k_c - above);
    sub_bin = f.bin;
    if (above + f.above + f.hist[sub_bin] > FAST_CAP) return FAST_NONE;  // ties beyond 22 bits: rare
  }
  if (tid == 0) f.count = 0;
  // The held keys are every candidate of this thread unless it may hold too few: its smallest held
  // key still in the candidates' bin (or the bin refined, which they do not know about).
  const bool overflow = sub_bin >= 0 || (held.id[HELD - 1] >= 0 && static_cast<int>(held.key[HELD - 1] >> 21) >= bin);
  const bool from_held = !__syncthreads_or(overflow);
  auto collect = [&](int e, float l) {
    const uint32_t key = order_key(l);
    const int top = static_cast<int>(key >> 21);
    if (l > -INFINITY &&  // a masked id is never a candidate
        (top > bin || (top == bin && (sub_bin < 0 || static_cast<int>((key >> 10) & (BINS - 1)) >= sub_bin)))) {
      const int at = atomicAdd(&f.count, 1);
      f.p[at] = expf(l / row.temperature - row.mx) / row.sum;  // = row.prob(e)
      f.id[at] = e;
    }
  };
  if (from_held) {
#pragma unroll
    for (int i = 0; i < HELD; ++i)
      if (held.id[i] >= 0) collect(held.id[i], from_order_key(held.key[i]));
  } else {
    for_each_owned(row, collect);
  }
  __syncthreads();
  const int n = f.count;
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = tid; i < size; i += THREADS)
    if (i >= n) { f.p[i] = -1.f; f.id[i] = INT_MAX; }  // padding sorts last
  __syncthreads();
  bitonic_sort(f.p, f.id, size);
  // Inclusive prefix sums in sorted order (each thread two neighbours, then a block scan).
  const int i0 = 2 * tid, i1 = 2 * tid + 1;
  const float a0 = i0 < n ? f.p[i0] : 0.f, a1 = i1 < n ? f.p[i1] : 0.f;
  const float incl = warp_inclusive_scan(a0 + a1);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();  // the histogram is no longer read: `cum` may overwrite it
  float offset = 0.f;
  for (int w = 0; w < warp; ++w) offset += warp_sums[w];
  const float before = offset + incl - (a0 + a1);
  if (i0 < n) f.cum[i0] = before + a0;
  if (i1 < n) f.cum[i1] = before + a0 + a1;
  if (tid == 0) { f.first = INT_MAX; f.pick = INT_MAX; f.last = -1; }
  __syncthreads();

  const bool use_k = top_k > 0 && top_k < row.vocab;
  const bool complete = f.complete;
  // n >= k_c = top_k: the k-th largest p; fewer finite ids than top_k (complete): it is a p of 0.
  float threshold = use_k && top_k <= n ? f.p[top_k - 1] : 0.f;
  if (top_p < 1.f) {
    for (int i = tid; i < n; i += THREADS)
      if (f.cum[i] >= top_p) atomicMin(&f.first, i);
    __syncthreads();
    if (f.first != INT_MAX) threshold = fmaxf(threshold, f.p[f.first]);
    else if (!use_k && !complete) return FAST_NONE;  // the candidates hold less than top_p: the exact walk decides
  }
  // Kept: the sorted prefix with p >= threshold. If it reaches the last candidate, tokens outside
  // the candidates may tie with it: draw over the whole row instead (unless there are none).
  for (int i = tid; i < n; i += THREADS) {
    const bool kept = f.p[i] >= threshold && (i + 1 == n || f.p[i + 1] < threshold);
    if (kept) f.last = i;  // exactly one thread: the end of the kept prefix
  }
  __syncthreads();
  const int m = f.last + 1;
  if (!complete && (m == n || threshold <= 0.f)) {
    *threshold_out = threshold;
    return FAST_THRESHOLD;
  }
  const float total = f.cum[m - 1];
  const float target = uniform01(seed32, step) * total;
  // The first kept token in id order whose cumulative mass (in id order) reaches the target.
  for (int i = tid; i < m; i += THREADS) {
    const int mine = f.id[i];
    float cumulative = 0.f;
    for (int j = 0; j < m; ++j) cumulative += f.id[j] <= mine ? f.p[j] : 0.f;
    if (cumulative >= target && f.p[i] > 0.f) atomicMin(&f.pick, mine);  // p = 0 never wins (u = 0)
  }
  __syncthreads();
  if (tid == 0) {
    int pick = f.pick;
    if (pick == INT_MAX) {  // rounding between the two summations: the last kept id
      for (int j = 0; j < m; ++j) pick = j == 0 ? f.id[0] : max(pick, f.id[j]);
    }
    *token = pick;
  }
  __syncthreads();
  return FAST_TOKEN;
}

// ---------------------------------------------------------------------------------------------
// Rejection draw (the twin's `_rejection_draw`; docs/kernels.md "Rejection draw"): rounds of one
// pass each over the row, no sort. Weights w = exp(l / T - max(l) / T). A pass sums the mass M and
// count C of the weights above the pivot; they settle the pending draw x (whose w is the pivot):
// kept when C == 0, or C < top_k and M < top_p * Z. Otherwise the same pass's per-thread masses
// place the round's uniform: a block scan over the threads finds the one whose quads hold the new
// draw, which it walks in walk order; the pivot rises to its weight. Walk order: thread t owns the
// quads q = t, t + THREADS, ... (ids 4q .. 4q + 3), so the loads are coalesced float4s.

constexpr int REJECTION_ROUNDS = 32;  // draws before the row takes the exact path (the twin's)

__device__ __forceinline__ uint2 mulhilo32(uint32_t a, uint32_t b) {
  return make_uint2(__umulhi(a, b), a * b);  // (high, low)
}

// Philox4x32-10, word 0: the round's uniform from key (seed32, step mod 2**32) and counter
// (round, step >> 32, 0, 0), as the twin's round_uniform.
__device__ float round_uniform(int64_t seed32, int64_t step, int round) {
  uint32_t c0 = static_cast<uint32_t>(round), c1 = static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32), c2 = 0u,
           c3 = 0u;
  uint32_t k0 = static_cast<uint32_t>(seed32), k1 = static_cast<uint32_t>(step);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
    const uint2 p0 = mulhilo32(c0, 0xD2511F53u), p1 = mulhilo32(c2, 0xCD9E8D57u);
    const uint32_t n0 = p1.x ^ c1 ^ k0, n2 = p0.x ^ c3 ^ k1;
    c0 = n0; c1 = p1.y; c2 = n2; c3 = p0.y;
  }
  return static_cast<float>(c0 >> 8) * 5.9604644775390625e-08f;  // 2**-24
}

__device__ __forceinline__ float weight(const Row& row, float l) { return expf(l / row.temperature - row.mx); }

struct RejectionShared {
  float warp_mass[WARPS];
  int warp_count[WARPS];
  int chosen;  // the thread whose quads hold the draw
  int token;
  float pivot;
};

// Returns true (every thread alike) with *token set when the row is decided within the rounds.
__device__ bool rejection_sample(const Row& row, int64_t top_k, float top_p, int64_t seed32, int64_t step,
                                 RejectionShared& sh, int64_t* token) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool use_k = top_k > 0 && top_k < row.vocab, use_p = top_p < 1.f;
  const bool maxima_only = (use_k && top_k == 1) || top_p <= 0.f;
  const bool free_row = !use_k && !use_p;
  const bool vector = quad_aligned(row);
  const int quads = (row.vocab + 3) / 4;
  float pivot = maxima_only ? __uint_as_float(0x3F7FFFFFu) : 0.f;  // just under 1: only the maxima (w = 1)
  float total = 0.f;
  int pending = -1;
  for (int round = 0; round <= REJECTION_ROUNDS; ++round) {
    float local = 0.f;
    int count = 0;
    for (int q = tid; q < quads; q += THREADS) {
      const float4 l = load_quad(row, q, vector);
      const float w[4] = {weight(row, l.x), weight(row, l.y), weight(row, l.z), weight(row, l.w)};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (w[j] > pivot) { local += w[j]; ++count; }
    }
    // Block scan of the threads' masses (thread order = walk order) and the block's count.
    const float incl = warp_inclusive_scan(local);
    int warp_count = count;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) warp_count += __shfl_xor_sync(0xffffffffu, warp_count, o);
    __syncthreads();  // the previous round's readers are done with the shared sums
    if (lane == 31) sh.warp_mass[warp] = incl;
    if (lane == 0) sh.warp_count[warp] = warp_count;
    if (tid == 0) sh.chosen = INT_MAX;
    __syncthreads();
    float offset = 0.f, mass = 0.f;
    int above = 0;
    for (int w = 0; w < WARPS; ++w) {
      const float m = sh.warp_mass[w];
      if (w < warp) offset += m;
      mass += m;
      above += sh.warp_count[w];
    }
    if (round == 0) total = mass;
    else if (above == 0 || ((!use_k || above < top_k) && (!use_p || mass < top_p * total))) {
      *token = pending;
      return true;
    }
    if (round == REJECTION_ROUNDS) return false;
    const float target = round_uniform(seed32, step, round) * mass;
    const float excl = offset + incl - local;
    if (local > 0.f && excl + local >= target) atomicMin(&sh.chosen, tid);
    __syncthreads();
    int chosen = sh.chosen;
    if (chosen == INT_MAX) {  // rounding between the two summations: the last thread with mass
      const int last = local > 0.f ? tid : -1;
      __syncthreads();  // every thread has read sh.chosen
      if (tid == 0) sh.chosen = -1;
      __syncthreads();
      atomicMax(&sh.chosen, last);
      __syncthreads();
      chosen = sh.chosen;
    }
    if (tid == chosen) {
      float cumulative = excl, last_w = 0.f;
      int pick = -1, last = -1;
      for (int q = tid; q < quads && pick < 0; q += THREADS) {
        const float4 l = load_quad(row, q, vector);
        const float w[4] = {weight(row, l.x), weight(row, l.y), weight(row, l.z), weight(row, l.w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (pick >= 0 || !(w[j] > pivot)) continue;
          cumulative += w[j];
          last = 4 * q + j;
          last_w = w[j];
          if (cumulative >= target) pick = last;
        }
      }
      sh.token = last;  // the draw, or (rounding left the walk short) this thread's last id above the pivot
      sh.pivot = last_w;
    }
    __syncthreads();
    pending = sh.token;
    pivot = sh.pivot;
    if (maxima_only || free_row) {
      *token = pending;
      return true;
    }
  }
  return false;
}

__global__ void __launch_bounds__(THREADS) sample_kernel(const float* __restrict__ logits, const int64_t logits_stride,
                                                         const int64_t* __restrict__ slots, const RowParams params,
                                                         float* __restrict__ penalties, bool* __restrict__ seen,
                                                         const int vocab, const bool update, const bool adjusted,
                                                         const bool rejection, int64_t* __restrict__ out) {
  const int row_index = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t slot = slots[row_index];
  __shared__ float scratch[WARPS];
  __shared__ float bin_mass[WARPS][16];
  __shared__ float mass16[16];
  __shared__ int hist[256];
  __shared__ int shared_int[2];
  __shared__ float shared_f[2];
  __shared__ float warp_best[WARPS];
  __shared__ int warp_best_id[WARPS];
  __shared__ int chosen_thread;
  __shared__ int64_t token;
  __shared__ union {
    Candidates exact;
    FastShared fast;
    RejectionShared rejection;
  } shared;
  Candidates& candidates = shared.exact;
  FastShared& fast = shared.fast;

  Row row;
  row.logits = logits + row_index * logits_stride;
  row.penalty = adjusted ? nullptr : penalties + slot * vocab;  // adjusted: constrain_kernel did step 0
  row.vocab = vocab;
  const float temperature = params.temperature[row_index];
  const int64_t top_k = params.top_k[row_index];
  const float top_p = params.top_p[row_index];
  const bool use_k = top_k > 0 && top_k < vocab;
  // The rejection draw serves the rows without top_k (sampler.py, `_rejection_rows`): a row with
  // top_k is decided faster by the candidate fast path (H200, session 5: 0.84 against 0.91 ms at
  // 960 rows, before the held keys made that path faster still).
  const bool reject_row = rejection && !use_k;
  // The fast path's candidate count: the top-k set, or (top_p alone) the 1024 largest.
  const int k_c = temperature > 0.f && !reject_row ? (use_k ? (top_k <= 1024 ? static_cast<int>(top_k) : 0) : (top_p < 1.f ? 1024 : 0)) : 0;
  if (k_c > 0) {
    for (int b = tid; b < BINS; b += THREADS) fast.hist[b] = 0;
    __syncthreads();
  }

  // Pass 1: max of l and its lowest id (each thread sees its ids in ascending order); for a
  // sampled row also the softmax sum of l / T (online: rescaled when the max grows) and, for the
  // fast path, the histogram of the top 11 bits of l's order key and the thread's held keys.
  float best = -INFINITY;
  int best_id = INT_MAX;
  float m = -INFINITY, s = 0.f;
  Held held;
  held.clear();
  for_each_owned(row, [&](int e, float l) {
    if (l > best) { best = l; best_id = e; }
    if (temperature > 0.f) {
      const float x = l / temperature;
      if (x > m) { s = s * expf(m - x) + 1.f; m = x; }
      else if (x > -INFINITY) s += expf(x - m);
      if (k_c > 0 && l > -INFINITY) {
        const uint32_t key = order_key(l);
        atomicAdd(&fast.hist[key >> 21], 1);
        held.offer(key, e);
      }
    }
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, best, o);
    const int other_id = __shfl_xor_sync(0xffffffffu, best_id, o);
    if (other > best || (other == best && other_id < best_id)) { best = other; best_id = other_id; }
  }
  if (lane == 0) { warp_best[warp] = best; warp_best_id[warp] = best_id; }
  __syncthreads();
  if (tid == 0) {
    float b = warp_best[0];
    int id = warp_best_id[0];
    for (int w = 1; w < WARPS; ++w)
      if (warp_best[w] > b || (warp_best[w] == b && warp_best_id[w] < id)) { b = warp_best[w]; id = warp_best_id[w]; }
    warp_best[0] = b;
    warp_best_id[0] = id == INT_MAX ? 0 : id;
  }
  __syncthreads();

  if (temperature <= 0.f) {
    if (tid == 0) token = warp_best_id[0];
  } else {
    row.temperature = temperature;
    row.mx = warp_best[0] / temperature;  // rounding is monotone, so this is the max of l / T
    row.sum = block_sum(m > -INFINITY ? s * expf(m - row.mx) : 0.f, scratch);

    float threshold = 0.f;
    FastResult fast_result = FAST_NONE;
    if (reject_row && row.mx > -INFINITY) {
      int64_t drawn = 0;
      if (rejection_sample(row, top_k, top_p, params.seed32[row_index], params.step[row_index], shared.rejection, &drawn)) {
        fast_result = FAST_TOKEN;  // decided: skip the exact path below
        if (tid == 0) token = drawn;
      }
      __syncthreads();  // the exact path reuses the shared union
    }
    if (k_c > 0 && row.mx > -INFINITY)
      fast_result = fast_sample(row, fast, held, k_c, top_k, top_p, params.seed32[row_index], params.step[row_index], &threshold, &token);
    __syncthreads();
    if (fast_result == FAST_NONE) {
      threshold = 0.f;
      if (use_k) threshold = kth_largest(row, static_cast<int>(top_k), hist, shared_int);
      if (top_p < 1.f) {
        // Candidates: the top-k set itself when it is small enough, else the CANDIDATES largest p.
        const bool k_floor = use_k && top_k <= CANDIDATES;
        const float floor = k_floor ? threshold
                            : vocab > CANDIDATES ? kth_largest(row, CANDIDATES, hist, shared_int) : 0.f;
        float t_p = 0.f;
        if (top_p_from_candidates(row, floor, top_p, candidates, &t_p)) {
          threshold = fmaxf(threshold, t_p);
        } else if (!k_floor || candidates.count > CANDIDATES) {
          // Undecided among the candidates. (With the top-k set as candidates and their mass below
          // top_p, t_p lies below the top-k threshold and changes nothing.)
          threshold = fmaxf(threshold, top_p_threshold(row, top_p, bin_mass, mass16, shared_f, shared_int));
        }
      }
    }
    if (fast_result != FAST_TOKEN) {
    // Kept mass of this thread's contiguous id range, then an exclusive scan over threads.
    const int per = (vocab + THREADS - 1) / THREADS;
    const int lo = min(tid * per, vocab), hi = min(lo + per, vocab);
    float local = 0.f;
    for (int e = lo; e < hi; ++e) {
      const float p = row.prob(e);
      if (p >= threshold) local += p;
    }
    const float incl = warp_inclusive_scan(local);
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      scratch[lane] = warp_inclusive_scan(scratch[lane]);  // inclusive warp offsets
    }
    if (tid == 0) chosen_thread = INT_MAX;
    __syncthreads();
    const float warp_offset = warp > 0 ? scratch[warp - 1] : 0.f;
    const float total = scratch[WARPS - 1];
    const float excl = warp_offset + incl - local;
    const float target = uniform01(params.seed32[row_index], params.step[row_index]) * total;
    if (local > 0.f && excl + local >= target) atomicMin(&chosen_thread, tid);
    __syncthreads();
    if (tid == chosen_thread) {
      float cumulative = excl;
      int pick = -1, last_kept = -1;
      for (int e = lo; e < hi; ++e) {
        const float p = row.prob(e);
        if (p < threshold || p <= 0.f) continue;
        cumulative += p;
        last_kept = e;
        if (cumulative >= target) { pick = e; break; }
      }
      token = pick >= 0 ? pick : last_kept;  // rounding between the two summations: stay in range
    }
    if (tid == 0 && chosen_thread == INT_MAX) token = warp_best_id[0];  // no positive mass at all
    }
  }
  __syncthreads();

  if (update) {
    float* pen = penalties + slot * vocab;
    const float decay = params.decay[row_index];
    if (decay != 1.f) {  // x * 1 is x: a row without decay skips the pass (read and write of the row)
      if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(pen) % 16 == 0) {
        float4* quads = reinterpret_cast<float4*>(pen);
        for (int q = tid; q < vocab / 4; q += THREADS) {
          float4 v = quads[q];
          v.x *= decay; v.y *= decay; v.z *= decay; v.w *= decay;
          quads[q] = v;
        }
      } else {
        for (int e = tid; e < vocab; e += THREADS) pen[e] *= decay;
      }
    }
    __syncthreads();
    if (tid == 0) {
      bool* seen_row = seen + slot * vocab;
      const float bump = params.frequency[row_index] + (seen_row[token] ? 0.f : params.presence[row_index]);
      pen[token] += bump;
      seen_row[token] = true;
    }
  }
  if (tid == 0) out[row_index] = token;
}

// ---------------------------------------------------------------------------------------------
// Step 0 for calls with allowed-token masks or logit biases: one block per row writes
// `l = logits - penalty + bias` (the twin's order of operations), and -inf for every id outside the
// row's mask, into `out` [R, V]; sample_kernel then reads `out` as adjusted logits. Kept apart from
// the candidate search so that a new search needs nothing from it but "-inf means excluded".
// - mask: row r is constrained when mask_index[r] >= 0; bit i of mask_words[mask_index[r], j]
//   allows id 32 j + i; ids past the words are not allowed. An index past the words' rows allows
//   nothing. A mask that allows nothing allows id 0 alone (the end of text; the caller's grammar
//   then refuses it): the kernel cannot raise, and a row must keep some id.
// - bias: row r's entries are bias_ids/bias_values[bias_offsets[r] : bias_offsets[r + 1]]; ids
//   are distinct within a row (so no two threads add to one id); ids outside the vocabulary are
//   skipped.

struct Constraints {
  const int64_t* mask_index;  // null: no masks
  const int32_t* mask_words;
  int64_t mask_rows, words_per_row;
  const int64_t* bias_offsets;  // null: no biases
  const int64_t* bias_ids;
  const float* bias_values;
  int64_t bias_count;
};

__global__ void __launch_bounds__(THREADS) constrain_kernel(const float* __restrict__ logits, const int64_t logits_stride,
                                                            const int64_t* __restrict__ slots,
                                                            const float* __restrict__ penalties, const int vocab,
                                                            const Constraints c, float* __restrict__ out) {
  const int row_index = blockIdx.x, tid = threadIdx.x;
  const float* in = logits + row_index * logits_stride;
  const float* pen = penalties + slots[row_index] * vocab;
  float* dst = out + static_cast<int64_t>(row_index) * vocab;
  const int64_t index = c.mask_index ? c.mask_index[row_index] : -1;
  const int32_t* words = index >= 0 && index < c.mask_rows ? c.mask_words + index * c.words_per_row : nullptr;
  const bool constrained = index >= 0;
  const int64_t allowed_ids = constrained && words ? min(static_cast<int64_t>(vocab), 32 * c.words_per_row) : 0;
  int any_allowed = 0;
  for (int e = tid; e < vocab; e += THREADS) {
    bool allowed = !constrained;
    if (constrained && e < allowed_ids) allowed = (static_cast<uint32_t>(words[e >> 5]) >> (e & 31)) & 1u;
    any_allowed |= allowed;
    dst[e] = allowed ? in[e] - pen[e] : -INFINITY;
  }
  if (!__syncthreads_or(any_allowed) && tid == 0) dst[0] = in[0] - pen[0];
  __syncthreads();
  if (c.bias_offsets) {
    const int64_t zero = 0;
    const int64_t start = max(zero, min(c.bias_offsets[row_index], c.bias_count));
    const int64_t stop = max(start, min(c.bias_offsets[row_index + 1], c.bias_count));
    for (int64_t j = start + tid; j < stop; j += THREADS) {
      const int64_t e = c.bias_ids[j];
      if (e >= 0 && e < vocab) dst[e] += c.bias_values[j];  // -inf stays -inf: the mask wins
    }
  }
}

// The optional mask and bias arguments: each group whole or absent, on the device, typed and
// shaped as the op's schema documents (albatross/ops.py).
Constraints check_constraints(int64_t R, const OptionalTensor& mask_index, const OptionalTensor& mask_words,
                              const OptionalTensor& bias_offsets, const OptionalTensor& bias_ids,
                              const OptionalTensor& bias_values) {
  Constraints c{nullptr, nullptr, 0, 0, nullptr, nullptr, nullptr, 0};
  ALBATROSS_CHECK(mask_index.has_value() == mask_words.has_value(), "mask_index and mask_words go together");
  ALBATROSS_CHECK(bias_offsets.has_value() == bias_ids.has_value() && bias_ids.has_value() == bias_values.has_value(),
                  "bias_offsets, bias_ids and bias_values go together");
  if (mask_index.has_value()) {
    const Tensor &index = *mask_index, &words = *mask_words;
    check_cuda(index, "mask_index");
    check_cuda(words, "mask_words");
    ALBATROSS_CHECK(index.dim() == 1 && index.size(0) == R && index.is_contiguous() && index.scalar_type() == ScalarType::Long,
                    "mask_index must be a contiguous int64 vector of length ", R);
    ALBATROSS_CHECK(words.dim() == 2 && words.is_contiguous() && words.scalar_type() == ScalarType::Int,
                    "mask_words must be contiguous int32 [masks, words]");
    c.mask_index = index.const_data_ptr<int64_t>();
    c.mask_words = words.numel() ? words.const_data_ptr<int32_t>() : nullptr;
    c.mask_rows = words.numel() ? words.size(0) : 0;
    c.words_per_row = words.size(1);
  }
  if (bias_offsets.has_value()) {
    const Tensor &offsets = *bias_offsets, &ids = *bias_ids, &values = *bias_values;
    check_cuda(offsets, "bias_offsets");
    check_cuda(ids, "bias_ids");
    check_cuda(values, "bias_values");
    ALBATROSS_CHECK(offsets.dim() == 1 && offsets.size(0) == R + 1 && offsets.is_contiguous() &&
                        offsets.scalar_type() == ScalarType::Long,
                    "bias_offsets must be a contiguous int64 vector of length ", R + 1);
    ALBATROSS_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == ScalarType::Long,
                    "bias_ids must be a contiguous int64 vector");
    ALBATROSS_CHECK(values.dim() == 1 && values.size(0) == ids.size(0) && values.is_contiguous() &&
                        values.scalar_type() == ScalarType::Float,
                    "bias_values must be a contiguous float32 vector as long as bias_ids");
    c.bias_offsets = offsets.const_data_ptr<int64_t>();
    c.bias_count = ids.size(0);
    c.bias_ids = c.bias_count ? ids.const_data_ptr<int64_t>() : nullptr;
    c.bias_values = c.bias_count ? values.const_data_ptr<float>() : nullptr;
  }
  return c;
}

Tensor sample_cuda(const Tensor& logits, const Tensor& slots, const Tensor& temperature, const Tensor& top_p,
                   const Tensor& top_k, const Tensor& presence, const Tensor& frequency, const Tensor& decay,
                   const Tensor& seed32, const Tensor& step, Tensor penalties, Tensor seen, bool update_penalties,
                   const OptionalTensor& mask_index, const OptionalTensor& mask_words,
                   const OptionalTensor& bias_offsets, const OptionalTensor& bias_ids,
                   const OptionalTensor& bias_values, bool rejection) {
  check_cuda(logits, "logits");
  ALBATROSS_CHECK(logits.dim() == 2 && logits.scalar_type() == ScalarType::Float && logits.stride(1) == 1,
                  "logits must be float32 [rows, vocab] with unit stride along vocab");
  const int64_t R = logits.size(0), V = logits.size(1);
  ALBATROSS_CHECK(V > 0 && V <= INT_MAX / 2, "vocab size out of range");
  check_cuda(penalties, "penalties");
  check_cuda(seen, "seen");
  ALBATROSS_CHECK(penalties.dim() == 2 && penalties.size(1) == V && penalties.scalar_type() == ScalarType::Float &&
                      penalties.is_contiguous(),
                  "penalties must be contiguous float32 [slots, vocab]");
  ALBATROSS_CHECK(seen.dim() == 2 && seen.size(0) == penalties.size(0) && seen.size(1) == V &&
                      seen.scalar_type() == ScalarType::Bool && seen.is_contiguous(),
                  "seen must be contiguous bool with the penalties' shape");
  const std::pair<const Tensor*, ScalarType> columns[9] = {
      {&slots, ScalarType::Long},      {&temperature, ScalarType::Float}, {&top_p, ScalarType::Float},
      {&top_k, ScalarType::Long},      {&presence, ScalarType::Float},    {&frequency, ScalarType::Float},
      {&decay, ScalarType::Float},     {&seed32, ScalarType::Long},       {&step, ScalarType::Long}};
  const char* names[9] = {"slots", "temperature", "top_p", "top_k", "presence", "frequency", "decay", "seed32", "step"};
  for (int q = 0; q < 9; ++q) {
    const Tensor& t = *columns[q].first;
    check_cuda(t, names[q]);
    ALBATROSS_CHECK(t.dim() == 1 && t.size(0) == R && t.is_contiguous() && t.scalar_type() == columns[q].second,
                    names[q], " must be a contiguous ", columns[q].second, " vector of length ", R);
  }
  const Constraints constraints = check_constraints(R, mask_index, mask_words, bias_offsets, bias_ids, bias_values);
  const DeviceGuard guard(logits.get_device_index());
  Tensor out = new_empty(logits, {R}, ScalarType::Long);
  if (R == 0) return out;
  const bool adjusted = constraints.mask_index != nullptr || constraints.bias_offsets != nullptr;
  const float* rows = logits.const_data_ptr<float>();
  int64_t rows_stride = logits.stride(0);
  std::optional<Tensor> scratch;  // freed to the caching allocator on this stream: reuse is ordered after the sampler
  if (adjusted) {
    scratch = new_empty(logits, {R, V}, ScalarType::Float);
    constrain_kernel<<<static_cast<unsigned>(R), THREADS, 0, current_stream(logits)>>>(
        rows, rows_stride, slots.const_data_ptr<int64_t>(), penalties.const_data_ptr<float>(), static_cast<int>(V),
        constraints, scratch->mutable_data_ptr<float>());
    check_launch();
    rows = scratch->const_data_ptr<float>();
    rows_stride = V;
  }
  const RowParams params{temperature.const_data_ptr<float>(), top_p.const_data_ptr<float>(),
                         top_k.const_data_ptr<int64_t>(),     presence.const_data_ptr<float>(),
                         frequency.const_data_ptr<float>(),   decay.const_data_ptr<float>(),
                         seed32.const_data_ptr<int64_t>(),    step.const_data_ptr<int64_t>()};
  sample_kernel<<<static_cast<unsigned>(R), THREADS, 0, current_stream(logits)>>>(
      rows, rows_stride, slots.const_data_ptr<int64_t>(), params, penalties.mutable_data_ptr<float>(),
      seen.mutable_data_ptr<bool>(), static_cast<int>(V), update_penalties, adjusted, rejection, out.mutable_data_ptr<int64_t>());
  check_launch();
  return out;
}

}  // namespace
}  // namespace albatross

// The schema is declared in albatross/ops.py.
STABLE_TORCH_LIBRARY_IMPL(albatross, CUDA, m) { m.impl("sample", TORCH_BOX(&albatross::sample_cuda)); }
