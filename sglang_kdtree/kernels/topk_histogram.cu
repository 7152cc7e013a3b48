// Per-row top-K + logsumexp over a drafter's vocabulary, exact (ties: lower token id first), by streaming
// histograms instead of per-chunk selection.
//
// Twin of reference.topk_logprobs / shard_topk_partials (the TP merge stays in topk_logsumexp.cu). Two
// launches, both on fixed preallocated workspaces (graph-capturable):
//
//   hist_pass   grid (C, R), 256 threads, 8192 columns per block (the *_g2 kernels, aligned bf16 rows of large
//               batches: 16384, two 32-column groups per thread; the launcher's HIST_G2_MIN_BLOCKS), 16-byte loads.
//               Per thread its largest and smallest value (NaN-propagating: the max screens for NaN / +inf); each
//               warp sorts its 32 thread maxima (shuffles) and the chunk bound c is the smallest of the 8 warps'
//               ceil(K/8)-th largest (K <= 256; for 256 < K <= 1024 on full bf16 chunks, of the threads' m4 values,
//               each reached by 4 distinct columns of the thread, and the warps' ceil(K/32)-th largest; else no
//               bound): K distinct columns are >= c, so c <= the row's K-th largest key T. The block histogram of
//               the key's top 12 bits in shared memory counts only the columns >= c (typically a few dozen of 8192
//               at K 64; found by a bit mask during the exp pass, then re-read), which
//               keeps the boundary bin at T's bin; the bins c .. max are flushed to the row's global histogram with
//               one atomic per nonzero bin, and the row's bin range grows to cover them (`row_range`: two
//               atomicMax per block). Also the chunk's (max, sum exp(x - max)) for the logsumexp over every
//               column (ex2.approx of one FMA, its common factor taken out in float64: see exp_sum_mask; the
//               subnormal fix-up skipped when no column of the thread needs it), per thread the largest bin among its
//               32 columns (`group_bin`, 0 when below c), so the select can visit only the groups with something to
//               give, and c (`chunk_cut`).
//   hist_select grid (R), 256 threads. Logsumexp from the chunk partials (float64; warp 0 alone when C <= 32);
//               the boundary bin b* where the row histogram's count from the top reaches K (every winner has
//               bin >= b*; only the row's bin range is read, and only its nonzero words are zeroed for the next
//               call, as is the range); the candidates (every column with bin
//               >= b* and key >= its chunk's c: exactly what the histogram counted), gathered from the groups
//               whose largest bin is >= b* into shared memory (or the row's global buffer when more than
//               S_CACHE). At most RANK_ITEMS candidates in shared memory are placed directly by rank (the
//               number of larger (key << 32 | ~id) composites: a strict total order that carries the tie rule,
//               so candidate order does not matter); more go through an exact radix select of the K largest
//               composites, whose winners are placed by rank (<= RANK_ITEMS) or a bitonic sort. K > 256 (the
//               *_wide select kernels), when they fit in shared memory: each is placed in its bin's segment (which
//               starts at the histogram's count above the bin) and ranked among its own bin's only. A row with
//               more than `cap` candidates (heavy ties around the K-th value) runs the same select over the
//               row itself.
//
// Errors go to an int32 flag (bits ERR_LOGITS_NAN, ERR_LOGITS_POSINF, ERR_DEAD_ROW of common.cuh), as
// topk_logsumexp.cu's; what both files use (keys, composites, block scans, row_lse, the radix select over
// composites, the output writer) is in topk_common.cuh.

#include "topk_common.cuh"

#define H_THREADS 256
#define H_ELEMS 32                         // columns per thread
#define H_COLS (H_THREADS * H_ELEMS)       // 8192 columns per block
#define H_BITS 12                          // histogram bins: the key's top 12 bits
#define H_BINS (1 << H_BITS)
#define H_SHIFT (32 - H_BITS)
#define S_THREADS 256
static_assert(S_THREADS == H_THREADS, "boundary_bin splits the histogram over the select block's threads");
#define S_CACHE 2048                       // candidates staged in shared memory when they fit (16 KiB)

// Group t's columns in a chunk of GT groups: ((j * GT + t) * VEC + v), j < H_ELEMS / VEC: coalesced loads.
// The raw values stay packed in 32-bit words (bf16: two per word, element e in word e / 2, low half first,
// as a 16-byte load lays them out) so a thread's 32 columns cost 16 registers in bf16.
template <typename T> struct Packed {
  static constexpr int words = H_ELEMS * (int)sizeof(T) / 4;
};

__device__ __forceinline__ float elem_float(const u32* w, int e, unsigned short) {
  const u32 x = w[e >> 1];
  return (e & 1) ? bf16_hi(x) : bf16_lo(x);
}
__device__ __forceinline__ float elem_float(const u32* w, int e, float) { return __uint_as_float(w[e]); }

// Loads group t of a chunk (thread t's columns; see group_col) into w; columns >= n read as 0.
// FULL: the chunk has all GT * H_ELEMS columns (no bounds checks).
template <typename T, int VEC, int GT, bool FULL = false>
__device__ __forceinline__ void load_group(const T* __restrict__ row, int n, u32 (&w)[Packed<T>::words], int t) {
  constexpr int NV = H_ELEMS / VEC;
  constexpr int WPV = VEC * (int)sizeof(T) / 4;  // words per vector load (VEC > 1)
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int col0 = (j * GT + t) * VEC;
    if (VEC > 1 && (FULL || col0 + VEC <= n)) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(row + col0));  // launcher guarantees alignment
      w[j * WPV] = q.x;
      w[j * WPV + 1] = q.y;
      w[j * WPV + 2] = q.z;
      w[j * WPV + 3] = q.w;
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
        const int e = j * VEC + v;
        if constexpr (sizeof(T) == 4) {
          w[e] = col0 + v < n ? __float_as_uint(((const float*)row)[col0 + v]) : 0u;
        } else {
          const u32 h = col0 + v < n ? (u32)((const unsigned short*)row)[col0 + v] : 0u;
          if (e & 1) w[e >> 1] |= h << 16;
          else w[e >> 1] = h;
        }
      }
    }
  }
}

template <int VEC, int GT>
__device__ __forceinline__ int group_col(int e, int t) {
  return ((e / VEC) * GT + t) * VEC + (e % VEC);
}

// ---------------------------------------------------------------------------------------------------
// pass 1: filtered histogram + logsumexp partial + per-group max bin
// ---------------------------------------------------------------------------------------------------

// keys are monotone in the value: the largest key is the max (-0.0 already folded onto +0.0); a +inf or
// positive NaN has a key >= KEY_POS_INF, a negative NaN one below KEY_NEG_INF
#define KEY_NEG_INF 0x007fffffu
#define KEY_POS_INF 0xff800000u
#define H_FILTER_K H_THREADS  // K above this: no chunk bound (every element is histogrammed)

