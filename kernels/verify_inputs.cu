// Verify inputs from a padded batch of trees; twin of reference.verify_inputs.
//
//   verify_links   grid (bs), 256 threads: input ids, positions, retrieve_index, first-child / next-sibling
//                  links and the bit-packed ancestor-or-self rows (ceil(N/32) uint32 words per node).
//   verify_full_mask  grid (bs, Y): SGLang's FULL_MASK bytes from those rows. Request b's block starts at
//                  N*N*b + N*sum(seq_lens[:b]) (prefix computed on the device: no host sync), rows of
//                  seq_len + N bytes: prefix columns True, then the ancestor-or-self row.
//
// Links need no sort: children of p are exactly the nodes j > p with parents[j] == p, so the first child of
// i is the first such j after i and the next sibling of i is the first j > i sharing i's parent. A node's
// ancestor chain is at most 32 long (depth <= 31), so one thread walks it for its row.
//
// A malformed tree (num_nodes outside [0, N-1], a live node's parent outside [0, i), a chain deeper than
// 31) sets ERR_BAD_TREE; the kernel clamps and never writes outside its rows.

#include "common.cuh"  // ERR_BAD_TREE, u32

#define LINK_THREADS 256
#define MAX_N 1025
#define MAX_CHAIN 32

extern "C" __global__ void __launch_bounds__(LINK_THREADS) verify_links(
    const long long* __restrict__ tokens, const long long* __restrict__ depths,
    const long long* __restrict__ parents, const long long* __restrict__ num_nodes,
    const long long* __restrict__ seq_lens, int N, long long* __restrict__ input_ids,
    long long* __restrict__ positions, u32* __restrict__ ancestor_bits, long long* __restrict__ retrieve_index,
    long long* __restrict__ next_token, long long* __restrict__ next_sibling, int* __restrict__ err) {
  __shared__ short par[MAX_N];
  const int b = blockIdx.x, tid = threadIdx.x;
  const long long row = (long long)b * N;
  const int W = (N + 31) / 32;
  long long nn = num_nodes[b];
  int bad = 0;
  if (nn < 0 || nn > N - 1) {
    bad |= ERR_BAD_TREE;
    nn = nn < 0 ? 0 : N - 1;
  }
  const int n = (int)nn;
  for (int i = tid; i < N; i += LINK_THREADS) {
    long long p = parents[row + i];
    if (i >= 1 && i <= n && (p < 0 || p >= i)) {
      bad |= ERR_BAD_TREE;
      p = -1;  // unlinked: sees only itself
    }
    par[i] = (short)(i <= n && i >= 1 ? p : -1);
  }
  __syncthreads();
  const long long P = seq_lens[b];
  for (int i = tid; i < N; i += LINK_THREADS) {
    input_ids[row + i] = tokens[row + i];
    positions[row + i] = P + depths[row + i];
    retrieve_index[row + i] = row + i;
    long long first = -1, sib = -1;
    if (i <= n) {
      for (int j = i + 1; j <= n; ++j)
        if (par[j] == i) { first = j; break; }
      const int p = par[i];
      if (i >= 1 && p >= 0)
        for (int j = i + 1; j <= n; ++j)
          if (par[j] == p) { sib = j; break; }
    }
    next_token[row + i] = first;
    next_sibling[row + i] = sib;

    // ancestor-or-self chain of row i (padding rows: itself only)
    int chain[MAX_CHAIN];
    int len = 0;
    int x = i;
    while (x >= 0 && len < MAX_CHAIN) {
      chain[len++] = x;
      x = (x <= n) ? par[x] : -1;
    }
    if (x >= 0) bad |= ERR_BAD_TREE;
    u32* out = ancestor_bits + (row + i) * W;
    for (int w = 0; w < W; ++w) {
      u32 word = 0;
      if (w * 32 <= i)
        for (int c = 0; c < len; ++c)
          if ((chain[c] >> 5) == w) word |= 1u << (chain[c] & 31);
      out[w] = word;
    }
  }
  if (bad) atomicOr(err, bad);
}

// full_mask: bool bytes. fill_prefix = 0 leaves the seq_len prefix columns alone (a buffer already True).
extern "C" __global__ void verify_full_mask(const u32* __restrict__ ancestor_bits,
                                            const long long* __restrict__ seq_lens, int N, int fill_prefix,
                                            unsigned char* __restrict__ full_mask) {
  __shared__ long long offset;
  const int b = blockIdx.x, tid = threadIdx.x;
  const int W = (N + 31) / 32;
  if (tid == 0) {
    long long before = 0;
    for (int i = 0; i < b; ++i) before += seq_lens[i];
    offset = (long long)N * N * b + (long long)N * before;
  }
  __syncthreads();
  const long long P = seq_lens[b];
  const long long width = P + N;
  unsigned char* base = full_mask + offset;
  const u32* bits = ancestor_bits + (long long)b * N * W;
  for (int i = blockIdx.y; i < N; i += gridDim.y) {
    unsigned char* out = base + (long long)i * width;
    if (fill_prefix)
      for (long long c = tid; c < P; c += blockDim.x) out[c] = 1;
    const u32* rbits = bits + (long long)i * W;
    for (int j = tid; j < N; j += blockDim.x) out[P + j] = (unsigned char)((rbits[j >> 5] >> (j & 31)) & 1u);
  }
}
