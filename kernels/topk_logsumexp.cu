// Per-row top-K + logsumexp over a drafter's vocabulary, exact (ties: lower token id first).
//
// Twin of reference.topk_logprobs / shard_topk_partials / merge_topk_partials. Three kernels:
//
//   topk_chunk_*    grid (R * C): one block per 8192-column chunk of a row. One read of the logits (they live
//                   in registers for the whole block): chunk max + sum of exp (logsumexp partial), then a cut
//                   that provably keeps every global winner of the chunk (the row's published K-th-largest
//                   bound, or the chunk's own bound from a bisection over group maxima), and the columns >= the
//                   cut are appended to the row's candidate buffer as (key, id) composites. Heavy ties fall
//                   back to the chunk's exact top-min(K, n) by a radix select.
//   topk_merge_*    grid (R): exact radix select of the K largest composites among the row's candidates
//                   (shared memory when they fit), a bitonic sort of the K winners by (value desc, id asc),
//                   and the logsumexp from the partials.
//   topk_merge_shards  grid (R): tensor-parallel merge of S shards' sorted partials (any order inside a
//                   shard) by a full bitonic sort of S*Ks (value, id) composites in shared memory.
//
// Selection is exact on every input, not only on peaked ones: candidates carry the composite
// (key << 32 | ~id), a strict total order equal to (value desc, id asc), so the merge selects the K largest
// composites with no reliance on candidate order; the tie rule is in the composite.
//
// Errors (never a trap, never an out-of-range write) go to an int32 flag (bits below); the Python layer
// documents them (sglang_kdtree.gpu.topk.TOPK_ERRORS).

typedef unsigned int u32;

// NVRTC has no <math.h> macros.
#define INFINITY __int_as_float(0x7f800000)
typedef unsigned long long u64;

#define ERR_NAN 1       // NaN in the logits
#define ERR_POSINF 2    // +inf in the logits
#define ERR_DEAD_ROW 4  // a row (or every shard of it) is entirely -inf

#define CHUNK_THREADS 512
#ifndef CHUNK_MIN_BLOCKS
#define CHUNK_MIN_BLOCKS 3  // 40 registers: 3 resident chunk blocks per SM (64 registers gave 2)
#endif
#define CHUNK_ELEMS 16                                 // elements per thread, kept in registers
#define CHUNK_COLS (CHUNK_THREADS * CHUNK_ELEMS)       // 8192 columns per block
#define MERGE_THREADS 1024
#define MAX_BINS 2048                                  // widest radix digit (11 bits)
#define MAX_K 1024

// ---------------------------------------------------------------------------------------------------
// keys
// ---------------------------------------------------------------------------------------------------

// Monotone float -> u32 map; -0.0 is folded onto +0.0 so that they tie (and then the lower id wins),
// exactly as numpy compares them in the reference.
__device__ __forceinline__ u32 float_key(float f) {
  u32 b = __float_as_uint(f);
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_float(u32 k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// bf16 is the top half of an fp32: the widening is exact, as the reference's upcast.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(unsigned short x) { return __uint_as_float(((u32)x) << 16); }

// ---------------------------------------------------------------------------------------------------
// block primitives (THREADS a multiple of 32, <= 1024)
// ---------------------------------------------------------------------------------------------------

// Exclusive prefix sum over the block in thread order; *total gets the block sum. Ends with a barrier so
// `scratch` (32 words) can be reused at once.
template <int THREADS>
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32* scratch, u32* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    u32 y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u32 s = lane < THREADS / 32 ? scratch[lane] : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      u32 y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < THREADS / 32) scratch[lane] = s;
  }
  __syncthreads();
  const u32 before = (warp ? scratch[warp - 1] : 0u) + x - v;
  *total = scratch[THREADS / 32 - 1];
  __syncthreads();
  return before;
}

template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < THREADS / 32; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

template <int THREADS>
__device__ __forceinline__ double block_sum(double v, double* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < THREADS / 32; ++w) s = __dadd_rn(s, scratch[w]);  // fixed order: deterministic
  __syncthreads();
  return s;
}