// NaN-propagating max / min (any NaN operand gives NaN), so one max per element both finds the thread's
// largest value and screens for NaN: fp32, and bf16x2 (two packed values at once). C: the asm operand kind.
#define NAN_PROPAGATING(NAME, INSN, T, C)                  \
  __device__ __forceinline__ T NAME(T a, T b) {            \
    T d;                                                   \
    asm(INSN " %0, %1, %2;" : "=" C(d) : C(a), C(b));      \
    return d;                                              \
  }
NAN_PROPAGATING(fmax_nan, "max.NaN.f32", float, "f")
NAN_PROPAGATING(fmin_nan, "min.NaN.f32", float, "f")
NAN_PROPAGATING(bf16x2_max_nan, "max.NaN.bf16x2", u32, "r")
NAN_PROPAGATING(bf16x2_min_nan, "min.NaN.bf16x2", u32, "r")

// The thread's largest and smallest values among its valid columns (-inf / +inf when it has none; NaN when
// any is NaN). WIDE (bf16 full chunks, K > H_FILTER_K): also m4, a value that 4 distinct columns of the group
// reach: each half of the packed words (the even and the odd elements, 16 each) keeps its two largest, and m4
// is the smallest of those four (else -inf: no bound).
template <typename T, int VEC, int GT, bool FULL, bool WIDE = false>
__device__ __forceinline__ void thread_range(const u32 (&raw)[Packed<T>::words], int n, int g, float& mx, float& mn,
                                             float& m4) {
  m4 = -INFINITY;
  if constexpr (FULL && sizeof(T) == 2) {
    u32 hi = raw[0], lo = raw[0], hi2 = 0xff80ff80u;  // hi2: each half's second largest (-inf, -inf at first)
#pragma unroll
    for (int i = 1; i < Packed<T>::words; ++i) {
      if (WIDE) hi2 = bf16x2_max_nan(hi2, bf16x2_min_nan(hi, raw[i]));
      hi = bf16x2_max_nan(hi, raw[i]);
      lo = bf16x2_min_nan(lo, raw[i]);
    }
    mx = fmax_nan(bf16_lo(hi), bf16_hi(hi));
    mn = fmin_nan(bf16_lo(lo), bf16_hi(lo));
    if (WIDE) m4 = fmin_nan(bf16_lo(hi2), bf16_hi(hi2));
  } else {
    mx = -INFINITY;
    mn = INFINITY;
#pragma unroll
    for (int e = 0; e < H_ELEMS; ++e)
      if (FULL || group_col<VEC, GT>(e, g) < n) {
        mx = fmax_nan(mx, elem_float(raw, e, T()));
        mn = fmin_nan(mn, elem_float(raw, e, T()));
      }
  }
}

// 2^y as __expf computes it (ex2.approx.f32 of the correctly rounded product); FTZ: without the subnormal
// range fix-up, the same value for y >= -126 (the caller checks that for every column of the thread).
#define LOG2E_F 1.4426950216293334961f
template <bool FTZ>
__device__ __forceinline__ float ex2_approx(float y) {
  float d;
  if (FTZ) asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(d) : "f"(y));
  else asm("ex2.approx.f32 %0, %1;" : "=f"(d) : "f"(y));
  return d;
}

// Sum of exp(x - M) over the thread's columns, as 2^(x log2(e) - ML) with ML = M log2(e) rounded to fp32: the
// exponent is one FMA (correctly rounded), the power ex2.approx (relative error 2 ulp), groups of 4 summed in fp32,
// groups summed in float64. Every term carries the same factor 2^(M log2(e) - ML), which the block takes out of
// the chunk's sum once, exactly, in float64 (chunk_exp_scale), so the sum is exp(x - M)'s within a few ulp per
// term. Also the bit mask of the thread's columns with value >= cf (element e: bit e), which the histogram
// counts. The caller drops the sum when M is -inf. !FMA (M log2(e) beyond fp32's range, or M not finite): the
// exponent is (x - M) * log2(e), each step rounded, and no factor.
template <typename T, int VEC, int GT, bool FULL, bool FTZ, bool FMA>
__device__ __forceinline__ double exp_sum_mask(const u32 (&raw)[Packed<T>::words], int n, int grp, float cf, float M,
                                               float ML, u32& mask) {
  double s = 0.0;
#pragma unroll
  for (int g = 0; g < H_ELEMS; g += 4) {
    float q = 0.f;
#pragma unroll
    for (int e = g; e < g + 4; ++e)
      if (FULL || group_col<VEC, GT>(e, grp) < n) {
        const float x = elem_float(raw, e, T());
        if (x >= cf) mask |= 1u << e;
        const float y = FMA ? __fmaf_rn(x, LOG2E_F, -ML) : __fmul_rn(__fsub_rn(x, M), LOG2E_F);
        q = __fadd_rn(q, ex2_approx<FTZ>(y));
      }
    s = __dadd_rn(s, (double)q);
  }
  return s;
}

// bf16, full chunk: the same sum, and the mask from packed compares (set.ge.bf16x2: one per two columns). Mask
// layout PACKED_MASK: word i of the thread's raw values holds elements 2i (low half) and 2i + 1 (high half);
// element 2i is bit i, element 2i + 1 bit 16 + i (mask_elem decodes).
template <bool FTZ>
__device__ __forceinline__ double exp_sum_mask_bf16_full(const u32 (&raw)[Packed<unsigned short>::words], u32 cf2,
                                                         float ML, u32& mask) {
  double s = 0.0;
#pragma unroll
  for (int g = 0; g < H_ELEMS / 2; g += 2) {
    float t[4];
#pragma unroll
    for (int i = g; i < g + 2; ++i) {
      u32 ge;
      asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(ge) : "r"(raw[i]), "r"(cf2));
      mask |= (ge & 0x00010001u) << i;
      t[2 * (i - g)] = ex2_approx<FTZ>(__fmaf_rn(bf16_lo(raw[i]), LOG2E_F, -ML));
      t[2 * (i - g) + 1] = ex2_approx<FTZ>(__fmaf_rn(bf16_hi(raw[i]), LOG2E_F, -ML));
    }
    const float q = __fadd_rn(__fadd_rn(__fadd_rn(t[0], t[1]), t[2]), t[3]);  // the generic path's order
    s = __dadd_rn(s, (double)q);
  }
  return s;
}

// Element of a PACKED_MASK bit (see exp_sum_mask_bf16_full).
__device__ __forceinline__ int mask_elem(int bit) { return bit < 16 ? 2 * bit : 2 * (bit - 16) + 1; }

