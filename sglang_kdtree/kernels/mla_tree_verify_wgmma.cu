// Tree-verify attention for absorbed MLA on Hopper tensor cores (sm_90a wgmma). The problem, the inputs, the
// outputs and the split-K partial states are exactly mla_tree_verify.cu's (its header states them; its merge
// kernel combines this kernel's partial states too); only how a CTA multiplies changes.
//
// Why: the mma.sync kernel feeds each warp's tensor core from shared memory through ldmatrix, about one x4 load
// per mma, and at ~20 % of the bf16 roofline it is bound by shared-memory bandwidth. A wgmma reads its operands
// from shared memory once for a warpgroup (four warps), so the same work moves ~2.5x fewer shared-memory bytes.
//
// CTA: 64 consecutive (node, head) query rows of one request (one wgmma M), 256 threads = two warpgroups; the
// request's keys stream through shared memory 64 at a time (double buffered; warpgroup 1 issues the cp.async loads
// of the next tile while warpgroup 0 computes):
//   * warpgroup 0: S = Q K^T (64 x 64 keys, 36 wgmma m64n64k16 over depth 576), the ancestor mask, the online
//     softmax; P (bf16) and each row's rescale factor go to shared memory;
//   * both warpgroups: O += P V for their half of the 512 value columns (4 wgmma m64n256k16; V is read in place
//     from the key tile, since a key's value is the first 512 columns of its row: B is N-major, transposed).
// Shared memory (1024-byte aligned): Q 73,728 B, two key tiles 147,456 B, P 8,192 B, row factors 512 B.
// A 64-row tile is stored as nine 64-column blocks, each 64 rows x 128 B with the 16-byte chunks of row r
// XOR-swizzled by r % 8: wgmma's 128-byte swizzle (the descriptors below), which also spreads cp.async writes
// over every bank.
//
// No system includes (NVRTC); inline PTX throughout. Compiled for sm_90a only (gpu/runtime.load_module_arch).

#include "mla_common.cuh"

#define KEY_TILE 64
#define CHUNKS (D_QK / 8)                      // 16-byte chunks per 576-wide row
#define BLK_BYTES (64 * 128)                   // one 64-column block of a 64-row tile
#define TILE_BYTES ((D_QK / 64) * BLK_BYTES)   // a 64 x 576 bf16 tile
#define K_OFF TILE_BYTES                       // two key tiles after Q
#define P_OFF (3 * TILE_BYTES)
#define ROWF_OFF (P_OFF + BLK_BYTES)

