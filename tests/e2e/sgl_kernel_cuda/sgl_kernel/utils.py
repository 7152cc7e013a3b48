"""``sgl_kernel.utils`` of the CUDA test stand-in (see the package docstring)."""

from __future__ import annotations


def is_arch_support_pdl() -> bool:
    """Whether the GPU supports programmatic dependent launch (sm_90+), as SGLang's own JIT helper says.

    Call site: ``sglang/srt/layers/attention/triton_backend.py`` (module-level import on CUDA; the
    Triton attention kernels pass ``launch_pdl`` from it)."""
    from sglang.kernels.jit.utils import is_arch_support_pdl as jit_is_arch_support_pdl

    return jit_is_arch_support_pdl()