// Row r's logsumexp (float64) from its C chunk partials (chunk max, sum exp(x - chunk max)); -inf for a row
// with no finite value, and then (MODE 0: logprobs) ERR_DEAD_ROW is set. Shared by the chunk merge and the
// histogram select.
template <int THREADS, int MODE>
__device__ __forceinline__ double row_lse(const float* __restrict__ chunk_max, const double* __restrict__ chunk_sum,
                                          int r, int C, float* fscratch, double* dscratch, int* err) {
  float m = -INFINITY;
  for (int c = threadIdx.x; c < C; c += THREADS) m = fmaxf(m, chunk_max[r * C + c]);
  const float M = block_max<THREADS>(m, fscratch);
  double s = 0.0;
  if (M != -INFINITY)
    for (int c = threadIdx.x; c < C; c += THREADS) {
      const float mc = chunk_max[r * C + c];
      if (mc != -INFINITY) s = __dadd_rn(s, __dmul_rn(chunk_sum[r * C + c], exp(__dsub_rn((double)mc, (double)M))));
    }
  s = block_sum<THREADS>(s, dscratch);
  if (MODE == 0 && M == -INFINITY && threadIdx.x == 0) atomicOr(err, ERR_DEAD_ROW);
  return M == -INFINITY ? -INFINITY : __dadd_rn((double)M, log(s));
}

// Given hist[nb] (bin nb-1 = largest keys), find bin d with above(d) < k <= above(d) + hist[d], where
// above(d) = sum of the bins over d. Result in sel[0..2] = (d, above, hist[d]); ends with a barrier.
template <int THREADS>
__device__ __forceinline__ void find_bucket(const u32* hist, int nb, u32 k, u32* scratch, u32* sel) {
  const int per = (nb + THREADS - 1) / THREADS;
  const int top = nb - 1 - (int)threadIdx.x * per;  // this thread's bins: top, top-1, ..., top-per+1
  u32 s = 0;
  for (int j = 0; j < per; ++j)
    if (top - j >= 0) s += hist[top - j];
  u32 total;
  const u32 before = block_exclusive_scan<THREADS>(s, scratch, &total);
  if (before < k && k <= before + s) {
    u32 acc = before;
    for (int j = 0; j < per; ++j) {
      const int bin = top - j;
      const u32 h = hist[bin];
      if (acc + h >= k) {
        sel[0] = (u32)bin;
        sel[1] = acc;
        sel[2] = h;
        break;
      }
      acc += h;
    }
  }
  __syncthreads();
}

// Radix passes over the 32-bit key, most significant digit first. bf16 keys have 16 significant bits, so
// two digits (11 + 5) resolve them; fp32 keys need three (11 + 11 + 10).
template <typename T> struct Digits;
template <> struct Digits<unsigned short> {
  static constexpr int passes = 2;
  __device__ static int shift(int p) { return p == 0 ? 21 : 16; }
  __device__ static int bits(int p) { return p == 0 ? 11 : 5; }
};
template <> struct Digits<float> {
  static constexpr int passes = 3;
  __device__ static int shift(int p) { return p == 0 ? 21 : (p == 1 ? 10 : 0); }
  __device__ static int bits(int p) { return p == 0 ? 11 : (p == 1 ? 11 : 10); }
};
// Candidate keys in the merge come from either input type; three digits always resolve a u32 key.
struct MergeDigits {
  static constexpr int passes = 3;
  __device__ static int shift(int p) { return p == 0 ? 21 : (p == 1 ? 10 : 0); }
  __device__ static int bits(int p) { return p == 0 ? 11 : (p == 1 ? 11 : 10); }
};

struct SelectState {
  u32 lo, hi;  // the boundary bucket [lo, hi]: keys > hi are all taken
  u32 k_rem;   // how many of the keys in [lo, hi] are taken (the first ones in column order)
};

// ---------------------------------------------------------------------------------------------------
// kernel 1: one chunk of one row
// ---------------------------------------------------------------------------------------------------

