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
// Warp layout (8 warps, 256 threads): warp w owns query rows 16*(w&3)..+15 and
//   * for S = Q.K^T the key half 16*(w>>2)..+15 of the 32-key tile (so the pair w, w^4 covers 32 keys);
//   * for O += P.V the value columns 256*(w>>2)..+255 (a 16 x 512 fp32 accumulator would need 256
//     registers per thread; half of it fits next to everything else).
// The pair exchanges its row maxima and its P tile through shared memory, synchronised by a named
// barrier of 64 threads, so the other pairs are not stalled. 155,648 B of shared memory per block: more than
// sm_120 allows (101,376 B); mla_tree_verify_compact.cu is the kernel for such GPUs.
//
// No system includes: NVRTC's default include path has no cuda_bf16.h / stdint.h everywhere; bf16 travels as
// its 16-bit pattern (common.cuh: bf16_t, pack_bf16x2) and all tensor-core work is inline PTX.

#include "mma_sync.cuh"

#define KEY_TILE 32       // keys per pipeline stage
#define LDS (D_QK + 8)    // smem row pitch in bf16: 1168 B = 73 x 16 B (odd), so ldmatrix rows hit distinct banks
#define PLDS (KEY_TILE + 8)  // P tile pitch: 80 B = 5 x 16 B (odd), conflict-free ldmatrix as well

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
    const int rgroup = warp & 3, half = warp >> 2;
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
        // 8 threads per key row: each copies 9 of its 72 16-byte chunks; one slot lookup per thread.
        int r = tid >> 3;
        int t = t0 + r;
        bool valid = t < k_hi;
        long long slot = 0;
        if (valid) slot = t < prefix ? (long long)kv_indices[kv_begin + t] : tree_slots[(long long)b * N + (t - prefix)];
        const bf16_t* src = kv + slot * kv_stride;
        bf16_t* dst = k_s + (buf * KEY_TILE + r) * LDS;
        for (int ch = tid & 7; ch < D_QK / 8; ch += 8) cp_async16(smem_u32(dst + ch * 8), src + ch * 8, valid);
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
    // B for S (K rows = mma columns): two n-tiles of 8 keys x k16 per x4 load.
    const int kb_row = 16 * half + (lane & 7) + ((lane >> 4) << 3);
    const int kb_col = ((lane >> 3) & 1) * 8;
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

        // ---- S = Q K^T: 16 rows x 16 keys per warp, depth 576 = 36 k-steps ----
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const unsigned k_addr = smem_u32(kb + kb_row * LDS + kb_col);
#pragma unroll 12
        for (int kk = 0; kk < D_QK / 16; ++kk) {
            unsigned a0, a1, a2, a3, b0, b1, b2, b3;
            ldsm_x4(q_addr + kk * 32, a0, a1, a2, a3);
            ldsm_x4(k_addr + kk * 32, b0, b1, b2, b3);
            mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[1], a0, a1, a2, a3, b2, b3);
        }

        // ---- mask (prefix always visible; tree key j visible iff ancestor-or-self) and scale ----
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hh = e >> 1;
                const int t = t0 + 16 * half + 8 * n + 2 * quad + (e & 1);
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
            for (int n = 0; n < 2; ++n) {
                const float p0 = exp2f(s[n][2 * hh] - ref);
                const float p1 = exp2f(s[n][2 * hh + 1] - ref);
                sum += p0 + p1;
                *(unsigned*)(p_s + lrow[hh] * PLDS + 16 * half + 8 * n + 2 * quad) = pack_bf16x2(p0, p1);
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

        // ---- O += P V: 16 rows x 256 value columns per warp, 32 keys = 2 k-steps ----
        const unsigned v_addr = smem_u32(kb + vb_row * LDS + vb_col);
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
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