// ex2.approx.ftz gives the same value as without ftz when every exponent is >= -126 (monotone in x: checked
// on the thread's smallest value; NaN / -inf: the exact one). fma: ML = M log2(e) is an fp32 within 2^24 (the
// exponent's form above; block-uniform).
template <typename T, int VEC, int GT, bool FULL>
__device__ __forceinline__ double exp_sum_mask(const u32 (&raw)[Packed<T>::words], int n, int g, float cf, float M,
                                               float ML, bool fma, float tmin, u32& mask) {
  if (!fma) {
    if (__fmul_rn(__fsub_rn(tmin, M), LOG2E_F) >= -126.f)
      return exp_sum_mask<T, VEC, GT, FULL, true, false>(raw, n, g, cf, M, ML, mask);
    return exp_sum_mask<T, VEC, GT, FULL, false, false>(raw, n, g, cf, M, ML, mask);
  }
  const bool ftz = __fmaf_rn(tmin, LOG2E_F, -ML) >= -126.f;
  if constexpr (FULL && sizeof(T) == 2) {
    const u32 c = __float_as_uint(cf) >> 16;  // cf is a bf16 value (a thread maximum's key, or +-inf)
    if (ftz) return exp_sum_mask_bf16_full<true>(raw, c | (c << 16), ML, mask);
    return exp_sum_mask_bf16_full<false>(raw, c | (c << 16), ML, mask);
  }
  if (ftz) return exp_sum_mask<T, VEC, GT, FULL, true, true>(raw, n, g, cf, M, ML, mask);
  return exp_sum_mask<T, VEC, GT, FULL, false, true>(raw, n, g, cf, M, ML, mask);
}

// The factor 2^(M log2(e) - ML) that turns a sum of 2^(x log2(e) - ML) into sum exp(x - M): M * LOG2E_F is exact
// in float64 (two 24-bit significands), the difference is exact, exp2 rounds once.
__device__ __forceinline__ double chunk_exp_scale(float M, float ML) {
  return exp2(__dsub_rn(__dmul_rn((double)M, (double)LOG2E_F), (double)ML));
}

// G groups per thread (G = 1: one 32-column group, 8192-column chunks; G = 2, bf16 only: two, 16384-column
// chunks, so the block's fixed work (the maxima sort, the bound, the flush) is paid once per 16384 columns).
// Thread tid owns groups tid + i * H_THREADS, i < G, of the chunk's GT = G * H_THREADS.
// WIDE (the hist_pass_wide_* kernels, which the launcher picks for bf16 rows and 256 < K <= 1024): the bound from
// the threads' m4 values on full chunks; the other kernels carry none of that code.
template <typename T, int VEC, int G, bool WIDE = false>
__device__ __forceinline__ void hist_pass(const T* __restrict__ logits, long long row_stride, int V, int K, int C,
                                          u32* __restrict__ ghist, unsigned short* __restrict__ group_bin,
                                          u32* __restrict__ chunk_cut, float* __restrict__ chunk_max,
                                          double* __restrict__ chunk_sum, u32* __restrict__ row_range,
                                          int* __restrict__ err) {
  constexpr int GT = H_THREADS * G, CC = H_COLS * G;  // groups and columns per chunk
  __shared__ __align__(16) u32 hist[H_BINS];
  __shared__ u32 sorted[H_THREADS];
  __shared__ u32 wmax[H_THREADS / 32];
  __shared__ double dscratch[H_THREADS / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = blockIdx.y, c = blockIdx.x;  // grid (C, R)
  const long long blk = (long long)r * C + c;  // the chunk's index in the per-chunk outputs
  const int start = c * CC;
  const int n = min(CC, V - start);
  const bool full = n == CC;
  const int kout = min(K, V);
  const T* row = logits + (long long)r * row_stride + start;

  u32 raw[G][Packed<T>::words];
  // issued before the zeroing so the loads are in flight meanwhile
#pragma unroll
  for (int i = 0; i < G; ++i) {
    if (full) load_group<T, VEC, GT, true>(row, n, raw[i], tid + i * H_THREADS);
    else load_group<T, VEC, GT>(row, n, raw[i], tid + i * H_THREADS);
  }
  uint4* h4 = reinterpret_cast<uint4*>(hist);
  for (int b = tid; b < H_BINS / 4; b += H_THREADS) h4[b] = make_uint4(0u, 0u, 0u, 0u);

  // K up to H_FILTER_K: the bound from the threads' maxima; up to 4 H_FILTER_K (bf16 full chunks): from each
  // thread's m4 (thread_range), 4 distinct columns per thread
  const bool wide = WIDE && kout > H_FILTER_K && kout <= 4 * H_FILTER_K && full && sizeof(T) == 2;
  float tmax = -INFINITY, tmin = INFINITY, t4 = -INFINITY;
  u32 gkey[G];  // each group's largest key (KEY_NEG_INF for a group with no valid column)
#pragma unroll
  for (int i = 0; i < G; ++i) {
    float gmax, gmin, g4;
    if (WIDE && wide) thread_range<T, VEC, GT, true, true>(raw[i], n, tid + i * H_THREADS, gmax, gmin, g4);
    else if (full) thread_range<T, VEC, GT, true>(raw[i], n, tid + i * H_THREADS, gmax, gmin, g4);
    else thread_range<T, VEC, GT, false>(raw[i], n, tid + i * H_THREADS, gmax, gmin, g4);
    gkey[i] = float_key(gmax);
    tmax = i == 0 ? gmax : fmax_nan(tmax, gmax);
    tmin = i == 0 ? gmin : fmin_nan(tmin, gmin);
    t4 = i == 0 ? g4 : fmax_nan(t4, g4);  // one group's 4 columns suffice
  }
  if (tmax != tmax || tmax == INFINITY) {  // rare: name the bad values exactly
    int bad = 0;
#pragma unroll
    for (int i = 0; i < G; ++i)
#pragma unroll
      for (int e = 0; e < H_ELEMS; ++e) {
        const float f = elem_float(raw[i], e, T());
        if (group_col<VEC, GT>(e, tid + i * H_THREADS) < n)
          bad |= f != f ? ERR_LOGITS_NAN : (f == INFINITY ? ERR_LOGITS_POSINF : 0);
      }
    if (bad) atomicOr(err, bad);
  }
  const u32 kmax = float_key(tmax);  // KEY_NEG_INF for a thread with no valid column
  if (wide) {  // the sort below is of m4 keys: each warp's largest key separately
    u32 wm = kmax;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wm = max(wm, __shfl_xor_sync(0xffffffffu, wm, o));
    if (lane == 0) wmax[warp] = wm;
  }
  // each warp's maxima (wide: m4 keys) sorted descending (bitonic network over the lanes)
  u32 v = wide ? float_key(t4) : kmax;
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const u32 o = __shfl_xor_sync(0xffffffffu, v, j);
      v = (((lane & j) == 0) == ((lane & k) == 0)) ? max(v, o) : min(v, o);
    }
  sorted[tid] = v;
  __syncthreads();  // the zeroed histogram and the sorted maxima
  // The chunk bound: with q = ceil(kout / 8), the smallest of the 8 warps' q-th largest thread maxima. Each
  // warp has q threads (distinct columns) whose largest key is >= it, so 8 q >= kout columns of the chunk
  // are, and the chunk's kout-th largest key is >= it; so is the row's kout-th largest key T (the chunk's
  // top kout are kout of the row's columns). Every key >= T is then counted, which keeps the boundary bin
  // at T's bin: the counts above that bin are exact and the bin's own count still reaches kout. A thread
  // with no valid column counts as -inf (KEY_NEG_INF, the smallest key of any non-NaN value: no filter).
  // Wide: q = ceil(kout / 32) threads per warp with 4 distinct columns >= their m4 >= the bound, 32 q >= kout.
  // Otherwise (K > 256 on other chunks): no bound.
  u32 bmax = wide ? wmax[0] : sorted[0], cut = KEY_NEG_INF;
#pragma unroll
  for (int w = 1; w < H_THREADS / 32; ++w) bmax = max(bmax, wide ? wmax[w] : sorted[32 * w]);
  if (kout <= H_FILTER_K || wide) {
    const int q = wide ? (kout + 31) >> 5 : (kout + 7) >> 3;
    cut = sorted[q - 1];
#pragma unroll
    for (int w = 1; w < H_THREADS / 32; ++w) cut = min(cut, sorted[32 * w + q - 1]);
  }
  // the bound as a non-NaN key (a NaN key only with the error flag set), compared as a float: for non-NaN x,
  // x >= key_float(cut) <=> float_key(x) >= cut (-0.0 >= +0.0 as the folded keys tie), as the select's gather
  // compares
  cut = min(max(cut, KEY_NEG_INF), KEY_POS_INF);
  const float cf = key_float(cut);
  const float M = key_float(bmax);  // -inf for a chunk of -inf only; NaN / +inf only with the error flag set

#pragma unroll
  for (int i = 0; i < G; ++i)  // 0 for a group with nothing >= the bound
    group_bin[blk * GT + tid + i * H_THREADS] = gkey[i] >= cut ? (unsigned short)(gkey[i] >> H_SHIFT) : 0;
  const float ML = __fmul_rn(M, LOG2E_F);
  // the FMA form (exp_sum_mask) while ML is within 2^24: its rounding error, the factor's exponent, is then <= 1 (a
  // larger |M|, e.g. 1e30, would put 2^(M log2(e) - ML) out of range); beyond, the plain form
  const bool fma = fabsf(ML) <= 16777216.f;
  const bool packed = full && sizeof(T) == 2 && fma;  // the mask's layout (PACKED_MASK or element order)
  double s = 0.0;
#pragma unroll
  for (int i = 0; i < G; ++i) {
    const int g = tid + i * H_THREADS;
    u32 mask = 0;
    const double si = full ? exp_sum_mask<T, VEC, GT, true>(raw[i], n, g, cf, M, ML, fma, tmin, mask)
                           : exp_sum_mask<T, VEC, GT, false>(raw[i], n, g, cf, M, ML, fma, tmin, mask);
    s = i == 0 ? si : __dadd_rn(s, si);
    // the few columns >= the bound into the block histogram (re-read: an L1 hit, no dynamic register index)
    while (mask) {
      const int e = packed ? mask_elem(__ffs(mask) - 1) : __ffs(mask) - 1;
      mask &= mask - 1;
      atomicAdd(hist + (float_key(to_float(__ldg(row + group_col<VEC, GT>(e, g)))) >> H_SHIFT), 1u);
    }
  }
  if (M == -INFINITY) s = 0.0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = __dadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  if (lane == 0) dscratch[warp] = s;
  __syncthreads();  // also orders the histogram atomics before the flush

  // flush the nonzero bins to the row's histogram: only bins cut's .. bmax's can hold counts
  u32* gh = ghist + (long long)r * H_BINS;
  for (int b = (int)(cut >> H_SHIFT) + tid; b <= (int)(bmax >> H_SHIFT); b += H_THREADS) {
    const u32 h = hist[b];
    if (h) atomicAdd(gh + b, h);
  }
  if (tid == 0) {
    double t = 0.0;
#pragma unroll
    for (int w = 0; w < H_THREADS / 32; ++w) t = __dadd_rn(t, dscratch[w]);
    chunk_max[blk] = M;
    chunk_sum[blk] = fma ? __dmul_rn(t, chunk_exp_scale(M, ML)) : t;
    chunk_cut[blk] = cut;
    atomicMax(row_range + 2 * r, (bmax >> H_SHIFT) + 1);          // the row's bin range: the flush above wrote
    atomicMax(row_range + 2 * r + 1, H_BINS - (cut >> H_SHIFT));  // bins cut .. bmax (kept as two maxima over zero)
  }
}