// (value desc, id asc) as one descending u64; ids < 2^32. Candidates travel in this form, so the merge
// needs no column order: the composite order is a strict total order that already holds the tie rule.
__device__ __forceinline__ u64 composite(u32 key, u32 id) { return ((u64)key << 32) | (u64)(0xffffffffu - id); }

// Why a candidate cut is exact. Let T be the row's K-th largest key (K = min(K, V)). A global winner has
// key >= T, and inside its chunk it is one of the chunk's top-min(K, n) by composite order, so its key is
// >= the chunk's min(K, n)-th largest key. Hence any cut <= max(that chunk bound, any lower bound of T)
// keeps every winner. Lower bounds of T: a chunk with n >= K and a value s such that >= K of its elements
// are >= s gives T >= s; such s are published per row (atomicMax on row_thresh) and later chunks of the
// row cut at them. A chunk bound: s such that >= min(K, n) groups of the chunk have their maximum >= s
// (distinct elements, so the chunk's min(K, n)-th largest is >= s), found by bisection with
// __syncthreads_count on one or two group maxima per thread (cheap: one barrier per step, no histogram).
// If even the cut leaves more than `allow` columns (heavy ties), the chunk falls back to the exact radix
// select of its top-min(K, n) (the previous kernel), so every chunk writes at most `allow` candidates.
//
// VEC columns per load: 8 for bf16 / 4 for fp32 (16-byte loads) when rows are 16-byte aligned, else 1.
// Block b: row b % R, chunk b / R (rows fastest, so a row's later chunks start after its first ones have
// published a threshold).
template <typename T, int VEC>
__device__ __forceinline__ void topk_chunk(const T* __restrict__ logits, long long row_stride, int V, int K, int R,
                                           int C, int allow, long long row_cap, u64* __restrict__ cands,
                                           int* __restrict__ row_count, u32* __restrict__ row_thresh,
                                           float* __restrict__ chunk_max, double* __restrict__ chunk_sum,
                                           int* __restrict__ err) {
  constexpr int NVEC = CHUNK_ELEMS / VEC;
  constexpr int HALF = NVEC / 2;
  constexpr int SH = sizeof(T) == 2 ? 16 : 0;  // bf16 keys carry 16 significant bits
  __shared__ u32 hist[MAX_BINS];
  __shared__ u32 scratch[32];
  __shared__ u32 sel[3];
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  __shared__ u32 s_rt, s_cut, s_base;

  const int tid = threadIdx.x;
  const int r = blockIdx.x % R, c = blockIdx.x / R;
  const int start = c * CHUNK_COLS;
  const int n = min(CHUNK_COLS, V - start);
  const int kk = min(K, n);
  const T* row = logits + (long long)r * row_stride + start;
  if (tid == 0) s_rt = *(volatile u32*)(row_thresh + r);  // read before block_max's barriers

  // Column of element (j, v) of this thread: ((j * THREADS + tid) * VEC + v). Loads are coalesced.
  u32 key[NVEC][VEC];
  float m = -INFINITY;
  int bad = 0;
  u32 gm0 = 0, gm1 = 0;   // max key of the thread's first / second half (j < HALF / j >= HALF)
  bool gv0 = false, gv1 = false;
#pragma unroll
  for (int j = 0; j < NVEC; ++j) {
    const int col0 = (j * CHUNK_THREADS + tid) * VEC;
    T raw[VEC];
    if (VEC > 1 && col0 + VEC <= n) {
      // 16-byte vector load; the launcher guarantees alignment for VEC > 1.
      const uint4 w = *reinterpret_cast<const uint4*>(row + col0);
      const T* p = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int v = 0; v < VEC; ++v) raw[v] = p[v];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) raw[v] = col0 + v < n ? row[col0 + v] : T(0);
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float f = to_float(raw[v]);
      key[j][v] = float_key(f);
      if (col0 + v < n) {
        if (f != f) bad |= ERR_NAN;
        else if (f == INFINITY) bad |= ERR_POSINF;
        m = fmaxf(m, f);
        if (j < HALF) { gm0 = max(gm0, key[j][v]); gv0 = true; }
        else { gm1 = max(gm1, key[j][v]); gv1 = true; }
      }
    }
  }
  if (bad) atomicOr(err, bad);

  // logsumexp partial: exp in fp32 of (x - max) (the subtraction is correctly rounded and small for the
  // terms that matter), summed in float64.
  const float M = block_max<CHUNK_THREADS>(m, fscratch);
  const u32 rt = s_rt;
  double s = 0.0;
  if (M != -INFINITY) {
#pragma unroll
    for (int j = 0; j < NVEC; ++j)
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if ((j * CHUNK_THREADS + tid) * VEC + v < n) s = __dadd_rn(s, (double)expf(key_float(key[j][v]) - M));
  }
  s = block_sum<CHUNK_THREADS>(s, dscratch);
  if (tid == 0) {
    chunk_max[r * C + c] = M;
    chunk_sum[r * C + c] = s;
  }

  // 1) cut at the row's published bound
  u32 cut = rt, cnt = 0, total;