// Byte offset of 16-byte chunk `chunk` (0..71) of row `row` (0..63) inside a swizzled tile.
__device__ __forceinline__ u32 swz(int row, int chunk) {
    return (u32)((chunk >> 3) * BLK_BYTES + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Generic-proxy shared-memory writes (cp.async, st.shared) made visible to wgmma's async proxy; each writing thread
// runs it before the barrier that precedes the wgmma.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// After the wait: the accumulators are read only past this point (the compiler sees them produced here).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// 2^x in one MUFU op (flushes subnormal results to 0: a P of 2^-126 is nothing next to the row's 1).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major operands (Q, K, P): lbo unused (16), sbo = 1024
// (the next 8 rows). N-major V: lbo = the next 64 value columns (a column block), sbo = the next 8 keys.
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both K-major in shared memory; scale_d 0 overwrites D.
__device__ __forceinline__ void wgmma_m64n64_kk(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n256_kn(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <typename Index>
__device__ __forceinline__ void mla_tree_verify_wgmma_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, long long kv_stride,
    const long long* __restrict__ kv_start, const long long* __restrict__ kv_end, const Index* __restrict__ kv_indices,
    const long long* __restrict__ tree_slots, const unsigned* __restrict__ anc_bits, int N, int H, int words,
    int num_splits, float scale_log2, bf16_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o,
    float2* __restrict__ part_ml, long long total_rows) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;  // the swizzle pattern repeats on 1024-byte boundaries
    unsigned char* smem = smem_raw + (base - raw);
    const u32 q_sa = base, k_sa = base + K_OFF, p_sa = base + P_OFF;
    unsigned char* p_s = smem + P_OFF;
    float* alpha_s = (float*)(smem + ROWF_OFF);  // [ROW_TILE] this tile's rescale factor per row
    float* sum_s = alpha_s + ROW_TILE;           // [ROW_TILE] final row sums

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = warp >> 2, wr = warp & 3;     // warpgroup; warp within it (owns rows 16 wr .. +15)
    const int g = lane >> 2, quad = lane & 3;
    const int b = blockIdx.z, split = blockIdx.y;
    const int rows_per_req = N * H;
    const int row0 = blockIdx.x * ROW_TILE;
    const long long req_row0 = (long long)b * rows_per_req;

    const KeySplit ks = key_split<KEY_TILE>(kv_start, kv_end, b, split, num_splits, N);
    const long long kv_begin = ks.kv_begin;
    const int prefix = ks.prefix, k_lo = ks.k_lo, k_hi = ks.k_hi, nblk = ks.nblk;

    // The two rows of this thread's accumulator fragments (the same in both warpgroups): g and g + 8 of its warp.
    int lrow[2];
    bool row_ok[2];
    const unsigned* anc_row[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        lrow[hh] = 16 * wr + g + 8 * hh;
        const int rr = row0 + lrow[hh];
        row_ok[hh] = rr < rows_per_req;
        const int node = row_ok[hh] ? rr / H : N - 1;  // rows past the request compute on zeros, never stored
        anc_row[hh] = anc_bits + ((long long)b * N + node) * words;
    }

    // A key tile's loads, issued by warpgroup 1 alone: it is idle while warpgroup 0 computes S and the softmax, so
    // warpgroup 0 never waits on a slot lookup. 8 threads per key row (a warp covers 4 rows x 128 contiguous bytes
    // per load), 9 of its 72 chunks each, 16 rows per pass. (On the H200 this beat all 256 threads loading, and 2
    // or 4 threads per row: benchmarks/RESULTS.md.) The rows' slots are looked up one tile ahead
    // (fetch_slots, into registers; the lookup's latency passes while the previous tile computes), so a tile's
    // copies start as soon as its stage is free. A row past the split's keys gets slot -1 and zero-fills.
    long long slot_next[KEY_TILE / 16];
    auto fetch_slots = [&](int t0) {
        if (wg != 1) return;
        const int lt = tid - 128;
#pragma unroll
        for (int pass = 0; pass < KEY_TILE / 16; ++pass) {
            const int t = t0 + (lt >> 3) + 16 * pass;
            long long slot = -1;
            if (t < k_hi) slot = t < prefix ? (long long)kv_indices[kv_begin + t] : tree_slots[(long long)b * N + (t - prefix)];
            slot_next[pass] = slot;
        }
    };
    auto load_keys = [&](int stage) {
        if (wg != 1) return;
        const u32 dst = k_sa + stage * TILE_BYTES;
        const int lt = tid - 128;
#pragma unroll
        for (int pass = 0; pass < KEY_TILE / 16; ++pass) {
            const int r = (lt >> 3) + 16 * pass;
            const bool valid = slot_next[pass] >= 0;
            const bf16_t* src = kv + (valid ? slot_next[pass] : 0) * kv_stride;
#pragma unroll
            for (int j = 0; j < CHUNKS / 8; ++j) {
                const int ch = (lt & 7) + 8 * j;
                cp_async16(dst + swz(r, ch), src + ch * 8, valid);
            }
        }
    };

    const u64 dq = sw128_desc(q_sa, 16, 1024), dp = sw128_desc(p_sa, 16, 1024);  // advanced in 16-byte units
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF};
    float l_run[2] = {0.f, 0.f};
    float alpha[2] = {1.f, 1.f};

    if (nblk > 0) {
        for (int c = tid; c < ROW_TILE * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, ch = c - r * CHUNKS;
            const bool valid = row0 + r < rows_per_req;
            const bf16_t* src = q + (req_row0 + row0 + (valid ? r : 0)) * D_QK + ch * 8;
            cp_async16(q_sa + swz(r, ch), src, valid);
        }
        fetch_slots(k_lo);
        load_keys(0);
        if (nblk > 1) fetch_slots(k_lo + KEY_TILE);
    }
    cp_async_commit();

    for (int blk = 0; blk < nblk; ++blk) {
        const int t0 = k_lo + blk * KEY_TILE;
        const int stage = blk & 1;
        cp_async_wait_all();
        fence_async_smem();
        __syncthreads();  // tile blk (and Q) visible to both warpgroups' wgmma; tile blk-1 fully consumed
        if (blk + 1 < nblk) {
            load_keys(stage ^ 1);
            if (blk + 2 < nblk) fetch_slots(t0 + 2 * KEY_TILE);
        }
        cp_async_commit();
        const u32 kt = k_sa + stage * TILE_BYTES;

        if (wg == 0) {
            // ---- S = Q K^T over depth 576: 36 k-steps of 16 (4 per 64-column block, 32 bytes apart) ----
            float s[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) s[i] = 0.f;
            const u64 dk = sw128_desc(kt, 16, 1024);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < D_QK / 16; ++kk) {
                const u32 off = ((kk >> 2) * BLK_BYTES + (kk & 3) * 32) >> 4;  // descriptor units (16 bytes)
                wgmma_m64n64_kk(s, dq + off, dk + off, kk > 0);
            }
            wg_commit();
            wg_wait_all();
            fence_regs(s);

            // ---- mask (prefix always visible; tree key j iff ancestor-or-self), scale ----
            // s[4 i + e]: row lrow[e >> 1], key t0 + 8 i + 2 quad + (e & 1)
            if (t0 + KEY_TILE <= min(prefix, k_hi)) {  // the whole tile is prefix: every key visible to every row
#pragma unroll
                for (int i = 0; i < 32; ++i) s[i] *= scale_log2;
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int hh = e >> 1;
                        const int t = t0 + 8 * i + 2 * quad + (e & 1);
                        bool vis = t < k_hi;
                        if (vis && t >= prefix) {
                            const int j = t - prefix;
                            vis = (__ldg(anc_row[hh] + (j >> 5)) >> (j & 31)) & 1u;
                        }
                        // select, never add: a masked key may hold any value (poisoned rows included)
                        s[4 * i + e] = vis ? s[4 * i + e] * scale_log2 : NEG_INF;
                    }
                }
            }
            // ---- online softmax (row max and sum as pairwise trees: short dependency chains) ----
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float m[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) m[i] = fmaxf(s[4 * i + 2 * hh], s[4 * i + 2 * hh + 1]);
#pragma unroll
                for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
                    for (int i = 0; i < w; ++i) m[i] = fmaxf(m[i], m[i + w]);
                float mx = m[0];
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[hh], mx);
                // a row with no visible key so far keeps max -inf: use 0 as reference so exp2 sees -inf, not NaN
                const float ref = m_new == NEG_INF ? 0.f : m_new;
                alpha[hh] = ex2(m_run[hh] - ref);
                m_run[hh] = m_new;
                const int row = lrow[hh];
                float sums[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float p0 = ex2(s[4 * i + 2 * hh] - ref);
                    const float p1 = ex2(s[4 * i + 2 * hh + 1] - ref);
                    sums[i] = p0 + p1;
                    // P[row][8 i + 2 quad ..+1], K-major, swizzled like every tile
                    *(u32*)(p_s + row * 128 + ((i ^ (row & 7)) << 4) + 4 * quad) = pack_bf16x2(p0, p1);
                }
