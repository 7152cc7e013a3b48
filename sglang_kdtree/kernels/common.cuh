// Shared by every kernel (sglang_kdtree/kernels/moe/ included): the integer types, the one device error-flag table
// and the bf16 helpers.
//
// No system includes: NVRTC's default include path has no cuda_bf16.h / math.h everywhere, so bf16 travels
// as its 16-bit pattern and is widened / rounded by hand. Included as "common.cuh" (the runtime passes the
// kernels folder as the include path); a .cu includes only headers, never another .cu.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short bf16_t;

// NVRTC has no <math.h> macros.
#define INFINITY __int_as_float(0x7f800000)

// ---------------------------------------------------------------------------------------------------
// Device error bits: one table, one bit per fault, so any flag (the tree-construction flag, the commit
// flag, an accept kernel's per-request int64 word) decodes with the same table. Kernels never trap and never
// write out of range on bad input: they set a bit and skip or clamp. Mirrored bit for bit by
// sglang_kdtree/gpu/errors.py (tests/test_kernels_compile.py checks the two agree).
// ---------------------------------------------------------------------------------------------------

// accept (tree_accept.cu; per request, int64 [bs])
#define ERR_NUM_NODES (1 << 0)        // num_nodes[b] outside [0, N-1]; clamped
#define ERR_BAD_PARENT (1 << 1)       // parents[i] outside [0, i) for a live node; the node is unlinked
#define ERR_MAX_DEPTH (1 << 2)        // the accepted path is longer than max_depth; truncated
#define ERR_TARGET_NAN (1 << 3)       // NaN in a visited target logits row
#define ERR_SAMPLING (1 << 4)         // top_k < 1 (treated as 1) or a target row entirely -inf at T > 0
// bit 5 is free
// commit (kv_compact.cu, gather_hidden.cu; int32 [1] flag)
#define ERR_BAD_PATH (1 << 6)         // accept_lens / accepted not a valid path inside the verify window
#define ERR_BAD_SLOT (1 << 7)         // a KV source or destination slot outside [0, num_slots); request skipped
#define ERR_BAD_HIDDEN_ROW (1 << 8)   // a hidden-state row index outside [0, rows); that output row is zeroed
// MoE routing (moe/moe_align.cu)
#define ERR_EXPERT_ID (1 << 9)        // a routed expert id outside [0, num_experts); the route is dropped
// tree construction (topk_*.cu, best_first_tree.cu, verify_inputs.cu; int32 [1] flag)
#define ERR_LOGITS_NAN (1 << 10)      // NaN in the drafter's logits
#define ERR_LOGITS_POSINF (1 << 11)   // +inf in the drafter's logits
#define ERR_DEAD_ROW (1 << 12)        // a logits row (or every shard of it) is entirely -inf
#define ERR_LOGPROB_NAN (1 << 13)     // NaN in the log-probs
#define ERR_LOGPROB_POSINF (1 << 14)  // +inf in the log-probs
#define ERR_UNSORTED (1 << 15)        // a log-prob row not sorted descending
#define ERR_NEGATIVE_ID (1 << 16)     // a negative token id
#define ERR_BAD_TREE (1 << 17)        // num_nodes outside [0, N-1], a parent outside [0, i) or a chain deeper than 31

// ---------------------------------------------------------------------------------------------------
// bf16
// ---------------------------------------------------------------------------------------------------

// bf16 is the top half of an fp32: the widening is exact (the reference's upcast).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// The two bf16 halves of a 32-bit word as floats: lo is the lower address (element 2i of a packed row).
__device__ __forceinline__ float bf16_lo(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

// Two floats -> packed bf16x2, round to nearest even (sm_80+); lo lands in the low half (lower address).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+; runtime.launch(..., pdl=True)). A kernel launched that way may be scheduled
// before the kernel ahead of it in the stream has finished, so it calls pdl_wait() before it touches global memory:
// that returns once the previous kernel has finished and its writes are visible (at once after a plain launch). With
// the wait at entry no read or write moves; only the launch's latency overlaps the previous kernel's tail. No kernel
// triggers its dependents early (griddepcontrol.launch_dependents): at the top-K pass's and select's entry that made
// the batch-1 tree step slower (benchmarks/RESULTS.md).
// ---------------------------------------------------------------------------------------------------

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