#define HIST_ARGS                                                                                      \
  long long row_stride, int V, int K, int C, u32 *ghist, unsigned short *group_bin, u32 *chunk_cut,       \
      float *chunk_max, double *chunk_sum, u32 *row_range, int *err
#define HIST_PASS row_stride, V, K, C, ghist, group_bin, chunk_cut, chunk_max, chunk_sum, row_range, err

extern "C" __global__ void __launch_bounds__(H_THREADS, 6) hist_pass_bf16_v8(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 8, 1>(logits, HIST_PASS);
}
// two groups per thread: 32 registers of raw values, so 4 resident blocks (64 registers) instead of 6
extern "C" __global__ void __launch_bounds__(H_THREADS, 4) hist_pass_bf16_v8_g2(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 8, 2>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 6) hist_pass_bf16_v1(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 1, 1>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 6) hist_pass_wide_bf16_v8(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 8, 1, true>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 4) hist_pass_wide_bf16_v8_g2(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 8, 2, true>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 6) hist_pass_wide_bf16_v1(const unsigned short* logits, HIST_ARGS) {
  hist_pass<unsigned short, 1, 1, true>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 4) hist_pass_f32_v4(const float* logits, HIST_ARGS) {
  hist_pass<float, 4, 1>(logits, HIST_PASS);
}
extern "C" __global__ void __launch_bounds__(H_THREADS, 4) hist_pass_f32_v1(const float* logits, HIST_ARGS) {
  hist_pass<float, 1, 1>(logits, HIST_PASS);
}

// ---------------------------------------------------------------------------------------------------
// pass D: exact select + sort + outputs per row
// ---------------------------------------------------------------------------------------------------

// The row itself as select_winners' source (a row with more candidates than fit: heavy ties).
template <typename T>
struct RowSource {
  const T* p;
  __device__ __forceinline__ u64 get(int t) const { return composite(float_key(to_float(p[t])), (u32)t); }
};

