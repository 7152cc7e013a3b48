"""Plain torch twins of the Marlin MoE path, on any device: one per glue kernel (same arguments, same
results: ``moe_align_reference``, ``silu_and_mul_reference``, ``moe_topk_sum_reference``) and the float twin of
the whole forward (``fused_moe_reference``, on ``PackedMoEWeights``: each touched expert dequantized to fp32).
"""

from __future__ import annotations

import numpy as np

from sglang_kdtree.moe.routing import ERR_EXPERT_ID, MoEAlignment, align_capacity
from sglang_kdtree.moe.weights import PackedMoEWeights, dequantize

__all__ = ["moe_align_reference", "silu_and_mul_reference", "moe_topk_sum_reference", "fused_moe_reference"]


def moe_align_reference(topk_ids, num_experts: int, block_size: int) -> MoEAlignment:
    """Twin of ``moe_align_block_size`` on any device: routes grouped by ascending expert, each group in
    ascending flat index ``token * top_k + k`` and padded with ``numel`` to a multiple of ``block_size``.
    Ids < 0 are dropped; ids >= num_experts are dropped and set ``ERR_EXPERT_ID`` in ``errors``."""
    import torch

    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    device = topk_ids.device
    capacity = align_capacity(numel, num_experts, block_size)
    live = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[live], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=device)
    expert_ids = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=device)
    order = torch.argsort(torch.where(live, flat, num_experts), stable=True)[: int(live.sum())]
    experts_in_order = flat[order]
    rank = torch.arange(order.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts_in_order]
    sorted_ids[starts[experts_in_order] + rank] = order.to(torch.int32)
    blocks = padded // block_size
    expert_ids[: total // block_size] = torch.repeat_interleave(
        torch.arange(num_experts, device=device, dtype=torch.int32), blocks)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    if bool((flat >= num_experts).any()):
        errors[0] = ERR_EXPERT_ID
    return MoEAlignment(
        sorted_token_ids=sorted_ids,
        expert_ids=expert_ids,
        num_tokens_post_padded=torch.tensor([total, 0], dtype=torch.int32, device=device),
        block_size=block_size,
        errors=errors,
    )


def silu_and_mul_reference(gate_up):
    """Twin of ``silu_and_mul``: ``[rows, 2N]`` -> ``silu(gate) * up`` ``[rows, N]``, fp32 math, one rounding."""
    import torch

    n = gate_up.shape[-1] // 2
    g = gate_up[..., :n].float()
    return (torch.nn.functional.silu(g) * gate_up[..., n:].float()).to(gate_up.dtype)


def moe_topk_sum_reference(routed, topk_ids, num_experts: int, routed_scaling_factor: float = 1.0):
    """Twin of ``moe_topk_sum``: ``routed [M*top_k, K]`` -> ``[M, K]`` = factor * sum of the live routes
    (fp32, ascending k, one rounding to ``routed.dtype``)."""
    import torch

    M, top_k = topk_ids.shape
    live = ((topk_ids >= 0) & (topk_ids < num_experts)).reshape(M, top_k, 1)
    rows = routed.reshape(M, top_k, -1).float()
    acc = torch.zeros((M, rows.shape[-1]), dtype=torch.float32, device=routed.device)
    for k in range(top_k):  # ascending k, the kernel's summation order
        acc += torch.where(live[:, k], rows[:, k], torch.zeros((), device=routed.device))
    return (acc * np.float32(routed_scaling_factor)).to(routed.dtype)


def fused_moe_reference(hidden_states, weights: PackedMoEWeights, topk_weights, topk_ids,
                        routed_scaling_factor: float = 1.0):
    """Float twin of ``fused_moe_marlin``: dequantize each touched expert to fp32 and run it in torch.

    Args:
        hidden_states: ``[M, K]`` (any float dtype; used in fp32).
        weights: ``PackedMoEWeights`` (the layout before Marlin's repack).
        topk_weights: ``[M, top_k]`` float; topk_ids: ``[M, top_k]`` int (negative = no expert).
    Returns:
        ``[M, K]`` fp32 = factor * sum_k w[m, k] * down(silu(gate(x)) * up(x)) of expert topk_ids[m, k].
    """
    import torch

    weights.validate()
    x = hidden_states.float()
    M, K = x.shape
    N = weights.intermediate_size
    out = torch.zeros((M, K), dtype=torch.float32, device=x.device)
    ids = topk_ids.to(torch.int64)
    if bool((ids >= weights.num_experts).any()):
        raise ValueError(f"topk_ids holds an expert id >= num_experts = {weights.num_experts}")
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        w13 = dequantize(weights.w13_packed[e], weights.w13_scale[e], weights.group_size)
        gate_up = x[tokens] @ w13
        act = torch.nn.functional.silu(gate_up[:, :N]) * gate_up[:, N:]
        w2 = dequantize(weights.w2_packed[e], weights.w2_scale[e], weights.group_size)
        out.index_add_(0, tokens, (act @ w2) * topk_weights[tokens, slots].float()[:, None])
    return out * routed_scaling_factor
