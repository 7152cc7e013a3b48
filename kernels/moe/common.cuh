// bf16 helpers shared by the MoE glue kernels (silu_and_mul.cu, moe_topk_sum.cu).
//
// No system includes: NVRTC's default include path has no cuda_bf16.h everywhere, so bf16 travels as its
// 16-bit pattern and is widened / rounded by hand. Included as "moe/common.cuh" (the runtime passes the
// kernels folder as the include path).
#pragma once

typedef unsigned short bf16_t;
typedef long long i64;

// The two bf16 halves of a 32-bit word as floats: lo is the lower address.
__device__ __forceinline__ float bf16_lo(unsigned pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned pair) { return __uint_as_float(pair & 0xffff0000u); }

// Two floats -> packed bf16x2, round to nearest even (sm_80+); lo lands in the low half (lower address).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
