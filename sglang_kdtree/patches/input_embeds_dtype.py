"""Keep a draft forward's ``input_embeds`` in the model's dtype (fp32 CPU tests; fp16 models).

SGLang symbol wrapped (``HookType.AFTER``, SGLang 0.5.23):
``sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs``.

Why: it passes ``forward_batch.input_embeds.bfloat16()`` unconditionally. The DFlash draft block is fed
through ``input_embeds`` (target embedding of ``[bonus, MASK...]``), so on a model that is not bf16 the
draft's first projection fails (``expected m1 and m2 to have the same dtype ... BFloat16 != float``). When the
model's dtype is not bf16, the embeddings are cast to it instead; bf16 models (every production
deployment) get exactly what SGLang passed.
"""

from __future__ import annotations

import torch

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"
TARGETS = (TARGET,)


def extend_forward_kwargs(result, self, forward_batch, *args, **kwargs):
    embeds = forward_batch.input_embeds
    model_dtype = getattr(getattr(self, "model_config", None), "dtype", None)
    if (embeds is not None and isinstance(result, dict) and "input_embeds" in result
            and model_dtype is not None and model_dtype != torch.bfloat16
            and forward_batch.replace_embeds is None):
        result["input_embeds"] = embeds.to(model_dtype)
    return result


def register() -> None:
    """Register the AFTER hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, extend_forward_kwargs, HookType.AFTER)
