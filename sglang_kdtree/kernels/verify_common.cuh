// What verify_inputs.cu and best_first_tree.cu's fused tree + verify kernels share (twin: reference.verify_inputs):
// a row's ancestor-or-self words, and SGLang's FULL_MASK layout: request b's block of N rows starts at
// N*N*b + N*sum(seq_lens[:b]); a row is seq_lens[b] + N bytes, the prefix columns True, then the ancestor-or-self row.
#pragma once
#include "common.cuh"

// n bytes of 1 from p (word stores where p is 4-byte aligned), by the 32 lanes of a warp.
__device__ __forceinline__ void fill_ones(unsigned char* p, long long n, int lane) {
  const long long head = min((long long)((4 - ((unsigned long long)p & 3)) & 3), n);
  if (lane < head) p[lane] = 1;
  u32* w = reinterpret_cast<u32*>(p + head);
  const long long words = (n - head) >> 2;
  for (long long k = lane; k < words; k += 32) w[k] = 0x01010101u;
  const long long tail = head + words * 4;
  if (tail + lane < n) p[tail + lane] = 1;
}

// sum(seq_lens[:b]) by one warp (each lane a strided share, then the warp's sum in every lane): request b's FULL_MASK
// block starts at N*N*b + N*sum.
__device__ __forceinline__ long long warp_sum_before(const long long* __restrict__ seq_lens, int b) {
  const int lane = threadIdx.x & 31;
  long long before = 0;
  for (int i = lane; i < b; i += 32) before += seq_lens[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
  return before;
}

// Row i's W ancestor-or-self words (bit x % 32 of word x / 32 for every node x on i's chain), each handed once to
// emit(w, word): the words above i's own as 0, then from i's word down, since the chain strictly decreases
// (parent(x) < x; -1 ends it). At most max_len nodes are walked; returns where the walk stopped: -1, or the next node
// when max_len cut it (a chain too deep: a malformed tree).
template <typename Parent, typename Emit>
__device__ __forceinline__ int ancestor_words(int i, int W, int max_len, Parent parent, Emit emit) {
  for (int w = (i >> 5) + 1; w < W; ++w) emit(w, 0u);
  int cw = i >> 5, x = i, len = 0;
  u32 word = 0;
  while (x >= 0 && len < max_len) {
    for (; cw > (x >> 5); --cw) {
      emit(cw, word);
      word = 0;
    }
    word |= 1u << (x & 31);
    ++len;
    x = parent(x);
  }
  for (; cw >= 0; --cw) {
    emit(cw, word);
    word = 0;
  }
  return x;
}
