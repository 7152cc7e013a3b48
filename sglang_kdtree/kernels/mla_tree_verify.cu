// Tree-verify attention for absorbed MLA (DeepSeek-V3 / Kimi-K2 latent KV), bf16 tensor cores.
//
// Problem: request b verifies N tree nodes with H heads each. Query row (node i, head h) is the 576-wide
// absorbed query [q_nope 512 | q_rope 64]; keys are the 576-wide latent+rope rows of SGLang's MLA pool and
// values are their first 512 columns. Row (i, h) sees every prefix key of b and, among the N tree keys,
// exactly the ancestors-or-self of node i (bit j%32 of word j/32 of ancestor row i).
//
// Why this shape of kernel: all N*H query rows of a request read the same keys, so a CTA takes 64
// consecutive (node, head) rows (the query layout [bs*N, H, 576] makes them one contiguous block) and
// streams the request's keys through shared memory once, 32 keys at a time, doing Q.K^T and P.V with
// mma.sync m16n8k16 (bf16 in, fp32 accumulate). Split-K over the keys (grid.y) keeps the GPU full when
// bs * row-tiles is small; a merge kernel then combines the partial softmax states.
//
// Warp layout (ROW_GROUPS = ROW_TILE / 16 groups of two warps): warp w owns query rows 16*(w % ROW_GROUPS)..+15
// and, with half = w / ROW_GROUPS,
//   * for S = Q.K^T the key half KEY_TILE/2 * half..+KEY_TILE/2-1 of the key tile (the pair covers the tile);
//   * for O += P.V the value columns 256*half..+255 (a 16 x 512 fp32 accumulator would need 256
//     registers per thread; half of it fits next to everything else).
// The pair exchanges its row maxima and its P tile through shared memory, synchronised by a named
// barrier of 64 threads, so the other pairs are not stalled.
//
// Two shapes, one source:
//   * default: 64 rows, 32-key stages, 8 warps: 155,648 B of shared memory (Hopper / Blackwell datacenter);
//   * compact (-DROW_TILE=48 -DTHREADS=192 -DKEY_TILE=16): 48 rows, 16-key stages, 6 warps: 96,512 B, which fits
//     sm_120's 101,376 B per block. The Q tile is what costs: 1,168 B per row, so 48 rows plus two 16-key stages
//     is the largest double-buffered shape under 99 KiB with whole 16-row mma groups.
//
// No system includes: NVRTC's default include path has no cuda_bf16.h / stdint.h everywhere; bf16 travels as
// its 16-bit pattern (common.cuh: bf16_t, pack_bf16x2) and all tensor-core work is inline PTX.

#include "mla_common.cuh"

#ifndef KEY_TILE
#define KEY_TILE 32       // keys per pipeline stage
#endif
#define ROW_GROUPS (ROW_TILE / 16)
#define WARP_KEYS (KEY_TILE / 2)  // keys of a stage whose scores one warp of a pair computes (8 or 16)
static_assert(THREADS == 64 * ROW_GROUPS, "two warps per 16-row group");
static_assert(KEY_TILE == 16 || KEY_TILE == 32, "a warp's score tile is one or two 8-key mma n-tiles");
#define LDS (D_QK + 8)    // smem row pitch in bf16: 1168 B = 73 x 16 B (odd), so ldmatrix rows hit distinct banks
#define PLDS (KEY_TILE + 8)  // P tile pitch: 80 or 48 B = 5 or 3 x 16 B (odd), conflict-free ldmatrix as well

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// Transposed variant: V is stored key-major, the mma B operand wants it column-major.
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Barrier for the two warps (64 threads) that share a row group; ids 1..4 (0 is __syncthreads).
__device__ __forceinline__ void pair_barrier(int row_group) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(row_group + 1));
}

