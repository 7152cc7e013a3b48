// mma.sync helpers shared by the two mma.sync MLA tree-verify kernels (mla_tree_verify.cu, mla_tree_verify_compact.cu):
// ldmatrix loads of bf16 fragments, the m16n8k16 bf16 MMA with fp32 accumulation, and the named barrier of the two
// warps that share a 16-row group. Inline PTX only: NVRTC has no cuda_bf16.h / mma.h on its default include path.
#pragma once

#include "mla_common.cuh"

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
