"""Routed experts of a compressed-tensors W4A16 MoE (Kimi K2.6: INT4, symmetric, group 32) on SGLang's
JIT Marlin GEMM, with the glue in CuPy kernels: no ``sgl_kernel`` binary op anywhere on the path.

Weight layouts (all per local expert, K = hidden size, N = expert intermediate size per TP rank):

* Checkpoint (``pack_quantized``): ``gate_proj`` / ``up_proj`` ``weight_packed`` ``[N, K/8]`` int32 and
  ``down_proj`` ``[K, N/8]``; eight 4-bit codes per word along the *input* dim, code j of a word in bits
  ``4j..4j+3``, stored as ``value + 8`` (uint4b8); ``weight_scale`` ``[out, in/group]``.
* ``PackedMoEWeights``: what SGLang's ``FusedMoE`` loader leaves in ``CompressedTensorsWNA16MoE``'s
  parameters before ``process_weights_after_loading`` (the loader transposes packed tensors:
  ``is_transposed``): ``w13_packed [E, K/8, 2N]`` (gate columns ``[0, N)``, up ``[N, 2N)``),
  ``w13_scale [E, K/g, 2N]``, ``w2_packed [E, N/8, K]``, ``w2_scale [E, N/g, K]``. ``from_checkpoint``
  builds it from checkpoint tensors; it is the float reference's input.
* ``MarlinMoEWeights``: the same after ``repack_for_marlin`` (SGLang's ``gptq_marlin_moe_repack`` and
  ``marlin_moe_permute_scales``, called once at load): ``w13 [E, K/16, 4N]``, ``w2 [E, N/16, 2K]``.

Forward (``fused_moe_marlin``), the call sequence of SGLang's ``fused_marlin_moe``: align the routes to
expert blocks (``kernels/moe_align.cu``), GEMM1 ``x @ w13`` without top-k weights, SiLU-and-mul
(``kernels/silu_and_mul.cu``), GEMM2 ``@ w2`` with the top-k weights, then the top-k sum times the routed
scaling factor (``kernels/moe_topk_sum.cu``). Marlin's K-slices are combined with its fp32 reduce by default
(``DEFAULT_REDUCE``; SGLang uses bf16 atomics on sm_90). ``fused_moe_reference`` is the float twin (same argument
order, ``PackedMoEWeights``), and every glue kernel has a torch twin (``*_reference``).

Marlin MoE is a JIT module: the first call compiles it with nvcc (~6 minutes on the H200 machine) into
SGLang's cache (``$SGLANG_JIT_CACHE_DIR``, default ``~/.cache/sglang/jit``); later processes load it in
well under a second. ``ensure_marlin_kernels`` logs before compiling; ``python -m sglang_kdtree.marlin_moe
--warmup`` builds it ahead of time. Only one Marlin specialization is used for both GEMMs (bf16, no EP,
no bias, generic block order), so one compile serves the whole path.

Route ids: a negative id is SGLang's "no expert" (padded tokens): dropped, its token gets no contribution.
An id >= num_experts is a caller bug: dropped too, and bit ``ERR_EXPERT_ID`` is set in the device error
flag (``raise_on_route_error`` reads it with a sync; never on the hot path).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from sglang_kdtree.gpu.runtime import device_ptr as _ptr
from sglang_kdtree.gpu.runtime import require_cuda as _require_cuda

logger = logging.getLogger(__name__)

__all__ = [
    "UINT4B8",
    "GROUP_SIZE",
    "ERR_EXPERT_ID",
    "PackedMoEWeights",
    "MarlinMoEWeights",
    "MoEAlignment",
    "pack_int4",
    "unpack_int4",
    "dequantize",
    "quantize_symmetric",
    "from_checkpoint",
    "random_packed_weights",
    "marlin_repack_args",
    "repack_for_marlin",
    "choose_block_size_m",
    "moe_align_reference",
    "silu_and_mul_reference",
    "moe_topk_sum_reference",
    "fused_moe_reference",
    "moe_align_block_size",
    "silu_and_mul",
    "moe_topk_sum",
    "fused_moe_marlin",
    "raise_on_route_error",
    "jit_cache_dir",
    "marlin_kernels_cached",
    "ensure_marlin_kernels",
]

NUM_BITS = 4
PACK_FACTOR = 32 // NUM_BITS  # int4 codes per int32 word
CODE_OFFSET = 1 << (NUM_BITS - 1)  # uint4b8: stored code = value + 8
#: the only group size the hook routes (Kimi K2 / K2.6); the functions here accept any multiple of 16
GROUP_SIZE = 32
#: Marlin's MoE block heights (rows of one expert per block); 8 is its special small-M tile
BLOCK_SIZES_M = (8, 16, 32, 48, 64)
#: device error bit: a top-k expert id >= num_experts (the route was dropped)
ERR_EXPERT_ID = 512
#: Marlin's tile constraints: GEMM N a multiple of 128 (thread_n), GEMM K a multiple of 64 (thread_k)
_MARLIN_N_MULTIPLE = 128
_MARLIN_K_MULTIPLE = 64
_MAX_EXPERTS = 4096  # moe_align.cu keeps two ints per expert in shared memory
_ALIGN_THREADS = 1024
_ELEMENTWISE_THREADS = 256
_MAX_BLOCKS = 4 * 132  # enough blocks to fill an H200's 132 SMs; the grid-stride loops cover the rest


class _ScalarTypeId:
    """Stands in for ``sgl_kernel.scalar_type.ScalarType``: ``moe_wna16_marlin_gemm`` only reads ``.id``."""

    __slots__ = ("name", "id")

    def __init__(self, name: str, type_id: int):
        self.name = name
        self.id = type_id

    def __repr__(self) -> str:
        return f"ScalarType({self.name}, id={self.id})"


#: uint4b8 (4-bit unsigned code with bias 8); id packs exponent 0, mantissa 4, unsigned, bias 8
UINT4B8 = _ScalarTypeId("uint4b8", 1125899907892224)


# --------------------------------------------------------------------------------------------------------
# Weight containers and the INT4 format
# --------------------------------------------------------------------------------------------------------


@dataclass
class PackedMoEWeights:
    """Experts in SGLang's loaded compressed-tensors layout (see the module docstring).

    ``w13_packed [E, K/8, 2N]`` int32, ``w13_scale [E, K/g, 2N]``, ``w2_packed [E, N/8, K]`` int32,
    ``w2_scale [E, N/g, K]`` (bf16 for Kimi; the activation dtype), all on one device.
    """

    w13_packed: object
    w13_scale: object
    w2_packed: object
    w2_scale: object
    group_size: int = GROUP_SIZE

    @property
    def num_experts(self) -> int:
        return int(self.w13_packed.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w13_packed.shape[1]) * PACK_FACTOR

    @property
    def intermediate_size(self) -> int:
        return int(self.w2_packed.shape[1]) * PACK_FACTOR

    def validate(self) -> None:
        import torch

        E, K, N, g = self.num_experts, self.hidden_size, self.intermediate_size, self.group_size
        expected = {
            "w13_packed": ((E, K // PACK_FACTOR, 2 * N), torch.int32),
            "w2_packed": ((E, N // PACK_FACTOR, K), torch.int32),
            "w13_scale": ((E, K // g if g > 0 else 1, 2 * N), None),
            "w2_scale": ((E, N // g if g > 0 else 1, K), None),
        }
        for name, (shape, dtype) in expected.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"PackedMoEWeights.{name} must be a torch tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"PackedMoEWeights.{name} has shape {tuple(t.shape)}, expected {shape} for {E} experts, "
                    f"hidden {K}, intermediate {N}, group {g} (layout [E, in/8, out] after SGLang's transpose; "
                    "build it with from_checkpoint)"
                )
            if dtype is not None and t.dtype != dtype:
                raise TypeError(f"PackedMoEWeights.{name} must be {dtype}, got {t.dtype}")
        if g <= 0 or g % 16 or K % g or N % g:
            raise ValueError(f"group_size {g} must be a positive multiple of 16 dividing hidden {K} and "
                             f"intermediate {N}")
        if self.w13_scale.dtype != self.w2_scale.dtype or not self.w13_scale.is_floating_point():
            raise TypeError(f"scales must share one float dtype, got {self.w13_scale.dtype} and {self.w2_scale.dtype}")


@dataclass
class MarlinMoEWeights:
    """Experts in Marlin's layout (``repack_for_marlin``, or a Marlin-converted SGLang layer).

    ``w13 [E, K/16, 4N]`` int32, ``w13_scale [E, K/g, 2N]``, ``w2 [E, N/16, 2K]`` int32,
    ``w2_scale [E, N/g, K]`` (scales permuted for Marlin), ``workspace`` int32 CUDA zeros of at least
    ``4 * SMs`` entries (Marlin's inter-block locks; it leaves them zero).
    """

    w13: object
    w13_scale: object
    w2: object
    w2_scale: object
    workspace: object
    group_size: int = GROUP_SIZE

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w13.shape[1]) * 16

    @property
    def intermediate_size(self) -> int:
        return int(self.w2.shape[1]) * 16


def pack_int4(values):
    """Pack signed 4-bit values ``[..., K, N]`` (integers in [-8, 7]) into ``[..., K/8, N]`` int32 words
    along K, code j of a word in bits 4j..4j+3, stored as value + 8 (compressed-tensors' pack_quantized
    after SGLang's transpose)."""
    import torch

    if values.shape[-2] % PACK_FACTOR:
        raise ValueError(f"the packed dim has {values.shape[-2]} entries, not a multiple of {PACK_FACTOR}")
    codes = (values.to(torch.int64) + CODE_OFFSET)
    if bool(((codes < 0) | (codes > 15)).any()):
        raise ValueError("values to pack must lie in [-8, 7]")
    codes = codes.reshape(*values.shape[:-2], values.shape[-2] // PACK_FACTOR, PACK_FACTOR, values.shape[-1])
    shifts = torch.arange(PACK_FACTOR, device=values.device, dtype=torch.int64) * NUM_BITS
    words = (codes << shifts[:, None]).sum(dim=-2)  # the 4-bit fields do not overlap: sum == bitwise or
    # reinterpret the low 32 bits as int32 (code 15 in the top nibble sets the sign bit)
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def unpack_int4(packed):
    """Inverse of ``pack_int4``: ``[..., K/8, N]`` int32 -> ``[..., K, N]`` int8 values in [-8, 7]."""
    import torch

    shifts = torch.arange(PACK_FACTOR, device=packed.device, dtype=torch.int32) * NUM_BITS
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & 0xF  # arithmetic shift: the mask drops sign fill
    values = codes.to(torch.int8) - CODE_OFFSET
    return values.reshape(*packed.shape[:-2], packed.shape[-2] * PACK_FACTOR, packed.shape[-1])


def dequantize(packed, scale, group_size: int = GROUP_SIZE):
    """fp32 ``[..., K, N]`` weights of packed ``[..., K/8, N]`` int32 with scales ``[..., K/g, N]``."""
    values = unpack_int4(packed).float()
    return values * scale.float().repeat_interleave(group_size, dim=-2)


def quantize_symmetric(weights, group_size: int = GROUP_SIZE, scale_dtype=None):
    """Symmetric INT4 group quantization of ``[..., K, N]`` float weights along K (the input dim).

    Returns ``(packed [..., K/8, N] int32, scale [..., K/g, N])`` with scale = max|w| / 7 per group rounded
    to ``scale_dtype`` (default bf16), codes = clamp(round(w / scale), -8, 7): every weight is within
    scale / 2 of its dequantized value.
    """
    import torch

    scale_dtype = scale_dtype or torch.bfloat16
    *lead, K, N = weights.shape
    if K % group_size:
        raise ValueError(f"K = {K} is not a multiple of group_size = {group_size}")
    grouped = weights.float().reshape(*lead, K // group_size, group_size, N)
    amax = grouped.abs().amax(dim=-2)
    scale = (amax / 7).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = torch.round(grouped / scale.float().unsqueeze(-2)).clamp(-8, 7).reshape(*lead, K, N)
    return pack_int4(codes.to(torch.int8)), scale


def from_checkpoint(gate_packed, up_packed, down_packed, gate_scale, up_scale, down_scale,
                    group_size: int = GROUP_SIZE) -> PackedMoEWeights:
    """``PackedMoEWeights`` from checkpoint tensors stacked over the local experts, as SGLang's loader
    would leave them (transposed, gate and up fused into w13; TP slicing is the caller's).

    Args:
        gate_packed, up_packed: ``[E, N, K/8]`` int32 (``weight_packed`` of gate_proj / up_proj).
        down_packed: ``[E, K, N/8]`` int32.
        gate_scale, up_scale: ``[E, N, K/g]``; down_scale: ``[E, K, N/g]`` (``weight_scale``).
    """
    import torch

    w13 = torch.cat([gate_packed, up_packed], dim=1).transpose(1, 2).contiguous()
    s13 = torch.cat([gate_scale, up_scale], dim=1).transpose(1, 2).contiguous()
    weights = PackedMoEWeights(
        w13_packed=w13,
        w13_scale=s13,
        w2_packed=down_packed.transpose(1, 2).contiguous(),
        w2_scale=down_scale.transpose(1, 2).contiguous(),
        group_size=group_size,
    )
    weights.validate()
    return weights


def random_packed_weights(num_experts: int, hidden_size: int, intermediate_size: int, *,
                          group_size: int = GROUP_SIZE, device="cpu", dtype=None, generator=None,
                          seed: int | None = None) -> PackedMoEWeights:
    """Random experts: uniform codes over all 16 values (incl. -8) and scales in [0.5, 1.5] x 1/(4 sqrt(in))
    so activations keep unit scale through both projections. Generated on ``device`` (fast on a GPU)."""
    import torch

    dtype = dtype or torch.bfloat16
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    E, K, N = num_experts, hidden_size, intermediate_size

    def words(rows, cols):
        return torch.randint(-(2**31), 2**31, (E, rows, cols), dtype=torch.int64, device=device,
                             generator=generator).to(torch.int32)

    def scales(groups, cols, fan_in):
        base = 1.0 / (4.0 * math.sqrt(fan_in))
        return ((torch.rand((E, groups, cols), device=device, generator=generator) + 0.5) * base).to(dtype)

    weights = PackedMoEWeights(
        w13_packed=words(K // PACK_FACTOR, 2 * N),
        w13_scale=scales(K // group_size, 2 * N, K),
        w2_packed=words(N // PACK_FACTOR, K),
        w2_scale=scales(N // group_size, K, N),
        group_size=group_size,
    )
    weights.validate()
    return weights


# --------------------------------------------------------------------------------------------------------
# Repack (once, at load) through SGLang's own functions
# --------------------------------------------------------------------------------------------------------


def marlin_repack_args(weights: PackedMoEWeights) -> dict:
    """The exact arguments ``repack_for_marlin`` hands SGLang: ``{"w13": (b_q_weight, perm, size_k, size_n,
    num_bits), "w2": (...)}`` for ``gptq_marlin_moe_repack`` and ``{"w13_scale": (s, size_k, size_n,
    group_size), "w2_scale": (...)}`` for ``marlin_moe_permute_scales``. ``perm`` is the empty ``[E, 0]``
    int32 tensor SGLang uses without activation reordering."""
    import torch

    weights.validate()
    E, K, N, g = weights.num_experts, weights.hidden_size, weights.intermediate_size, weights.group_size
    no_perm = torch.empty((E, 0), dtype=torch.int32, device=weights.w13_packed.device)
    return {
        "w13": (weights.w13_packed, no_perm, K, 2 * N, NUM_BITS),
        "w2": (weights.w2_packed, no_perm, N, K, NUM_BITS),
        "w13_scale": (weights.w13_scale, K, 2 * N, g),
        "w2_scale": (weights.w2_scale, N, K, g),
    }


def _check_marlin_shape(hidden_size: int, intermediate_size: int) -> None:
    for gemm, n, k in (("gate_up", 2 * intermediate_size, hidden_size), ("down", hidden_size, intermediate_size)):
        if n % _MARLIN_N_MULTIPLE or k % _MARLIN_K_MULTIPLE:
            raise ValueError(
                f"Marlin MoE needs every GEMM's N to be a multiple of {_MARLIN_N_MULTIPLE} and K of "
                f"{_MARLIN_K_MULTIPLE}; the {gemm} GEMM is N={n}, K={k} (hidden {hidden_size}, intermediate "
                f"{intermediate_size}): use the float/Triton path for this shape"
            )


def make_workspace(device):
    """Marlin's lock array: ``4 * SMs`` int32 zeros (what SGLang's ``marlin_make_workspace(device, 4)`` makes)."""
    import torch

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(4 * sms, dtype=torch.int32, device=device)


def _sglang_repack_functions():
    """SGLang's ``(gptq_marlin_moe_repack, marlin_moe_permute_scales)``.

    ``marlin_utils`` is imported first: it initialises ``sglang.srt.layers.quantization``, which must be
    fully imported before ``gptq_kernels`` (importing ``gptq_kernels`` first is a circular import in 0.5.23).
    Where ``gptq_kernels`` does not import (it pulls SGLang's MoE runner stack), the per-expert loop it
    runs is done here over the same JIT ``gptq_marlin_repack``.
    """
    from sglang.srt.layers.quantization.marlin_utils import marlin_moe_permute_scales

    try:
        from sglang.srt.hardware_backend.gpu.quantization.gptq_kernels import gptq_marlin_moe_repack
    except ImportError as exc:
        import torch
        from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack

        logger.info("sglang-kdtree: gptq_kernels does not import (%s); repacking expert by expert with the "
                    "JIT gptq_marlin_repack", exc)

        def gptq_marlin_moe_repack(b_q_weight, perm, size_k, size_n, num_bits):
            out = torch.empty((b_q_weight.shape[0], size_k // 16, size_n * (num_bits // 2)),
                              dtype=b_q_weight.dtype, device=b_q_weight.device)
            for e in range(b_q_weight.shape[0]):
                out[e] = gptq_marlin_repack(b_q_weight[e], perm[e], size_k, size_n, num_bits)
            return out

    return gptq_marlin_moe_repack, marlin_moe_permute_scales


def repack_for_marlin(weights: PackedMoEWeights, *, workspace=None) -> MarlinMoEWeights:
    """Repack CUDA ``PackedMoEWeights`` into Marlin's layout with SGLang's ``gptq_marlin_moe_repack`` (JIT
    ``gptq_marlin_repack``, ~11 s of nvcc the first time) and ``marlin_moe_permute_scales``. Call once at
    load; the result holds new tensors (the inputs can be freed)."""
    gptq_marlin_moe_repack, marlin_moe_permute_scales = _sglang_repack_functions()
    args = marlin_repack_args(weights)
    _check_marlin_shape(weights.hidden_size, weights.intermediate_size)
    if weights.w13_packed.device.type != "cuda":
        raise ValueError(f"repack_for_marlin needs CUDA weights, got {weights.w13_packed.device}")
    return MarlinMoEWeights(
        w13=gptq_marlin_moe_repack(*args["w13"]),
        w13_scale=marlin_moe_permute_scales(*args["w13_scale"]),
        w2=gptq_marlin_moe_repack(*args["w2"]),
        w2_scale=marlin_moe_permute_scales(*args["w2_scale"]),
        workspace=make_workspace(weights.w13_packed.device) if workspace is None else workspace,
        group_size=weights.group_size,
    )


# --------------------------------------------------------------------------------------------------------
# Glue: references (CPU or GPU torch) and CuPy launchers with the same signatures
# --------------------------------------------------------------------------------------------------------


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
    """Block tables for Marlin (layout in ``kernels/moe_align.cu``): ``sorted_token_ids`` and
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






def _require_16b(name, t):
    # the glue kernels move 8 bf16 per 16-byte load/store
    if t.data_ptr() % 16:
        raise ValueError(f"{name} starts at an address that is not 16-byte aligned (a view with an odd offset); "
                         "pass a fresh or .clone()d tensor")


def _grid(work_items: int, threads: int) -> int:
    return max(1, min(_MAX_BLOCKS * 4, -(-work_items // threads)))


def moe_align_block_size(topk_ids, num_experts: int, block_size: int, *, errors=None) -> MoEAlignment:
    """Marlin block tables from top-k expert ids on the GPU (``kernels/moe_align.cu``), no host sync.

    Args:
        topk_ids: ``[M, top_k]`` int32 or int64 CUDA tensor of local expert ids (negative = no expert).
        num_experts: local experts E (<= 4096).
        block_size: one of ``BLOCK_SIZES_M``.
        errors: ``int32 [1]`` CUDA flag to OR ``ERR_EXPERT_ID`` into; a new one otherwise.
    """
    import torch

    from sglang_kdtree.gpu import runtime

    _require_cuda("topk_ids", topk_ids, (torch.int32, torch.int64))
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if not 1 <= num_experts <= _MAX_EXPERTS:
        raise ValueError(f"num_experts = {num_experts} is outside [1, {_MAX_EXPERTS}]")
    if block_size not in BLOCK_SIZES_M:
        raise ValueError(f"block_size = {block_size} is not a Marlin MoE block size {BLOCK_SIZES_M}")
    ids = topk_ids.contiguous()
    numel = ids.numel()
    if numel >= 2**31 - _MAX_EXPERTS * 64:
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
    mod = runtime.load_module("moe_align.cu")
    kernel = mod.get_function("moe_align_i32" if ids.dtype == torch.int32 else "moe_align_i64")
    with runtime.current_stream():
        kernel((1,), (_ALIGN_THREADS,),
               (_ptr(ids), np.int32(numel), np.int32(num_experts), np.int32(block_size),
                _ptr(align.sorted_token_ids), _ptr(align.expert_ids), _ptr(align.num_tokens_post_padded),
                _ptr(align.errors), np.int32(fresh_errors)),
               shared_mem=2 * num_experts * 4)
    return align


def silu_and_mul(gate_up, out=None):
    """``silu(gate) * up`` of bf16 ``gate_up [rows, 2N]`` into ``out [rows, N]`` (``kernels/silu_and_mul.cu``);
    N % 8 == 0, both contiguous. Returns ``out``."""
    import torch

    _require_cuda("gate_up", gate_up, (torch.bfloat16,))
    if gate_up.dim() != 2 or gate_up.shape[1] % 16:
        raise ValueError(f"gate_up must be [rows, 2N] with N % 8 == 0, got shape {tuple(gate_up.shape)}")
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    if out is None:
        out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    _require_cuda("out", out, (torch.bfloat16,))
    if tuple(out.shape) != (rows, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {n}] tensor, got {tuple(out.shape)}")
    _require_16b("gate_up", gate_up)
    _require_16b("out", out)
    if rows == 0:
        return out
    from sglang_kdtree.gpu import runtime

    kernel = runtime.load_module("silu_and_mul.cu").get_function("silu_and_mul_bf16")
    with runtime.current_stream():
        kernel((_grid(rows * n // 8, _ELEMENTWISE_THREADS),), (_ELEMENTWISE_THREADS,),
               (_ptr(gate_up), _ptr(out), np.int64(rows), np.int32(n)))
    return out


def moe_topk_sum(routed, topk_ids, num_experts: int, routed_scaling_factor: float = 1.0, out=None):
    """``out [M, K]`` = factor * sum over live k of bf16 ``routed [M*top_k, K]`` (``kernels/moe_topk_sum.cu``);
    routes with an id outside [0, num_experts) are skipped. K % 8 == 0. Returns ``out``."""
    import torch

    _require_cuda("routed", routed, (torch.bfloat16,))
    _require_cuda("topk_ids", topk_ids, (torch.int32, torch.int64))
    M, top_k = topk_ids.shape
    if routed.dim() != 2 or routed.shape[0] != M * top_k or routed.shape[1] % 8:
        raise ValueError(f"routed must be [{M * top_k}, K] with K % 8 == 0, got shape {tuple(routed.shape)}")
    K = routed.shape[1]
    routed, ids = routed.contiguous(), topk_ids.contiguous()
    if out is None:
        out = torch.empty((M, K), dtype=routed.dtype, device=routed.device)
    _require_cuda("out", out, (torch.bfloat16,))
    if tuple(out.shape) != (M, K) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{M}, {K}] tensor, got {tuple(out.shape)}")
    _require_16b("routed", routed)
    _require_16b("out", out)
    if M == 0:
        return out
    from sglang_kdtree.gpu import runtime

    name = "moe_topk_sum_bf16_i32" if ids.dtype == torch.int32 else "moe_topk_sum_bf16_i64"
    kernel = runtime.load_module("moe_topk_sum.cu").get_function(name)
    with runtime.current_stream():
        kernel((_grid(M * K // 8, _ELEMENTWISE_THREADS),), (_ELEMENTWISE_THREADS,),
               (_ptr(routed), _ptr(ids), _ptr(out), np.int64(M), np.int32(top_k), np.int32(K),
                np.int32(num_experts), np.float32(routed_scaling_factor)))
    return out


def raise_on_route_error(errors) -> None:
    """Sync and raise ``ValueError`` if ``ERR_EXPERT_ID`` is set (tests, debugging; not the hot path)."""
    if int(errors.item()) & ERR_EXPERT_ID:
        raise ValueError("topk_ids holds an expert id >= num_experts; those routes were dropped "
                         "(pass local expert ids; EP-mapped ids are not supported here)")


# --------------------------------------------------------------------------------------------------------
# JIT compile (once, cached by SGLang) and the forward
# --------------------------------------------------------------------------------------------------------

#: the single Marlin specialization this path uses: (is_ep, has_bias, expert_ids_are_sorted,
#: zero_inactive_output, has_inactive_prefix_count). moe_align.cu emits only live blocks, so the
#: generic block walk never meets a -1 block and costs the same as the sorted one.
_MARLIN_SPECIALIZATION = (False, False, False, False, False)


def jit_cache_dir():
    """SGLang's JIT cache root (``$SGLANG_JIT_CACHE_DIR``, default ``~/.cache/sglang/jit``)."""
    from sglang.kernels.jit.utils.compile.cache import cache_root

    return cache_root()


def marlin_kernels_cached() -> bool:
    """Whether a built Marlin MoE module is in the cache (any target and build key: a heuristic for the log;
    SGLang's own key check decides whether it is reused)."""
    root = jit_cache_dir()
    return root.is_dir() and any(root.glob("*/*moe_wna16_marlin*/**/*.so"))


@functools.cache
def ensure_marlin_kernels(dtype_name: str = "bfloat16"):
    """Build (or load from SGLang's cache) the Marlin repack and MoE JIT modules, logging before a compile.

    Returns the seconds it took. Needs nvcc, ninja and apache-tvm-ffi, and a visible GPU (the target is
    the local arch). Once per process; SGLang's per-build file lock makes TP ranks compile only once.
    """
    cached = marlin_kernels_cached()
    if not cached:
        logger.warning(
            "sglang-kdtree: compiling Marlin MoE kernels (nvcc, ~6 min on an H200 host, once), cached at %s "
            "(set SGLANG_JIT_CACHE_DIR to keep it elsewhere; pre-build with `python -m sglang_kdtree.marlin_moe "
            "--warmup`)", jit_cache_dir())
    start = time.perf_counter()
    for build in _marlin_module_builders(dtype_name):
        build()
    seconds = time.perf_counter() - start
    (logger.info if seconds > 5 or not cached else logger.debug)(
        "sglang-kdtree: Marlin MoE kernels ready in %.1f s (cache %s)", seconds, jit_cache_dir())
    return seconds


def _marlin_module_builders(dtype_name: str = "bfloat16"):
    """The SGLang JIT module getters this path needs (repack, then the one Marlin MoE specialization)."""
    import torch

    from sglang.kernels.ops.moe.moe_wna16_marlin import _jit_moe_wna16_marlin_module
    from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module

    dtype = getattr(torch, dtype_name)
    return (_jit_gptq_marlin_repack_module, lambda: _jit_moe_wna16_marlin_module(dtype, *_MARLIN_SPECIALIZATION))


def export_prebuilt(dest) -> list:
    """Copy the built Marlin modules out of SGLang's JIT cache into ``dest`` (``<module>.so`` plus
    ``<module>.deps.json``, SGLang's recorded dependency list), so another machine with the same sglang,
    apache-tvm-ffi, CUDA major and GPU arch can seed its cache with ``seed_prebuilt`` instead of compiling.
    Returns the module names exported (the newest build of each)."""
    import shutil
    from pathlib import Path

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    exported = []
    for pattern in ("*gptq_marlin_repack", "*moe_wna16_marlin_*"):
        builds = sorted(jit_cache_dir().glob(f"*/{pattern}/build-*/deps-*/*.so"), key=lambda p: p.stat().st_mtime)
        for so in builds[-1:]:
            shutil.copy2(so, dest / so.name)
            shutil.copy2(so.parent / "sgl_deps.json", dest / f"{so.stem}.deps.json")
            exported.append(so.stem)
    return exported


def seed_prebuilt(source, dtype_name: str = "bfloat16") -> list:
    """Seed SGLang's JIT cache with Marlin modules exported by ``export_prebuilt`` on another machine.

    Runs SGLang's own ``load_jit`` (same cache key, lock and publication) with only its compile step
    replaced: for a module found in ``source`` whose recorded SGLang kernel sources and tvm-ffi headers hash
    exactly like this installation's, the prebuilt ``.so`` is copied in place of running nvcc, then loaded
    (a library that does not load here raises inside ``load_jit``) and published. Anything that does not
    match falls through to a normal compile. Returns the modules seeded from ``source``.
    """
    import json
    import shutil
    from pathlib import Path

    from sglang.kernels.jit.utils.compile import cache as jit_cache
    from sglang.kernels.jit.utils.compile import ninja as jit_ninja

    source = Path(source)
    real_build = jit_ninja.build
    seeded = []

    def prebuilt_build(*, spec, build_dir, build_file):
        so = source / f"{spec.module_name}.so"
        deps = source / f"{spec.module_name}.deps.json"
        if not (so.is_file() and deps.is_file()):
            return real_build(spec=spec, build_dir=build_dir, build_file=build_file)
        paths = []
        for root, relpath, digest in json.loads(deps.read_text()):
            if root not in ("kernels", "tvm_ffi"):
                continue  # system / toolkit headers: same CUDA major is the caller's promise
            path = jit_cache._resolve_path(root=root, relpath=relpath)
            if path is None or jit_cache._file_digest(path) != digest:
                logger.warning("sglang-kdtree: prebuilt %s was built from a different %s:%s; compiling instead",
                               spec.module_name, root, relpath)
                return real_build(spec=spec, build_dir=build_dir, build_file=build_file)
            paths.append(str(path))
        build_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, build_dir / so.name)
        # SGLang records what the compiler read from the depfiles; list the verified sources there
        escaped = (p.replace(" ", "\\ ") for p in paths)
        (build_dir / "prebuilt.o.d").write_text("prebuilt.o: " + " ".join(escaped) + "\n")
        seeded.append(spec.module_name)
        return build_dir / so.name

    for build in _marlin_module_builders(dtype_name):
        before = len(seeded)
        jit_ninja.build = prebuilt_build
        try:
            build()
        except Exception as exc:  # e.g. the library needs a newer libstdc++ than this machine has
            del seeded[before:]
            logger.warning("sglang-kdtree: a prebuilt Marlin module did not load here (%s); it will be compiled",
                           exc)
        finally:
            jit_ninja.build = real_build
    return seeded


#: How Marlin combines the partial sums of a GEMM whose K dimension is split over several thread blocks
#: (small token counts split K to fill the SMs): "fp32" = Marlin's fp32 global reduce through its scratch
#: buffer, slices added in a fixed order (one bf16 rounding, run-to-run deterministic); "atomic" = bf16
#: atomicAdd of every slice into the output (SGLang's choice on sm_90: one rounding per slice, order
#: depends on scheduling).
REDUCE_MODES = ("fp32", "atomic")
#: The default. Measured on the H200 (benchmarks/RESULTS.md): "atomic" exceeds issue 7's 1e-2 relative-error
#: bar on 23-40% of random draws at hidden 256 / 65 tokens and reaches 1.05e-2 at Kimi TP 8 / 1 token, while
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
    _check_marlin_shape(K, N)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kdtree.marlin_moe",
        description="Pre-build, export or seed the Marlin MoE JIT kernels (SGLang's cache: $SGLANG_JIT_CACHE_DIR).")
    parser.add_argument("--seed", metavar="DIR",
                        help="first seed the cache from modules exported with --export on another machine")
    parser.add_argument("--warmup", action="store_true",
                        help="compile (or load) the Marlin repack + MoE modules; ~6 min of nvcc when not cached")
    parser.add_argument("--arch", metavar="MAJOR.MINOR",
                        help="build for this compute capability instead of the local GPU's (e.g. 9.0 on a "
                             "build machine without a GPU; needs nvcc)")
    parser.add_argument("--export", metavar="DIR", help="finally copy the built modules to DIR (for --seed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import contextlib

    arch = contextlib.nullcontext()
    if args.arch:
        from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

        major, minor = (int(v) for v in args.arch.split("."))
        arch = override_jit_cuda_arch(major, minor)
    print(f"JIT cache: {jit_cache_dir()} ({'has' if marlin_kernels_cached() else 'no'} Marlin MoE build)")
    with arch:
        if args.seed:
            start = time.perf_counter()
            seeded = seed_prebuilt(args.seed)
            print(f"seeded from {args.seed}: {seeded or 'nothing (compiled instead)'} "
                  f"in {time.perf_counter() - start:.1f} s")
        if args.warmup:
            seconds = ensure_marlin_kernels("bfloat16")
            print(f"Marlin MoE kernels ready in {seconds:.1f} s")
    if args.export:
        print(f"exported to {args.export}: {export_prebuilt(args.export)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
