"""Marlin MoE block tables: the block heights, the table layout the aligner fills (``MoEAlignment``, layout in
``sglang_kdtree/kernels/moe/moe_align.cu``), and the device error bit for an out-of-range expert id.

Route ids: a negative id is SGLang's "no expert" (padded tokens): dropped, its token gets no contribution.
An id >= num_experts is a caller bug: dropped too, and bit ``ERR_EXPERT_ID`` is set in the device error
flag (``raise_on_route_error`` reads it with a sync; never on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOCK_SIZES_M", "ERR_EXPERT_ID", "MAX_EXPERTS", "MoEAlignment", "align_capacity", "choose_block_size_m",
           "raise_on_route_error"]

#: Marlin's MoE block heights (rows of one expert per block); 8 is its special small-M tile
BLOCK_SIZES_M = (8, 16, 32, 48, 64)
#: device error bit: a top-k expert id >= num_experts (the route was dropped)
ERR_EXPERT_ID = 512
MAX_EXPERTS = 4096  # moe_align.cu keeps two ints per expert in shared memory


def choose_block_size_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Marlin block height: the smallest of 8/16/32/48/64 that the average expert's routes fill to less than
    90% (SGLang's ``fused_marlin_moe`` rule), else 64. Small verify batches get short blocks (little
    padding work), prefill gets tall ones (more reuse of each dequantized weight tile)."""
    routes_per_expert = num_tokens * top_k / num_experts
    for block in BLOCK_SIZES_M:
        if routes_per_expert < 0.9 * block:
            return block
    return BLOCK_SIZES_M[-1]


@dataclass
class MoEAlignment:
    """Block tables for Marlin (layout in ``sglang_kdtree/kernels/moe/moe_align.cu``): ``sorted_token_ids`` and
    ``expert_ids`` int32 (entries past ``num_tokens_post_padded[0]`` are undefined on the GPU),
    ``num_tokens_post_padded`` int32 ``[2]`` (padded total, 0), ``block_size``, ``errors`` int32 ``[1]``."""

    sorted_token_ids: object
    expert_ids: object
    num_tokens_post_padded: object
    block_size: int
    errors: object = None


def align_capacity(numel: int, num_experts: int, block_size: int) -> int:
    """Length of ``sorted_token_ids``: every route plus at most ``block_size - 1`` padding per active
    expert (at most ``min(numel, num_experts)`` are active), rounded up to whole blocks."""
    slots = numel + min(numel, num_experts) * (block_size - 1)
    return max(block_size, -(-slots // block_size) * block_size)


def raise_on_route_error(errors) -> None:
    """Sync and raise ``ValueError`` if ``ERR_EXPERT_ID`` is set (tests, debugging; not the hot path)."""
    if int(errors.item()) & ERR_EXPERT_ID:
        raise ValueError("topk_ids holds an expert id >= num_experts; those routes were dropped "
                         "(pass local expert ids; EP-mapped ids are not supported here)")
