// The exact DDTree best-first tree for every request of a batch in one launch. Twin of
// reference.build_trees: bit-identical tokens, depths, parents, ranks, scores and pop order, ties included.
//
// One warp per request (grid = bs, block = 32). The candidate set (<= budget + 1 entries, each pop removes
// one and adds at most two) sits in shared memory as an unordered array; every pop is a warp-wide argmax
// under the reference's total order:
//     higher float64 score first; equal scores: the lexicographically smaller rank tuple (prefix smaller).
// A rank tuple is never stored: two candidates' tuples are compared by walking their ancestor chains
// (per-node parent and rank in shared memory) up to the common ancestor. That walk only runs on exact
// score ties. An argmax over a strict total order is independent of slot order, so the result does not
// depend on how the warp reduction pairs lanes.
//
// Scores use __dadd_rn / __dsub_rn in the reference's order (sibling = (score - S[d][r]) + S[d][r+1],
// child = score + S[d+1][0]); the module is also compiled with -fmad=false.
//
// The per-depth log-probs rows (only the first min(K, budget + 1) ranks can ever be pushed) are staged in
// shared memory so a pop never waits on global memory. Validation of the whole [L, K] input (NaN, +inf,
// unsorted rows, negative ids) runs in the same launch and sets bits in an int32 flag (no host sync).

typedef unsigned int u32;

// NVRTC has no <math.h> macros.
#define INFINITY __int_as_float(0x7f800000)

#define ERR_LOGPROB_NAN 8
#define ERR_LOGPROB_POSINF 16
#define ERR_UNSORTED 32
#define ERR_NEGATIVE_ID 64

#define MAX_NODES 1025  // root + MAX_BUDGET (1024)
#define MAX_SLOTS 1026  // candidate slots: budget + 1, plus one of slack

// candidate meta: parent (11 bits, <= 1024) | rank (10 bits, < 1024... K - 1 <= 1023) | depth (5 bits, <= 31)
__device__ __forceinline__ u32 pack(int parent, int rank, int depth) {
  return (u32)parent | ((u32)rank << 11) | ((u32)depth << 21);
}
__device__ __forceinline__ int meta_parent(u32 m) { return (int)(m & 0x7ffu); }
__device__ __forceinline__ int meta_rank(u32 m) { return (int)((m >> 11) & 0x3ffu); }
__device__ __forceinline__ int meta_depth(u32 m) { return (int)(m >> 21); }

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

__device__ __forceinline__ bool pops_before(double sa, u32 ma, double sb, u32 mb, const short* np_,
                                            const short* nr_) {
  if (sa != sb) return sa > sb;
  return tuple_less(ma, mb, np_, nr_);
}

