// The exact DDTree best-first tree for every request of a batch in one launch. Twin of
// reference.build_trees: bit-identical tokens, depths, parents, ranks, scores and pop order, ties included.
//
// One block per request (grid = bs, block = TREE_THREADS = 128; any multiple of 32 works). All threads stage
// the per-depth log-prob rows (only the first KS = min(K, budget + 1) ranks can ever be pushed) in shared
// memory; then warp 0 builds the tree while warps 1.. validate the whole [L, K] input (NaN, +inf, unsorted
// rows, negative ids: bits of an int32 flag, no host sync); then all threads write the padded outputs.
//
// Pop order is the reference's total order:
//     higher float64 score first; equal scores: the lexicographically smaller rank tuple (prefix smaller).
// Every pushed score is finite (a candidate is only pushed when its log-prob is finite, and sums of at most
// 31 finite float32 values cannot overflow a double), so the order is total for every input, also inputs
// that raise the error flag; the result is therefore independent of where a candidate is stored.
//
// The candidate set (<= budget + 1 entries: each pop removes one, adds at most two) is kept in shared
// memory as a packed array of slots 0..size-1; slot g belongs to lane g % 32 (index g = j * 32 + lane).
// Per slot: an order-preserving u64 key of the score (-0.0 mapped to +0.0, so keys are equal exactly when
// the scores compare equal), the float64 score and the packed (parent, rank, depth). Each lane caches the
// best of its own slots (key, slot, meta, score) and re-scans its slots only when they changed (at most
// three lanes per pop: the winner's, the lane that receives a second push, the lane a moved slot came from;
// a re-scan reads the lane's ceil(size / 32) keys four at a time, and walks rank tuples only on equal keys).
// A pop is then: __reduce_max_sync (redux.sync) over the cached keys' high words, a ballot of the lanes that
// hold that maximum; only when several lanes do, a second redux over the low words; only when several lanes
// still hold the same key (an exact score tie) the rank-tuple comparison among them. A rank tuple is never
// stored: two candidates' tuples are compared by walking their ancestor chains (per-node parent and rank in
// shared memory) up to the common ancestor. Within a lane, equal keys are ordered by the same walk.
// Each lane also precomputes the two children (next sibling, first child) of its cached best at the top of
// every pop, off the reduction's critical path; the winner's lane writes its sibling (or child) into the
// popped slot, a second push goes to slot `size` (its lane gets the child's score by shuffle), and a pop
// that pushes nothing moves the last slot into the hole.
//
// Scores use __dadd_rn / __dsub_rn in the reference's order (sibling = (score - S[d][r]) + S[d][r+1],
// child = score + S[d+1][0]); the module is also compiled with -fmad=false.

// Errors: ERR_LOGPROB_NAN, ERR_LOGPROB_POSINF, ERR_UNSORTED, ERR_NEGATIVE_ID of common.cuh.
#include "common.cuh"

#define FULL 0xffffffffu
#define MAX_NODES 1025  // root + MAX_BUDGET (1024)
#define MAX_SLOTS 1056  // candidate slots: budget + 1 <= 1025, rounded up to whole rows of 32 lanes

// candidate meta: parent (11 bits, <= 1024) | rank (10 bits, < 1024... K - 1 <= 1023) | depth (5 bits, <= 31)
__device__ __forceinline__ u32 pack(int parent, int rank, int depth) {
  return (u32)parent | ((u32)rank << 11) | ((u32)depth << 21);
}
__device__ __forceinline__ int meta_parent(u32 m) { return (int)(m & 0x7ffu); }
__device__ __forceinline__ int meta_rank(u32 m) { return (int)((m >> 11) & 0x3ffu); }
__device__ __forceinline__ int meta_depth(u32 m) { return (int)(m >> 21); }