#define H_PER (H_BINS / H_THREADS)  // histogram bins per select thread: 16

// The thread's H_PER bins of the row histogram gh, for boundary_bin (issued first: the loads are in flight while the
// block does other work); only the row's bin range lo .. hi can hold counts, the rest reads as 0.
__device__ __forceinline__ void load_bins(const u32* __restrict__ gh, int lo, int hi, u32 (&h)[H_PER]) {
  const int base = (H_THREADS - 1 - (int)threadIdx.x) * H_PER;
  const uint4* q4 = reinterpret_cast<const uint4*>(gh + base);
#pragma unroll
  for (int q = 0; q < H_PER / 4; ++q) {
    const bool in = base + 4 * q + 3 >= lo && base + 4 * q <= hi;
    const uint4 w = in ? q4[q] : make_uint4(0u, 0u, 0u, 0u);
    h[4 * q] = w.x; h[4 * q + 1] = w.y; h[4 * q + 2] = w.z; h[4 * q + 3] = w.w;
  }
}

// The row's boundary bin from its histogram (H_BINS bins, bin H_BINS - 1 = largest keys), which it zeroes for
// the next call: sel = (b*, keys above b*, keys in b*) with above < want <= above + count, or b* = ~0u when the
// row holds fewer than `want` keys. Thread tid owns bins (H_THREADS - 1 - tid) * PER .. + PER - 1.
// With seg_start (H_BINS u16) and seg_cur (H_BINS / 2 u32: two u16 per word, bin b in half b & 1 of word b / 2),
// or null: also each bin's place in the descending order of the counted keys, for the bins b* and above:
// seg_start[b] = seg_cur's entry for b = the count of keys above bin b (the start of its segment; the cursor is the
// gather's). Counts fit 16 bits: the by-bin select runs only when at most S_CACHE keys are at or above b*.
// Written only when sel[0] is a bin; ends with a barrier.
// h: the thread's bins (load_bins).
__device__ __forceinline__ void boundary_bin(u32* __restrict__ gh, const u32 (&h)[H_PER], u32 want, u32* scratch,
                                             u32* sel, unsigned short* seg_start = nullptr, u32* seg_cur = nullptr) {
  constexpr int PER = H_PER;
  const int tid = threadIdx.x;
  const int base = (H_THREADS - 1 - tid) * PER;
  uint4* q4 = reinterpret_cast<uint4*>(gh + base);
  // clean for the next call, writing only what holds counts: at batch 32 rewriting every bin with zeros cost 7 us
  // of the select (8 MB of L2 writes; benchmarks/RESULTS.md)
#pragma unroll
  for (int q = 0; q < PER / 4; ++q)
    if (h[4 * q] | h[4 * q + 1] | h[4 * q + 2] | h[4 * q + 3]) q4[q] = make_uint4(0u, 0u, 0u, 0u);
  u32 s = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) s += h[i];
  if (tid == 0) sel[0] = 0xffffffffu;
  u32 total;
  const u32 before = block_exclusive_scan<H_THREADS>(s, scratch, &total);
  if (before < want && want <= before + s) {
    u32 acc = before;
#pragma unroll
    for (int i = PER - 1; i >= 0; --i) {
      if (acc < want && acc + h[i] >= want) {
        sel[0] = (u32)(base + i);
        sel[1] = acc;
        sel[2] = h[i];
      }
      acc += h[i];
    }
  }
  __syncthreads();
  if (seg_start != nullptr && sel[0] != 0xffffffffu && base + PER > (int)sel[0]) {
    // keys in the bins above base + i, walking down from the thread's top bin (its 16 bins: 8 cursor words)
    u32 above = before, st[PER];
#pragma unroll
    for (int i = PER - 1; i >= 0; --i) {
      st[i] = above;
      seg_start[base + i] = (unsigned short)above;
      above += h[i];
    }
#pragma unroll
    for (int i = 0; i < PER; i += 2) seg_cur[(base + i) >> 1] = (st[i] & 0xffffu) | (st[i + 1] << 16);  // below b*: unused
  }
  if (seg_start != nullptr) __syncthreads();
}

// Where the gather puts a candidate (gather_group's SEG): appended (cursor), or (the wide select, boundary_bin's
// tables) into its bin's segment, so the candidates end up grouped by bin in descending bin order; a candidate past
// its segment's end (only if the gather and the histogram disagreed) is dropped and sets *bad.
struct SegTable {
  const unsigned short* start;  // per bin: its segment's start (boundary_bin's seg_start)
  u32* cur;                     // per bin: its cursor (two u16 per word)
  u32 b0;                       // the boundary bin (the lowest segment)
  u32 items;                    // counted keys at or above b0 (b0's segment ends there)
  u32* bad;
  __device__ __forceinline__ u32 end(u32 bin) const { return bin > b0 ? start[bin - 1] : items; }
};

// Appends the columns of group g (chunk g / GT, group g % GT of hist_pass) whose key is >= cut
// and >= the chunk's bound (hist_pass's chunk_cut): exactly the columns the row histogram counted at or above
// the boundary bin, so the gather collects as many candidates as the histogram promised.
// FULL: the group's chunk has all CC columns (gather_group below picks).
template <typename T, int VEC, int G, bool SEG, bool FULL>
__device__ __forceinline__ void gather_group_impl(const T* __restrict__ row, int V, int g, u32 cut,
                                             const u32* __restrict__ ccut, u64* dst, int cap, u32* cursor,
                                             const SegTable& st) {
  constexpr int GT = H_THREADS * G, CC = H_COLS * G;  // groups and columns per chunk
  const int t = g % GT, start = (g / GT) * CC;
  const int n = min(CC, V - start);
  // compared as a float, as hist_pass counted: ccut is a non-NaN key >= KEY_NEG_INF (a bin edge above
  // KEY_POS_INF only with the error flag set)
  const float cf = key_float(min(max(cut, __ldg(ccut + g / GT)), KEY_POS_INF));
  u32 raw[Packed<T>::words];
  load_group<T, VEC, GT, FULL>(row + start, n, raw, t);
  // The mask of the group's columns >= cf. bf16 full chunks of the K <= 256 select: packed compares
  // (set.ge.bf16x2, one per two columns, hist_pass's PACKED_MASK layout). cf truncated to bf16 gives the same
  // predicate on bf16 values: cf is a bin edge or a chunk bound, so either bf16-exact, or (a negative edge, whose
  // key's low bits were set by key_float's complement) within one bf16 step below its truncation c, with no bf16
  // value in [cf, c). The segment path (K > 256) keeps the compare per column: packed, it was about 1 % slower at
  // batch 32-64 (benchmarks/RESULTS.md).
  constexpr bool PACKED = FULL && sizeof(T) == 2 && !SEG;
  u32 mask = 0;
  if constexpr (PACKED) {
    const u32 c = __float_as_uint(cf) >> 16, c2 = c | (c << 16);
#pragma unroll
    for (int i = 0; i < Packed<T>::words; ++i) {
      u32 ge;
      asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(ge) : "r"(raw[i]), "r"(c2));
      mask |= (ge & 0x00010001u) << i;
    }
  } else {
#pragma unroll
    for (int e = 0; e < H_ELEMS; ++e)
      if (group_col<VEC, GT>(e, t) < n && elem_float(raw, e, T()) >= cf) mask |= 1u << e;
  }
  u32 pos = atomicAdd(cursor, (u32)__popc(mask));
  // Only the set bits are visited, each value re-read (an L1 hit, as hist_pass does: a dynamic index into raw
  // would spill it); a live group has a few.
  while (mask) {
    const int bit = __ffs(mask) - 1;
    mask &= mask - 1;
    const int col = start + group_col<VEC, GT>(PACKED ? mask_elem(bit) : bit, t);
    const u32 key = float_key(to_float(__ldg(row + col)));
    if constexpr (SEG) {
      const u32 bin = key >> H_SHIFT;  // >= b0: the key is >= cut, b0's lower edge
      const u32 sh = 16 * (bin & 1);
      const u32 p = (atomicAdd(st.cur + (bin >> 1), 1u << sh) >> sh) & 0xffffu;
      if (bin >= st.b0 && p < st.end(bin) && p < (u32)cap) dst[p] = composite(key, (u32)col);
      else *st.bad = 1u;
    } else {
      if (pos < (u32)cap) dst[pos] = composite(key, (u32)col);  // never out of range
      ++pos;
    }
  }
}

