// The split-K merge of the MLA tree-verify kernels (mla_tree_verify.cu, mla_tree_verify_compact.cu and
// mla_tree_verify_wgmma.cu write the same partial states when a launch splits the keys): one pass per query row.

#include "mla_common.cuh"

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
