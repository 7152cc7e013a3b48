// Shared by the MLA tree-verify kernels (mla_tree_verify.cu: mma.sync; mla_tree_verify_compact.cu: mma.sync within
// sm_120's shared memory; mla_tree_verify_wgmma.cu: Hopper wgmma): the problem's widths, the CTA shape, the cp.async
// helpers and the kernel entry points (one signature, and the launch counter the serving path reads).
// mla_tree_verify.cu's header states the problem.
#pragma once

#include "common.cuh"

#define D_QK 576      // absorbed query / key width: kv_lora_rank 512 + qk_rope 64
#define D_V 512       // value width = the latent part of the key row
// The CTA shape; mla_tree_verify_compact.cu defines its own (48 rows, 192 threads) before including this file.
#ifndef ROW_TILE
#define ROW_TILE 64   // query (node, head) rows per CTA
#endif
#ifndef THREADS
#define THREADS 256   // two warpgroups / eight warps
#endif
#define LN2 0.69314718055994530942f
#define NEG_INF __int_as_float(0xff800000u)  // -inf without math.h (NVRTC has no default libc headers)

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global->shared copy that bypasses L1 (keys are used once per CTA); valid = false zero-fills the
// destination, which is how rows past the end of a request / split are made harmless.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// The keys CTA (b, split) reads: request b's prefix (kv_start[b] .. kv_end[b] in kv_indices) then its N tree keys,
// cut into num_splits ranges of whole key_tile tiles; [k_lo, k_hi) is this split's range, nblk its tiles.
struct KeySplit {
    long long kv_begin;
    int prefix, k_lo, k_hi, nblk;
};
template <int key_tile>
__device__ __forceinline__ KeySplit key_split(const long long* __restrict__ kv_start,
                                              const long long* __restrict__ kv_end, int b, int split, int num_splits,
                                              int N) {
    KeySplit s;
    s.kv_begin = kv_start[b];
    s.prefix = (int)(kv_end[b] - s.kv_begin);
    const int total = s.prefix + N;
    int per = (total + num_splits - 1) / num_splits;
    per = (per + key_tile - 1) / key_tile * key_tile;
    s.k_lo = min(total, split * per);
    s.k_hi = min(total, s.k_lo + per);
    s.nblk = (s.k_hi - s.k_lo + key_tile - 1) / key_tile;
    return s;
}

// extern "C" entry NAME for index type INDEX (int64: SGLang's triton kv_indices; int32: req_to_token rows, the
// fa3 path) around BODY<INDEX>, a __device__ template taking the same arguments less `launches`. Both kernels'
// launchers (gpu/mla_attention.py) pass the same arguments. One count per launch, eager or CUDA-graph replay:
// the serving path's proof that the kernel ran.
#define MLA_TREE_VERIFY_ENTRY(NAME, INDEX, BODY)                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                              \
        const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, long long kv_stride,                      \
        const long long* __restrict__ kv_start, const long long* __restrict__ kv_end,                          \
        const INDEX* __restrict__ kv_indices, const long long* __restrict__ tree_slots,                        \
        const unsigned* __restrict__ anc_bits, int N, int H, int words, int num_splits, float scale_log2,      \
        bf16_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o,                         \
        float2* __restrict__ part_ml, long long total_rows, unsigned long long* __restrict__ launches) {       \
        if (launches != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0)  \
            atomicAdd(launches, 1ULL);                                                                          \
        BODY<INDEX>(q, kv, kv_stride, kv_start, kv_end, kv_indices, tree_slots, anc_bits, N, H, words,         \
                    num_splits, scale_log2, out, lse, part_o, part_ml, total_rows);                             \
    }
