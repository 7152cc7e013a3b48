// Commit of the accepted paths: the plan (which KV slot moves where) and the KV row moves for every layer
// of a pool in one launch.
//
// A pool is a table of layer buffers (device pointers), each [slots, row] with the same row size and slot
// stride: SGLang's MLA pool gives one [slots, 1, 576] bf16 buffer per layer, its MHA pool a k and a v
// buffer per layer (both go in the table). Request b's accepted row j moves from src_slots[b, j] to
// dst_slots[b, j]. Inside a request a destination can be another row's source (accepted = [0, 2, 3]:
// row 1 reads slot P+2, which row 2 writes), so a block reads all moving rows of a column tile into
// registers, synchronises, then writes: no ordering between rows is needed.
//
// Errors are bits OR-ed into errors[0]; a request with any bad slot is skipped as a whole (no write).

#include "common.cuh"  // ERR_BAD_PATH (an invalid accepted path), ERR_BAD_SLOT (a slot out of range), i64

// One thread per (request, path column): src/dst slots and hidden-state rows, -1 past tau.
// verify_slots[b, i] is the KV slot holding node i during verify (= position P+i after the commit).
template <typename Slot>
__device__ void commit_plan_impl(const i64* accepted, const i64* accept_lens, const Slot* verify_slots,
                                 i64 slot_ld, int bs, int M, int N, i64* src_slots, i64* dst_slots,
                                 i64* hidden_rows, int* errors) {
  const int b = blockIdx.x;
  const i64 tau = accept_lens[b];
  const i64* path = accepted + (i64)b * M;
  bool valid = tau >= 1 && tau <= M && tau <= N;
  // strictly increasing from 0 and inside the window: checked by every thread for its column
  for (int j = threadIdx.x; valid && j < tau; j += blockDim.x) {
    const i64 node = path[j];
    const bool ok = (j == 0) ? node == 0 : (node > path[j - 1] && node < N);
    if (!ok) valid = false;
  }
  valid = __syncthreads_and(valid);
  if (!valid && threadIdx.x == 0) atomicOr(errors, ERR_BAD_PATH);
  for (int j = threadIdx.x; j < M; j += blockDim.x) {
    const i64 o = (i64)b * M + j;
    if (valid && j < tau) {
      const i64 node = path[j];
      src_slots[o] = (i64)verify_slots[(i64)b * slot_ld + node];
      dst_slots[o] = (i64)verify_slots[(i64)b * slot_ld + j];
      hidden_rows[o] = (i64)b * N + node;
    } else {
      src_slots[o] = -1;
      dst_slots[o] = -1;
      hidden_rows[o] = -1;
    }
  }
}

extern "C" __global__ void commit_plan_i64(const i64* accepted, const i64* accept_lens, const i64* verify_slots,
                                           i64 slot_ld, int bs, int M, int N, i64* src_slots, i64* dst_slots,
                                           i64* hidden_rows, int* errors) {
  commit_plan_impl(accepted, accept_lens, verify_slots, slot_ld, bs, M, N, src_slots, dst_slots, hidden_rows,
                   errors);
}

extern "C" __global__ void commit_plan_i32(const i64* accepted, const i64* accept_lens, const int* verify_slots,
                                           i64 slot_ld, int bs, int M, int N, i64* src_slots, i64* dst_slots,
                                           i64* hidden_rows, int* errors) {
  commit_plan_impl(accepted, accept_lens, verify_slots, slot_ld, bs, M, N, src_slots, dst_slots, hidden_rows,
                   errors);
}

// Rows moved per block are held in registers: UNITS_PER_THREAD units of `Unit` per thread per tile. With
// 256 threads a tile holds 2048 units, i.e. 15 moving MLA rows (15 x 72 x 16 B) in one tile. At <= 64
// registers 4 blocks stay resident per SM: 128 KB of loads in flight per SM, which is what HBM latency x
// bandwidth asks for (Little's law: ~4 TB/s x ~1.5 us over 132 SMs is ~48 KB per SM).
#define UNITS_PER_THREAD 8
#define COMPACT_THREADS 256
#define MAX_ROWS 1025

