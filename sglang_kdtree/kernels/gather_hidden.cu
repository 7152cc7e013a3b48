// The accepted rows of the verify hidden states, packed per request for the drafter:
// out[b, j] = hidden[hidden_rows[b, j]] for j < tau (the accepted nodes' rows, not the first tau rows),
// zero for the padding columns (hidden_rows = -1). One block per (request, column j).
//
// A row index outside [0, num_rows) is an error (bit OR-ed into errors[0]); that output row is zeroed.

#include "common.cuh"  // ERR_BAD_HIDDEN_ROW, i64

template <typename Unit>
__device__ void gather_impl(const Unit* hidden, i64 hidden_ld_units, i64 num_rows, i64 row_units,
                            const i64* hidden_rows, Unit* out, int* errors) {
  const i64 o = blockIdx.x;  // b * M + j
  const i64 r = hidden_rows[o];
  const bool ok = r >= 0 && r < num_rows;
  if ((r >= num_rows || r < -1) && threadIdx.x == 0) atomicOr(errors, ERR_BAD_HIDDEN_ROW);
  Unit* dst = out + o * row_units;
  if (ok) {
    const Unit* src = hidden + r * hidden_ld_units;
    for (i64 c = threadIdx.x; c < row_units; c += blockDim.x) dst[c] = src[c];
  } else {
    Unit zero;
    memset(&zero, 0, sizeof(Unit));
    for (i64 c = threadIdx.x; c < row_units; c += blockDim.x) dst[c] = zero;
  }
}

#define GATHER_ENTRY(NAME, UNIT)                                                                         \
  extern "C" __global__ void NAME(const UNIT* hidden, i64 hidden_ld_units, i64 num_rows, i64 row_units, \
                                  const i64* hidden_rows, UNIT* out, int* errors) {                      \
    gather_impl<UNIT>(hidden, hidden_ld_units, num_rows, row_units, hidden_rows, out, errors);          \
  }

GATHER_ENTRY(gather_hidden_16B, uint4)
GATHER_ENTRY(gather_hidden_4B, unsigned int)
GATHER_ENTRY(gather_hidden_2B, unsigned short)