// gather_group_impl out of line: groups of the row's last, partial chunk, and groups past the shared list's
// GATHER_LIST entries (both rare; see select_winners_cold).
template <typename T, int VEC, int G, bool SEG>
__device__ __noinline__ void gather_group_cold(const T* __restrict__ row, int V, int g, u32 cut,
                                               const u32* __restrict__ ccut, u64* dst, int cap, u32* cursor,
                                               SegTable st) {
  gather_group_impl<T, VEC, G, SEG, false>(row, V, g, cut, ccut, dst, cap, cursor, st);
}

template <typename T, int VEC, int G, bool SEG>
__device__ __forceinline__ void gather_group(const T* __restrict__ row, int V, int g, u32 cut,
                                             const u32* __restrict__ ccut, u64* dst, int cap, u32* cursor,
                                             const SegTable& st) {
  constexpr int GT = H_THREADS * G, CC = H_COLS * G;
  if (V - (g / GT) * CC >= CC) gather_group_impl<T, VEC, G, SEG, true>(row, V, g, cut, ccut, dst, cap, cursor, st);
  else gather_group_cold<T, VEC, G, SEG>(row, V, g, cut, ccut, dst, cap, cursor, st);
}

// Appends every column of the row whose key's bin is >= bsel to dst (at most cap), visiting only the
// 32-column groups whose largest bin (hist_pass's group_bin) reaches bsel. The row's group_bin entries
// (C * GT u16, 16-byte aligned) are read 8 at a time, GATHER_LOADS loads in flight per thread, so a
// block waits for a handful of memory round trips rather than one per entry. The groups found go to a
// shared-memory list first, which the block's threads then split one group each: every group's loads are in
// flight at once (a thread that finds several would otherwise wait for their logits one after another; a group
// past the list's GATHER_LIST entries is gathered by the thread that found it). Returns the number appended.
#define GATHER_LOADS 4  // 32 entries per thread per round: one bit each in `live`
#define GATHER_LIST 1024
template <typename T, int VEC, int G, bool SEG>
__device__ __forceinline__ int gather_candidates(const T* __restrict__ row, int V, int C,
                                                 const unsigned short* __restrict__ gbin,
                                                 const u32* __restrict__ ccut, u32 bsel, u64* dst, int cap,
                                                 u32* cursor, u32* list, u32* listed, const SegTable& st) {
  const u32 cut = bsel << H_SHIFT;
  const int nq = C * H_THREADS * G / 8;
  const uint4* gq = reinterpret_cast<const uint4*>(gbin);
  for (int q0 = 0; q0 < nq; q0 += GATHER_LOADS * S_THREADS) {
    uint4 w[GATHER_LOADS];
#pragma unroll
    for (int i = 0; i < GATHER_LOADS; ++i) {
      const int q = q0 + i * S_THREADS + (int)threadIdx.x;
      w[i] = q < nq ? __ldg(gq + q) : make_uint4(0u, 0u, 0u, 0u);
    }
    u32 live = 0;  // bit 8 i + h: entry h of load i reaches bsel
#pragma unroll
    for (int i = 0; i < GATHER_LOADS; ++i) {
      const u32 words[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
#pragma unroll
      for (int h = 0; h < 8; ++h)
        live |= (u32)(((words[h >> 1] >> ((h & 1) * 16)) & 0xffffu) >= bsel) << (8 * i + h);
      if (q0 + i * S_THREADS + (int)threadIdx.x >= nq) live &= ~(0xffu << (8 * i));
    }
    while (live) {  // one call site: the group's loads are not unrolled 32 times
      const int b = __ffs(live) - 1;
      live &= live - 1;
      const int g = (q0 + (b >> 3) * S_THREADS + (int)threadIdx.x) * 8 + (b & 7);
      const u32 slot = atomicAdd(listed, 1u);
      if (slot < GATHER_LIST) list[slot] = (u32)g;
      else gather_group_cold<T, VEC, G, SEG>(row, V, g, cut, ccut, dst, cap, cursor, st);
    }
  }
  __syncthreads();  // the list is complete
  const int n = (int)min(*listed, (u32)GATHER_LIST);
  for (int k = threadIdx.x; k < n; k += S_THREADS) gather_group<T, VEC, G, SEG>(row, V, (int)list[k], cut, ccut, dst, cap, cursor, st);
  __syncthreads();
  return (int)min(*cursor, (u32)cap);
}

// The select's rare paths out of line (__noinline__): the exact radix select (heavy ties, or more candidates than
// the rank-by-counting path takes) and the large rankings. A select block runs each phase's code once, so at small
// batches the code it is fetched past costs time (ncu at batch 1: 18 % of the stall samples were instruction fetch,
// most at the emit, which came after the inlined radix select and sort).
template <typename Src>
__device__ __noinline__ int select_winners_cold(Src src, int items, u32 want, int kout, u32* hist, u64* winners,
                                                u32* scratch, u32* sel, u32* n_win) {
  return select_winners<S_THREADS>(src, items, want, kout, hist, winners, scratch, sel, n_win);
}

#define RANK_ITEMS 512
// emit_sorted for more than S_THREADS composites, out of line (see select_winners_cold).
template <int MODE>
__device__ __noinline__ void emit_sorted_many(u64* src, int got, int kout, int r, double lse,
                                              float* __restrict__ out_vals, long long* __restrict__ out_ids,
                                              long long id_offset) {
  const int tid = threadIdx.x;
  if (got <= RANK_ITEMS) {
    for (int i = tid; i < got; i += S_THREADS) {
      const u64 w = src[i];
      int rank = 0;
#pragma unroll 8
      for (int j = 0; j < got; ++j) rank += src[j] > w;  // one address per step: a broadcast
      if (rank < kout) emit<MODE>(r, kout, rank, w, lse, out_vals, out_ids, id_offset);
    }
  } else {
    int P = 1;
    while (P < got) P <<= 1;
    for (int i = got + tid; i < P; i += S_THREADS) src[i] = 0ull;  // sorts last
    __syncthreads();
    bitonic_sort_desc<S_THREADS>(src, P);
    for (int i = tid; i < min(got, kout); i += S_THREADS) emit<MODE>(r, kout, i, src[i], lse, out_vals, out_ids, id_offset);
  }
}

// Writes the top kout of the unique composites src[0, got) (all of them when got <= kout; positions past
// got are padded) in descending order. Rank by counting (each composite's place is the number of larger
// ones: no barrier; several lanes per composite when got <= S_THREADS / 2) when got <= RANK_ITEMS; else
// (only from the radix select's winners, got <= kout <= MAX_K, src == hw) a bitonic sort in place.
template <int MODE>
__device__ __forceinline__ void emit_sorted(u64* src, int got, int kout, int r, double lse,
                                            float* __restrict__ out_vals, long long* __restrict__ out_ids,
                                            long long id_offset) {
  const int tid = threadIdx.x;
  if (got <= S_THREADS) {
    // p lanes per composite (a power of two <= 32 with got * p <= S_THREADS: an aligned group of one warp),
    // each counting every p-th of the larger ones, summed over the group
    int p = 1;
    while (p < 32 && got * (p << 1) <= S_THREADS) p <<= 1;
    const int i = tid / p, sub = tid & (p - 1);
    const u64 w = i < got ? src[i] : 0ull;
    int rank = 0;
    if (i < got)
#pragma unroll 4
      for (int j = sub; j < got; j += p) rank += src[j] > w;
    for (int o = 1; o < p; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);  // p is block-uniform
    if (i < got && sub == 0 && rank < kout) emit<MODE>(r, kout, rank, w, lse, out_vals, out_ids, id_offset);
  } else {
    emit_sorted_many<MODE>(src, got, kout, r, lse, out_vals, out_ids, id_offset);
  }
  for (int i = got + tid; i < kout; i += S_THREADS) emit<MODE>(r, kout, i, 0ull, lse, out_vals, out_ids, id_offset);
}

// Writes the top kout of the `items` candidates that the gather placed by bin (SegTable): a candidate's rank is
// its segment's start plus the number of larger candidates in its segment, so only candidates of one bin are
// compared (K > 256: the many bins above the boundary hold few keys each).
template <int MODE>
__device__ __forceinline__ void emit_by_segment(const u64* src, const SegTable& st, int kout, int r, double lse,
                                                float* __restrict__ out_vals, long long* __restrict__ out_ids,
                                                long long id_offset) {
  for (int i = threadIdx.x; i < (int)st.items; i += S_THREADS) {
    const u64 w = src[i];
    const u32 bin = (u32)(w >> (32 + H_SHIFT));
    const u32 lo = st.start[bin], hi = st.end(bin);
    u32 rank = lo;
    for (u32 j = lo; j < hi; ++j) rank += src[j] > w;
    if (rank < (u32)kout) emit<MODE>(r, kout, (int)rank, w, lse, out_vals, out_ids, id_offset);
  }
  for (int i = (int)st.items + threadIdx.x; i < kout; i += S_THREADS) emit<MODE>(r, kout, i, 0ull, lse, out_vals, out_ids, id_offset);
}

// row_lse over the block, out of line: rows of more than 32 chunks (V > 262144) only.
template <int MODE>
__device__ __noinline__ double row_lse_cold(const float* __restrict__ chunk_max, const double* __restrict__ chunk_sum,
                                            int r, int C, float* fscratch, double* dscratch, int* err) {
  return row_lse<S_THREADS, MODE>(chunk_max, chunk_sum, r, C, fscratch, dscratch, err);
}

// Row r's logsumexp by warp 0 alone when C <= 32 (into *out; the other warps go on): the same operations in
// the same order as row_lse<S_THREADS, MODE> (a lane per chunk, the same xor tree, the other warps' zero
// sums added), so bit for bit its value. mc, cs: lane's chunk partials (chunk_max[r * C + lane], chunk_sum[...];
// -inf and 0 for lanes >= C), loaded by the caller.
template <int MODE>
__device__ __forceinline__ void row_lse_warp(float mc, double cs, double* out, int* err) {
  const int lane = threadIdx.x & 31;
  float M = mc;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  double s = 0.0;
  if (M != -INFINITY && mc != -INFINITY) s = __dadd_rn(s, __dmul_rn(cs, exp(__dsub_rn((double)mc, (double)M))));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = __dadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  double t = 0.0;
#pragma unroll
  for (int w = 0; w < S_THREADS / 32; ++w) t = __dadd_rn(t, w == 0 ? s : 0.0);
  if (lane == 0) {
    if (MODE == 0 && M == -INFINITY) atomicOr(err, ERR_DEAD_ROW);
    *out = M == -INFINITY ? -INFINITY : __dadd_rn((double)M, log(t));
  }
}

// MODE 0: logprobs + ids; MODE 1: raw logits, ids + id_offset and the row lse (shard partials). WIDE (the
// *_wide kernels, which the launcher picks for K > 256): the candidates are placed by bin and ranked within it.
template <typename T, int VEC, int MODE, int G, bool WIDE>
__device__ __forceinline__ void hist_select(const T* __restrict__ logits, long long row_stride, int V, int K, int C,
                                            u32* __restrict__ ghist, const unsigned short* __restrict__ group_bin,
                                            const u32* __restrict__ chunk_cut, u64* __restrict__ cands,
                                            long long cap, const float* __restrict__ chunk_max,
                                            const double* __restrict__ chunk_sum, float* __restrict__ out_vals,
                                            long long* __restrict__ out_ids, double* __restrict__ out_lse,
                                            long long id_offset, u32* __restrict__ row_range, int* __restrict__ err) {
  __shared__ u64 hw[MAX_K];  // histogram (2048 u32) during the select, winners (<= 1024 u64) after
  u32* hist = reinterpret_cast<u32*>(hw);
  __shared__ u64 cache[S_CACHE];
  __shared__ u32 scratch[32];
  __shared__ u32 sel[3];
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  __shared__ double s_lse;
  __shared__ u32 n_win, cursor, listed, seg_bad;
  __shared__ u32 list[GATHER_LIST];  // gather_candidates' live groups

  const int tid = threadIdx.x, r = blockIdx.x;
  const int kout = min(K, V);
  pdl_wait();  // a dependent launch after hist_pass (runtime.launch): the pass's outputs are read from here on
  const u32 rr_hi = row_range[2 * r], rr_lo = row_range[2 * r + 1];  // issued first: the histogram loads wait on it
  if (tid == 0) n_win = cursor = listed = seg_bad = 0;

  // C <= 32 (V <= 262144): warp 0 computes the lse while the block finds the boundary bin (s_lse is read
  // after boundary_bin's barriers). Its chunk partials are loaded first, then every thread's histogram bins, so
  // warp 0's bins are in flight during the lse.
  const bool lse_warp = C <= 32 && tid < 32;
  const float mc = lse_warp && tid < C ? chunk_max[r * C + tid] : -INFINITY;
  const double cs = lse_warp && tid < C ? chunk_sum[r * C + tid] : 0.0;
  u32 h[H_PER];
  load_bins(ghist + (long long)r * H_BINS, H_BINS - (int)rr_lo, (int)rr_hi - 1, h);
  if (C <= 32) {
    if (lse_warp) row_lse_warp<MODE>(mc, cs, &s_lse, err);
  } else {
    const double l = row_lse_cold<MODE>(chunk_max, chunk_sum, r, C, fscratch, dscratch, err);
    if (tid == 0) s_lse = l;
  }

  const T* row = logits + (long long)r * row_stride;
  // WIDE: the candidates are placed by bin (SegTable: the starts in hw, the cursors in seg_cur) and ranked within
  // their bin
  __shared__ u32 seg_cur[WIDE ? H_BINS / 2 : 1];
  unsigned short* seg_start = WIDE ? reinterpret_cast<unsigned short*>(hw) : nullptr;
  boundary_bin(ghist + (long long)r * H_BINS, h, (u32)kout, scratch, sel, seg_start, WIDE ? seg_cur : nullptr);
  if (tid == 0) row_range[2 * r] = row_range[2 * r + 1] = 0u;  // read by every thread before boundary_bin's barriers
  const double lse = s_lse;
  const u32 bsel = sel[0];
  const unsigned long long items = (unsigned long long)sel[1] + sel[2];  // counted keys with bin >= b*
  u64* src = hw;
  int got;
  // the segment path: every candidate in shared memory, and every bin with counts inside the table
  const bool by_seg = WIDE && bsel != 0xffffffffu && items <= S_CACHE;
  if (WIDE && by_seg) {
    const SegTable st{seg_start, seg_cur, bsel, (u32)items, &seg_bad};
    got = gather_candidates<T, VEC, G, true>(row, V, C, group_bin + (long long)r * C * H_THREADS * G, chunk_cut + (long long)r * C,
                                    bsel, cache, S_CACHE, &cursor, list, &listed, st);
    if (!seg_bad && got == (int)items) {  // block-uniform (read after the gather's barrier)
      emit_by_segment<MODE>(cache, st, kout, r, lse, out_vals, out_ids, id_offset);
      if (MODE == 1 && tid == 0) out_lse[r] = lse;
      return;
    }
    // the gather disagreed with the histogram (only with the error flag set): the exact select over the row
    __syncthreads();
    got = select_winners_cold(RowSource<T>{row}, V, (u32)kout, kout, hist, hw, scratch, sel, &n_win);
  } else if (bsel != 0xffffffffu && items <= (unsigned long long)cap) {
    u64* dst = items <= S_CACHE ? cache : cands + (long long)r * cap;
    got = gather_candidates<T, VEC, G, false>(row, V, C, group_bin + (long long)r * C * H_THREADS * G, chunk_cut + (long long)r * C,
                                    bsel, dst, items <= S_CACHE ? S_CACHE : (int)cap, &cursor, list, &listed, SegTable{});
    if (got <= RANK_ITEMS && dst == cache) src = cache;  // few candidates: ranked directly, no select
    else got = select_winners_cold(CandSource{dst}, got, (u32)min(kout, got), kout, hist, hw, scratch, sel, &n_win);
  } else {
    got = select_winners_cold(RowSource<T>{row}, V, (u32)kout, kout, hist, hw, scratch, sel, &n_win);
  }
  emit_sorted<MODE>(src, got, kout, r, lse, out_vals, out_ids, id_offset);
  if (MODE == 1 && tid == 0) out_lse[r] = lse;
}

#define SELECT_ARGS                                                                                         \
  long long row_stride, int V, int K, int C, u32 *ghist, const unsigned short *group_bin, const u32 *chunk_cut, \
      u64 *cands, long long cap, const float *chunk_max, const double *chunk_sum, float *out_vals,              \
      long long *out_ids
#define SELECT_PASS                                                                                           \
  row_stride, V, K, C, ghist, group_bin, chunk_cut, cands, cap, chunk_max, chunk_sum, out_vals, out_ids
// 4 resident blocks per SM (<= 64 registers; shared memory allows 5): one wave for up to 528 rows (bs 35 at
// 15 depths) instead of 396 at the 80 registers the compiler picks unbounded, which left a tail wave at bs 32.
#define SELECT_MIN_BLOCKS 4
#define SELECT_KERNELS_W(SUFFIX, T, VEC, G, WIDE)                                                                \
  extern "C" __global__ void __launch_bounds__(S_THREADS, SELECT_MIN_BLOCKS) hist_select_logprobs_##SUFFIX(    \
      const T* logits, SELECT_ARGS, u32* row_range, int* err) {                                                 \
    hist_select<T, VEC, 0, G, WIDE>(logits, SELECT_PASS, nullptr, 0, row_range, err);                           \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(S_THREADS, SELECT_MIN_BLOCKS) hist_select_partials_##SUFFIX(    \
      const T* logits, SELECT_ARGS, double* out_lse, long long id_offset, u32* row_range, int* err) {           \
    hist_select<T, VEC, 1, G, WIDE>(logits, SELECT_PASS, out_lse, id_offset, row_range, err);                   \
  }
#define SELECT_KERNELS(SUFFIX, T, VEC, G)        \
  SELECT_KERNELS_W(SUFFIX, T, VEC, G, false)     \
  SELECT_KERNELS_W(wide_##SUFFIX, T, VEC, G, true)

SELECT_KERNELS(bf16_v8, unsigned short, 8, 1)
SELECT_KERNELS(bf16_v8_g2, unsigned short, 8, 2)
SELECT_KERNELS(bf16_v1, unsigned short, 1, 1)
SELECT_KERNELS(f32_v4, float, 4, 1)
SELECT_KERNELS(f32_v1, float, 1, 1)