// logprobs [bs, L, K] float32, token_ids [bs, L, K] int64 (both contiguous), root_tokens [bs] int64.
// Outputs [bs, N] (N = budget + 1): tokens/depths/parents/ranks int64, scores float64 (root and padding:
// token 0 (root: its token), depth 0, parent -1, rank -1, score 0); num_nodes [bs] int64.
// Dynamic shared memory: L * KS floats, KS = min(K, budget + 1).
extern "C" __global__ void __launch_bounds__(32) build_trees_kernel(
    const float* __restrict__ logprobs, const long long* __restrict__ token_ids,
    const long long* __restrict__ root_tokens, int L, int K, int budget, int KS, long long* __restrict__ tokens,
    long long* __restrict__ depths, long long* __restrict__ parents, long long* __restrict__ ranks,
    double* __restrict__ scores, long long* __restrict__ num_nodes, int* __restrict__ err) {
  extern __shared__ float S[];  // [L][KS]
  __shared__ double slot_score[MAX_SLOTS];
  __shared__ u32 slot_meta[MAX_SLOTS];
  __shared__ short node_parent[MAX_NODES];
  __shared__ short node_rank[MAX_NODES];
  __shared__ signed char node_depth[MAX_NODES];
  __shared__ double node_score[MAX_NODES];

  const int lane = threadIdx.x, b = blockIdx.x;
  const int N = budget + 1;
  const float* lp = logprobs + (long long)b * L * K;
  const long long* ids = token_ids + (long long)b * L * K;

  // Validate the whole input (the reference checks every entry) and stage the usable ranks.
  int bad = 0;
  for (int d = 0; d < L; ++d) {
    for (int k = lane; k < K; k += 32) {
      const float x = lp[d * K + k];
      if (x != x) bad |= ERR_LOGPROB_NAN;
      else if (x == INFINITY) bad |= ERR_LOGPROB_POSINF;
      if (k + 1 < K && (double)lp[d * K + k + 1] > (double)x) bad |= ERR_UNSORTED;
      if (ids[d * K + k] < 0) bad |= ERR_NEGATIVE_ID;
      if (k < KS) S[d * KS + k] = x;
    }
  }
  if (bad) atomicOr(err, bad);
  node_parent[0] = -1;
  node_rank[0] = 0;
  node_depth[0] = 0;
  __syncwarp();

  int n = 0, size = 0;
  if (budget > 0 && L > 0 && isfinite((double)S[0])) {
    if (lane == 0) {
      slot_score[0] = (double)S[0];
      slot_meta[0] = pack(0, 0, 1);
    }
    size = 1;
  }
  __syncwarp();

  while (size > 0 && n < budget) {
    // Warp argmax over the candidate slots.
    int best = -1;
    double bs_ = 0.0;
    u32 bm = 0;
    for (int i = lane; i < size; i += 32) {
      const double sc = slot_score[i];
      const u32 mt = slot_meta[i];
      if (best < 0 || pops_before(sc, mt, bs_, bm, node_parent, node_rank)) {
        best = i;
        bs_ = sc;
        bm = mt;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const int ob = __shfl_xor_sync(0xffffffffu, best, o);
      const double os = __shfl_xor_sync(0xffffffffu, bs_, o);
      const u32 om = __shfl_xor_sync(0xffffffffu, bm, o);
      if (ob >= 0 && (best < 0 || pops_before(os, om, bs_, bm, node_parent, node_rank))) {
        best = ob;
        bs_ = os;
        bm = om;
      }
    }
    // Every lane holds the same winner; lane 0 emits it and updates the slots.
    ++n;
    const int parent = meta_parent(bm), rank = meta_rank(bm), depth = meta_depth(bm);
    if (lane == 0) {
      node_parent[n] = (short)parent;
      node_rank[n] = (short)rank;
      node_depth[n] = (signed char)depth;
      node_score[n] = bs_;
      int free_slot = best;  // the popped slot is reused by the first push
      bool filled = false;
      if (rank + 1 < K) {
        const double cur = (double)S[(depth - 1) * KS + rank];
        const double nxt = (double)S[(depth - 1) * KS + rank + 1];
        if (isfinite(nxt)) {
          slot_score[free_slot] = __dadd_rn(__dsub_rn(bs_, cur), nxt);
          slot_meta[free_slot] = pack(parent, rank + 1, depth);
          filled = true;
        }
      }
      if (depth < L) {
        const double first = (double)S[depth * KS];
        if (isfinite(first)) {
          const int at = filled ? size : free_slot;
          slot_score[at] = __dadd_rn(bs_, first);
          slot_meta[at] = pack(n, 0, depth + 1);
          if (filled) ++size;
          filled = true;
        }
      }
      if (!filled) {  // nothing pushed: move the last slot into the hole
        --size;
        slot_score[free_slot] = slot_score[size];
        slot_meta[free_slot] = slot_meta[size];
      }
    }
    size = __shfl_sync(0xffffffffu, size, 0);
    __syncwarp();
  }

  // Cooperative write-out of the finished tree, padded to N rows.
  const long long row = (long long)b * N;
  for (int i = lane; i < N; i += 32) {
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
  if (lane == 0) num_nodes[b] = n;
}
