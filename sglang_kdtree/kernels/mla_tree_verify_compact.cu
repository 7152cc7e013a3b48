// Tree-verify attention for absorbed MLA within sm_120's shared memory (101,376 B per block): the problem, the
// arguments and the results of mla_tree_verify.cu (its header states them), on bf16 mma.sync with fp32 softmax
// and accumulation, in 99,584 B.
//
// Why this shape: the Q tile is what costs (1,168 B per row with the padded pitch), so a CTA takes 48 consecutive
// (node, head) rows (56,064 B) and streams the request's keys through a double-buffered 16-key stage (37,376 B).
// Three 16-row groups of two warps, 192 threads.
//
// Shared-memory traffic, not tensor work, bounds an mma.sync kernel of this size: every warp re-reads its 16 Q rows
// from shared memory for each stage. So the two warps of a group split the stage's score work along the 576-wide
// depth (warp half h: k-steps 18h..18h+17) over all 16 keys, rather than splitting the keys (which makes each warp
// read the whole Q for 8 keys): each reads half of Q per stage. They add their partial scores through a 1 KiB slot
// per warp (a + b == b + a in IEEE arithmetic, so both warps hold bit-identical scores), and from there each warp
// runs the softmax of all 16 keys itself (same maxima, same sums, no exchange) and feeds its probabilities to P.V
// straight from registers (the m16n8 accumulator layout of two 8-key tiles is the m16k16 A-operand layout), for its
// 256 of the 512 value columns.
//
// No system includes (common.cuh: bf16 travels as its 16-bit pattern; all tensor-core work is inline PTX).

#define ROW_TILE 48    // query (node, head) rows per CTA: three 16-row mma groups
#define THREADS 192    // two warps per row group
#include "mma_sync.cuh"

#define ROW_GROUPS (ROW_TILE / 16)
#define KEY_TILE 16               // keys per pipeline stage: two 8-key mma n-tiles
#define LDS (D_QK + 8)            // smem row pitch in bf16: 1168 B = 73 x 16 B (odd): conflict-free ldmatrix rows
#define HALF_KSTEPS (D_QK / 32)   // 18 k16 steps: each warp of a pair takes half the depth