// kv_start[b] .. kv_end[b]: request b's prefix entries in kv_indices. CSR form: kv_start = kv_indptr,
// kv_end = kv_indptr + 1. Page-table form: kv_start[b] = req_pool_indices[b] * table_stride and
// kv_end[b] = kv_start[b] + prefix_len[b]. Entries are token slots of the pool (with page size P > 1
// SGLang's req_to_token / kv_indices still hold token slots page*P + offset, so nothing changes here).
template <typename Index>
__device__ __forceinline__ void mla_tree_verify_body(
    const bf16_t* __restrict__ q,             // [bs*N*H, 576]
    const bf16_t* __restrict__ kv,            // [slots, kv_stride], key = cols 0..575, value = cols 0..511
    long long kv_stride,                      // elements between consecutive slots
    const long long* __restrict__ kv_start,   // [bs]
    const long long* __restrict__ kv_end,     // [bs]
    const Index* __restrict__ kv_indices,     // prefix slots
    const long long* __restrict__ tree_slots, // [bs*N] slot of tree node j of request b at b*N + j
    const unsigned* __restrict__ anc_bits,    // [bs, N, words]
    int N, int H, int words, int num_splits, float scale_log2,
    bf16_t* __restrict__ out,                 // [bs*N*H, 512]   written when num_splits == 1
    float* __restrict__ lse,                  // [bs*N*H]        natural-log LSE of the scaled scores
    float* __restrict__ part_o,               // [num_splits, bs*N*H, 512] unnormalised partial outputs
    float2* __restrict__ part_ml,             // [num_splits, bs*N*H] (running max in log2 units, sum)
    long long total_rows) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* q_s = (bf16_t*)smem;                 // [ROW_TILE][LDS]
    bf16_t* k_s = q_s + ROW_TILE * LDS;          // [2][KEY_TILE][LDS] double buffer
    bf16_t* p_s = k_s + 2 * KEY_TILE * LDS;      // [ROW_TILE][PLDS]
    float* red_max = (float*)(p_s + ROW_TILE * PLDS);  // [2][ROW_TILE]
    float* red_sum = red_max + 2 * ROW_TILE;           // [2][ROW_TILE]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rgroup = warp % ROW_GROUPS, half = warp / ROW_GROUPS;
    const int b = blockIdx.z, split = blockIdx.y;
    const int rows_per_req = N * H;
    const int row0 = blockIdx.x * ROW_TILE;
    const long long req_row0 = (long long)b * rows_per_req;

    const KeySplit ks = key_split<KEY_TILE>(kv_start, kv_end, b, split, num_splits, N);
    const long long kv_begin = ks.kv_begin;
    const int prefix = ks.prefix, k_lo = ks.k_lo, k_hi = ks.k_hi, nblk = ks.nblk;

    // The two query rows this thread holds in mma C fragments: g and g + 8 of its row group.
    const int g = lane >> 2, quad = lane & 3;
    int lrow[2];
    bool row_ok[2];
    const unsigned* anc_row[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        lrow[hh] = 16 * rgroup + g + 8 * hh;
        int rr = row0 + lrow[hh];
        row_ok[hh] = rr < rows_per_req;
        int node = row_ok[hh] ? rr / H : N - 1;  // rows past the request compute on zeros, never stored
        anc_row[hh] = anc_bits + ((long long)b * N + node) * words;
    }

    auto load_keys = [&](int buf, int t0) {
        // THREADS / KEY_TILE (8 or 12) threads per key row, each copying 9 or 6 of its 72 16-byte chunks; one slot
        // lookup per thread.
        constexpr int per_row = THREADS / KEY_TILE;
        int r = tid / per_row;
        int t = t0 + r;
        bool valid = t < k_hi;
        long long slot = 0;
        if (valid) slot = t < prefix ? (long long)kv_indices[kv_begin + t] : tree_slots[(long long)b * N + (t - prefix)];
        const bf16_t* src = kv + slot * kv_stride;
        bf16_t* dst = k_s + (buf * KEY_TILE + r) * LDS;
        for (int ch = tid % per_row; ch < D_QK / 8; ch += per_row) cp_async16(smem_u32(dst + ch * 8), src + ch * 8, valid);
    };

    float o[32][4];
#pragma unroll
    for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF};
    float l_run[2] = {0.f, 0.f};

    if (nblk > 0) {
        for (int c = tid; c < ROW_TILE * (D_QK / 8); c += THREADS) {
            int r = c / (D_QK / 8), ch = c % (D_QK / 8);
            bool valid = row0 + r < rows_per_req;
            const bf16_t* src = q + (req_row0 + row0 + (valid ? r : 0)) * D_QK + ch * 8;
            cp_async16(smem_u32(q_s + r * LDS + ch * 8), src, valid);
        }
        load_keys(0, k_lo);
    }
    cp_async_commit();

    // ldmatrix lane addresses (bytes). A (Q rows, row-major): lanes 0-15 rows 0-15 at k, 16-31 at k+8.
    const unsigned q_addr = smem_u32(q_s + (16 * rgroup + (lane & 15)) * LDS + (lane >> 4) * 8);
    // B for S (K rows = mma columns), one x4 load: two n-tiles of 8 keys x k16 (WARP_KEYS 16), or one n-tile of
    // 8 keys x two k16 steps (WARP_KEYS 8).
