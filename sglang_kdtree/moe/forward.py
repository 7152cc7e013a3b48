"""Routed experts of a compressed-tensors W4A16 MoE on SGLang's JIT Marlin GEMM with the CuPy glue of
``sglang_kdtree.moe.launch``: no ``sgl_kernel`` binary op anywhere on the path.

``fused_moe_marlin`` follows the call sequence of SGLang's ``fused_marlin_moe``: align the routes to expert
blocks (``sglang_kdtree/kernels/moe/moe_align.cu``), GEMM1 ``x @ w13`` without top-k weights, SiLU-and-mul
(``sglang_kdtree/kernels/moe/silu_and_mul.cu``), GEMM2 ``@ w2`` with the top-k weights, then the top-k sum times the
routed scaling factor (``sglang_kdtree/kernels/moe/moe_topk_sum.cu``). Marlin's K-slices are combined with its fp32
reduce by default (``DEFAULT_REDUCE``; SGLang uses bf16 atomics on sm_90). ``sglang_kdtree.moe.reference.
fused_moe_reference`` is the float twin (same argument order, ``PackedMoEWeights``).
"""

from __future__ import annotations

from sglang_kdtree.gpu.runtime import require_cuda as _require_cuda
from sglang_kdtree.moe.jit import ensure_marlin_kernels
from sglang_kdtree.moe.launch import moe_align_block_size, moe_topk_sum, silu_and_mul
from sglang_kdtree.moe.routing import choose_block_size_m
from sglang_kdtree.moe.weights import UINT4B8, MarlinMoEWeights, check_marlin_shape

__all__ = ["REDUCE_MODES", "DEFAULT_REDUCE", "marlin_gemm", "fused_moe_marlin"]

#: How Marlin combines the partial sums of a GEMM whose K dimension is split over several thread blocks
#: (small token counts split K to fill the SMs): "fp32" = Marlin's fp32 global reduce through its scratch
#: buffer, slices added in a fixed order (one bf16 rounding, run-to-run deterministic); "atomic" = bf16
#: atomicAdd of every slice into the output (SGLang's choice on sm_90: one rounding per slice, order
#: depends on scheduling).
REDUCE_MODES = ("fp32", "atomic")
#: The default. Measured on the H200 (benchmarks/RESULTS.md): "atomic" exceeds the 1e-2 relative-error
#: bar of tests/gpu/test_marlin_moe_gpu.py (REL_TOL) on 23-40% of random draws at hidden 256 / 65 tokens and reaches 1.05e-2 at Kimi TP 8 / 1 token, while
#: "fp32" stays within 8.8e-3 everywhere (the bf16 model's own level); the two take the same time at 8 or more
#: tokens (every tree verify) and "atomic" wins only at 1 token (27 vs 43 us at TP 8).
DEFAULT_REDUCE = "fp32"


def _resolve_reduce(reduce) -> bool:
    """``use_atomic_add`` for ``reduce`` (None = ``DEFAULT_REDUCE``)."""
    reduce = DEFAULT_REDUCE if reduce is None else reduce
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce = {reduce!r}; expected one of {REDUCE_MODES} or None ({DEFAULT_REDUCE!r})")
    return reduce == "atomic"


def marlin_gemm(a, c, w, scale, workspace, tables, block: int, *, top_k: int, mul_topk_weights: bool,
                atomic: bool):
    """One of the path's two grouped GEMMs: SGLang's JIT ``moe_wna16_marlin_gemm`` (uint4b8, no EP, bias,
    zero points or act-order) writing ``c [rows * top_k, N] = a[route // top_k] @ W[expert]`` for every live
    route of ``tables`` = (sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights), times the
    route's top-k weight when ``mul_topk_weights``. ``fused_moe_marlin`` checks the arguments."""
    from sglang.kernels.ops.moe.moe_wna16_marlin import moe_wna16_marlin_gemm

    size_k = a.shape[1]
    return moe_wna16_marlin_gemm(
        a, c, w, None, scale, None, None, None, None, workspace, *tables, moe_block_size=block, top_k=top_k,
        mul_topk_weights=mul_topk_weights, is_ep=False, b_q_type=UINT4B8, size_m=a.shape[0], size_n=c.shape[1],
        size_k=size_k, is_k_full=True, use_atomic_add=atomic, use_fp32_reduce=True, is_zp_float=False,
    )


