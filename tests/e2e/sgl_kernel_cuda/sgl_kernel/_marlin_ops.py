"""Test-only Marlin pieces of the CUDA ``sgl_kernel`` stand-in (helper B's part; see ``__init__.py``).

SGLang's plain CUDA path for compressed-tensors W4A16 MoE (``CompressedTensorsWNA16MoE``) runs on SGLang's own
JIT kernels (``gptq_marlin_repack``, ``moe_wna16_marlin_gemm``, ``moe_align*``, ``silu_and_mul``); from the
``sgl_kernel`` binary it needs ``moe_sum_reduce`` / ``moe_align_block_size`` (provided by ``__init__.py``)
and the pure-Python ``sgl_kernel.scalar_type`` module, which this file provides as ``scalar_type``:

* ``ScalarType``: the fields ``exponent, mantissa, signed, bias, finite_values_only, nan_repr`` and the
  ``id`` that SGLang's JIT Marlin GEMMs receive (``b_q_type.id``; the kernels decode it with the C++
  ``ScalarType::from_id``: 8 bits exponent, 8 bits mantissa, 1 bit signed, 32 bits bias, 1 bit finite-only,
  8 bits NaN representation, packed from bit 0 up). Call sites:
  ``sglang/srt/layers/moe/fused_moe_triton/fused_marlin_moe.py:get_scalar_type`` (``b_q_type`` of both
  Marlin GEMMs), ``sglang/srt/layers/quantization/utils.py:get_scalar_types`` (module level, imported by
  ``marlin_utils`` and the compressed-tensors schemes).
* ``scalar_types``: the six members SGLang 0.5.23 reads (``uint4b8``, ``uint8b128``, ``uint4``, ``uint8``,
  ``float4_e2m1f``, ``float8_e4m3fn``); any other member raises ``AttributeError`` naming it.

``tests/test_kimi_model.py`` checks every id against the real ``sgl_kernel.scalar_type`` where that is
installed (the CPU venv).
"""

from __future__ import annotations

import enum
import types

__all__: list[str] = []  # no op beyond __init__.py's; this file adds the scalar_type submodule


class NanRepr(enum.Enum):
    NONE = 0
    IEEE_754 = 1
    EXTD_RANGE_MAX_MIN = 2


class ScalarType:
    """A number format as SGLang's Marlin kernels take it (``id`` only is read on the W4A16 MoE path)."""

    __slots__ = ("exponent", "mantissa", "signed", "bias", "finite_values_only", "nan_repr", "name")

    def __init__(self, exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool = False,
                 nan_repr: NanRepr = NanRepr.IEEE_754, name: str = ""):
        self.exponent, self.mantissa, self.signed, self.bias = exponent, mantissa, signed, bias
        self.finite_values_only, self.nan_repr, self.name = finite_values_only, nan_repr, name

    @property
    def id(self) -> int:
        fields = ((self.exponent, 8), (self.mantissa, 8), (int(self.signed), 1), (self.bias, 32),
                  (int(self.finite_values_only), 1), (self.nan_repr.value, 8))
        value, shift = 0, 0
        for field, bits in fields:
            value |= (field & ((1 << bits) - 1)) << shift
            shift += bits
        return value

    @property
    def size_bits(self) -> int:
        return self.exponent + self.mantissa + int(self.signed)

    def is_signed(self) -> bool:
        return bool(self.signed)

    def is_floating_point(self) -> bool:
        return self.exponent != 0

    def is_integer(self) -> bool:
        return self.exponent == 0

    def has_bias(self) -> bool:
        return self.bias != 0

    def __eq__(self, other) -> bool:
        return isinstance(other, ScalarType) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __str__(self) -> str:
        return self.name or f"ScalarType(id={self.id})"

    __repr__ = __str__

    def __getattr__(self, attr: str):
        # min(), max(), from_id, ... : not on the W4A16 MoE path; fail by name
        raise AttributeError(f"sgl_kernel.scalar_type.ScalarType.{attr} is not provided by the sglang-kdtree CUDA "
                             "test stand-in (tests/e2e/sgl_kernel_cuda/sgl_kernel/_marlin_ops.py)")


class _ScalarTypes:
    """``sgl_kernel.scalar_type.scalar_types``: the members SGLang 0.5.23 reads."""

    uint4 = ScalarType(0, 4, False, 0, name="uint4")
    uint8 = ScalarType(0, 8, False, 0, name="uint8")
    uint4b8 = ScalarType(0, 4, False, 8, name="uint4b8")  # GPTQ / compressed-tensors symmetric INT4
    uint8b128 = ScalarType(0, 8, False, 128, name="uint8b128")
    float4_e2m1f = ScalarType(2, 1, True, 0, True, NanRepr.NONE, name="float4_e2m1f")
    float8_e4m3fn = ScalarType(4, 3, True, 0, True, NanRepr.EXTD_RANGE_MAX_MIN, name="float8_e4m3fn")

    def __getattr__(self, attr: str):
        raise AttributeError(f"sgl_kernel.scalar_type.scalar_types.{attr} is not provided by the sglang-kdtree "
                             "CUDA test stand-in (tests/e2e/sgl_kernel_cuda/sgl_kernel/_marlin_ops.py)")


scalar_type = types.ModuleType(f"{__package__ or 'sgl_kernel'}.scalar_type",
                               "sglang-kdtree CUDA test stand-in for sgl_kernel.scalar_type (see _marlin_ops.py)")
scalar_type.NanRepr = NanRepr
scalar_type.ScalarType = ScalarType
scalar_type.scalar_types = _ScalarTypes()
# sgl_kernel/__init__.py registers it as sys.modules["sgl_kernel.scalar_type"]
