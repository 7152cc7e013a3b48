// The exact DDTree best-first tree for every request of a batch in one launch. Twin of
// reference.build_trees: bit-identical tokens, depths, parents, ranks, scores and pop order, ties included.
//
// One block per request (grid = bs, block = TREE_THREADS = 128; any multiple of 32 works). All threads stage
// the per-depth log-prob rows (only the first KS = min(K, budget + 1) ranks can ever be pushed) in shared
// memory; then warp 0 builds the tree while warps 1.. validate the whole [L, K] input (NaN, +inf, unsorted
// rows, negative ids: bits of an int32 flag, no host sync); then all threads write the padded outputs. The
// sorted-list kernels (below) also come fused with the verify inputs (build_trees_verify_list1/2/4, further below).
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
#include "verify_common.cuh"  // the fused kernels' FULL_MASK; includes common.cuh

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

// Stage the usable ranks of one request's [L, K] log-probs as S[L][KS] floats for the slot kernel (all threads;
// independent loads); the list kernels stage padded doubles (stage_rows_padded).
__device__ __forceinline__ void stage_rows(float* S, const float* lp, int L, int K, int KS) {
  const int staged = L * KS;
#pragma unroll 4
  for (int i = threadIdx.x; i < staged; i += blockDim.x) {
    const int d = i / KS, k = i - d * KS;
    S[i] = lp[d * K + k];
  }
}

// Node 0 (the root) of the node arrays, and no node popped yet (thread 0, before the block's first barrier).
__device__ __forceinline__ void init_root(short* node_parent, short* node_rank, signed char* node_depth,
                                          double* node_score, int* s_nodes) {
  node_parent[0] = -1;
  node_rank[0] = 0;
  node_depth[0] = 0;
  node_score[0] = 0.0;
  *s_nodes = 0;
}

// Validation of the whole input (the reference checks every entry): warps 1.. while warp 0 builds the tree; a
// block of one warp validates with it after the tree.
__device__ __forceinline__ void validate_rows(const float* lp, const long long* ids, int L, int K, int* err) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  if (nthreads <= 32 || tid >= 32) {
    const int vt = nthreads <= 32 ? tid : tid - 32, vn = nthreads <= 32 ? 32 : nthreads - 32;
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
}

// Cooperative write-out of the finished tree of n nodes, padded to N rows (after a __syncthreads).
// node(i) gives node i's (depth, rank, parent) as an int3 (x, y, z).
// With `rows` (the fused kernels: verify_inputs.cu's per-row outputs) also each row's input id (its token), position
// (P + depth) and retrieve index.
struct VerifyRows {
  long long *input_ids, *positions, *retrieve_index;
  long long P;
};
template <typename Node>
__device__ __forceinline__ void write_tree(int b, int N, int n, const long long* ids, int K,
                                           const long long* __restrict__ root_tokens, Node node,
                                           const double* node_score, long long* __restrict__ tokens,
                                           long long* __restrict__ depths, long long* __restrict__ parents,
                                           long long* __restrict__ ranks, double* __restrict__ scores,
                                           long long* __restrict__ num_nodes, const VerifyRows* rows = nullptr) {
  const int tid = threadIdx.x;
  const long long row = (long long)b * N;
  for (int i = tid; i < N; i += blockDim.x) {
    long long tok = 0;
    int d = 0;
    if (i == 0) {
      tok = root_tokens[b];
      parents[row] = -1;
      ranks[row] = -1;
      scores[row] = 0.0;
    } else if (i <= n) {
      const int3 v = node(i);
      const int r = v.y;
      d = v.x;
      tok = ids[(d - 1) * K + r];
      parents[row + i] = v.z;
      ranks[row + i] = r;
      scores[row + i] = node_score[i];
    } else {
      parents[row + i] = -1;
      ranks[row + i] = -1;
      scores[row + i] = 0.0;
    }
    tokens[row + i] = tok;
    depths[row + i] = d;
    if (rows != nullptr) {
      rows->input_ids[row + i] = tok;
      rows->positions[row + i] = rows->P + d;
      rows->retrieve_index[row + i] = row + i;
    }
  }
  if (tid == 0) num_nodes[b] = n;
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

  const int tid = threadIdx.x, b = blockIdx.x;
  const int lane = tid & 31;
  const int N = budget + 1;
  const float* lp = logprobs + (long long)b * L * K;
  const long long* ids = token_ids + (long long)b * L * K;

  stage_rows(S, lp, L, K, KS);
  if (tid == 0) init_root(node_parent, node_rank, node_depth, node_score, &s_nodes);
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

  validate_rows(lp, ids, L, K, err);
  __syncthreads();
  write_tree(b, N, s_nodes, ids, K, root_tokens,
             [&](int i) { return make_int3(node_depth[i], node_rank[i], node_parent[i]); }, node_score, tokens,
             depths, parents, ranks, scores, num_nodes);
}

