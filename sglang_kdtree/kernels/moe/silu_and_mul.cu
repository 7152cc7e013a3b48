// SiLU-and-mul between Marlin MoE's two GEMMs (twin: sglang_kdtree.moe.reference.silu_and_mul_reference).
//
// gate_up [rows, 2N] bf16 holds the gate projection in columns [0, N) and the up projection in [N, 2N)
// (SGLang's w13 = gate | up, not interleaved); out [rows, N] bf16 = silu(gate) * up, computed in fp32 and
// rounded once to nearest even, like SGLang's silu_and_mul. Rows of dropped routes hold garbage from the
// first GEMM; they are transformed like any row and never read by the second GEMM.
//
// bf16 travels as its 16-bit pattern (helpers in sglang_kdtree/kernels/common.cuh). Each thread moves 8 values (one
// 16-byte load of gate, one of up, one store): the op is pure bandwidth, and N % 8 == 0 with 16-byte aligned rows is
// checked by the Python launcher.

#include "common.cuh"

// expf, not __expf: the fast intrinsic is off by a few ulp, which would show in the bf16 rounding.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

extern "C" __global__ void silu_and_mul_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out,
                                             i64 rows, int half_width) {
  const int vecs_per_row = half_width / 8;
  const i64 total = rows * vecs_per_row;
  for (i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x; v < total; v += (i64)gridDim.x * blockDim.x) {
    const i64 row = v / vecs_per_row;
    const int col = (int)(v - row * vecs_per_row) * 8;
    const uint4 g = *reinterpret_cast<const uint4*>(gate_up + row * 2 * half_width + col);
    const uint4 u = *reinterpret_cast<const uint4*>(gate_up + row * 2 * half_width + half_width + col);
    uint4 r;
    r.x = pack_bf16x2(silu(bf16_lo(g.x)) * bf16_lo(u.x), silu(bf16_hi(g.x)) * bf16_hi(u.x));
    r.y = pack_bf16x2(silu(bf16_lo(g.y)) * bf16_lo(u.y), silu(bf16_hi(g.y)) * bf16_hi(u.y));
    r.z = pack_bf16x2(silu(bf16_lo(g.z)) * bf16_lo(u.z), silu(bf16_hi(g.z)) * bf16_hi(u.z));
    r.w = pack_bf16x2(silu(bf16_lo(g.w)) * bf16_lo(u.w), silu(bf16_hi(g.w)) * bf16_hi(u.w));
    *reinterpret_cast<uint4*>(out + row * half_width + col) = r;
  }
}