#pragma unroll
  for (int j = 0; j < NVEC; ++j)
#pragma unroll
    for (int v = 0; v < VEC; ++v) cnt += ((j * CHUNK_THREADS + tid) * VEC + v < n) && key[j][v] >= cut;
  u32 ex = block_exclusive_scan<CHUNK_THREADS>(cnt, scratch, &total);

  // 2) too many: this chunk's own bound by bisection over group maxima (block-uniform control flow)
  if (total > (u32)allow) {
    const bool two = kk > CHUNK_THREADS;  // one group per thread is too few groups for kk
    const bool a0 = two ? gv0 : (gv0 || gv1);
    const u32 m0 = two ? gm0 : max(gm0, gm1);
    u32 groups = (u32)__syncthreads_count(a0) + (two ? (u32)__syncthreads_count(gv1) : 0u);
    if (groups >= (u32)kk) {
      // invariant: count(lo) >= kk; stop once the cut keeps few more groups than needed
      u64 lo = 0, hi = (u64)(float_key(M) >> SH) + 1;
      u32 cnt_lo = groups;
      const u32 enough = (u32)kk + ((u32)kk >> 2) + 16u;
      while (hi - lo > 1 && cnt_lo > enough) {
        const u64 mid = (lo + hi) >> 1;
        const u32 cm = (u32)__syncthreads_count(a0 && (u64)(m0 >> SH) >= mid) +
                       (two ? (u32)__syncthreads_count(gv1 && (u64)(gm1 >> SH) >= mid) : 0u);
        if (cm >= (u32)kk) {
          lo = mid;
          cnt_lo = cm;
        } else {
          hi = mid;
        }
      }
      const u32 sc = (u32)(lo << SH);
      if (tid == 0) {
        // only a chunk with >= K columns bounds the row's K-th largest
        const u32 old = kk == K ? atomicMax(row_thresh + r, sc) : *(volatile u32*)(row_thresh + r);
        s_cut = max(old, sc);
      }
      __syncthreads();
      cut = s_cut;
      cnt = 0;
#pragma unroll
      for (int j = 0; j < NVEC; ++j)
#pragma unroll
        for (int v = 0; v < VEC; ++v) cnt += ((j * CHUNK_THREADS + tid) * VEC + v < n) && key[j][v] >= cut;
      ex = block_exclusive_scan<CHUNK_THREADS>(cnt, scratch, &total);
    }
  }

  u64* out = cands + (long long)r * row_cap;
  if (total <= (u32)allow) {
    if (tid == 0) s_base = total ? (u32)atomicAdd(row_count + r, (int)total) : 0u;
    __syncthreads();
    u32 pos = s_base + ex;
#pragma unroll
    for (int j = 0; j < NVEC; ++j)
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int col = (j * CHUNK_THREADS + tid) * VEC + v;
        if (col < n && key[j][v] >= cut) out[pos++] = composite(key[j][v], (u32)(start + col));
      }
    return;
  }

  // 3) heavy ties: exact radix select of the kk-th largest key (block-uniform branch)
  if (tid == 0) s_base = (u32)atomicAdd(row_count + r, kk);
  u32 prefix = 0, pmask = 0, k_rem = (u32)kk;
  for (int p = 0; p < Digits<T>::passes; ++p) {
    const int shift = Digits<T>::shift(p), nb = 1 << Digits<T>::bits(p);
    for (int b = tid; b < nb; b += CHUNK_THREADS) hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NVEC; ++j)
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        if ((j * CHUNK_THREADS + tid) * VEC + v < n && (key[j][v] & pmask) == prefix)
          atomicAdd(&hist[(key[j][v] >> shift) & (nb - 1)], 1u);
    __syncthreads();
    find_bucket<CHUNK_THREADS>(hist, nb, k_rem, scratch, sel);
    const u32 d = sel[0], above = sel[1], cntb = sel[2];
    k_rem -= above;
    prefix |= d << shift;
    pmask |= (u32)(nb - 1) << shift;
    if (cntb == k_rem) break;  // the whole bucket is taken: no finer digit needed
  }
  const u32 lo = prefix, hi = prefix | ~pmask;
  const u32 base = s_base;  // written before the first barrier above

  // Ordered compaction: keys > hi all, and the first k_rem keys in [lo, hi] in column order.
  u32 above_base = 0, tie_base = 0;
