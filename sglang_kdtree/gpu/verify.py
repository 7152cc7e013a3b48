"""GPU verify inputs from a padded tree batch (``sglang_kdtree/kernels/verify_inputs.cu``); twin of
``reference.verify_inputs``: input ids, positions, SGLang's FULL_MASK for mixed prefix lengths, bit-packed
ancestor rows and the retrieve_index / next_token / next_sibling links of ``verify_tree_greedy``.

No host sync when ``seq_lens_sum`` (the scheduler's host-side ``sum(seq_lens)``) is passed; without it the
launcher reads the sum from the device (one sync, documented). A malformed tree sets ``ERR_BAD_TREE`` in
``error_flag`` (``TOPK_ERRORS``).
"""

from __future__ import annotations

import numpy as np

from sglang_kdtree.contract import VerifyInputs
from sglang_kdtree.gpu import runtime
from sglang_kdtree.gpu.topk import _ptr, _require_cuda, new_error_flag, raise_on_flag
from sglang_kdtree.state import MAX_WIDTH as _MAX_WIDTH

__all__ = ["verify_inputs", "verify_outputs", "alloc_verify_inputs", "full_mask_numel"]

_KERNEL = "verify_inputs.cu"
_ROWS_PER_BLOCK = 8  # = VERIFY_WARPS in the kernel: one row per warp


def full_mask_numel(seq_lens_sum: int, width: int, bs: int) -> int:
    """Entries of SGLang's FULL_MASK for ``bs`` trees of width ``width`` over prefixes summing to
    ``seq_lens_sum``: each request's ``N x (P + N)`` block."""
    return int(seq_lens_sum) * int(width) + int(width) * int(width) * int(bs)


def alloc_verify_inputs(max_batch: int, max_width: int, max_mask_bytes: int, device) -> VerifyInputs:
    """Buffers for up to ``max_batch`` requests of width ``max_width`` and a FULL_MASK of ``max_mask_bytes``."""
    import torch

    words = (max_width + 31) // 32
    n = max_batch * max_width
    return VerifyInputs(
        input_ids=torch.empty(n, dtype=torch.int64, device=device),
        positions=torch.empty(n, dtype=torch.int64, device=device),
        full_mask=torch.empty(max(int(max_mask_bytes), 0), dtype=torch.bool, device=device),
        ancestor_bits=torch.empty(n * words, dtype=torch.int32, device=device),
        retrieve_index=torch.empty(n, dtype=torch.int64, device=device),
        retrieve_next_token=torch.empty(n, dtype=torch.int64, device=device),
        retrieve_next_sibling=torch.empty(n, dtype=torch.int64, device=device),
    )


def verify_views(out: VerifyInputs, bs: int, width: int, mask_numel: int) -> VerifyInputs:
    """The views of ``out`` (``alloc_verify_inputs`` buffers) that ``verify_inputs`` returns for ``bs`` trees of
    width ``width`` and a FULL_MASK of ``mask_numel`` bytes (also how a replayed CUDA graph's result is read)."""
    n, words = bs * width, (width + 31) // 32
    return VerifyInputs(
        input_ids=out.input_ids[:n],
        positions=out.positions[:n],
        full_mask=out.full_mask[:mask_numel],
        ancestor_bits=out.ancestor_bits[: n * words].view(bs, width, words),
        retrieve_index=out.retrieve_index[:n].view(bs, width),
        retrieve_next_token=out.retrieve_next_token[:n].view(bs, width),
        retrieve_next_sibling=out.retrieve_next_sibling[:n].view(bs, width),
    )


