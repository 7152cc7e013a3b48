"""Give SGLang's ``torch_native`` attention backend a TARGET_VERIFY path (the CPU backend of our tests).

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend``.

Why: TARGET_VERIFY counts as an extend mode, but ``TorchNativeAttnBackend.forward_extend`` reads
``forward_batch.extend_prefix_lens`` / ``extend_seq_lens``, which a verify ``ForwardBatch`` does not carry
(``None``), and it has no notion of a tree mask: it would crash, and with lengths filled in it would verify
a causal chain. Both KDTREE forwards are TARGET_VERIFY: the DFlash draft block (``N = block_size`` rows,
non-causal ``ENCODER_ONLY`` layers) and the target's tree verify (``N = budget + 1`` rows, the FULL_MASK
allow-mask in ``spec_info.custom_mask``).

What the replacement computes, per request b with committed length ``P_b`` and ``N`` verify rows whose KV
slots are ``req_to_token[req_b, P_b : P_b + N]`` (where the verify forward wrote them):
row i attends to every prefix slot and to verify row j iff ``custom_mask`` allows it (FULL_MASK layout:
an ``N x (P_b + N)`` row-major block per request, requests concatenated), else iff the layer is
non-causal, else iff ``j <= i``. Any other forward mode, or any other algorithm's verify on another
backend, runs SGLang's original.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
TARGETS = (TARGET,)


def _verify_width(forward_batch) -> int:
    spec_info = forward_batch.spec_info
    width = getattr(spec_info, "draft_token_num", None)
    if width is None:
        raise ValueError(
            "torch_native TARGET_VERIFY needs spec_info.draft_token_num (rows per request); got a spec_info "
            f"of type {type(spec_info).__name__} without it"
        )
    return int(width)


def verify_attention(q, layer, forward_batch, backend) -> torch.Tensor:
    """SDPA for a TARGET_VERIFY batch; ``q`` is ``[bs*N, heads*qk_head_dim]``. Returns the output in the
    layout ``forward_extend`` returns (``[bs*N, heads*v_head_dim]``)."""
    from sglang.srt.layers.radix_attention import AttentionType

    width = _verify_width(forward_batch)
    heads = layer.tp_q_head_num
    q_ = q.view(-1, heads, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], heads * layer.v_head_dim))
    o_ = out.view(-1, heads, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    custom_mask = getattr(forward_batch.spec_info, "custom_mask", None)
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    prefix_lens = forward_batch.seq_lens.tolist()
    req_rows = forward_batch.req_pool_indices.tolist()
    mask_offset = 0
    for b, (req, prefix) in enumerate(zip(req_rows, prefix_lens)):
        kv_len = prefix + width
        slots = req_to_token[req, :kv_len].long()
        keys = k_cache[slots].movedim(0, 1).to(q_.dtype)  # [kv_heads, kv_len, d]
        values = v_cache[slots].movedim(0, 1).to(q_.dtype)
        query = q_[b * width : (b + 1) * width].movedim(0, 1)  # [heads, N, d]
        if custom_mask is not None:
            allowed = custom_mask[mask_offset : mask_offset + width * kv_len].view(width, kv_len).bool()
            mask_offset += width * kv_len
        elif causal:
            allowed = torch.ones(width, kv_len, dtype=torch.bool, device=q.device)
            allowed[:, prefix:] = torch.tril(allowed[:, prefix:])
        else:
            allowed = None
        result = scaled_dot_product_attention(
            query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=allowed,
            scale=layer.scaling, enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        o_[b * width : (b + 1) * width] = result.squeeze(0).movedim(0, 1)
    return out


def forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    """AROUND hook: TARGET_VERIFY goes to ``verify_attention``; everything else to SGLang."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify() or layer.is_cross_attention:
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
        )
    return verify_attention(q, layer, forward_batch, self)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, forward_extend, HookType.AROUND)
