"""Run DeepSeek/Kimi MLA prefill on the ``torch_native`` backend (CPU tests) through absorbed MLA.

SGLang symbol touched: ``sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry``
(its ``register`` API: we add a ``"torch_native"`` entry; SGLang 0.5.23 has none).

Why: an unregistered backend falls back to the Triton handler, which picks the MHA forward for a prefill
without cached prefix. The MHA forward hands ``torch_native`` uncompressed K/V but ``torch_native`` reads
K/V back from the latent MLA pool, so the shapes disagree (``Expected size ... [4, 24] but got [4, 40]``)
and DeepSeek-V3 cannot prefill on CPU at all. Absorbed MLA (what every KDTREE verify runs anyway) reads the
latent pool and works in every mode, so ``torch_native`` always gets it. Other backends are unaffected.
"""

from __future__ import annotations

TARGET = "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry"
TARGETS = (TARGET, "sglang.srt.models.deepseek_common.attention_backend_handler._dispatch_mla_subtype")


def handle_attention_torch_native(attn, forward_batch):
    from sglang.srt.models.deepseek_common import attention_backend_handler as handlers

    return handlers._dispatch_mla_subtype(attn, forward_batch)


def register() -> None:
    """Add the ``torch_native`` handler (idempotent; importing the handler module needs no GPU)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)