#pragma unroll
  for (int j = 0; j < NVEC; ++j) {
    u32 na = 0, nt = 0;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if ((j * CHUNK_THREADS + tid) * VEC + v < n) {
        na += key[j][v] > hi;
        nt += key[j][v] >= lo && key[j][v] <= hi;
      }
    }
    u32 tot;
    const u32 e = block_exclusive_scan<CHUNK_THREADS>(na | (nt << 16), scratch, &tot);
    u32 a = above_base + (e & 0xffffu), t = tie_base + (e >> 16);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int col = (j * CHUNK_THREADS + tid) * VEC + v;
      if (col < n) {
        const u32 k = key[j][v];
        if (k > hi) {
          out[base + a + min(t, k_rem)] = composite(k, (u32)(start + col));
          ++a;
        } else if (k >= lo && t < k_rem) {
          out[base + a + t] = composite(k, (u32)(start + col));
          ++t;
        } else if (k >= lo) {
          ++t;
        }
      }
    }
    above_base += tot & 0xffffu;
    tie_base += tot >> 16;
  }
}

#define CHUNK_ARGS                                                                                              \
  long long row_stride, int V, int K, int R, int C, int allow, long long row_cap, u64 *cands, int *row_count,  \
      u32 *row_thresh, float *chunk_max, double *chunk_sum, int *err
#define CHUNK_PASS row_stride, V, K, R, C, allow, row_cap, cands, row_count, row_thresh, chunk_max, chunk_sum, err

extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, CHUNK_MIN_BLOCKS) topk_chunk_bf16_v8(const unsigned short* logits,
                                                                             CHUNK_ARGS) {
  topk_chunk<unsigned short, 8>(logits, CHUNK_PASS);
}
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, CHUNK_MIN_BLOCKS) topk_chunk_bf16_v1(const unsigned short* logits,
                                                                             CHUNK_ARGS) {
  topk_chunk<unsigned short, 1>(logits, CHUNK_PASS);
}
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, CHUNK_MIN_BLOCKS) topk_chunk_f32_v4(const float* logits, CHUNK_ARGS) {
  topk_chunk<float, 4>(logits, CHUNK_PASS);
}
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, CHUNK_MIN_BLOCKS) topk_chunk_f32_v1(const float* logits, CHUNK_ARGS) {
  topk_chunk<float, 1>(logits, CHUNK_PASS);
}

// ---------------------------------------------------------------------------------------------------
// kernel 2: merge the candidates of one row
// ---------------------------------------------------------------------------------------------------