// ---------------------------------------------------------------------------------------------------
// The sorted-list variant, for budget <= 64 * J (J = 1, 2, 4; 32 * J list positions): the same contract, arguments,
// outputs, error bits and launch shape as build_trees_kernel, and the same pop order (the order is total, so any
// exact priority queue reproduces it). Dynamic shared memory: L * (KS + 1) + 1 doubles.
//
// The log-probs are staged widened to double (exact) in rows of KS + 1: column KS, one entry after the last row, and
// every non-finite input hold -inf. The reference pushes a candidate only when its log-prob is finite; here such a
// candidate gets the score -inf, which marks "not pushed" (below every finite score, never popped). So a pop reads
// its next sibling's and its first child's log-probs with no bounds or finiteness tests.
//
// A candidate (and a node) is one u32 `meta`: the byte offset of its own log-prob in the staged rows (16 bits), its
// depth (5 bits), its parent node (11 bits). The next sibling's meta is meta + 8; the first child's is
// (8 * depth * (KS + 1), depth + 1, n).
//
// Warp 0 keeps the candidates as one list sorted best first, position p = j * 32 + lane in register j of that
// lane: the float64 score (-inf = empty) and the meta. The head (position 0) is known to every lane. A pop writes the
// head as node n, computes its sibling and first child (sibling = (score - S[d][r]) + S[d][r+1], child = score +
// S[d+1][0]), orders the two (a before b; on equal scores the child, whose rank tuple is the head's plus (0,) and so
// smaller than the sibling's), counts with two ballots per register how many old positions q >= 1 are better than
// a (pa) and than b (pb), and rebuilds every position at once:
//     new[i] = old[i+1] (i < pa), a (i == pa), old[i] (pa < i <= pb), b (i == pb + 1), old[i-1] (i > pb + 1).
// The next head is a (pa == 0) or old[1].
//
// The pop loop is one warp's dependent chain (head -> log-prob loads -> float64 sums -> ballots -> next head), so
// what does not depend on the head is issued first: old[1] and both neighbours' entries for the rebuild are shuffled
// at the top of the pop. Scores compare as doubles (equal exactly when the reference's do; -0.0 == +0.0). Exact
// score ties between an old position and a or b (rare) take the rank-tuple walk after a __syncwarp that publishes
// node n, and its ballots replace the untied ones.
//
// Only C = 32 * J positions are kept; what shifts past the end is dropped. That is exact for budget <= 2 * C =
// 64 * J: after n pops the list holds at most n + 1 candidates, so something is dropped only when n + 1 > C; a
// dropped candidate has C candidates ahead of it, all popped before it, so it could only be popped if more than
// C pops remained, budget - n > C. Both need budget > 2 * C. Larger budgets take build_trees_kernel.
// (tests/test_tree_list_bound.py checks this bound on a CPU model of the list.)
// ---------------------------------------------------------------------------------------------------

#define LM_DEPTH_SHIFT 16
#define LM_PARENT_SHIFT 21
// byte offset < 2^16 (8 * (L * (KS + 1) + 1) <= 8 * (31 * 258 + 1)), depth <= 31, parent <= 256
__device__ __forceinline__ u32 lm_pack(int off, int depth, int parent) {
  return (u32)off | ((u32)depth << LM_DEPTH_SHIFT) | ((u32)parent << LM_PARENT_SHIFT);
}
__device__ __forceinline__ int lm_off(u32 m) { return (int)(m & 0xffffu); }
__device__ __forceinline__ int lm_depth(u32 m) { return (int)((m >> LM_DEPTH_SHIFT) & 31u); }
__device__ __forceinline__ int lm_parent(u32 m) { return (int)(m >> LM_PARENT_SHIFT); }

