// Verify inputs from a padded batch of trees, in one launch; twin of reference.verify_inputs.
//
//   verify_inputs  grid (bs, Y), 256 threads (8 warps). Block (b, y) owns request b's rows i = y, y + Y, ...
//                  (< N), one warp per row at a time: the row's input id, position, retrieve_index, first-child
//                  and next-sibling links, its bit-packed ancestor-or-self row (ceil(N/32) uint32 words) and its
//                  SGLang FULL_MASK row. Request b's mask block starts at N*N*b + N*sum(seq_lens[:b]) (the prefix
//                  sum on the device, by the block's threads together: no host sync); its rows are seq_len + N
//                  bytes: prefix columns True (fill_prefix = 0 leaves them alone: a buffer already True), then the
//                  ancestor-or-self row. Every block reads the request's parents (a few hundred bytes, from L2
//                  after the first block), so no block waits on another and the whole step is one kernel.
//
// Links need no sort: children of p are exactly the nodes j > p with parents[j] == p, so the first child of
// i is the smallest such j (one shared-memory atomicMin per node) and the next sibling of i is the first
// j > i sharing i's parent (the row's warp tests 32 candidates per ballot). A node's ancestor chain is at most
// 32 long (depth <= 31) and strictly decreasing (parents[j] < j), so lane 0 walks it once, emitting the row's
// words from the highest down.
//
// A malformed tree (num_nodes outside [0, N-1], a live node's parent outside [0, i), a chain deeper than
// 31) sets ERR_BAD_TREE; the kernel clamps and never writes outside its rows.

#include "verify_common.cuh"  // fill_ones; common.cuh: ERR_BAD_TREE, u32

#define VERIFY_THREADS 256
#define VERIFY_WARPS (VERIFY_THREADS / 32)
#define MAX_N 1025
#define MAX_CHAIN 32
#define NO_NODE 0x7fffffff

extern "C" __global__ void __launch_bounds__(VERIFY_THREADS) verify_inputs(
    const long long* __restrict__ tokens, const long long* __restrict__ depths,
    const long long* __restrict__ parents, const long long* __restrict__ num_nodes,
    const long long* __restrict__ seq_lens, int N, int fill_prefix, long long* __restrict__ input_ids,
    long long* __restrict__ positions, u32* __restrict__ ancestor_bits, long long* __restrict__ retrieve_index,
    long long* __restrict__ next_token, long long* __restrict__ next_sibling, unsigned char* __restrict__ full_mask,
    int* __restrict__ err) {
  __shared__ short par[MAX_N];
  __shared__ int first[MAX_N];  // smallest child index (NO_NODE: none)
  __shared__ long long warp_sums[VERIFY_WARPS];
  const int b = blockIdx.x, y = blockIdx.y, Y = gridDim.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long row = (long long)b * N;
  const int W = (N + 31) / 32;
  // every global read the block needs first, issued before any is used: node count, prefix lengths, parents
  long long nn = num_nodes[b];
  const long long P = seq_lens[b];
  long long before = 0;
  for (int i = tid; i < b; i += VERIFY_THREADS) before += seq_lens[i];
  int bad = 0;
  if (nn < 0 || nn > N - 1) {
    bad |= ERR_BAD_TREE;
    nn = nn < 0 ? 0 : N - 1;
  }
  const int n = (int)nn;
  for (int i = tid; i < N; i += VERIFY_THREADS) {
    long long p = parents[row + i];
    if (i >= 1 && i <= n && (p < 0 || p >= i)) {
      bad |= ERR_BAD_TREE;
      p = -1;  // unlinked: sees only itself
    }
    par[i] = (short)(i <= n && i >= 1 ? p : -1);
    first[i] = NO_NODE;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
  if (lane == 0) warp_sums[warp] = before;
  __syncthreads();
  for (int j = tid + 1; j <= n; j += VERIFY_THREADS)
    if (par[j] >= 0) atomicMin(&first[par[j]], j);  // par[j] < j <= n: only live nodes have children
  long long offset = 0;
#pragma unroll
  for (int w = 0; w < VERIFY_WARPS; ++w) offset += warp_sums[w];
  unsigned char* base = full_mask + (long long)N * N * b + (long long)N * offset;  // request b's FULL_MASK block
  const long long width = P + N;  // bytes per FULL_MASK row
  __syncthreads();

  // one warp per row of this block (rows y, y + Y, ...)
  for (int i = y + Y * warp; i < N; i += Y * VERIFY_WARPS) {
    const int p = (i >= 1 && i <= n) ? par[i] : -1;
    long long sib = -1;  // the first j in (i, n] with par[j] == p: 32 candidates per ballot
    if (p >= 0)
      for (int j0 = i + 1; j0 <= n; j0 += 32) {
        const unsigned hit = __ballot_sync(0xffffffffu, j0 + lane <= n && par[j0 + lane] == p);
        if (hit) {
          sib = j0 + __ffs(hit) - 1;
          break;
        }
      }
    u32* out = ancestor_bits + (row + i) * W;
    if (lane == 0) {
      input_ids[row + i] = tokens[row + i];
      positions[row + i] = P + depths[row + i];
      retrieve_index[row + i] = row + i;
      next_token[row + i] = (i <= n && first[i] != NO_NODE) ? (long long)first[i] : -1;
      next_sibling[row + i] = sib;
      // ancestor-or-self words (padding rows: itself only)
      const int end = ancestor_words(i, W, MAX_CHAIN, [&](int x) { return x <= n ? par[x] : -1; },
                                     [&](int w, u32 word) { out[w] = word; });
      if (end >= 0) bad |= ERR_BAD_TREE;
    }
    __syncwarp();  // lane 0's words are visible to the warp
    unsigned char* mrow = base + (long long)i * width;
    if (fill_prefix) fill_ones(mrow, P, lane);
    for (int j = lane; j < N; j += 32) mrow[P + j] = (unsigned char)((out[j >> 5] >> (j & 31)) & 1u);
  }
  if (bad) atomicOr(err, bad);
}