#pragma unroll
                for (int w = 4; w >= 1; w >>= 1)
#pragma unroll
                    for (int i = 0; i < w; ++i) sums[i] += sums[i + w];
                l_run[hh] = l_run[hh] * alpha[hh] + sums[0];
                if (quad == 0) alpha_s[row] = alpha[hh];
            }
        }
        fence_async_smem();
        __syncthreads();  // P and the row factors of this tile visible to both warpgroups
        if (wg == 1) {
            alpha[0] = alpha_s[lrow[0]];
            alpha[1] = alpha_s[lrow[1]];
        }
        // ---- O = alpha O + P V over this warpgroup's 256 value columns: 4 k-steps of 16 keys ----
        // (once the running maxima settle, alpha is 1 for every row of the warp: the rescale is skipped)
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                o[4 * i] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
        }
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < KEY_TILE / 16; ++ks) {  // P: 32 bytes per k-step; V: 16 keys = 2 KiB per k-step
            wgmma_m64n256_kn(o, dp + ks * 2, sw128_desc(kt + 4 * wg * BLK_BYTES, BLK_BYTES, 1024) + ks * 128, 1);
        }
        wg_commit();
        wg_wait_all();
        fence_regs(o);
    }

    // ---- row sums: warpgroup 0's quad reduce, shared with warpgroup 1 ----
    float l_tot[2];
    if (wg == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = l_run[hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            l_tot[hh] = l;
            if (quad == 0) sum_s[lrow[hh]] = l;
        }
    }
    __syncthreads();
    if (wg == 1) {
        l_tot[0] = sum_s[lrow[0]];
        l_tot[1] = sum_s[lrow[1]];
    }

    // o[4 i + e]: row lrow[e >> 1], value column 256 wg + 8 i + 2 quad + (e & 1)
    if (num_splits == 1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            const float inv = l_tot[hh] > 0.f ? 1.f / l_tot[hh] : 0.f;
            u32* dst = (u32*)(out + grow * D_V + 256 * wg + 2 * quad);
#pragma unroll
            for (int i = 0; i < 32; ++i) dst[4 * i] = pack_bf16x2(o[4 * i + 2 * hh] * inv, o[4 * i + 2 * hh + 1] * inv);
            if (wg == 0 && quad == 0) lse[grow] = l_tot[hh] > 0.f ? (m_run[hh] + log2f(l_tot[hh])) * LN2 : NEG_INF;
        }
    } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (!row_ok[hh]) continue;
            const long long grow = req_row0 + row0 + lrow[hh];
            float2* dst = (float2*)(part_o + ((long long)split * total_rows + grow) * D_V + 256 * wg + 2 * quad);
#pragma unroll
            for (int i = 0; i < 32; ++i) dst[4 * i] = make_float2(o[4 * i + 2 * hh], o[4 * i + 2 * hh + 1]);
            if (wg == 0 && quad == 0) part_ml[(long long)split * total_rows + grow] = make_float2(m_run[hh], l_tot[hh]);
        }
    }
}

MLA_TREE_VERIFY_ENTRY(mla_tree_verify_wgmma_i64, long long, mla_tree_verify_wgmma_body)
MLA_TREE_VERIFY_ENTRY(mla_tree_verify_wgmma_i32, int, mla_tree_verify_wgmma_body)
