// Top-k combine after Marlin MoE's second GEMM (twin: sglang_kdtree.moe.reference.moe_topk_sum_reference).
//
// routed [tokens * top_k, K] bf16 holds each route's expert output, already multiplied by its top-k weight
// (the second GEMM runs with mul_topk_weights). out [tokens, K] bf16 =
//     routed_scaling_factor * sum over k of routed[token * top_k + k]
// summed in fp32 in ascending k and rounded once, like SGLang's moe_sum_reduce. Routes whose expert id is
// outside [0, num_experts) were dropped by moe_align.cu: their rows were never written, so they are
// skipped here (a token with no live route gets zeros).
//
// bf16 travels as its 16-bit pattern (helpers in sglang_kdtree/kernels/common.cuh); each thread owns 8 consecutive
// columns of one token (16-byte loads), K % 8 == 0 is checked by the Python launcher.

#include "common.cuh"

template <typename Id>
__device__ void moe_topk_sum_impl(const bf16_t* __restrict__ routed, const Id* __restrict__ topk_ids,
                                  bf16_t* __restrict__ out, i64 tokens, int top_k, int width, int num_experts,
                                  float scale) {
  const int vecs_per_row = width / 8;
  const i64 total = tokens * vecs_per_row;
  for (i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x; v < total; v += (i64)gridDim.x * blockDim.x) {
    const i64 token = v / vecs_per_row;
    const int col = (int)(v - token * vecs_per_row) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < top_k; ++k) {
      const i64 id = (i64)topk_ids[token * top_k + k];
      if (id < 0 || id >= num_experts) continue;
      const uint4 r = *reinterpret_cast<const uint4*>(routed + (token * top_k + k) * width + col);
      acc[0] += bf16_lo(r.x); acc[1] += bf16_hi(r.x);
      acc[2] += bf16_lo(r.y); acc[3] += bf16_hi(r.y);
      acc[4] += bf16_lo(r.z); acc[5] += bf16_hi(r.z);
      acc[6] += bf16_lo(r.w); acc[7] += bf16_hi(r.w);
    }
    uint4 o;
    o.x = pack_bf16x2(acc[0] * scale, acc[1] * scale);
    o.y = pack_bf16x2(acc[2] * scale, acc[3] * scale);
    o.z = pack_bf16x2(acc[4] * scale, acc[5] * scale);
    o.w = pack_bf16x2(acc[6] * scale, acc[7] * scale);
    *reinterpret_cast<uint4*>(out + token * width + col) = o;
  }
}

extern "C" __global__ void moe_topk_sum_bf16_i32(const bf16_t* routed, const int* topk_ids, bf16_t* out,
                                                 i64 tokens, int top_k, int width, int num_experts, float scale) {
  moe_topk_sum_impl(routed, topk_ids, out, tokens, top_k, width, num_experts, scale);
}

extern "C" __global__ void moe_topk_sum_bf16_i64(const bf16_t* routed, const i64* topk_ids, bf16_t* out,
                                                 i64 tokens, int top_k, int width, int num_experts, float scale) {
  moe_topk_sum_impl(routed, topk_ids, out, tokens, top_k, width, num_experts, scale);
}
