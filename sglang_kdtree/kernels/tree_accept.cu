// DDTree accept walk for a batch: one thread block per request (greedy over logits: one cluster of blocks).
//
// Layout (the reference's TreeBatch): request b owns rows b*N .. b*N+N-1; row 0 is the root, rows
// 1..num_nodes[b] are nodes in pop order with parents[i] < i, the rest is padding (never accepted).
// The walk: cur = 0; while the target's token at cur is the token of a child of cur, move to the
// lowest-index such child (the reference's and SGLang's verify_tree_greedy's child order).
//
// Three target kinds:
//   * argmax ids [bs*N] int64 (accept_ids): every node's "hit" (its token equals the target's choice at
//     its parent) is computed in parallel, then one thread follows first-hit links in shared memory;
//   * logits [bs*N, ld] fp32/bf16, greedy (accept_greedy_*): argmax is fused and lazy: only the rows on
//     the accepted path (tau <= L+1 of N) are ever read, instead of all bs*N rows of a separate argmax;
//     each row is split over a cluster of GREEDY_CLUSTER blocks (end of file);
//   * logits, sampled (accept_sampled_*): the same lazy walk, but the token at each visited node is a
//     sample of softmax(logits/T) restricted by SGLang's top-k / top-p / min-p. Sampling only the visited nodes
//     has the same distribution as sampling every node and then walking (unvisited draws never matter).
//
// Errors: each block gathers its request's bits in shared memory and stores them to errors[b] (int64 [bs];
// no zero-initialised flag, no host sync): ERR_NUM_NODES, ERR_BAD_PARENT, ERR_MAX_DEPTH, ERR_TARGET_NAN and
// ERR_SAMPLING of common.cuh (decoded by sglang_kdtree/gpu/errors.py).

#include "common.cuh"

#define MAX_WIDTH 1025       // N = budget + 1, budget <= MAX_BUDGET = 1024
#define NO_CHILD 0x7fffffff

// to_float (common.cuh): bf16 -> fp32 is exact.
template <typename Elem>
__device__ __forceinline__ float load_elem(const Elem* p, i64 i) { return to_float(__ldg(p + i)); }

// Apply f(value, index) to every element this thread owns of part `part` of PARTS of row [0, V) (PARTS = 1:
// the whole row, one block; PARTS = GREEDY_CLUSTER: this block's slice of a cluster's row). 16-byte loads when
// vec_ok (the row aligned; slice bounds are multiples of the vector width, except the row's tail, which the
// last part takes element by element), issued LOADS_IN_FLIGHT at a time before any is consumed: one block
// reads a whole 300 KB vocabulary row, and a single SM only approaches its share of HBM bandwidth with many
// bytes in flight.
#ifndef LOADS_IN_FLIGHT
#define LOADS_IN_FLIGHT 4
#endif
template <int PARTS, typename Elem, typename F, int LOADS = LOADS_IN_FLIGHT>
__device__ __forceinline__ void for_each_in_part(const Elem* row, i64 V, bool vec_ok, u32 part, F f) {
  constexpr int PER_VEC = 16 / sizeof(Elem);
  i64 start = 0;
  if (vec_ok) {
    const uint4* vrow = reinterpret_cast<const uint4*>(row);
    const i64 nvec = V / PER_VEC;
    const i64 q_lo = nvec * part / PARTS, q_hi = nvec * (part + 1) / PARTS;
    for (i64 q0 = q_lo + threadIdx.x; q0 < q_hi; q0 += (i64)LOADS * blockDim.x) {
      uint4 w[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const i64 q = q0 + (i64)u * blockDim.x;
        if (q < q_hi) w[u] = __ldg(vrow + q);
      }
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const i64 q = q0 + (i64)u * blockDim.x;
        if (q < q_hi) {
          const Elem* e = reinterpret_cast<const Elem*>(&w[u]);
#pragma unroll
          for (int k = 0; k < PER_VEC; ++k) f(to_float(e[k]), q * PER_VEC + k);
        }
      }
    }
    if (part != PARTS - 1) return;
    start = nvec * PER_VEC;
  } else {
    start = V * part / PARTS;
    V = V * (part + 1) / PARTS;
  }
  for (i64 v = start + threadIdx.x; v < V; v += blockDim.x) f(load_elem(row, v), v);
}