// tuple_less for list metas: a position at depth d is (parent node, staged offset), and staged offsets of one row
// order like ranks.
__device__ __forceinline__ bool meta_tuple_less(u32 a, u32 b, const u32* node_meta) {
  int pa = lm_parent(a), oa = lm_off(a), da = lm_depth(a);
  int pb = lm_parent(b), ob = lm_off(b), db = lm_depth(b);
  const int da0 = da, db0 = db;
  while (da > db) { const u32 m = node_meta[pa]; oa = lm_off(m); pa = lm_parent(m); --da; }
  while (db > da) { const u32 m = node_meta[pb]; ob = lm_off(m); pb = lm_parent(m); --db; }
  if (pa == pb && oa == ob) return da0 < db0;  // one is a prefix of the other: the shorter is smaller
  while (pa != pb) {
    const u32 ma = node_meta[pa], mb = node_meta[pb];
    oa = lm_off(ma); pa = lm_parent(ma);
    ob = lm_off(mb); pb = lm_parent(mb);
  }
  return oa < ob;
}

// Stage one request's usable log-probs as S[L][KS + 1] doubles plus one entry, -inf where described above: a warp
// per row (no index division), every load of a thread issued before its stores.
__device__ __forceinline__ void stage_rows_padded(double* S, const float* lp, int L, int K, int KS) {
  const int stride = KS + 1, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int d = threadIdx.x >> 5; d < L; d += warps) {
    const float* src = lp + d * K;
    double* dst = S + d * stride;
    for (int k0 = 0; k0 <= KS; k0 += 128) {
      float x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int k = k0 + u * 32 + lane;
        x[u] = k < KS ? src[k] : -INFINITY;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int k = k0 + u * 32 + lane;
        if (k <= KS) dst[k] = isfinite(x[u]) ? (double)x[u] : -INFINITY;
      }
    }
  }
  if (threadIdx.x == 0) S[L * stride] = -INFINITY;
}

// A value the compiler must keep in a register: it cannot recompute it inside the pop loop (ptxas otherwise re-reads
// the thread index every pop).
__device__ __forceinline__ u32 opaque(u32 x) {
  asm volatile("" : "+r"(x));
  return x;
}
// Shared-memory addresses (32-bit, shared window) read back from shared memory with volatile loads: ptxas keeps them
// in registers instead of rebuilding them from the CTA's window base (S2R + LEA) ahead of every pop's staged loads.
// `slots` (3 words) is scratch that nothing reads before the second __syncwarp.
__device__ __forceinline__ void shared_addrs_kept(const void* p0, const void* p1, const void* p2, u32* slots,
                                                  u32& a0, u32& a1, u32& a2) {
  slots[0] = (u32)__cvta_generic_to_shared(p0);
  slots[1] = (u32)__cvta_generic_to_shared(p1);
  slots[2] = (u32)__cvta_generic_to_shared(p2);
  __syncwarp();
  const u32 s = (u32)__cvta_generic_to_shared(slots);
  asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(a0) : "r"(s));
  asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(a1) : "r"(s + 4u));
  asm volatile("ld.volatile.shared.u32 %0, [%1];" : "=r"(a2) : "r"(s + 8u));
  __syncwarp();
}