// Bitonic sort, descending, of P (power of two) u64 in shared memory.
template <int THREADS>
__device__ __forceinline__ void bitonic_sort_desc(u64* s, int P) {
  for (int k = 2; k <= P; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < P; i += THREADS) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const u64 a = s[i], b = s[ixj];
          if (((i & k) == 0) ? (a < b) : (a > b)) {
            s[i] = b;
            s[ixj] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}


// Radix select over the 64-bit composites (11-bit digits from the top; the last digit has 9 bits).
// Composites are unique, so the kout-th largest is one value and the winners are exactly the composites
// >= it: no order among the candidates is needed.
__device__ __forceinline__ int comp_shift(int p) { return p < 5 ? 53 - 11 * p : 0; }
__device__ __forceinline__ int comp_bits(int p) { return p < 5 ? 11 : 9; }
#define CAND_CACHE 2048  // candidates staged in shared memory when they fit (16 KiB)

// MODE 0: out_vals = logprobs (float32(logit - lse)), out_ids = ids.  MODE 1 (shard partials): out_vals =
// the raw logits, out_ids = ids + id_offset, out_lse = the row's logsumexp (-inf for an all -inf row).
// Resets the row's candidate count and threshold for the next call (CUDA-graph replay included).
template <int MODE>
__device__ __forceinline__ void topk_merge(const u64* __restrict__ cands, int* __restrict__ row_count,
                                           u32* __restrict__ row_thresh, long long row_cap, int C, int V, int K,
                                           const float* __restrict__ chunk_max,
                                           const double* __restrict__ chunk_sum, float* __restrict__ out_vals,
                                           long long* __restrict__ out_ids, double* __restrict__ out_lse,
                                           long long id_offset, int* __restrict__ err) {
  __shared__ u32 hist[MAX_BINS];
  __shared__ u32 scratch[32];
  __shared__ u32 sel[3];
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  __shared__ u64 winners[MAX_K];
  __shared__ u64 cache[CAND_CACHE];
  __shared__ u32 n_win;

  const int tid = threadIdx.x, r = blockIdx.x;
  const int kout = min(K, V);

  // logsumexp of the row from the chunk partials, float64.
  const double lse = row_lse<MERGE_THREADS, MODE>(chunk_max, chunk_sum, r, C, fscratch, dscratch, err);

  const int items = min(row_count[r], (int)min(row_cap, (long long)0x7fffffff));
  const u64* src = cands + (long long)r * row_cap;
  if (items <= CAND_CACHE) {
    for (int t = tid; t < items; t += MERGE_THREADS) cache[t] = src[t];
    src = cache;
  }
  if (tid == 0) n_win = 0;
  const u32 want = (u32)min(kout, items);  // == kout unless the input was invalid (NaN)

  u64 prefix = 0, pmask = 0;
  u32 k_rem = want;
  if (want > 0)
    for (int p = 0; p < 6; ++p) {
      const int shift = comp_shift(p), nb = 1 << comp_bits(p);
      for (int b = tid; b < nb; b += MERGE_THREADS) hist[b] = 0;
      __syncthreads();
      for (int t = tid; t < items; t += MERGE_THREADS) {
        const u64 w = src[t];
        if ((w & pmask) == prefix) atomicAdd(&hist[(u32)(w >> shift) & (nb - 1)], 1u);
      }
      __syncthreads();
      find_bucket<MERGE_THREADS>(hist, nb, k_rem, scratch, sel);
      const u32 d = sel[0], above = sel[1], cnt = sel[2];
      k_rem -= above;
      prefix |= (u64)d << shift;
      pmask |= (u64)(nb - 1) << shift;
      if (cnt == k_rem) break;  // the whole bucket is taken
    }
  // winners: every composite >= prefix (the bucket is wholly taken; unique composites)
  __syncthreads();
  if (want > 0)
    for (int t = tid; t < items; t += MERGE_THREADS) {
      const u64 w = src[t];
      if (w >= prefix) {
        const u32 p = atomicAdd(&n_win, 1u);
        if (p < (u32)MAX_K) winners[p] = w;
      }
    }
  __syncthreads();
  const int got = min((int)n_win, kout);
  int P = 1;
  while (P < kout) P <<= 1;
  for (int i = got + tid; i < P; i += MERGE_THREADS) winners[i] = 0ull;  // sorts last
  __syncthreads();
  bitonic_sort_desc<MERGE_THREADS>(winners, P);

  for (int i = tid; i < kout; i += MERGE_THREADS) {
    const u64 w = winners[i];
    const float f = key_float((u32)(w >> 32));
    const long long id = (long long)(0xffffffffu - (u32)w);
    if (MODE == 0) {
      out_vals[(long long)r * kout + i] = (float)__dsub_rn((double)f, lse);
      out_ids[(long long)r * kout + i] = id;
    } else {
      out_vals[(long long)r * kout + i] = f;
      out_ids[(long long)r * kout + i] = id + id_offset;
    }
  }
  if (tid == 0) {
    if (MODE == 1) out_lse[r] = lse;
    row_count[r] = 0;  // every thread read it before the barriers above
    row_thresh[r] = 0u;
  }
}

#define MERGE_ARGS                                                                                           \
  const u64 *cands, int *row_count, u32 *row_thresh, long long row_cap, int C, int V, int K,                 \
      const float *chunk_max, const double *chunk_sum, float *out_vals, long long *out_ids

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) topk_merge_logprobs(MERGE_ARGS, int* err) {
  topk_merge<0>(cands, row_count, row_thresh, row_cap, C, V, K, chunk_max, chunk_sum, out_vals, out_ids, nullptr,
                0, err);
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) topk_merge_partials(MERGE_ARGS, double* out_lse,
                                                                              long long id_offset, int* err) {
  topk_merge<1>(cands, row_count, row_thresh, row_cap, C, V, K, chunk_max, chunk_sum, out_vals, out_ids, out_lse,
                id_offset, err);
}

