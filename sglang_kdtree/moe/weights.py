"""The expert weights of a compressed-tensors W4A16 MoE (Kimi K2.6: INT4, symmetric, group 32): the INT4
format, its quantiser, the two weight containers, and the one-time repack into Marlin's layout through
SGLang's own functions.

Layouts (all per local expert, K = hidden size, N = expert intermediate size per TP rank):

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
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = [
    "NUM_BITS",
    "PACK_FACTOR",
    "GROUP_SIZE",
    "UINT4B8",
    "PackedMoEWeights",
    "MarlinMoEWeights",
    "pack_int4",
    "unpack_int4",
    "dequantize",
    "quantize_symmetric",
    "from_checkpoint",
    "random_packed_weights",
    "marlin_repack_args",
    "check_marlin_shape",
    "make_workspace",
    "repack_for_marlin",
]

NUM_BITS = 4
PACK_FACTOR = 32 // NUM_BITS  # int4 codes per int32 word
CODE_OFFSET = 1 << (NUM_BITS - 1)  # uint4b8: stored code = value + 8
#: the only group size the hook routes (Kimi K2 / K2.6); the functions here accept any multiple of 16
GROUP_SIZE = 32
#: Marlin's tile constraints: GEMM N a multiple of 128 (thread_n), GEMM K a multiple of 64 (thread_k)
MARLIN_N_MULTIPLE = 128
MARLIN_K_MULTIPLE = 64


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


class _ExpertGeometry:
    """``num_experts``, ``hidden_size`` and ``intermediate_size`` read off a container's two weight tensors:
    ``_W13`` ``[E, K / _ROWS, ...]`` and ``_W2`` ``[E, N / _ROWS, ...]`` (``_ROWS`` input rows per entry)."""

    _W13 = "w13"
    _W2 = "w2"
    _ROWS = 16

    @property
    def num_experts(self) -> int:
        return int(getattr(self, self._W13).shape[0])

    @property
    def hidden_size(self) -> int:
        return int(getattr(self, self._W13).shape[1]) * self._ROWS

    @property
    def intermediate_size(self) -> int:
        return int(getattr(self, self._W2).shape[1]) * self._ROWS


@dataclass
class PackedMoEWeights(_ExpertGeometry):
    """Experts in SGLang's loaded compressed-tensors layout (see the module docstring).

    ``w13_packed [E, K/8, 2N]`` int32, ``w13_scale [E, K/g, 2N]``, ``w2_packed [E, N/8, K]`` int32,
    ``w2_scale [E, N/g, K]`` (bf16 for Kimi; the activation dtype), all on one device.
    """

    w13_packed: object
    w13_scale: object
    w2_packed: object
    w2_scale: object
    group_size: int = GROUP_SIZE

    _W13, _W2, _ROWS = "w13_packed", "w2_packed", PACK_FACTOR

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
class MarlinMoEWeights(_ExpertGeometry):
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


def check_marlin_shape(hidden_size: int, intermediate_size: int) -> None:
    """Raise ``ValueError`` naming the GEMM when the experts' shape does not fit Marlin's tiles."""
    for gemm, n, k in (("gate_up", 2 * intermediate_size, hidden_size), ("down", hidden_size, intermediate_size)):
        if n % MARLIN_N_MULTIPLE or k % MARLIN_K_MULTIPLE:
            raise ValueError(
                f"Marlin MoE needs every GEMM's N to be a multiple of {MARLIN_N_MULTIPLE} and K of "
                f"{MARLIN_K_MULTIPLE}; the {gemm} GEMM is N={n}, K={k} (hidden {hidden_size}, intermediate "
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
    check_marlin_shape(weights.hidden_size, weights.intermediate_size)
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
