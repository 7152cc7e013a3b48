// Top-k routing -> Marlin MoE block tables (twin: sglang_kdtree.moe.reference.moe_align_reference).
//
// Marlin's MoE GEMM walks "blocks" of block_size rows that all use one expert. Input: topk_ids [numel]
// (numel = tokens * top_k, row-major [tokens, top_k]), each a local expert id. Output, for the experts
// that received at least one route, in ascending expert order:
//   sorted_token_ids: the flat route indices (token * top_k + k) of each expert, its segment padded up to
//                     a multiple of block_size with the sentinel numel (Marlin skips ids >= numel);
//   expert_ids:       one expert id per block;
//   num_tokens_post_padded[0]: the padded total (a multiple of block_size); [1]: 0 (no inactive prefix).
// Experts with no route get no block, so every block is live: Marlin's generic (unsorted, non-EP)
// specialization then never scans for -1 blocks, and the tables stay small at tree-verify widths.
// Inside an expert's segment the order of the routes is not defined (warp-aggregated atomics); each
// row of a Marlin GEMM is independent of its neighbours, so the product does not depend on it.
//
// Negative ids are SGLang's "no expert" (padded tokens under CUDA graphs): the route is dropped and its
// output row is never written. An id >= num_experts is a caller bug: the route is dropped and bit 512 is
// OR-ed into errors[0] (ERR_EXPERT_ID of common.cuh; sglang_kdtree.moe.routing.ERR_EXPERT_ID); with
// fresh_errors the kernel owns the flag and writes it whole (0 or 512), which saves the caller a zero-fill
// launch.
//
// One CTA does everything: routes are at most a few thousand at verify widths and ~100k in a prefill
// chunk, and a single CTA needs no grid-wide barrier between count, scan and scatter.

#include "common.cuh"

#define FULL_MASK 0xffffffffu

// Exclusive block-wide scan of one int per thread (blockDim.x a multiple of 32, at most 1024).
__device__ int block_exclusive_scan(int value, int* warp_totals, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(FULL_MASK, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    int t = lane < warps ? warp_totals[lane] : 0;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(FULL_MASK, t, offset);
      if (lane >= offset) t += up;
    }
    if (lane < warps) warp_totals[lane] = t;  // inclusive over warps
    if (lane == warps - 1) *total = t;
  }
  __syncthreads();
  const int warp_base = warp == 0 ? 0 : warp_totals[warp - 1];
  const int result = warp_base + inclusive - value;
  __syncthreads();  // warp_totals may be reused by the caller
  return result;
}

// Adds `amount` for every lane of the warp that routes to the same expert with one shared atomic per
// distinct expert (an adversarial routing that sends every token to one expert would otherwise
// serialise thousands of atomics on one address). Returns, for each live lane, the old counter value
// plus the number of peers with a lower lane id: a unique slot per route.
__device__ int warp_aggregated_add(int* counters, int expert, bool live) {
  const unsigned live_mask = __ballot_sync(FULL_MASK, live);
  const unsigned peers = __match_any_sync(FULL_MASK, live ? expert : -1) & live_mask;
  const int lane = threadIdx.x & 31;
  const int leader = peers ? __ffs(peers) - 1 : lane;
  int base = 0;
  if (live && lane == leader) base = atomicAdd(&counters[expert], __popc(peers));
  base = __shfl_sync(FULL_MASK, base, leader);
  const unsigned lower = (1u << lane) - 1u;
  return base + __popc(peers & lower);
}

template <typename Id>
__device__ void moe_align_impl(const Id* topk_ids, int numel, int num_experts, int block_size,
                               int* sorted_token_ids, int* expert_ids, int* num_tokens_post_padded,
                               int* errors, int fresh_errors) {
  extern __shared__ int shared[];
  int* counts = shared;                 // [num_experts] routes per expert
  int* cursor = shared + num_experts;   // [num_experts] next free slot of each expert's segment
  __shared__ int warp_totals[32];
  __shared__ int padded_total;

  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();

  bool bad_id = false;
  // Every thread runs the same number of iterations so the warp intrinsics see full warps.
  for (int base = 0; base < numel; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const i64 id = i < numel ? (i64)topk_ids[i] : -1;
    bad_id |= id >= num_experts;
    const bool live = id >= 0 && id < num_experts;
    warp_aggregated_add(counts, live ? (int)id : 0, live);
  }
  const bool any_bad = __syncthreads_or(bad_id);
  if (threadIdx.x == 0) {
    if (fresh_errors)
      *errors = any_bad ? ERR_EXPERT_ID : 0;
    else if (any_bad)
      atomicOr(errors, ERR_EXPERT_ID);
  }

  // Each thread owns a contiguous run of experts so the scan keeps ascending expert order.
  const int per_thread = (num_experts + blockDim.x - 1) / blockDim.x;
  const int first = threadIdx.x * per_thread;
  const int last = min(first + per_thread, num_experts);
  int run = 0;
  for (int e = first; e < last; ++e) run += (counts[e] + block_size - 1) / block_size * block_size;
  int offset = block_exclusive_scan(run, warp_totals, &padded_total);
  for (int e = first; e < last; ++e) {
    const int count = counts[e];
    const int padded = (count + block_size - 1) / block_size * block_size;
    cursor[e] = offset;
    for (int b = offset / block_size; b < (offset + padded) / block_size; ++b) expert_ids[b] = e;
    for (int j = offset + count; j < offset + padded; ++j) sorted_token_ids[j] = numel;
    offset += padded;
  }
  if (threadIdx.x == 0) {
    num_tokens_post_padded[0] = padded_total;
    num_tokens_post_padded[1] = 0;
  }
  __syncthreads();

  for (int base = 0; base < numel; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const i64 id = i < numel ? (i64)topk_ids[i] : -1;
    const bool live = id >= 0 && id < num_experts;
    const int slot = warp_aggregated_add(cursor, live ? (int)id : 0, live);
    if (live) sorted_token_ids[slot] = i;
  }
}

extern "C" __global__ void moe_align_i32(const int* topk_ids, int numel, int num_experts, int block_size,
                                         int* sorted_token_ids, int* expert_ids, int* num_tokens_post_padded,
                                         int* errors, int fresh_errors) {
  moe_align_impl(topk_ids, numel, num_experts, block_size, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, errors, fresh_errors);
}

extern "C" __global__ void moe_align_i64(const i64* topk_ids, int numel, int num_experts, int block_size,
                                         int* sorted_token_ids, int* expert_ids, int* num_tokens_post_padded,
                                         int* errors, int fresh_errors) {
  moe_align_impl(topk_ids, numel, num_experts, block_size, sorted_token_ids, expert_ids,
                 num_tokens_post_padded, errors, fresh_errors);
}
