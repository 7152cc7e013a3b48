"""CuPy launchers of the MoE glue kernels in ``sglang_kdtree/kernels/moe/`` (twins in ``sglang_kdtree.moe.reference``):
route alignment to Marlin blocks, SiLU-and-mul between the two GEMMs, and the top-k sum after them. Each
launches on torch's current stream with no host sync, so the whole forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from sglang_kdtree.gpu import limits, runtime
from sglang_kdtree.gpu.runtime import device_ptr as _ptr
from sglang_kdtree.gpu.runtime import require_cuda as _require_cuda
from sglang_kdtree.moe.routing import BLOCK_SIZES_M, MAX_EXPERTS, MoEAlignment, align_capacity

__all__ = ["moe_align_block_size", "silu_and_mul", "moe_topk_sum"]

_ALIGN_THREADS = 1024
_ELEMENTWISE_THREADS = 256
_BLOCKS_PER_SM = 16  # at most four waves of four blocks per SM; the grid-stride loops cover the rest


def _require_16b(name, t):
    # the glue kernels move 8 bf16 per 16-byte load/store
    if t.data_ptr() % 16:
        raise ValueError(f"{name} starts at an address that is not 16-byte aligned (a view with an odd offset); "
                         "pass a fresh or .clone()d tensor")


def _bf16_out(out, rows: int, cols: int, like):
    """The glue kernels' output: ``out``, or a new ``[rows, cols]`` tensor like ``like``; checked to be a
    contiguous bf16 CUDA tensor of that shape."""
    import torch

    if out is None:
        out = torch.empty((rows, cols), dtype=like.dtype, device=like.device)
    _require_cuda("out", out, (torch.bfloat16,))
    if tuple(out.shape) != (rows, cols) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {cols}] tensor, got {tuple(out.shape)}")
    return out


def _grid(work_items: int, threads: int, device) -> int:
    return max(1, min(_BLOCKS_PER_SM * limits.current(device.index).sm_count, -(-work_items // threads)))


def moe_align_block_size(topk_ids, num_experts: int, block_size: int, *, errors=None) -> MoEAlignment:
    """Marlin block tables from top-k expert ids on the GPU (``sglang_kdtree/kernels/moe/moe_align.cu``), no host sync.

    Args:
        topk_ids: ``[M, top_k]`` int32 or int64 CUDA tensor of local expert ids (negative = no expert).
        num_experts: local experts E (<= 4096).
        block_size: one of ``BLOCK_SIZES_M``.
        errors: ``int32 [1]`` CUDA flag to OR ``ERR_EXPERT_ID`` into; a new one otherwise.
    """
    import torch

    _require_cuda("topk_ids", topk_ids, (torch.int32, torch.int64))
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts} is outside [1, {MAX_EXPERTS}]")
    if block_size not in BLOCK_SIZES_M:
        raise ValueError(f"block_size = {block_size} is not a Marlin MoE block size {BLOCK_SIZES_M}")
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if numel >= 2**31 - MAX_EXPERTS * 64:
        raise ValueError(f"{numel} routes overflow the int32 route index")
    device = ids.device
    capacity = align_capacity(numel, num_experts, block_size)
    align = MoEAlignment(
        sorted_token_ids=torch.empty(capacity, dtype=torch.int32, device=device),
        expert_ids=torch.empty(capacity // block_size, dtype=torch.int32, device=device),
        num_tokens_post_padded=torch.empty(2, dtype=torch.int32, device=device),
        block_size=block_size,
        errors=torch.empty(1, dtype=torch.int32, device=device) if errors is None else errors,
    )
    fresh_errors = errors is None  # the kernel then writes the whole flag (no zero-fill launch)
    mod = runtime.load_module("moe/moe_align.cu")
    kernel = mod.get_function("moe_align_i32" if ids.dtype == torch.int32 else "moe_align_i64")
    with runtime.current_stream():
        kernel((1,), (_ALIGN_THREADS,),
               (_ptr(ids), np.int32(numel), np.int32(num_experts), np.int32(block_size),
                _ptr(align.sorted_token_ids), _ptr(align.expert_ids), _ptr(align.num_tokens_post_padded),
                _ptr(align.errors), np.int32(fresh_errors)),
               shared_mem=2 * num_experts * 4)
    return align


def silu_and_mul(gate_up, out=None):
    """``silu(gate) * up`` of bf16 ``gate_up [rows, 2N]`` into ``out [rows, N]``
    (``sglang_kdtree/kernels/moe/silu_and_mul.cu``); N % 8 == 0, both contiguous. Returns ``out``."""
    import torch

    _require_cuda("gate_up", gate_up, (torch.bfloat16,))
    if gate_up.dim() != 2 or gate_up.shape[1] % 16:
        raise ValueError(f"gate_up must be [rows, 2N] with N % 8 == 0, got shape {tuple(gate_up.shape)}")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    out = _bf16_out(out, rows, n, gate_up)
    _require_16b("gate_up", gate_up)
    _require_16b("out", out)
    if rows == 0:
        return out
    kernel = runtime.load_module("moe/silu_and_mul.cu").get_function("silu_and_mul_bf16")
    with runtime.current_stream():
        kernel((_grid(rows * n // 8, _ELEMENTWISE_THREADS, out.device),), (_ELEMENTWISE_THREADS,),
               (_ptr(gate_up), _ptr(out), np.int64(rows), np.int32(n)))
    return out


def moe_topk_sum(routed, topk_ids, num_experts: int, routed_scaling_factor: float = 1.0, out=None):
    """``out [M, K]`` = factor * sum over live k of bf16 ``routed [M*top_k, K]``
    (``sglang_kdtree/kernels/moe/moe_topk_sum.cu``); routes with an id outside [0, num_experts) are skipped.
    K % 8 == 0. Returns ``out``."""
    import torch

    _require_cuda("routed", routed, (torch.bfloat16,))
    _require_cuda("topk_ids", topk_ids, (torch.int32, torch.int64))
    M, top_k = topk_ids.shape
    if routed.dim() != 2 or routed.shape[0] != M * top_k or routed.shape[1] % 8:
        raise ValueError(f"routed must be [{M * top_k}, K] with K % 8 == 0, got shape {tuple(routed.shape)}")
    K = routed.shape[1]
    routed, ids = routed.contiguous(), topk_ids.contiguous()
    out = _bf16_out(out, M, K, routed)
    _require_16b("routed", routed)
    _require_16b("out", out)
    if M == 0:
        return out
    name = "moe_topk_sum_bf16_i32" if ids.dtype == torch.int32 else "moe_topk_sum_bf16_i64"
    kernel = runtime.load_module("moe/moe_topk_sum.cu").get_function(name)
    with runtime.current_stream():
        kernel((_grid(M * K // 8, _ELEMENTWISE_THREADS, out.device),), (_ELEMENTWISE_THREADS,),
               (_ptr(routed), _ptr(ids), _ptr(out), np.int64(M), np.int32(top_k), np.int32(K),
                np.int32(num_experts), np.float32(routed_scaling_factor)))
    return out
