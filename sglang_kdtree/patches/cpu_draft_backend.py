"""Let the DFlash draft worker run on ``torch_native`` attention (the CPU backend).

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend``.

Why: it accepts only ``DRAFT_ATTENTION_BACKEND_CHOICES`` (flashinfer, fa3, fa4, triton, ascend,
trtllm_mha, intel_xpu) and otherwise falls back to ``flashinfer``, which cannot be built without CUDA
(``NameError: BatchPrefillWithRaggedKVCacheWrapper``). On a CPU server whose target runs ``torch_native``
the draft gets ``torch_native`` too (its TARGET_VERIFY path is ``sglang_kdtree/patches/torch_native_verify.py``). On
every other configuration SGLang's answer stands.
"""

from __future__ import annotations

TARGET = "sglang.srt.speculative.draft_worker_common.resolve_draft_worker_attention_backend"
TARGETS = (TARGET, "sglang.srt.runtime_context.attention_backends")

CPU_BACKEND = "torch_native"


def resolve_draft_worker_attention_backend(original, *args, **kwargs):
    from sglang.srt.runtime_context import attention_backends, get_spec

    requested = get_spec().speculative_draft_attention_backend
    prefill, _ = attention_backends()
    if requested == CPU_BACKEND or (requested is None and prefill == CPU_BACKEND):
        return CPU_BACKEND
    return original(*args, **kwargs)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, resolve_draft_worker_attention_backend, HookType.AROUND)