// Order-preserving key of a (finite) double: a > b  <=>  key(a) > key(b); -0.0 and +0.0 share a key.
// Every finite score's key is > 0x000fffffffffffff, so key 0 marks an empty lane.
__device__ __forceinline__ u64 order_key(double s) {
  long long b = __double_as_longlong(s);
  if (b == (long long)0x8000000000000000ULL) b = 0;
  return (u64)(b ^ ((b >> 63) | (long long)0x8000000000000000ULL));
}

// Rank tuple of candidate a < rank tuple of candidate b? Position at depth d = (parent node, rank); the
// position of its ancestor at depth d-1 is the parent node's own (parent, rank).
__device__ __forceinline__ bool tuple_less(u32 a, u32 b, const short* node_parent, const short* node_rank) {
  int pa = meta_parent(a), ra = meta_rank(a), da = meta_depth(a);
  int pb = meta_parent(b), rb = meta_rank(b), db = meta_depth(b);
  const int da0 = da, db0 = db;
  while (da > db) { ra = node_rank[pa]; pa = node_parent[pa]; --da; }
  while (db > da) { rb = node_rank[pb]; pb = node_parent[pb]; --db; }
  if (pa == pb && ra == rb) return da0 < db0;  // one is a prefix of the other: the shorter is smaller
  while (pa != pb) {
    ra = node_rank[pa]; pa = node_parent[pa];
    rb = node_rank[pb]; pb = node_parent[pb];
  }
  return ra < rb;
}