__device__ __forceinline__ double lds_f64(u32 addr) {
  double v;
  asm("ld.shared.f64 %0, [%1];" : "=d"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_node(u32 meta_addr, u32 meta, u32 score_addr, double score) {
  asm volatile("st.shared.u32 [%0], %1;\n\tst.shared.f64 [%2], %3;" ::"r"(meta_addr), "r"(meta), "r"(score_addr),
               "d"(score) : "memory");
}

template <int J>
__device__ __forceinline__ int list_tree(const double* S, int L, int stride, int budget, u32* node_meta,
                                         double* node_score) {
  const int stride8 = 8 * stride;
  const int lane = (int)opaque(threadIdx.x & 31);
  u32 s_base, meta_base, score_base;  // node_score[0..1] (the root's, never read): scratch for three words
  shared_addrs_kept(S, node_meta, node_score, reinterpret_cast<u32*>(node_score), s_base, meta_base, score_base);
  double sc[J];  // position j * 32 + lane: score (-inf = empty), meta
  u32 mt[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    sc[j] = -INFINITY;
    mt[j] = 0u;
  }
  double hs = -INFINITY;  // the head (position 0), uniform
  u32 hm = 0u;
  if (budget > 0 && L > 0 && S[0] > -INFINITY) {
    hs = S[0];
    hm = lm_pack(0, 1, 0);
    if (lane == 0) {
      sc[0] = hs;
      mt[0] = hm;
    }
  }
  const int next_lane = (int)opaque((lane + 1) & 31), prev_lane = (int)opaque((lane + 31) & 31);
  int n = 0;
  while (hs > -INFINITY && n < budget) {
    // Off the head's chain: old[1] (lane 1, register 0: the next head unless a is better) and, for the rebuild,
    // old[i+1] from the next lane (lane 31: register j+1's lane 0) and old[i-1] from the previous lane (lane 0:
    // register j-1's lane 31).
    const double o1s = __shfl_sync(FULL, sc[0], 1);
    const u32 o1m = __shfl_sync(FULL, mt[0], 1);
    double dn_s[J], up_s[J];
    u32 dn_m[J], up_m[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
      if (J == 1) {  // no neighbour register: shifts within the warp (lanes 31 and 0 never take them, below)
        dn_s[j] = __shfl_down_sync(FULL, sc[j], 1);
        dn_m[j] = __shfl_down_sync(FULL, mt[j], 1);
        up_s[j] = __shfl_up_sync(FULL, sc[j], 1);
        up_m[j] = __shfl_up_sync(FULL, mt[j], 1);
      } else {
        dn_s[j] = __shfl_sync(FULL, sc[j], next_lane);
        dn_m[j] = __shfl_sync(FULL, mt[j], next_lane);
        up_s[j] = __shfl_sync(FULL, sc[j], prev_lane);
        up_m[j] = __shfl_sync(FULL, mt[j], prev_lane);
      }
    }

    ++n;
    sts_node(meta_base + 4u * n, hm, score_base + 8u * n, hs);  // every lane: the same values, the same addresses
    const int depth = lm_depth(hm), first_off = depth * stride8;
    const u32 a_off = s_base + (hm & 0xffffu);
    const double cur = lds_f64(a_off), nxt = lds_f64(a_off + 8u), first = lds_f64(s_base + first_off);
    const double ss = __dadd_rn(__dsub_rn(hs, cur), nxt);  // -inf: no next sibling
    const double cs = __dadd_rn(hs, first);                 // -inf: no first child
    const u32 sm = hm + 8u, cm = lm_pack(first_off, depth + 1, n);
    const bool child_first = cs >= ss;
    const double as = child_first ? cs : ss, bsc = child_first ? ss : cs;
    const u32 ma = child_first ? cm : sm, mb = child_first ? sm : cm;

    // Old positions q >= 1 better than a / than b (a prefix of the list each): pa and pb. Exact score ties (rare)
    // are decided by the rank-tuple walk after the untied rebuild, which they then redo.
    bool tie = false;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const bool live = j > 0 || lane > 0;  // position 0 is the popped head
      tie = tie | (live & (sc[j] > -INFINITY) & ((sc[j] == as) | (sc[j] == bsc)));
    }
    const bool any_tie = __any_sync(FULL, tie);
    int pa = 0, pb = 0;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const bool live = j > 0 || lane > 0;
      pa += __popc(__ballot_sync(FULL, live & (sc[j] > as)));
      pb += __popc(__ballot_sync(FULL, live & (sc[j] > bsc)));
    }
    double nsc[J];
    u32 nmt[J];
    auto rebuild = [&]() {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int i = j * 32 + lane;
        // Lane 31 of register j takes old[i+1] from lane 0 of register j+1, lane 0 of register j takes old[i-1]
        // from lane 31 of register j-1. The last position never takes old[i+1] (i < pa <= C - 1) and position 0
        // never takes old[i-1] (0 > pb + 1), so their values there do not matter.
        const int jn = j + 1 < J ? j + 1 : j, jp = j > 0 ? j - 1 : 0;
        const double ns = J > 1 && lane == 31 ? dn_s[jn] : dn_s[j];
        const u32 nm = J > 1 && lane == 31 ? dn_m[jn] : dn_m[j];
        const double ps = J > 1 && lane == 0 ? up_s[jp] : up_s[j];
        const u32 pm = J > 1 && lane == 0 ? up_m[jp] : up_m[j];
        // i < pa: old[i+1]; i == pa: a; pa < i <= pb: old[i]; i == pb + 1: b; i > pb + 1: old[i-1]
        const bool take_next = i < pa, keep = i > pa && i <= pb, take_prev = i > pb + 1;
        double s_new = take_next ? ns : take_prev ? ps : keep ? sc[j] : 0.0;
        u32 m_new = take_next ? nm : take_prev ? pm : keep ? mt[j] : 0u;
        nsc[j] = i == pa ? as : i == pb + 1 ? bsc : s_new;
        nmt[j] = i == pa ? ma : i == pb + 1 ? mb : m_new;
      }
    };
    rebuild();
    if (any_tie) {  // the smaller rank tuple is better
      __syncwarp();  // node n (the child's parent) is visible to every lane's walk
      pa = pb = 0;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const bool live = (j > 0 || lane > 0) && sc[j] > -INFINITY;
        bool ga = live && sc[j] > as, gb = live && sc[j] > bsc;
        if (live && sc[j] == as) ga = meta_tuple_less(mt[j], ma, node_meta);
        if (live && sc[j] == bsc) gb = meta_tuple_less(mt[j], mb, node_meta);
        pa += __popc(__ballot_sync(FULL, ga));
        pb += __popc(__ballot_sync(FULL, gb));
      }
      rebuild();
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      sc[j] = nsc[j];
      mt[j] = nmt[j];
    }
    hs = pa == 0 ? as : o1s;
    hm = pa == 0 ? ma : o1m;
  }
  return n;
}