def verify_outputs(seq_lens, bs: int, width: int, seq_lens_sum, out: VerifyInputs | None, dev) -> VerifyInputs:
    """Checks ``seq_lens`` (``[bs]`` int64 CUDA), ``seq_lens_sum`` and the width, and returns the views of ``out`` (or
    of new buffers) that verify inputs for ``bs`` trees of width ``width`` are written to (``verify_inputs`` and
    ``gpu.tree.build_trees_verify``)."""
    import torch

    _require_cuda("seq_lens", seq_lens)
    if seq_lens.dtype != torch.int64:
        raise TypeError(f"seq_lens must be an int64 array, got dtype {seq_lens.dtype}")
    if tuple(seq_lens.shape) != (bs,):
        raise ValueError(f"seq_lens has shape {tuple(seq_lens.shape)}, expected {(bs,)}")
    if not 1 <= width <= _MAX_WIDTH:
        raise ValueError(f"tree width N = {width} must lie in [1, {_MAX_WIDTH}]")
    if seq_lens_sum is None:
        seq_lens_sum = int(seq_lens.sum().item())  # the one sync; pass seq_lens_sum to avoid it
    if isinstance(seq_lens_sum, bool) or not isinstance(seq_lens_sum, (int, np.integer)) or seq_lens_sum < 0:
        raise ValueError(f"seq_lens_sum must be an int >= 0, got {seq_lens_sum!r}")
    words = (width + 31) // 32
    n = bs * width
    mask_numel = full_mask_numel(seq_lens_sum, width, bs)
    if out is None:
        out = alloc_verify_inputs(bs, width, mask_numel, dev)
    else:
        if out.input_ids.numel() < n or out.ancestor_bits.numel() < n * words:
            raise ValueError(f"out holds {out.input_ids.numel()} rows, fewer than bs*N = {n}")
        if out.full_mask.numel() < mask_numel:
            raise ValueError(
                f"out.full_mask holds {out.full_mask.numel()} bytes, fewer than sum(seq_lens)*N + N*N*bs = "
                f"{mask_numel}; build the TreeBuilder with a larger max_mask_bytes"
            )
    return verify_views(out, bs, width, mask_numel)


def verify_inputs(trees, seq_lens, *, seq_lens_sum: int | None = None, out: VerifyInputs | None = None,
                  fill_prefix: bool = True, error_flag=None, check: bool = False) -> VerifyInputs:
    """Verify inputs for a batch of trees; twin of ``reference.verify_inputs``.

    Args:
        trees: ``contract.Trees`` (or any object with ``tokens``/``depths``/``parents`` ``[bs, N]`` int64 and
            ``num_nodes`` ``[bs]`` int64 CUDA tensors), N <= ``state.MAX_WIDTH``.
        seq_lens: ``[bs]`` int64 CUDA committed lengths P (the root sits at position P), >= 0.
        seq_lens_sum: host int ``sum(seq_lens)``; sizes the FULL_MASK without a sync (else one sync).
        out: preallocated ``alloc_verify_inputs`` buffers (views of the right sizes are returned).
        fill_prefix: write the True prefix columns (False: the mask buffer already holds True there).
        error_flag / check: as ``build_trees`` (``ERR_BAD_TREE``: malformed tree).
    """
    import torch

    for name in ("tokens", "depths", "parents", "num_nodes"):
        _require_cuda(f"trees.{name}", getattr(trees, name))
        if getattr(trees, name).dtype != torch.int64:
            raise TypeError(f"trees.{name} must be int64, got {getattr(trees, name).dtype}")
    if trees.tokens.ndim != 2:
        raise ValueError(f"trees.tokens must be [bs, N], got shape {tuple(trees.tokens.shape)}")
    bs, width = trees.tokens.shape
    for name in ("depths", "parents"):
        if tuple(getattr(trees, name).shape) != (bs, width):
            raise ValueError(f"trees.{name} has shape {tuple(getattr(trees, name).shape)}, expected {(bs, width)}")
    if tuple(trees.num_nodes.shape) != (bs,):
        raise ValueError(f"trees.num_nodes has shape {tuple(trees.num_nodes.shape)}, expected {(bs,)}")
    res = verify_outputs(seq_lens, bs, width, seq_lens_sum, out, trees.tokens.device)
    if error_flag is None:
        error_flag = new_error_flag(trees.tokens.device)
    if bs == 0:
        return res
    tok, dep, par, nn = (t.contiguous() for t in (trees.tokens, trees.depths, trees.parents, trees.num_nodes))
    sl = seq_lens.contiguous()
    mod = runtime.load_module(_KERNEL)
    # block (b, y) writes every output of request b's rows y, y+Y, ..., one row per warp
    y = -(-width // _ROWS_PER_BLOCK)
    with runtime.current_stream():
        mod.get_function("verify_inputs")(
            (bs, y), (256,),
            (_ptr(tok), _ptr(dep), _ptr(par), _ptr(nn), _ptr(sl), np.int32(width), np.int32(1 if fill_prefix else 0),
             _ptr(res.input_ids), _ptr(res.positions), _ptr(res.ancestor_bits), _ptr(res.retrieve_index),
             _ptr(res.retrieve_next_token), _ptr(res.retrieve_next_sibling), _ptr(res.full_mask),
             _ptr(error_flag)),
        )
    if check:
        raise_on_flag(error_flag, "verify_inputs")
    return res