// logprobs [bs, L, K] float32, token_ids [bs, L, K] int64 (both contiguous), root_tokens [bs] int64.
// Outputs [bs, N] (N = budget + 1): tokens/depths/parents/ranks int64, scores float64 (root and padding:
// token 0 (root: its token), depth 0, parent -1, rank -1, score 0); num_nodes [bs] int64.
// Dynamic shared memory: L * KS floats, KS = min(K, budget + 1).
extern "C" __global__ void __launch_bounds__(128) build_trees_kernel(
    const float* __restrict__ logprobs, const long long* __restrict__ token_ids,
    const long long* __restrict__ root_tokens, int L, int K, int budget, int KS, long long* __restrict__ tokens,
    long long* __restrict__ depths, long long* __restrict__ parents, long long* __restrict__ ranks,
    double* __restrict__ scores, long long* __restrict__ num_nodes, int* __restrict__ err) {
  extern __shared__ float S[];  // [L][KS]
  __shared__ u64 slot_key[MAX_SLOTS];
  __shared__ double slot_score[MAX_SLOTS];
  __shared__ u32 slot_meta[MAX_SLOTS];
  __shared__ double node_score[MAX_NODES];
  __shared__ short node_parent[MAX_NODES];
  __shared__ short node_rank[MAX_NODES];
  __shared__ signed char node_depth[MAX_NODES];
  __shared__ int s_nodes;

  const int tid = threadIdx.x, nthreads = blockDim.x, b = blockIdx.x;
  const int lane = tid & 31;
  const int N = budget + 1;
  const float* lp = logprobs + (long long)b * L * K;
  const long long* ids = token_ids + (long long)b * L * K;

  // Stage the usable ranks (all threads; independent loads).
  const int staged = L * KS;
#pragma unroll 4
  for (int i = tid; i < staged; i += nthreads) {
    const int d = i / KS, k = i - d * KS;
    S[i] = lp[d * K + k];
  }
  if (tid == 0) {
    node_parent[0] = -1;
    node_rank[0] = 0;
    node_depth[0] = 0;
    node_score[0] = 0.0;
    s_nodes = 0;
  }
  __syncthreads();

  if (tid < 32) {
    // ---------------- warp 0: the best-first tree ----------------
    int n = 0, size = 0;
    // cached best of this lane's slots; key 0 = no slot
    u64 bkey = 0;
    int bj = 0;
    u32 bmeta = pack(0, 0, 1);
    double bscore = 0.0;

    // (re)scan this lane's slots g = lane + 32 j < size
    auto rescan = [&](int sz) {
      const int jc = (sz - lane + 31) >> 5;
      // Fast pass: the largest key and its first slot, 4 independent loads at a time; `tie` records whether
      // another slot holds that same key (an exact score tie inside the lane: ordered by rank tuple below).
      u64 k0 = 0;
      int j0 = -1;
      bool tie = false;
      int j = 0;
      for (; j + 4 <= jc; j += 4) {
        u64 k[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) k[t] = slot_key[(j + t) * 32 + lane];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          tie = k[t] > k0 ? false : (tie || k[t] == k0);
          if (k[t] > k0) {
            k0 = k[t];
            j0 = j + t;
          }
        }
      }
      for (; j < jc; ++j) {
        const u64 k = slot_key[j * 32 + lane];
        tie = k > k0 ? false : (tie || k == k0);
        if (k > k0) {
          k0 = k;
          j0 = j;
        }
      }
      if (tie) {  // rare: several slots of this lane share the best key
        u32 m0 = slot_meta[j0 * 32 + lane];
        for (int jj = j0 + 1; jj < jc; ++jj) {
          if (slot_key[jj * 32 + lane] != k0) continue;
          const u32 m = slot_meta[jj * 32 + lane];
          if (tuple_less(m, m0, node_parent, node_rank)) {
            j0 = jj;
            m0 = m;
          }
        }
      }
      bkey = k0;
      if (j0 >= 0) {
        bj = j0;
        bmeta = slot_meta[j0 * 32 + lane];
        bscore = slot_score[j0 * 32 + lane];
      } else {
        bj = 0;
        bmeta = pack(0, 0, 1);  // any in-range position: the children below stay in bounds
        bscore = 0.0;
      }
    };

    if (budget > 0 && L > 0 && isfinite((double)S[0])) {
      if (lane == 0) {
        const double s0 = (double)S[0];
        slot_key[0] = order_key(s0);
        slot_score[0] = s0;
        slot_meta[0] = pack(0, 0, 1);
        rescan(1);
      }
      size = 1;
    }
    __syncwarp();

    while (size > 0 && n < budget) {
      // Warp argmax of the cached keys: high words, then (only if several lanes share it) low words.
      const u32 hi = (u32)(bkey >> 32), lo = (u32)bkey;
      const u32 mhi = __reduce_max_sync(FULL, hi);

      // Children of this lane's cached best (every lane; only the winner's are used). Independent of the
      // reduction above, so their shared loads and float64 math overlap its latency.
      const int cd = meta_depth(bmeta), cr = meta_rank(bmeta);
      const float* row = S + (cd - 1) * KS;
      const double cur = (double)row[cr];
      const bool has_next = cr + 1 < K && cr + 1 < KS;  // rank KS (only if KS < K) can never be popped
      const double nxt = (double)row[has_next ? cr + 1 : cr];
      const bool has_first = cd < L;
      const double first = (double)S[has_first ? cd * KS : 0];
      const bool sib_ok = has_next && isfinite(nxt);
      const bool child_ok = has_first && isfinite(first);
      const double sib_score = __dadd_rn(__dsub_rn(bscore, cur), nxt);
      const double child_score = __dadd_rn(bscore, first);

      u32 mask = __ballot_sync(FULL, hi == mhi);
      if (mask & (mask - 1)) {
        const u32 mlo = __reduce_max_sync(FULL, hi == mhi ? lo : 0u);
        mask = __ballot_sync(FULL, hi == mhi && lo == mlo);
        if (mask & (mask - 1)) {
          // Exact score tie across lanes: the smallest rank tuple among them (uniform walk, all lanes).
          int win = __ffs(mask) - 1;
          u32 wm = __shfl_sync(FULL, bmeta, win);
          u32 rest = mask & (mask - 1);
          while (rest) {
            const int l = __ffs(rest) - 1;
            rest &= rest - 1;
            const u32 m = __shfl_sync(FULL, bmeta, l);
            if (tuple_less(m, wm, node_parent, node_rank)) {
              win = l;
              wm = m;
            }
          }
          mask = 1u << win;
        }
      }
      const int w = __ffs(mask) - 1;
      const u32 wmeta = __shfl_sync(FULL, bmeta, w);
      const u32 flags = __shfl_sync(FULL, (sib_ok ? 1u : 0u) | (child_ok ? 2u : 0u), w);
      const double wchild = __shfl_sync(FULL, child_score, w);
      const bool w_sib = flags & 1u, w_child = flags & 2u;
      const int parent = meta_parent(wmeta), rank = meta_rank(wmeta), depth = meta_depth(wmeta);
      ++n;
      const u32 child_meta = pack(n, 0, depth + 1);

      bool dirty = lane == w;
      int new_size = size;
      if (lane == w) {
        node_parent[n] = (short)parent;
        node_rank[n] = (short)rank;
        node_depth[n] = (signed char)depth;
        node_score[n] = bscore;
        const int gw = bj * 32 + lane;  // the popped slot
        if (w_sib) {
          slot_key[gw] = order_key(sib_score);
          slot_score[gw] = sib_score;
          slot_meta[gw] = pack(parent, rank + 1, depth);
        } else if (w_child) {
          slot_key[gw] = order_key(child_score);
          slot_score[gw] = child_score;
          slot_meta[gw] = child_meta;
        } else if (gw != size - 1) {  // nothing pushed: move the last slot into the hole
          slot_key[gw] = slot_key[size - 1];
          slot_score[gw] = slot_score[size - 1];
          slot_meta[gw] = slot_meta[size - 1];
        }
      }
      if (w_sib && w_child) {  // second push: slot `size`, owned by lane size % 32
        if (lane == (size & 31)) {
          slot_key[size] = order_key(wchild);
          slot_score[size] = wchild;
          slot_meta[size] = child_meta;
          dirty = true;
        }
        new_size = size + 1;
      } else if (!w_sib && !w_child) {
        if (lane == ((size - 1) & 31)) dirty = true;  // lost its last slot
        new_size = size - 1;
      }
      size = new_size;
      __syncwarp();  // node n and the moved slot are visible to every lane before any tuple walk
      if (dirty) rescan(size);
    }
    if (lane == 0) s_nodes = n;
  }

  // ---------------- validation of the whole input (the reference checks every entry) ----------------
  // Warps 1.. while warp 0 builds the tree; a single-warp block validates after it.
  if (nthreads == 32 || tid >= 32) {
    const int vt = nthreads == 32 ? tid : tid - 32, vn = nthreads == 32 ? 32 : nthreads - 32;
    int bad = 0;
    const int total = L * K;
#pragma unroll 4
    for (int i = vt; i < total; i += vn) {
      const float x = lp[i];
      if (x != x) bad |= ERR_LOGPROB_NAN;
      else if (x == INFINITY) bad |= ERR_LOGPROB_POSINF;
      const int k = i % K;
      if (k + 1 < K && (double)lp[i + 1] > (double)x) bad |= ERR_UNSORTED;
      if (ids[i] < 0) bad |= ERR_NEGATIVE_ID;
    }
    if (bad) atomicOr(err, bad);
  }
  __syncthreads();

  // Cooperative write-out of the finished tree, padded to N rows.
  const int n = s_nodes;
  const long long row = (long long)b * N;
  for (int i = tid; i < N; i += nthreads) {
    if (i == 0) {
      tokens[row] = root_tokens[b];
      depths[row] = 0;
      parents[row] = -1;
      ranks[row] = -1;
      scores[row] = 0.0;
    } else if (i <= n) {
      const int d = node_depth[i], r = node_rank[i];
      tokens[row + i] = ids[(d - 1) * K + r];
      depths[row + i] = d;
      parents[row + i] = node_parent[i];
      ranks[row + i] = r;
      scores[row + i] = node_score[i];
    } else {
      tokens[row + i] = 0;
      depths[row + i] = 0;
      parents[row + i] = -1;
      ranks[row + i] = -1;
      scores[row + i] = 0.0;
    }
  }
  if (tid == 0) num_nodes[b] = n;
}