#if WARP_KEYS == 16
    const int kb_row = 16 * half + (lane & 7) + ((lane >> 4) << 3);
    const int kb_col = ((lane >> 3) & 1) * 8;
#else
    const int kb_row = 8 * half + (lane & 7);
    const int kb_col = (lane >> 3) * 8;
#endif
    // B for O (V, transposed load): keys along k, value columns along n.
    const int vb_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int vb_col = 256 * half + (lane >> 4) * 8;
    const unsigned p_addr = smem_u32(p_s + (16 * rgroup + (lane & 15)) * PLDS + (lane >> 4) * 8);

    for (int blk = 0; blk < nblk; ++blk) {
        const int t0 = k_lo + blk * KEY_TILE;
        cp_async_wait_all();
        __syncthreads();  // tile blk visible to all; every warp is done with tile blk-1's buffer
        if (blk + 1 < nblk) load_keys((blk + 1) & 1, t0 + KEY_TILE);
        cp_async_commit();
        const bf16_t* kb = k_s + (blk & 1) * KEY_TILE * LDS;

        // ---- S = Q K^T: 16 rows x WARP_KEYS keys per warp, depth 576 = 36 k-steps ----
        constexpr int NT = WARP_KEYS / 8;  // 8-key n-tiles per warp
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
        const unsigned k_addr = smem_u32(kb + kb_row * LDS + kb_col);
#if WARP_KEYS == 16
#pragma unroll 12
        for (int kk = 0; kk < D_QK / 16; ++kk) {
            unsigned a0, a1, a2, a3, b0, b1, b2, b3;
            ldsm_x4(q_addr + kk * 32, a0, a1, a2, a3);
            ldsm_x4(k_addr + kk * 32, b0, b1, b2, b3);
            mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[1], a0, a1, a2, a3, b2, b3);
        }
#else
#pragma unroll 6
        for (int kk = 0; kk < D_QK / 16; kk += 2) {
            unsigned a0, a1, a2, a3, c0, c1, c2, c3, b0, b1, b2, b3;
            ldsm_x4(q_addr + kk * 32, a0, a1, a2, a3);
            ldsm_x4(q_addr + kk * 32 + 32, c0, c1, c2, c3);
            ldsm_x4(k_addr + kk * 32, b0, b1, b2, b3);
            mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[0], c0, c1, c2, c3, b2, b3);
        }
#endif

        // ---- mask (prefix always visible; tree key j visible iff ancestor-or-self) and scale ----
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hh = e >> 1;
                const int t = t0 + WARP_KEYS * half + 8 * n + 2 * quad + (e & 1);
                bool vis = t < k_hi;
                if (vis && t >= prefix) {
                    const int j = t - prefix;
                    vis = (__ldg(anc_row[hh] + (j >> 5)) >> (j & 31)) & 1u;
                }
                // select, never add: a masked key may hold any value (poisoned rows included)
                const float v = vis ? s[n][e] * scale_log2 : NEG_INF;
                s[n][e] = v;
                mx[hh] = fmaxf(mx[hh], v);
            }
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            if (quad == 0) red_max[half * ROW_TILE + lrow[hh]] = mx[hh];
        }
        pair_barrier(rgroup);

        // ---- online softmax; both warps of the pair derive the same running max ----
        float alpha[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float m_new = fmaxf(m_run[hh], fmaxf(red_max[lrow[hh]], red_max[ROW_TILE + lrow[hh]]));
            // a row with no visible key so far keeps max -inf: use 0 as reference so exp2 sees -inf, not NaN
            const float ref = m_new == NEG_INF ? 0.f : m_new;
            alpha[hh] = exp2f(m_run[hh] - ref);
            m_run[hh] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float p0 = exp2f(s[n][2 * hh] - ref);
                const float p1 = exp2f(s[n][2 * hh + 1] - ref);
                sum += p0 + p1;
                *(unsigned*)(p_s + lrow[hh] * PLDS + WARP_KEYS * half + 8 * n + 2 * quad) = pack_bf16x2(p0, p1);
            }
            l_run[hh] = l_run[hh] * alpha[hh] + sum;
        }
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            o[j][0] *= alpha[0];
            o[j][1] *= alpha[0];
            o[j][2] *= alpha[1];
            o[j][3] *= alpha[1];
        }
        pair_barrier(rgroup);  // the partner's half of P is in shared memory

        // ---- O += P V: 16 rows x 256 value columns per warp, KEY_TILE keys = KEY_TILE / 16 k-steps ----
        const unsigned v_addr = smem_u32(kb + vb_row * LDS + vb_col);