// ---------------------------------------------------------------------------------------------------
// The fused tree + verify kernels (build_trees_verify_list1/2/4): build_trees_list<J> and, in the same launch, the
// verify inputs of the tree it builds (verify_inputs.cu's outputs, layout and padding; twin: reference.verify_inputs
// of the tree). The pop loop is the plain kernels'; after the block's barrier all threads derive the verify inputs
// from the nodes' metas (node i's parent, depth and staged offset) in parallel:
//   - a thread per row walks the row's ancestor chain (parents < i, depth <= 31) and writes its ancestor-or-self
//     words, highest first (the chain decreases), to ancestor_bits and to shared memory (`anc`);
//   - a thread per node finds its next sibling, the first later node with its parent (reference.verify_inputs'
//     last_child rule gives the same: a parent's children are popped in rank order), and a rank-0 node is its
//     parent's first child;
//   - after a second barrier, a warp per row writes the tree columns of its FULL_MASK row from `anc`, and a thread
//     per row the links;
// and write_tree also writes each row's input id (its token), position (P + depth) and retrieve index. Blocks y >= 1
// of the grid fill the FULL_MASK prefix columns meanwhile.
// ---------------------------------------------------------------------------------------------------

// The verify outputs (verify_inputs.cu's arguments).
struct VerifyOut {
  const long long* seq_lens;
  long long *input_ids, *positions, *retrieve_index, *next_token, *next_sibling;
  u32* ancestor_bits;
  unsigned char* full_mask;
};

// Blocks y >= 1 (gridDim.y - 1 of them per request): the True prefix columns of request b's FULL_MASK rows, a warp
// per row, while block y = 0 builds the tree.
__device__ __forceinline__ void fill_prefix_rows(const VerifyOut& vo, int b, int N) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const long long P = vo.seq_lens[b];
  unsigned char* base = vo.full_mask + (long long)N * N * b + (long long)N * warp_sum_before(vo.seq_lens, b);
  for (int i = ((int)blockIdx.y - 1) * nw + warp; i < N; i += ((int)gridDim.y - 1) * nw)
    fill_ones(base + (long long)i * (P + N), P, lane);
}