// grid = (layer groups, bs, column splits); block = COMPACT_THREADS.
// Each block moves the moving rows (src != dst) of one request in layers_per_block layers (the plan is
// read once and reused for every layer), for its column split, tile by tile: a tile covers all moving
// rows and as many columns as fit in registers.
template <typename Unit>
__device__ void compact_impl(const unsigned long long* layer_ptrs, int num_layers, int layers_per_block,
                             i64 slot_stride_units, i64 row_units, i64 num_slots, const i64* src_slots,
                             const i64* dst_slots, const i64* accept_lens, int M, int* errors) {
  __shared__ i64 s_src[MAX_ROWS];  // unit offset of each moving row's source slot
  __shared__ i64 s_dst[MAX_ROWS];
  __shared__ int s_moving;
  const int layer_lo = blockIdx.x * layers_per_block, b = blockIdx.y;
  const int layer_hi = min(num_layers, layer_lo + layers_per_block);
  i64 tau = accept_lens[b];
  tau = tau < 0 ? 0 : (tau > M ? M : tau);
  if (threadIdx.x == 0) s_moving = 0;
  __syncthreads();
  // compact the list to the rows that move (any order: all reads precede all writes anyway); a path
  // already in place is a no-op: no reads, no writes
  bool bad = false;
  for (int j = threadIdx.x; j < tau; j += blockDim.x) {
    const i64 s = src_slots[(i64)b * M + j], d = dst_slots[(i64)b * M + j];
    if (s < 0 || s >= num_slots || d < 0 || d >= num_slots) {
      bad = true;
    } else if (s != d) {
      const int k = atomicAdd(&s_moving, 1);
      s_src[k] = s * slot_stride_units;  // unit offsets of the rows, computed once for every layer
      s_dst[k] = d * slot_stride_units;
    }
  }
  bad = __syncthreads_or(bad);
  if (bad) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.z == 0) atomicOr(errors, ERR_BAD_SLOT);
    return;
  }
  const int moving = s_moving;
  if (moving == 0) return;
  // this block's column split
  const i64 per_split = (row_units + gridDim.z - 1) / gridDim.z;
  const i64 col_lo = blockIdx.z * per_split;
  const i64 col_hi = min(row_units, col_lo + per_split);
  if (col_lo >= col_hi) return;
  const i64 capacity = (i64)blockDim.x * UNITS_PER_THREAD;
  i64 width = capacity / moving;
  if (width < 1) width = 1;
  for (int layer = layer_lo; layer < layer_hi; ++layer) {
    // layers are separate buffers: the next layer's reads need no barrier against this layer's writes
    Unit* base = reinterpret_cast<Unit*>(layer_ptrs[layer]);
    for (i64 c0 = col_lo; c0 < col_hi; c0 += width) {
      // 32-bit index math: a tile holds at most blockDim * UNITS_PER_THREAD units (64-bit division is slow)
      const int w = (int)min(width, col_hi - c0);
      const int items = w * moving;
      Unit held[UNITS_PER_THREAD];
#pragma unroll
      for (int k = 0; k < UNITS_PER_THREAD; ++k) {
        const int idx = threadIdx.x + k * blockDim.x;
        if (idx < items) {
          const int r = idx / w;
          held[k] = base[s_src[r] + c0 + idx % w];
        }
      }
      // every source of this tile is read before any destination of it is written
      __syncthreads();
#pragma unroll
      for (int k = 0; k < UNITS_PER_THREAD; ++k) {
        const int idx = threadIdx.x + k * blockDim.x;
        if (idx < items) {
          const int r = idx / w;
          base[s_dst[r] + c0 + idx % w] = held[k];
        }
      }
      // the next tile touches other columns only, so it needs no barrier against these writes
    }
  }
}

#define COMPACT_ENTRY(NAME, UNIT)                                                                             \
  extern "C" __global__ void __launch_bounds__(COMPACT_THREADS, 4)                                           \
      NAME(const unsigned long long* layer_ptrs, int num_layers, int layers_per_block, i64 slot_stride_units,  \
           i64 row_units, i64 num_slots, const i64* src_slots, const i64* dst_slots, const i64* accept_lens,   \
           int M, int* errors) {                                                                              \
    compact_impl<UNIT>(layer_ptrs, num_layers, layers_per_block, slot_stride_units, row_units, num_slots,     \
                       src_slots, dst_slots, accept_lens, M, errors);                                         \
  }

COMPACT_ENTRY(compact_kv_16B, uint4)
COMPACT_ENTRY(compact_kv_4B, unsigned int)
COMPACT_ENTRY(compact_kv_2B, unsigned short)
COMPACT_ENTRY(compact_kv_1B, unsigned char)