// f(value, index) over every element of the row this thread owns (one block per row).
template <typename Elem, typename F>
__device__ __forceinline__ void for_each_in_row(const Elem* row, i64 V, bool vec_ok, F f) {
  for_each_in_part<1>(row, V, vec_ok, 0u, f);
}

// (value, index) argmax order: larger value wins, equal values go to the lower index (numpy's argmax).
__device__ __forceinline__ bool better(float v, i64 i, float bv, i64 bi) { return v > bv || (v == bv && i < bi); }

// Block-wide reductions; every thread gets the result. scratch must hold 32 entries; blockDim % 32 == 0.
__device__ void block_argmax(float& v, i64& i, float* sv, i64* si) {
  for (int off = 16; off > 0; off >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, off);
    i64 oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = sv[0]; i = si[0];
  for (int w = 1; w < nwarps; ++w)
    if (better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

// Integer sums are associative, so the result does not depend on the summation order: sampling is
// bit-reproducible for a given seed regardless of scheduling.
__device__ u64 block_sum_u64(u64 x, u64* scratch) {
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  u64 s = 0;
  for (int w = 0; w < nwarps; ++w) s += scratch[w];
  return s;
}

// Philox4x32-10 (Salmon et al., SC'11): counter-based, so a draw is a pure function of (seed, absolute
// position) and needs no generator state between rounds.
__device__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
  for (int r = 0; r < 10; ++r) {
    u32 hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
    u32 hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += 0x9E3779B9u;
    key.y += 0xBB67AE85u;
  }
  return ctr;
}

// Monotone map of a float's bits to u32 (x < y as floats => mono(x) < mono(y); -0.0 just below +0.0) and back.
__device__ __forceinline__ u32 mono_bits(float x) {
  u32 b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_mono(u32 k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Order key of a vocabulary entry for top-k / top-p / min-p: logit descending, then token id ascending, as
// one unsigned 64-bit integer (larger key = earlier in the sorted order; all keys distinct).
__device__ __forceinline__ u64 order_key(float x, i64 id) {
  return ((u64)mono_bits(x) << 32) | (u64)(0xFFFFFFFFu - (u32)id);
}

// SGLang's min-p test of one logit x against the row max m: p_x >= min_p * p_max with p = softmax(x / T),
// i.e. exp(x/T - m/T) >= min_p, evaluated in float64 with exactly the operations of
// reference.sampling_weights (x/T and m/T each rounded once, their difference rounded once, exp, compare;
// the module is compiled with -fmad=false, so nothing is contracted). Only CUDA's double exp differs from
// numpy's (each within 1 ulp): the two disagree only for a token whose exp lies within ~2^-52 of min_p.
__device__ __forceinline__ bool min_p_keeps(float x, float m, double t, double min_p) {
  return exp((double)x / t - (double)m / t) >= min_p;
}

// The min-p kept set is a prefix of the sorted order, {x >= x_thr}: returns mono_bits(x_thr) for the smallest
// finite float x_thr that min_p_keeps (m itself always does: exp(0) = 1 >= min_p for min_p <= 1). A bisection
// over the monotone bit order of the finite floats <= m, narrowed first by probes 4 floats either side of
// the estimate m + T log(min_p) (the boundary lies between them unless the estimate's rounding is unusually
// far off: then the bisection just takes longer): about 5 double exp per row. Every thread computes the same
// value (no shared memory, no sync).
__device__ u32 min_p_threshold(float m, float temperature, float min_p) {
  const double t = (double)temperature, mp = (double)min_p;
  u32 lo = mono_bits(-__int_as_float(0x7f800000));  // -inf: never kept (exp(-inf) = 0 < min_p), below all finite
  u32 hi = mono_bits(m);                            // always kept
  const double est = (double)m + t * log(mp);  // NaN when T = inf and min_p = 1: then the full range
  u32 c = est >= -3.4028234663852886e38 ? mono_bits((float)est) : lo + 1;  // lo + 1 = -FLT_MAX
  c = c < hi ? c : hi;
  if (c > lo + 4) {  // each probe narrows [lo, hi] from one side, keeping lo not kept and hi kept
    if (min_p_keeps(from_mono(c - 4), m, t, mp)) hi = c - 4;
    else lo = c - 4;
  }
  if (c + 4 < hi) {
    if (min_p_keeps(from_mono(c + 4), m, t, mp)) hi = c + 4;
    else lo = c + 4;
  }
  while (hi - lo > 1) {
    const u32 mid = lo + (hi - lo) / 2;
    if (min_p_keeps(from_mono(mid), m, t, mp)) hi = mid;
    else lo = mid;
  }
  return hi;
}

// Sampling weight in 2^-44 fixed point relative to the row max: exp((x - m) / T) in [0, 1] scaled, so a
// whole row (V < 2^19) sums below 2^63. Weights under 2^-44 of the top token's round to 0.
#define WEIGHT_SCALE 17592186044416.0f  // 2^44
__device__ __forceinline__ u64 weight(float x, float m, float inv_t) {
  float e = expf((x - m) * inv_t);
  return (u64)(e * WEIGHT_SCALE);
}

struct SampleScratch {
  u32 cnt[256];
  u64 mass[256];
  u64 wsum[32];
  float fv[32];
  i64 fi[32];
  u64 bcast[4];
};

// The row's (max, argmax) over its non-NaN entries, lower id on ties, in every thread (-inf and INT64_MAX when
// every entry is NaN); NaN entries are flagged (ERR_TARGET_NAN) and never chosen.
template <typename Elem>
__device__ __forceinline__ void row_max(const Elem* row, i64 V, bool vec_ok, SampleScratch& s, int* errors, float& bv,
                                        i64& bi) {
  bv = -__int_as_float(0x7f800000);
  bi = 0x7fffffffffffffffLL;
  bool nan = false;
  for_each_in_row(row, V, vec_ok, [&](float x, i64 i) {
    if (x != x) nan = true;
    else if (better(x, i, bv, bi)) { bv = x; bi = i; }
  });
  if (nan) atomicOr(errors, ERR_TARGET_NAN);
  block_argmax(bv, bi, s.fv, s.fi);
}

// Greedy choice at one row: argmax, lower id on ties; NaN entries are flagged and never chosen.
template <typename Elem>
__device__ i64 row_argmax(const Elem* row, i64 V, bool vec_ok, SampleScratch& s, int* errors) {
  float bv;
  i64 bi;
  row_max(row, V, vec_ok, s, errors, bv, bi);
  return bi == 0x7fffffffffffffffLL ? 0 : bi;
}

// One sample from softmax(row / T) restricted to SGLang's top-k / top-p / min-p kept set:
// sorted by (logit desc, id asc), token at sorted rank r is kept iff r < top_k, the mass of ranks < r is
// <= top_p (torch's `probs_sum - probs_sort > top_p` zeroing) and min_p_keeps (its probability is >= min_p
// times the top token's; min_p <= 0 or NaN: off, > 1: 1). The top-k / top-p kept set's last key is found by an
// 8-level radix descent on the 64-bit order key with count and mass histograms; the min-p set is the keys
// >= min_p_threshold's, and the kept set, their intersection, is the larger of the two bounds (its mass
// recounted by one more pass when min-p cuts deeper); then an inverse-CDF in token-id order over the kept
// weights picks the token for a 64-bit Philox uniform.
template <typename Elem>
__device__ i64 row_sample(const Elem* row, i64 V, bool vec_ok, float temperature, i64 top_k, float top_p,
                          float min_p, uint4 ctr, uint2 key, SampleScratch& s, int* errors) {
  // 1. row max (the softmax shift)
  float m;
  i64 mi;
  row_max(row, V, vec_ok, s, errors, m, mi);
  if (!(m > -__int_as_float(0x7f800000))) {  // entirely -inf (or NaN): nothing to sample
    if (threadIdx.x == 0) atomicOr(errors, ERR_SAMPLING);
    return 0;
  }
  const float inv_t = 1.0f / temperature;
  // 2. total weight Z
  u64 z = 0;
  for_each_in_row(row, V, vec_ok, [&](float x, i64) { if (x == x) z += weight(x, m, inv_t); });
  z = block_sum_u64(z, s.wsum);
  // 3. kept set {key >= key_min} and its mass
  u64 key_min = 0, kept = z;
  if (top_k < 1) {
    if (threadIdx.x == 0) atomicOr(errors, ERR_SAMPLING);
    top_k = 1;
  }
  if (top_k < V || top_p < 1.0f) {
    const u64 p_limit = top_p >= 1.0f ? ~0ULL : (top_p <= 0.0f ? 0ULL : (u64)((double)top_p * (double)z));
    u64 prefix = 0, cnt_above = 0, mass_above = 0;
    for (int level = 0; level < 8; ++level) {
      const int shift = 56 - 8 * level;
      for (int t = threadIdx.x; t < 256; t += blockDim.x) { s.cnt[t] = 0; s.mass[t] = 0; }
      __syncthreads();
      for_each_in_row(row, V, vec_ok, [&](float x, i64 i) {
        if (x != x) return;
        u64 k = order_key(x, i);
        if (level > 0 && (k >> (shift + 8)) != prefix) return;
        u32 bucket = (u32)(k >> shift) & 255u;
        atomicAdd(&s.cnt[bucket], 1u);
        atomicAdd(&s.mass[bucket], weight(x, m, inv_t));
      });
      __syncthreads();
      if (threadIdx.x < 32) {
        // lane l owns buckets 255-8l .. 248-8l (descending = sorted order); exclusive scan over lanes
        const int lane = threadIdx.x;
        u64 c_own = 0, m_own = 0;
        for (int q = 0; q < 8; ++q) { c_own += s.cnt[255 - 8 * lane - q]; m_own += s.mass[255 - 8 * lane - q]; }
        u64 c_pre = c_own, m_pre = m_own;
        for (int off = 1; off < 32; off <<= 1) {
          u64 c = __shfl_up_sync(0xffffffffu, c_pre, off), mm = __shfl_up_sync(0xffffffffu, m_pre, off);
          if (lane >= off) { c_pre += c; m_pre += mm; }
        }
        u64 c_run = cnt_above + c_pre - c_own, m_run = mass_above + m_pre - m_own;
        int chosen = -1;
        u64 c_at = 0, m_at = 0;
        for (int q = 0; q < 8; ++q) {
          int bucket = 255 - 8 * lane - q;
          u32 c = s.cnt[bucket];
          if (c > 0 && c_run < (u64)top_k && m_run <= p_limit) { chosen = bucket; c_at = c_run; m_at = m_run; }
          c_run += c;
          m_run += s.mass[bucket];
        }
        // the kept condition is monotone in sorted order: the last bucket satisfying it is the
        // one from the highest lane that has any
        u32 has = __ballot_sync(0xffffffffu, chosen >= 0);
        int src = 31 - __clz(has);
        chosen = __shfl_sync(0xffffffffu, chosen, src);
        c_at = __shfl_sync(0xffffffffu, c_at, src);
        m_at = __shfl_sync(0xffffffffu, m_at, src);
        if (lane == 0) {
          s.bcast[0] = (prefix << 8) | (u64)chosen;
          s.bcast[1] = c_at;
          s.bcast[2] = m_at;
          s.bcast[3] = m_at + s.mass[chosen];  // at the last level the bucket is one token
        }
      }
      __syncthreads();
      prefix = s.bcast[0];
      cnt_above = s.bcast[1];
      mass_above = s.bcast[2];
      kept = s.bcast[3];
      __syncthreads();
    }
    key_min = prefix;
  }
  // 3b. min-p: the kept set shrinks to {x >= x_thr} when that bound is tighter; its mass is summed again
  if (min_p > 0.0f) {
    const u64 key_mp = (u64)min_p_threshold(m, temperature, fminf(min_p, 1.0f)) << 32;  // any id of x_thr
    if (key_mp > key_min) {
      key_min = key_mp;
      u64 km = 0;
      for_each_in_row(row, V, vec_ok, [&](float x, i64 i) {
        if (x == x && order_key(x, i) >= key_min) km += weight(x, m, inv_t);
      });
      kept = block_sum_u64(km, s.wsum);
    }
  }
  // 4. u uniform in [0, kept); the token is the first id whose running kept weight exceeds u.
  uint4 r = philox4x32_10(ctr, key);
  const u64 u = __umul64hi(((u64)r.x << 32) | r.y, kept);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  // contiguous per-warp segments keep id order; lanes interleave inside a segment for coalescing
  const i64 seg = ((V + nwarps - 1) / nwarps + 31) / 32 * 32;
  const i64 lo = warp * seg, hi = min(V, lo + seg);
  auto kept_weight = [&](i64 i) -> u64 {
    if (i >= hi) return 0;
    float x = load_elem(row, i);
    if (x != x || order_key(x, i) < key_min) return 0;
    return weight(x, m, inv_t);
  };
  u64 mine = 0;
  for (i64 i = lo + lane; i < hi; i += 32) mine += kept_weight(i);
  for (int off = 16; off > 0; off >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, off);
  __syncthreads();
  if (lane == 0) s.wsum[warp] = mine;
  __syncthreads();
  u64 before = 0;
  int owner = nwarps - 1;
  for (int w = 0; w < nwarps; ++w) {
    if (u < before + s.wsum[w]) { owner = w; break; }
    before += s.wsum[w];
  }
  if (warp == owner) {
    u64 run = before;
    i64 found = -1;
    for (i64 base = lo; base < hi && found < 0; base += 32) {
      u64 w = kept_weight(base + lane), incl = w;
      for (int off = 1; off < 32; off <<= 1) {
        u64 o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      u32 over = __ballot_sync(0xffffffffu, w > 0 && u < run + incl);
      if (over) found = base + (__ffs(over) - 1);
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) s.bcast[0] = (u64)(found < 0 ? mi : found);
  }
  __syncthreads();
  i64 tok = (i64)s.bcast[0];
  __syncthreads();
  return tok;
}

// Shared prologue: parents of request b in shared memory as int16 (N <= 1025), invalid ones unlinked.
__device__ int load_tree(const i64* parents, const i64* num_nodes, int b, int N, short* par, int* errors) {
  i64 n = num_nodes[b];
  if (n < 0 || n > N - 1) {
    if (threadIdx.x == 0) atomicOr(errors, ERR_NUM_NODES);
    n = n < 0 ? 0 : N - 1;
  }
  for (int i = threadIdx.x; i <= (int)n; i += blockDim.x) {
    i64 p = parents[(i64)b * N + i];
    if (i > 0 && (p < 0 || p >= i)) { atomicOr(errors, ERR_BAD_PARENT); p = -1; }
    par[i] = (short)(i == 0 ? -1 : p);
  }
  return (int)n;
}

// Prologue of the walks over logits: the request's error bits zeroed, its tree loaded (load_tree; a barrier
// before and after). Returns num_nodes, clamped.
__device__ __forceinline__ int begin_walk(const i64* parents, const i64* num_nodes, int b, int N, short* par,
                                          int* s_err) {
  if (threadIdx.x == 0) *s_err = 0;
  __syncthreads();
  const int n = load_tree(parents, num_nodes, b, N, par, s_err);
  __syncthreads();
  return n;
}

// 16-byte row loads are possible: every row starts 16-byte aligned.
template <typename Elem>
__device__ __forceinline__ bool rows_aligned(const Elem* logits, i64 ld) {
  return (ld % (16 / sizeof(Elem))) == 0 && ((size_t)logits % 16) == 0;
}

// Writes the padding after the walk: accepted[tau..M) = -1, committed[tau..C) = -1.
__device__ void finish(int b, int tau, int cur, i64 bonus, int M, int C, const i64* seq_lens, i64* accepted,
                       i64* accept_lens, i64* bonus_out, i64* committed, i64* new_seq_lens, const int* s_err,
                       i64* errors_out) {
  for (int j = tau + threadIdx.x; j < M; j += blockDim.x) accepted[(i64)b * M + j] = -1;
  for (int j = tau + threadIdx.x; j < C; j += blockDim.x) committed[(i64)b * C + j] = -1;
  if (threadIdx.x == 0) {
    committed[(i64)b * C + tau - 1] = bonus;
    accept_lens[b] = tau;
    bonus_out[b] = bonus;
    if (seq_lens != nullptr) new_seq_lens[b] = seq_lens[b] + tau;
  }
  __syncthreads();  // every thread's error bits are in s_err
  if (threadIdx.x == 0) errors_out[b] = *s_err;
}

// 256 threads: one or a few nodes each (N <= 1025)
extern "C" __global__ void __launch_bounds__(256) accept_ids(const i64* tokens, const i64* parents, const i64* num_nodes,
                                      const i64* target_ids, const i64* seq_lens, int N, int M, int C,
                                      i64* accepted, i64* accept_lens, i64* bonus_out, i64* committed,
                                      i64* new_seq_lens, i64* errors_out) {
  __shared__ short par[MAX_WIDTH];
  __shared__ int first_hit[MAX_WIDTH];
  __shared__ int s_tau, s_cur, s_err;
  const int b = blockIdx.x;
  int* errors = &s_err;
  if (threadIdx.x == 0) s_err = 0;
  __syncthreads();
  const int n = load_tree(parents, num_nodes, b, N, par, errors);
  for (int i = threadIdx.x; i <= n; i += blockDim.x) first_hit[i] = NO_CHILD;
  __syncthreads();
  const i64* tok = tokens + (i64)b * N;
  const i64* tgt = target_ids + (i64)b * N;
  // a node is a hit when its token is the target's choice at its parent; the lowest hit child wins
  for (int i = 1 + threadIdx.x; i <= n; i += blockDim.x) {
    int p = par[i];
    if (p >= 0 && tok[i] == tgt[p]) atomicMin(&first_hit[p], i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int cur = 0, tau = 1;
    accepted[(i64)b * M] = 0;
    while (first_hit[cur] != NO_CHILD) {
      if (tau >= M) { atomicOr(errors, ERR_MAX_DEPTH); break; }
      int nxt = first_hit[cur];
      accepted[(i64)b * M + tau] = nxt;
      committed[(i64)b * C + tau - 1] = tok[nxt];
      ++tau;
      cur = nxt;
    }
    s_tau = tau;
    s_cur = cur;
  }
  __syncthreads();
  finish(b, s_tau, s_cur, tgt[s_cur], M, C, seq_lens, accepted, accept_lens, bonus_out, committed, new_seq_lens,
         &s_err, errors_out);
}

// Lazy walk over logits: each step reads only row b*N+cur (argmax or sample), then finds the lowest child
// of cur carrying that token. SAMPLED=false is greedy.
template <typename Elem, bool SAMPLED>
__device__ void accept_logits_impl(const i64* tokens, const i64* parents, const i64* num_nodes, const Elem* logits,
                                   i64 V, i64 ld, const i64* seq_lens, const float* temperatures,
                                   const i64* top_ks, const float* top_ps, const float* min_ps, const i64* seeds,
                                   int N, int M, int C,
                                   i64* accepted, i64* accept_lens, i64* bonus_out, i64* committed,
                                   i64* new_seq_lens, i64* errors_out) {
  __shared__ short par[MAX_WIDTH];
  __shared__ int s_next, s_err;
  __shared__ SampleScratch scratch;
  const int b = blockIdx.x;
  int* errors = &s_err;
  const int n = begin_walk(parents, num_nodes, b, N, par, errors);
  const i64* tok = tokens + (i64)b * N;
  const bool vec_ok = rows_aligned(logits, ld);
  float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
  i64 top_k = V;
  uint2 key = make_uint2(0, 0);
  u64 position = 0;
  if (SAMPLED) {
    temperature = temperatures[b];
    top_k = top_ks != nullptr ? top_ks[b] : V;
    top_p = top_ps != nullptr ? top_ps[b] : 1.0f;
    min_p = min_ps != nullptr ? min_ps[b] : 0.0f;
    key = make_uint2((u32)seeds[b], (u32)((u64)seeds[b] >> 32));
    position = (u64)seq_lens[b];
  }
  if (threadIdx.x == 0) accepted[(i64)b * M] = 0;
  int cur = 0, tau = 1;
  i64 choice;
  while (true) {
    const Elem* row = logits + ((i64)b * N + cur) * ld;
    if (SAMPLED && temperature > 0.0f) {
      // counter = (0, position lo, position hi, stream tag) with position = P + depth + 1 = P + tau, the
      // absolute position of the token drawn here (as pipeline.ReferenceBackend keys its uniforms): the draw
      // does not depend on the node's index, so it is the same whatever the tree's shape or numbering
      const u64 pos = position + (u64)tau;
      uint4 ctr = make_uint4(0u, (u32)pos, (u32)(pos >> 32), 0x6b647472u);
      choice = row_sample(row, V, vec_ok, temperature, top_k, top_p, min_p, ctr, key, scratch, errors);
    } else {
      choice = row_argmax(row, V, vec_ok, scratch, errors);
    }
    if (threadIdx.x == 0) s_next = NO_CHILD;
    __syncthreads();
    for (int i = cur + 1 + threadIdx.x; i <= n; i += blockDim.x)
      if (par[i] == cur && tok[i] == choice) atomicMin(&s_next, i);
    __syncthreads();
    const int nxt = s_next;
    __syncthreads();  // s_next is reset next step
    if (nxt == NO_CHILD) break;
    if (tau >= M) {
      if (threadIdx.x == 0) atomicOr(errors, ERR_MAX_DEPTH);
      break;
    }
    if (threadIdx.x == 0) {
      accepted[(i64)b * M + tau] = nxt;
      committed[(i64)b * C + tau - 1] = tok[nxt];
    }
    ++tau;
    cur = nxt;
  }
  finish(b, tau, cur, choice, M, C, seq_lens, accepted, accept_lens, bonus_out, committed, new_seq_lens, &s_err,
         errors_out);
}

#define ACCEPT_LOGITS_ENTRY(NAME, ELEM, SAMPLED)                                                              \
  extern "C" __global__ void __launch_bounds__(1024) NAME(const i64* tokens, const i64* parents, const i64* num_nodes,               \
                                  const ELEM* logits, i64 V, i64 ld, const i64* seq_lens,                     \
                                  const float* temperatures, const i64* top_ks, const float* top_ps,          \
                                  const float* min_ps, const i64* seeds, int N, int M, int C, i64* accepted,  \
                                  i64* accept_lens, i64* bonus_out, i64* committed, i64* new_seq_lens,        \
                                  i64* errors) {                                                              \
    accept_logits_impl<ELEM, SAMPLED>(tokens, parents, num_nodes, logits, V, ld, seq_lens, temperatures,     \
                                      top_ks, top_ps, min_ps, seeds, N, M, C, accepted, accept_lens,         \
                                      bonus_out, committed, new_seq_lens, errors);                           \
  }

ACCEPT_LOGITS_ENTRY(accept_sampled_f32, float, true)
ACCEPT_LOGITS_ENTRY(accept_sampled_bf16, unsigned short, true)

// ---------------------------------------------------------------------------------------------------
// Greedy accept over logits with a cluster of GREEDY_CLUSTER blocks per request (accept_greedy_*).
// ---------------------------------------------------------------------------------------------------
// The lazy walk of accept_logits_impl with row_argmax at every node (same outputs and error bits), but each
// visited row is split across the blocks of one thread-block cluster (sm_90): every block takes the argmax of its
// slice, publishes (value, index, NaN seen) in its shared memory, one cluster barrier, then every block
// reads the GREEDY_CLUSTER partials over distributed shared memory and reduces them in the same total order
// (larger value, then lower index), so all blocks agree on the choice and walk on together with no second
// barrier. One block per request read a 163,840-column fp32 row in ~20 us (one SM's share of HBM); eight
// read it in ~eight times less. Partials are double-buffered by step parity: a block can only overwrite a
// slot after the next barrier, which every block reaches only once it has read that slot.
// -D overrides: benchmarks/accept_sweep.py compiles variants
#ifndef GREEDY_CLUSTER
#define GREEDY_CLUSTER 8
#endif
#ifndef GREEDY_THREADS
#define GREEDY_THREADS 512  // the launch bound; the launcher runs 384 or 256 threads (gpu/accept.py _greedy_threads)
#endif
// 16-byte loads in flight per thread: 8 took 1-2 us off every batch against 4 on fp32 target rows (the server's
// dtype; benchmarks/accept_sweep.py --dtype fp32)
#ifndef GREEDY_LOADS
#define GREEDY_LOADS 8
#endif

struct GreedyPartial {
  float v;
  int nan;
  i64 i;
};

__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives and waits; release / acquire order the shared-memory
// writes before it with the remote reads after it.
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// p (this block's shared memory) as an address in block `rank`'s shared memory window
__device__ __forceinline__ u32 cluster_map(const void* p, u32 rank) {
  const u32 local = (u32)__cvta_generic_to_shared(p);
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ GreedyPartial cluster_load(const GreedyPartial* p, u32 rank) {
  const u32 a = cluster_map(p, rank);
  GreedyPartial out;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(out.v) : "r"(a) : "memory");
  asm volatile("ld.shared::cluster.s32 %0, [%1+4];" : "=r"(out.nan) : "r"(a) : "memory");
  asm volatile("ld.shared::cluster.s64 %0, [%1+8];" : "=l"(out.i) : "r"(a) : "memory");
  return out;
}

template <typename Elem>
__device__ void accept_greedy_cluster_impl(const i64* tokens, const i64* parents, const i64* num_nodes,
                                           const Elem* logits, i64 V, i64 ld, const i64* seq_lens, int N, int M,
                                           int C, i64* accepted, i64* accept_lens, i64* bonus_out, i64* committed,
                                           i64* new_seq_lens, i64* errors_out) {
  __shared__ short par[MAX_WIDTH];
  __shared__ GreedyPartial part[2];
  __shared__ float sv[32];
  __shared__ i64 si[32];
  __shared__ i64 s_choice;
  __shared__ int s_next, s_err, s_nan;
  const u32 rank = cluster_ctarank();
  const bool leader = rank == 0;  // the block that writes the request's outputs
  const int b = blockIdx.x / GREEDY_CLUSTER;
  int* errors = &s_err;
  const int n = begin_walk(parents, num_nodes, b, N, par, errors);
  const i64* tok = tokens + (i64)b * N;
  const bool vec_ok = rows_aligned(logits, ld);
  if (leader && threadIdx.x == 0) accepted[(i64)b * M] = 0;
  int cur = 0, tau = 1;
  i64 choice = 0;
  for (int step = 0;; ++step) {
    const Elem* row = logits + ((i64)b * N + cur) * ld;
    float bv = -__int_as_float(0x7f800000);
    i64 bi = 0x7fffffffffffffffLL;
    bool nan = false;
    auto f_argmax = [&](float x, i64 i) {
      if (x != x) nan = true;
      else if (better(x, i, bv, bi)) { bv = x; bi = i; }
    };
    for_each_in_part<GREEDY_CLUSTER, Elem, decltype(f_argmax), GREEDY_LOADS>(row, V, vec_ok, rank, f_argmax);
    block_argmax(bv, bi, sv, si);
    const int any_nan = __syncthreads_or(nan);
    GreedyPartial* mine = &part[step & 1];
    if (threadIdx.x == 0) { mine->v = bv; mine->nan = any_nan; mine->i = bi; }
    cluster_barrier();
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      float v = -__int_as_float(0x7f800000);
      i64 i = 0x7fffffffffffffffLL;
      int nn = 0;
      if (lane < GREEDY_CLUSTER) {
        const GreedyPartial p = cluster_load(mine, (u32)lane);
        v = p.v; i = p.i; nn = p.nan;
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, off);
        const i64 oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
      }
      nn = __any_sync(0xffffffffu, nn != 0);
      if (lane == 0) {
        s_choice = i == 0x7fffffffffffffffLL ? 0 : i;  // every entry NaN: token 0, flagged (row_argmax's rule)
        s_nan = nn;
        s_next = NO_CHILD;
      }
    }
    __syncthreads();
    choice = s_choice;
    if (s_nan && threadIdx.x == 0) atomicOr(errors, ERR_TARGET_NAN);
    for (int i = cur + 1 + threadIdx.x; i <= n; i += blockDim.x)
      if (par[i] == cur && tok[i] == choice) atomicMin(&s_next, i);
    __syncthreads();
    const int nxt = s_next;  // s_choice / s_next are rewritten next step only after block_argmax's barriers
    if (nxt == NO_CHILD) break;
    if (tau >= M) {
      if (threadIdx.x == 0) atomicOr(errors, ERR_MAX_DEPTH);
      break;
    }
    if (leader && threadIdx.x == 0) {
      accepted[(i64)b * M + tau] = nxt;
      committed[(i64)b * C + tau - 1] = tok[nxt];
    }
    ++tau;
    cur = nxt;
  }
  cluster_barrier();  // no block leaves while another may still read its partials
  if (leader)
    finish(b, tau, cur, choice, M, C, seq_lens, accepted, accept_lens, bonus_out, committed, new_seq_lens, &s_err,
           errors_out);
}

#define ACCEPT_GREEDY_ENTRY(NAME, ELEM)                                                                        \
  extern "C" __global__ void __cluster_dims__(GREEDY_CLUSTER, 1, 1) __launch_bounds__(GREEDY_THREADS)          \
      NAME(const i64* tokens, const i64* parents, const i64* num_nodes, const ELEM* logits, i64 V, i64 ld,      \
           const i64* seq_lens, int N, int M, int C, i64* accepted, i64* accept_lens, i64* bonus_out,          \
           i64* committed, i64* new_seq_lens, i64* errors_out) {                                               \
    accept_greedy_cluster_impl<ELEM>(tokens, parents, num_nodes, logits, V, ld, seq_lens, N, M, C, accepted,    \
                                     accept_lens, bonus_out, committed, new_seq_lens, errors_out);             \
  }
ACCEPT_GREEDY_ENTRY(accept_greedy_f32, float)
ACCEPT_GREEDY_ENTRY(accept_greedy_bf16, unsigned short)