// ---------------------------------------------------------------------------------------------------
// kernel 3: tensor-parallel merge of S shards' partials (candidates in any order)
// ---------------------------------------------------------------------------------------------------

// top_vals / ids: [S, R, Ks]; lse: [S, R]. Dynamic shared memory: P u64 (P = next power of two >= S*Ks).
extern "C" __global__ void __launch_bounds__(MERGE_THREADS) topk_merge_shards(
    const float* top_vals, const long long* ids, const double* lse, int S, int R, int Ks, int K, int P,
    float* out_lp, long long* out_ids, int* err) {
  extern __shared__ u64 cands[];
  __shared__ double dscratch[32];
  const int tid = threadIdx.x, r = blockIdx.x;
  const int n = S * Ks, kout = min(K, n);

  // global logsumexp, float64, as the reference: m + log(sum(exp(lse_s - m)))
  double m = -INFINITY;
  for (int s = 0; s < S; ++s) m = fmax(m, lse[(long long)s * R + r]);
  double acc = 0.0;
  if (m != -INFINITY)
    for (int s = tid; s < S; s += MERGE_THREADS) acc = __dadd_rn(acc, exp(__dsub_rn(lse[(long long)s * R + r], m)));
  acc = block_sum<MERGE_THREADS>(acc, dscratch);
  const double glse = __dadd_rn(m, log(acc));
  if (m == -INFINITY && tid == 0) atomicOr(err, ERR_DEAD_ROW);

  int bad = 0;
  for (int t = tid; t < P; t += MERGE_THREADS) {
    if (t < n) {
      const int s = t / Ks, j = t % Ks;
      const long long off = ((long long)s * R + r) * Ks + j;
      const float f = top_vals[off];
      if (f != f) bad |= ERR_NAN;
      else if (f == INFINITY) bad |= ERR_POSINF;
      cands[t] = composite(float_key(f), (u32)ids[off]);
    } else {
      cands[t] = 0ull;
    }
  }
  if (bad) atomicOr(err, bad);
  __syncthreads();
  bitonic_sort_desc<MERGE_THREADS>(cands, P);
  for (int i = tid; i < kout; i += MERGE_THREADS) {
    const u64 w = cands[i];
    out_lp[(long long)r * kout + i] = (float)__dsub_rn((double)key_float((u32)(w >> 32)), glse);
    out_ids[(long long)r * kout + i] = (long long)(0xffffffffu - (u32)w);
  }
}