// Block 0's verify inputs of the n-node tree (after the barrier that follows the pops; see above): ancestor words and
// links, into shared memory too. anc: N * W words of shared memory; first / next: N ints each, -1 (set before that
// barrier).
__device__ __forceinline__ void write_verify_rows(const VerifyOut& vo, int b, int N, int W, int n, int stride,
                                                  const u32* node_meta, u32* anc, int* first, int* next) {
  const int tid = threadIdx.x;
  const long long row = (long long)b * N;
  u32* anc_out = vo.ancestor_bits + row * W;
  for (int i = tid; i < N; i += blockDim.x) {
    // ancestor-or-self words (padding rows: itself only; the root (x = 0) and padding rows end the chain, at most
    // 32 nodes: depth <= 31)
    ancestor_words(i, W, 32, [&](int x) { return (x >= 1 && x <= n) ? lm_parent(node_meta[x]) : -1; },
                   [&](int w, u32 word) { anc[i * W + w] = anc_out[i * W + w] = word; });
    if (i >= 1 && i <= n) {
      const u32 m = node_meta[i];
      const int p = lm_parent(m), d = lm_depth(m);
      if ((lm_off(m) >> 3) == (d - 1) * stride) first[p] = i;  // rank 0: its parent's first child
      int sib = -1;  // four independent loads per step
      for (int j0 = i + 1; j0 <= n && sib < 0; j0 += 4) {
#pragma unroll
        for (int u = 3; u >= 0; --u)
          if (j0 + u <= n && lm_parent(node_meta[j0 + u]) == p) sib = j0 + u;
      }
      next[i] = sib;
    }
  }
}

// The tree columns of the FULL_MASK rows, a warp per row (byte j: bit j of word j / 32: lane `lane` writes bit `lane`
// of each word), and the links; after the barrier that follows write_verify_rows. The row's words are read first
// (shared loads: global stores through a generic pointer would otherwise hold them back), WMAX of them at most.
template <int WMAX>
__device__ __forceinline__ void write_verify_mask(const VerifyOut& vo, int b, int N, int W, long long P,
                                                  const u32* anc, const int* first, const int* next) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const long long row = (long long)b * N;
  unsigned char* base = vo.full_mask + (long long)N * N * b + (long long)N * warp_sum_before(vo.seq_lens, b) + P;
  for (int i = warp; i < N; i += nw) {
    u32 wd[WMAX];
#pragma unroll
    for (int w = 0; w < WMAX; ++w) wd[w] = w < W ? anc[i * W + w] : 0u;
    unsigned char* mrow = base + (long long)i * (P + N);
#pragma unroll
    for (int w = 0; w < WMAX; ++w)
      if (w * 32 + lane < N) mrow[w * 32 + lane] = (unsigned char)((wd[w] >> lane) & 1u);
  }
  for (int i = tid; i < N; i += blockDim.x) {
    vo.next_token[row + i] = first[i];
    vo.next_sibling[row + i] = next[i];
  }
}

template <int J, bool V>
__device__ __forceinline__ void build_trees_list(
    const float* __restrict__ logprobs, const long long* __restrict__ token_ids,
    const long long* __restrict__ root_tokens, int L, int K, int budget, int KS, long long* __restrict__ tokens,
    long long* __restrict__ depths, long long* __restrict__ parents, long long* __restrict__ ranks,
    double* __restrict__ scores, long long* __restrict__ num_nodes, int* __restrict__ err,
    const VerifyOut& vo = VerifyOut{}) {
  extern __shared__ double S_list[];  // [L][KS + 1] + 1 (the dynamic shared memory; a name of its own: S is extern "C")
  double* S = S_list;
  __shared__ double node_score[64 * J + 1];
  __shared__ u32 node_meta[64 * J + 1];
  __shared__ int s_nodes;
  constexpr int NMAX = 64 * J + 1, WMAX = (NMAX + 31) / 32;
  __shared__ u32 anc[V ? NMAX * WMAX : 1];  // V: each row's ancestor-or-self words
  __shared__ int first[V ? NMAX : 1], next[V ? NMAX : 1];

  const int tid = threadIdx.x, b = blockIdx.x, stride = KS + 1;
  const int N = budget + 1;
  pdl_wait();  // launched after the top-K as a dependent launch (runtime.launch): its outputs from here on
  if (V && blockIdx.y > 0) {
    fill_prefix_rows(vo, b, N);
    return;
  }
  const float* lp = logprobs + (long long)b * L * K;
  const long long* ids = token_ids + (long long)b * L * K;
  long long P = 0;
  if (V) {
    P = vo.seq_lens[b];
    for (int i = tid; i < N; i += blockDim.x) first[i] = next[i] = -1;
  }
  stage_rows_padded(S, lp, L, K, KS);
  if (tid == 0) s_nodes = 0;
  __syncthreads();
  if (tid < 32) {
    const int n = list_tree<J>(S, L, stride, budget, node_meta, node_score);
    if (tid == 0) s_nodes = n;
  }
  validate_rows(lp, ids, L, K, err);
  __syncthreads();
  if (V) write_verify_rows(vo, b, N, (N + 31) >> 5, s_nodes, stride, node_meta, anc, first, next);
  const VerifyRows rows{vo.input_ids, vo.positions, vo.retrieve_index, P};
  write_tree(b, N, s_nodes, ids, K, root_tokens,
             [&](int i) {
               const u32 m = node_meta[i];
               const int d = lm_depth(m);
               return make_int3(d, (lm_off(m) >> 3) - (d - 1) * stride, lm_parent(m));
             },
             node_score, tokens, depths, parents, ranks, scores, num_nodes, V ? &rows : nullptr);
  if (V) {
    __syncthreads();  // every row's words and links
    write_verify_mask<WMAX>(vo, b, N, (N + 31) >> 5, P, anc, first, next);
  }
}