template <typename Index>
__device__ __forceinline__ void mla_tree_verify_compact_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, long long kv_stride,
    const long long* __restrict__ kv_start, const long long* __restrict__ kv_end,
    const Index* __restrict__ kv_indices, const long long* __restrict__ tree_slots,
    const unsigned* __restrict__ anc_bits, int N, int H, int words, int num_splits, float scale_log2,
    bf16_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o, float2* __restrict__ part_ml,
    long long total_rows) {
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* q_s = (bf16_t*)smem;                           // [ROW_TILE][LDS]
    bf16_t* k_s = q_s + ROW_TILE * LDS;                    // [2][KEY_TILE][LDS] double buffer
    float* partial = (float*)(k_s + 2 * KEY_TILE * LDS);   // [THREADS / 32][32 lanes][8] partial scores

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
        // 12 threads per key row, 6 of its 72 16-byte chunks each; one slot lookup per thread
        constexpr int per_row = THREADS / KEY_TILE;
        const int r = tid / per_row;
        const int t = t0 + r;
        const bool valid = t < k_hi;
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

    // ldmatrix lane addresses (bytes), starting at this warp's half of the depth. A (Q rows, row-major): lanes 0-15
    // rows 0-15 at k, 16-31 at k+8. B (K rows = mma columns): two n-tiles of 8 keys x k16 per x4 load.
    const unsigned q_addr = smem_u32(q_s + (16 * rgroup + (lane & 15)) * LDS + (lane >> 4) * 8) + half * HALF_KSTEPS * 32;
    const int kb_row = (lane & 7) + ((lane >> 4) << 3);
    const int kb_col = ((lane >> 3) & 1) * 8 + half * HALF_KSTEPS * 16;
    // B for O (V, transposed load): keys along k, value columns along n.
    const int vb_row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int vb_col = 256 * half + (lane >> 4) * 8;
    float4* mine = (float4*)(partial + (warp * 32 + lane) * 8);
    const float4* theirs = (const float4*)(partial + (((warp + ROW_GROUPS) % (2 * ROW_GROUPS)) * 32 + lane) * 8);

    for (int blk = 0; blk < nblk; ++blk) {
        const int t0 = k_lo + blk * KEY_TILE;
        cp_async_wait_all();
        __syncthreads();  // stage blk visible to all; every warp is done with stage blk-1 and with its partials
        if (blk + 1 < nblk) load_keys((blk + 1) & 1, t0 + KEY_TILE);
        cp_async_commit();
        const bf16_t* kb = k_s + (blk & 1) * KEY_TILE * LDS;

        // ---- S = Q K^T over this warp's half of the depth: 16 rows x 16 keys, 18 k-steps ----
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const unsigned k_addr = smem_u32(kb + kb_row * LDS + kb_col);
#pragma unroll 6
        for (int kk = 0; kk < HALF_KSTEPS; ++kk) {
            unsigned a0, a1, a2, a3, b0, b1, b2, b3;
            ldsm_x4(q_addr + kk * 32, a0, a1, a2, a3);
            ldsm_x4(k_addr + kk * 32, b0, b1, b2, b3);
            mma_bf16(s[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[1], a0, a1, a2, a3, b2, b3);
        }
        // ---- the pair's two halves added: both warps now hold the same 16 x 16 scores ----
        mine[0] = make_float4(s[0][0], s[0][1], s[0][2], s[0][3]);
        mine[1] = make_float4(s[1][0], s[1][1], s[1][2], s[1][3]);
        pair_barrier(rgroup);
        const float4 x0 = theirs[0], x1 = theirs[1];
        s[0][0] += x0.x; s[0][1] += x0.y; s[0][2] += x0.z; s[0][3] += x0.w;
        s[1][0] += x1.x; s[1][1] += x1.y; s[1][2] += x1.z; s[1][3] += x1.w;

        // ---- mask (prefix always visible; tree key j visible iff ancestor-or-self), scale, row maxima ----
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hh = e >> 1;
                const int t = t0 + 8 * n + 2 * quad + (e & 1);
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

        // ---- online softmax over the whole stage, in every warp of the pair alike ----
        unsigned pa[4];  // P as the m16k16 A operand: rows g / g+8, keys 2q.. of n-tile 0 and 8+2q.. of n-tile 1
        float alpha[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
            mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            const float m_new = fmaxf(m_run[hh], mx[hh]);
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
                pa[2 * n + hh] = pack_bf16x2(p0, p1);
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

        // ---- O += P V: 16 rows x 256 value columns per warp, 16 keys = one k-step ----
        const unsigned v_addr = smem_u32(kb + vb_row * LDS + vb_col);
#pragma unroll
        for (int np = 0; np < 16; ++np) {
            unsigned b0, b1, b2, b3;
            ldsm_x4_t(v_addr + np * 32, b0, b1, b2, b3);
            mma_bf16(o[2 * np], pa[0], pa[1], pa[2], pa[3], b0, b1);
            mma_bf16(o[2 * np + 1], pa[0], pa[1], pa[2], pa[3], b2, b3);
        }
    }

    // ---- row sums: each warp saw every key of its rows, so a quad reduce completes them ----
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 1);
        l_run[hh] += __shfl_xor_sync(0xffffffffu, l_run[hh], 2);
    }

    if (num_splits == 1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            const float inv = l_run[hh] > 0.f ? 1.f / l_run[hh] : 0.f;
            unsigned* dst = (unsigned*)(out + grow * D_V + 256 * half + 2 * quad);
#pragma unroll
            for (int j = 0; j < 32; ++j) dst[4 * j] = pack_bf16x2(o[j][2 * hh] * inv, o[j][2 * hh + 1] * inv);
            if (half == 0 && quad == 0)
                lse[grow] = l_run[hh] > 0.f ? (m_run[hh] + log2f(l_run[hh])) * LN2 : NEG_INF;
        }
    } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            float2* dst = (float2*)(part_o + ((long long)split * total_rows + grow) * D_V + 256 * half + 2 * quad);
#pragma unroll
            for (int j = 0; j < 32; ++j) dst[4 * j] = make_float2(o[j][2 * hh], o[j][2 * hh + 1]);
            if (half == 0 && quad == 0) part_ml[(long long)split * total_rows + grow] = make_float2(m_run[hh], l_run[hh]);
        }
    }
}

MLA_TREE_VERIFY_ENTRY(mla_tree_verify_compact_i64, long long, mla_tree_verify_compact_body)
MLA_TREE_VERIFY_ENTRY(mla_tree_verify_compact_i32, int, mla_tree_verify_compact_body)
