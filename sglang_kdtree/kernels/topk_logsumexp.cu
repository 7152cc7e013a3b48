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
// Errors (never a trap, never an out-of-range write) go to an int32 flag (bits ERR_LOGITS_NAN, ERR_LOGITS_POSINF,
// ERR_DEAD_ROW of common.cuh; sglang_kdtree/gpu/errors.py decodes them).

#include "topk_common.cuh"

#define CHUNK_THREADS 512
#ifndef CHUNK_MIN_BLOCKS
#define CHUNK_MIN_BLOCKS 3  // 40 registers: 3 resident chunk blocks per SM (64 registers gave 2)
#endif
#define CHUNK_ELEMS 16                                 // elements per thread, kept in registers
#define CHUNK_COLS (CHUNK_THREADS * CHUNK_ELEMS)       // 8192 columns per block
#define MERGE_THREADS 1024

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

// ---------------------------------------------------------------------------------------------------
// kernel 1: one chunk of one row
// ---------------------------------------------------------------------------------------------------

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
        if (f != f) bad |= ERR_LOGITS_NAN;
        else if (f == INFINITY) bad |= ERR_LOGITS_POSINF;
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
  const int got = select_winners<MERGE_THREADS>(CandSource{src}, items, want, kout, hist, winners, scratch, sel, &n_win);
  int P = 1;
  while (P < kout) P <<= 1;
  for (int i = got + tid; i < P; i += MERGE_THREADS) winners[i] = 0ull;  // sorts last
  __syncthreads();
  bitonic_sort_desc<MERGE_THREADS>(winners, P);

  for (int i = tid; i < kout; i += MERGE_THREADS) emit<MODE>(r, kout, i, winners[i], lse, out_vals, out_ids, id_offset);
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
      if (f != f) bad |= ERR_LOGITS_NAN;
      else if (f == INFINITY) bad |= ERR_LOGITS_POSINF;
      cands[t] = composite(float_key(f), (u32)ids[off]);
    } else {
      cands[t] = 0ull;
    }
  }
  if (bad) atomicOr(err, bad);
  __syncthreads();
  bitonic_sort_desc<MERGE_THREADS>(cands, P);
  for (int i = tid; i < kout; i += MERGE_THREADS) emit<0>(r, kout, i, cands[i], glse, out_lp, out_ids, 0);
}