#pragma unroll
        for (int ks = 0; ks < KEY_TILE / 16; ++ks) {
            unsigned a0, a1, a2, a3;
            ldsm_x4(p_addr + ks * 32, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 16; ++np) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(v_addr + ks * 16 * LDS * 2 + np * 32, b0, b1, b2, b3);
                mma_bf16(o[2 * np], a0, a1, a2, a3, b0, b1);
                mma_bf16(o[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }

    // ---- row sums: quad reduce, then add the partner warp's keys ----
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
        l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
        if (quad == 0) red_sum[half * ROW_TILE + lrow[hh]] = l_run[hh];
    }
    pair_barrier(rgroup);
    float l_tot[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) l_tot[hh] = red_sum[lrow[hh]] + red_sum[ROW_TILE + lrow[hh]];

    if (num_splits == 1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            const float inv = l_tot[hh] > 0.f ? 1.f / l_tot[hh] : 0.f;
            unsigned* dst = (unsigned*)(out + grow * D_V + 256 * half + 2 * quad);
#pragma unroll
            for (int j = 0; j < 32; ++j) dst[4 * j] = pack_bf16x2(o[j][2 * hh] * inv, o[j][2 * hh + 1] * inv);
            if (half == 0 && quad == 0)
                lse[grow] = l_tot[hh] > 0.f ? (m_run[hh] + log2f(l_tot[hh])) * LN2 : NEG_INF;
        }
    } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            float2* dst = (float2*)(part_o + ((long long)split * total_rows + grow) * D_V + 256 * half + 2 * quad);
#pragma unroll
            for (int j = 0; j < 32; ++j) dst[4 * j] = make_float2(o[j][2 * hh], o[j][2 * hh + 1]);
            if (half == 0 && quad == 0) part_ml[(long long)split * total_rows + grow] = make_float2(m_run[hh], l_tot[hh]);
        }
    }
}

MLA_TREE_VERIFY_ENTRY(mla_tree_verify_i64, long long, mla_tree_verify_body)
MLA_TREE_VERIFY_ENTRY(mla_tree_verify_i32, int, mla_tree_verify_body)

// Combine split-K partial softmax states: O = sum_s 2^(m_s - m) O_s / sum_s 2^(m_s - m) l_s.
// One CTA of 128 threads per query row, 4 value columns per thread.
extern "C" __global__ void __launch_bounds__(128) mla_tree_verify_merge(const float* __restrict__ part_o,
                                                                         const float2* __restrict__ part_ml,
                                                                         int num_splits, long long total_rows,
                                                                         bf16_t* __restrict__ out,
                                                                         float* __restrict__ lse) {
    const long long row = blockIdx.x;
    const int col = threadIdx.x * 4;
    float m = NEG_INF;
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, part_ml[(long long)s * total_rows + row].x);
    const float ref = m == NEG_INF ? 0.f : m;
    float l = 0.f, acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    for (int s = 0; s < num_splits; ++s) {
        const float2 ml = part_ml[(long long)s * total_rows + row];
        if (ml.y == 0.f) continue;  // empty split: its partial output was never meaningful
        const float w = exp2f(ml.x - ref);
        l += ml.y * w;
        const float4 v = *(const float4*)(part_o + ((long long)s * total_rows + row) * D_V + col);
        acc0 += v.x * w;
        acc1 += v.y * w;
        acc2 += v.z * w;
        acc3 += v.w * w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    uint2 packed;
    packed.x = pack_bf16x2(acc0 * inv, acc1 * inv);
    packed.y = pack_bf16x2(acc2 * inv, acc3 * inv);
    *(uint2*)(out + row * D_V + col) = packed;
    if (threadIdx.x == 0) lse[row] = l > 0.f ? (ref + log2f(l)) * LN2 : NEG_INF;
}
