"""Import stand-in for ``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` (test-only, CUDA servers on the H200).

What it replaces and why: SGLang's module imports ``cutlass`` (the CUTLASS DSL), which the test machine
lacks and which is too big to carry. ``sglang/srt/layers/dual_gemm.py:DualGemm._select_mode`` imports it
for every Llama MLP on CUDA, but the kernel itself is SM100-only: on an H200 (SM90) SGLang's own
``can_use_dual_gemm`` returns False because ``is_sm100_supported()`` is False. This stand-in gives that
same answer and raises, by name, if anything tries to run the kernel.

``sitecustomize.py`` registers it only when ``cutlass`` cannot be imported.
"""

from __future__ import annotations

from enum import IntEnum

# The interface DualGemm reads (values from SGLang 0.5.23's module).
MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self) -> bool:
        return self in (DualGemmQuantMode.STATIC_PER_TOKEN, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode) -> bool:
    """Always False: the CuTe DSL dual GEMM needs SM100 and the CUTLASS DSL, neither of which is here
    (SGLang's own predicate answers False on SM90 too)."""
    return False


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sglang.kernels.ops.gemm.cutedsl_dual_gemm.{name}: the CUTLASS DSL is not installed; this is the "
            "sglang-kdtree test stand-in (tests/e2e/sgl_kernel_cuda/shims), which only answers "
            "can_use_dual_gemm() = False"
        )

    op.__name__ = name
    return op


dual_gemm_swiglu = _missing("dual_gemm_swiglu")
dual_gemm_swiglu_fp8 = _missing("dual_gemm_swiglu_fp8")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