def fused_moe_marlin(hidden_states, weights: MarlinMoEWeights, topk_weights, topk_ids,
                     routed_scaling_factor: float = 1.0, *, out=None, errors=None, reduce=None):
    """Routed-expert output with Marlin W4A16 GEMMs; twin of ``fused_moe_reference``. No host sync.

    Args:
        hidden_states: ``[M, K]`` bf16 CUDA, contiguous.
        weights: ``MarlinMoEWeights`` (``repack_for_marlin`` or a Marlin-converted SGLang layer).
        topk_weights: ``[M, top_k]`` float32 (DeepSeek-V3 routing output, before routed scaling).
        topk_ids: ``[M, top_k]`` int32/int64 local expert ids; negative = no expert.
        routed_scaling_factor: applied to the top-k sum.
        out: optional ``[M, K]`` bf16 output (e.g. SGLang's zero-copy MoE output).
        errors: optional ``int32 [1]`` flag (``ERR_EXPERT_ID``).
        reduce: ``"fp32"`` or ``"atomic"`` (see ``REDUCE_MODES``); None = ``DEFAULT_REDUCE``.
    Returns:
        ``[M, K]`` bf16.
    """
    import torch

    _require_cuda("hidden_states", hidden_states, (torch.bfloat16,))
    _require_cuda("topk_weights", topk_weights, (torch.float32,))
    _require_cuda("topk_ids", topk_ids, (torch.int32, torch.int64))
    if hidden_states.dim() != 2 or not hidden_states.is_contiguous():
        raise ValueError(f"hidden_states must be a contiguous [M, K] tensor, got {tuple(hidden_states.shape)}")
    M, K = hidden_states.shape
    E, N = weights.num_experts, weights.intermediate_size
    if K != weights.hidden_size:
        raise ValueError(f"hidden_states has K = {K}, the experts' hidden size is {weights.hidden_size}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{M}, top_k]")
    if weights.w13_scale.dtype != hidden_states.dtype or weights.w2_scale.dtype != hidden_states.dtype:
        raise TypeError(f"scales are {weights.w13_scale.dtype}/{weights.w2_scale.dtype}; Marlin needs them in "
                        f"the activation dtype {hidden_states.dtype}")
    check_marlin_shape(K, N)
    atomic = _resolve_reduce(reduce)
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(hidden_states)
    if tuple(out.shape) != (M, K) or out.dtype != hidden_states.dtype:
        raise ValueError(f"out must be [{M}, {K}] {hidden_states.dtype}, got {tuple(out.shape)} {out.dtype}")
    if M == 0:
        return out
    # a caller's buffer the sum kernel cannot write directly (strided, or a view at an odd offset) is filled
    # by one copy at the end
    combined = out if out.is_contiguous() and out.data_ptr() % 16 == 0 else torch.empty_like(hidden_states)
    ensure_marlin_kernels("bfloat16")
    topk_weights = topk_weights.contiguous()
    block = choose_block_size_m(M, top_k, E)
    align = moe_align_block_size(topk_ids, E, block, errors=errors)
    tables = (align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded, topk_weights)
    gate_up = torch.empty((M * top_k, 2 * N), dtype=hidden_states.dtype, device=hidden_states.device)
    marlin_gemm(hidden_states, gate_up, weights.w13, weights.w13_scale, weights.workspace, tables, block,
                top_k=top_k, mul_topk_weights=False, atomic=atomic)
    act = silu_and_mul(gate_up)
    routed = torch.empty((M * top_k, K), dtype=hidden_states.dtype, device=hidden_states.device)
    marlin_gemm(act, routed, weights.w2, weights.w2_scale, weights.workspace, tables, block,
                top_k=1, mul_topk_weights=True, atomic=atomic)
    moe_topk_sum(routed, topk_ids, E, routed_scaling_factor, out=combined)
    if combined is not out:
        out.copy_(combined)
    return out