// build_trees_list<J> for budget <= 64 * J; the arguments of build_trees_kernel.
#define LIST_KERNEL(J)                                                                                              \
  extern "C" __global__ void __launch_bounds__(128, 1) build_trees_list##J(                                      \
      const float* __restrict__ logprobs, const long long* __restrict__ token_ids,                               \
      const long long* __restrict__ root_tokens, int L, int K, int budget, int KS, long long* __restrict__ tokens, \
      long long* __restrict__ depths, long long* __restrict__ parents, long long* __restrict__ ranks,            \
      double* __restrict__ scores, long long* __restrict__ num_nodes, int* __restrict__ err) {                   \
    build_trees_list<J, false>(logprobs, token_ids, root_tokens, L, K, budget, KS, tokens, depths, parents, ranks, \
                               scores, num_nodes, err);                                                          \
  }
LIST_KERNEL(1)
LIST_KERNEL(2)
LIST_KERNEL(4)

// The fused tree + verify kernels: build_trees_list<J>'s arguments, then verify_inputs.cu's but fill_prefix (seq_lens
// [bs] int64 and its outputs); grid (bs, 1 + F): the F fill blocks per request write the FULL_MASK prefix columns,
// F = 0 leaves them alone (the launcher's fill_prefix off; on: one FULL_MASK row per warp of the fill blocks); block
// shape and shared memory as build_trees_list<J>'s.
#define LIST_VERIFY_KERNEL(J)                                                                                       \
  extern "C" __global__ void __launch_bounds__(128, 1) build_trees_verify_list##J(                               \
      const float* __restrict__ logprobs, const long long* __restrict__ token_ids,                               \
      const long long* __restrict__ root_tokens, int L, int K, int budget, int KS, long long* __restrict__ tokens, \
      long long* __restrict__ depths, long long* __restrict__ parents, long long* __restrict__ ranks,            \
      double* __restrict__ scores, long long* __restrict__ num_nodes, int* __restrict__ err,                     \
      const long long* __restrict__ seq_lens, long long* __restrict__ input_ids,                                \
      long long* __restrict__ positions, u32* __restrict__ ancestor_bits, long long* __restrict__ retrieve_index, \
      long long* __restrict__ next_token, long long* __restrict__ next_sibling,                                  \
      unsigned char* __restrict__ full_mask) {                                                                   \
    const VerifyOut vo{seq_lens, input_ids, positions, retrieve_index, next_token, next_sibling,                 \
                       ancestor_bits, full_mask};                                                                \
    build_trees_list<J, true>(logprobs, token_ids, root_tokens, L, K, budget, KS, tokens, depths, parents, ranks, \
                              scores, num_nodes, err, vo);                                                       \
  }
LIST_VERIFY_KERNEL(1)
LIST_VERIFY_KERNEL(2)
LIST_VERIFY_KERNEL(4)
