// What the two top-K pipelines share (topk_logsumexp.cu: chunk cut + merge, the TP shard merge;
// topk_histogram.cu: streaming histogram + select): order keys and (key, id) composites, block primitives,
// the row logsumexp from chunk partials, the exact radix select over composites and the output writer.
#pragma once

#include "common.cuh"

#define MAX_BINS 2048  // widest radix digit (11 bits)
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

// (value desc, id asc) as one descending u64; ids < 2^32. Candidates travel in this form, so a merge
// needs no column order: the composite order is a strict total order that already holds the tie rule.
__device__ __forceinline__ u64 composite(u32 key, u32 id) { return ((u64)key << 32) | (u64)(0xffffffffu - id); }

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

// op over the block (every thread gets the result): a warp xor tree, then the warps' results in warp order
// (fixed order: deterministic), starting from warp 0's (FROM_FIRST) or from T(0). Ends with a barrier.
template <int THREADS, bool FROM_FIRST, typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  T acc = FROM_FIRST ? scratch[0] : T(0);
  for (int w = FROM_FIRST ? 1 : 0; w < THREADS / 32; ++w) acc = op(acc, scratch[w]);
  __syncthreads();
  return acc;
}

template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<THREADS, true>(v, scratch, [](float a, float b) { return fmaxf(a, b); });
}

template <int THREADS>
__device__ __forceinline__ double block_sum(double v, double* scratch) {
  return block_reduce<THREADS, false>(v, scratch, [](double a, double b) { return __dadd_rn(a, b); });
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

// ---------------------------------------------------------------------------------------------------
// exact selection
// ---------------------------------------------------------------------------------------------------

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

// A candidate list in memory (select_winners' source; the histogram select also selects over a row).
struct CandSource {
  const u64* p;
  __device__ __forceinline__ u64 get(int t) const { return p[t]; }
};

// Exact radix select of the `want` largest composites of src[0, items) (unique composites, 11-bit digits
// from the top). `hist` (MAX_BINS u32) is the digit histogram, `winners` (MAX_K u64) receives the winners,
// in winners[0, got) in no particular order; the two may be the same memory (every histogram read is done
// before a winner is written). Returns got = min(winners, kout).
template <int THREADS, class Src>
__device__ __forceinline__ int select_winners(const Src& src, int items, u32 want, int kout, u32* hist,
                                              u64* winners, u32* scratch, u32* sel, u32* n_win) {
  const int tid = threadIdx.x;
  u64 prefix = 0, pmask = 0;
  u32 k_rem = want;
  if (want > 0)
    for (int p = 0; p < 6; ++p) {
      const int shift = comp_shift(p), nb = 1 << comp_bits(p);
      for (int b = tid; b < nb; b += THREADS) hist[b] = 0;
      __syncthreads();
      for (int t = tid; t < items; t += THREADS) {
        const u64 w = src.get(t);
        if ((w & pmask) == prefix) atomicAdd(&hist[(u32)(w >> shift) & (nb - 1)], 1u);
      }
      __syncthreads();
      find_bucket<THREADS>(hist, nb, k_rem, scratch, sel);
      const u32 d = sel[0], above = sel[1], cnt = sel[2];
      k_rem -= above;
      prefix |= (u64)d << shift;
      pmask |= (u64)(nb - 1) << shift;
      if (cnt == k_rem) break;  // the whole bucket is taken: no finer digit needed
    }
  // winners: every composite >= prefix (the bucket is wholly taken; unique composites)
  __syncthreads();  // every histogram read is done before winners are written
  if (want > 0)
    for (int t = tid; t < items; t += THREADS) {
      const u64 w = src.get(t);
      if (w >= prefix) {
        const u32 q = atomicAdd(n_win, 1u);
        if (q < (u32)MAX_K) winners[q] = w;
      }
    }
  __syncthreads();
  return min((int)*n_win, kout);
}

// ---------------------------------------------------------------------------------------------------
// output
// ---------------------------------------------------------------------------------------------------

// The top-K output writer: rank i of row r holds composite w (0: padding, only when an error left fewer
// candidates). MODE 0 (logprobs): out_vals = float32(value - lse), out_ids = ids. MODE 1 (shard partials):
// out_vals = the raw value, out_ids = ids + id_offset.
template <int MODE>
__device__ __forceinline__ void emit(int r, int kout, int i, u64 w, double lse, float* __restrict__ out_vals,
                                     long long* __restrict__ out_ids, long long id_offset) {
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
