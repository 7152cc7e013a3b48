"""Route KDTREE's MLA tree verify to ``sglang_kdtree.gpu.mla_attention`` (one fused tree-verify kernel).

SGLang symbols wrapped (``HookType.AROUND``, SGLang 0.5.23):

* ``sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend``: for MLA it runs
  ``extend_attention_fwd`` with the dense FULL_MASK, one program per head re-reading the latent KV.
* ``sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.forward_extend``: for MLA tree
  verify it runs a two-pass prefix + mask-derived-page-table cascade and merges the two states.

Our kernel reads each request's latent KV once for all N*H (node, head) rows and takes the tree as bit-packed
ancestor rows. A call is routed to it only when every condition holds; anything else runs the original:

* ``forward_batch.forward_mode.is_target_verify()`` and the batch's speculative algorithm is named ``KDTREE``;
* the verify input carries ``ancestor_bits`` (``[bs, N, ceil(N/32)]`` uint32 CUDA tensor, the layout of
  ``sglang_kdtree.reference.verify_inputs``): the contract with the KDTREE worker;
* absorbed MLA with one latent head (q/k width 576, v width 512), a bf16 pool (``token_to_kv_pool.dtype``; an
  fp8 / fp4 ``--kv-cache-dtype`` keeps SGLang's path) without k/v scales, no sinks,
  ``score_mod``, logit cap, sliding window, DCP or context parallelism;
* fa3 only: page size 1 (its page table then lists token slots).

Option ``SGLANG_KDTREE_MLA`` (read when the plugin registers): ``fused`` (default) registers the hooks;
``off`` leaves SGLang's MLA verify path in place (for A/B comparisons of the verify logits; see
``tests/gpu/test_server_cuda.py``); ``check`` routes like ``fused`` and, on every routed call that runs eagerly,
also runs SGLang's original on the same inputs (q, k, v, the pool, the backend's metadata), keeping the fused
output: the largest |fused - SGLang| over those calls, and its ratio to the largest |SGLang output|, stay on the
device and the round log reports them (``mla_check``). Calls inside SGLang's graph capture (its warm-up runs and the
capture itself) are not compared: their inputs are placeholders, and a replay's padded rows are not real rows
either; so run ``check`` with ``--disable-cuda-graph`` (``benchmarks/bench_server.py --kinds kdtree-check`` does). A
diagnostic: it runs the verify attention twice. ``SGLANG_KDTREE_MLA_KERNEL`` (``auto|wgmma|mma``, checked at
registration) picks which fused kernel (``sglang_kdtree.gpu.mla_attention``).
"""

from __future__ import annotations

import logging

from sglang_kdtree import state

logger = logging.getLogger(__name__)

TRITON_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
FA3_TARGET = "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.forward_extend"
TARGETS = (TRITON_TARGET, FA3_TARGET)

_MLA_QK, _MLA_V = 576, 512
_mode = "fused"  # option() as registered


def is_kdtree_verify(forward_batch) -> bool:
    """True for a TARGET_VERIFY forward of the KDTREE algorithm (and nothing else)."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return False
    return state.is_kdtree(getattr(forward_batch, "spec_algorithm", None))


def _ancestor_bits(forward_batch):
    bits = getattr(getattr(forward_batch, "spec_info", None), "ancestor_bits", None)
    return bits if bits is not None and getattr(bits, "is_cuda", False) else None


def _layer_is_plain_absorbed_mla(layer) -> bool:
    window = getattr(layer, "sliding_window_size", None)
    return (
        getattr(layer, "qk_head_dim", getattr(layer, "head_dim", None)) == _MLA_QK
        and getattr(layer, "v_head_dim", None) == _MLA_V
        and getattr(layer, "tp_k_head_num", 1) == 1
        and getattr(layer, "k_scale", None) is None
        and not (getattr(layer, "logit_cap", 0) or 0) > 0
        and (window is None or window <= -1)
    )


def _bf16_pool(backend) -> bool:
    """The kernels read bf16 latent rows; an fp8 / fp4 pool (``--kv-cache-dtype``) stays on SGLang's path."""
    import torch

    return getattr(getattr(backend, "token_to_kv_pool", None), "dtype", None) == torch.bfloat16


def _no_extras(kwargs) -> bool:
    return all(kwargs.get(name) is None for name in ("sinks", "score_mod", "aux_tensors", "rel_bias"))


def triton_forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    """AROUND hook for ``TritonAttnBackend.forward_extend`` (see the module docstring for the routing rule)."""
    bits = _ancestor_bits(forward_batch) if is_kdtree_verify(forward_batch) else None
    if (
        bits is None
        or args  # sinks / score_mod passed positionally: not ours
        or not getattr(self, "use_mla", False)
        or not _bf16_pool(self)
        or getattr(self, "dcp_size", 1) != 1
        or k is None
        or v is None
        or not _no_extras(kwargs)
        or not _layer_is_plain_absorbed_mla(layer)
        or getattr(forward_batch, "_attn_output", None) is not None
    ):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_kdtree.gpu.mla_attention import mla_tree_verify

    if save_kv_cache:
        # The same write the original does first: the tree rows land at out_cache_loc, where we read them.
        loc_info = KVWriteLoc.for_batch(forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc)
        self._set_kv_buffer(forward_batch, layer, loc_info, k, v)
    heads = layer.tp_q_head_num
    meta = self.forward_metadata
    out, _ = mla_tree_verify(
        q.view(-1, heads, _MLA_QK),
        self.token_to_kv_pool.get_key_buffer(layer.layer_id),
        meta.kv_indptr,
        meta.kv_indices,
        forward_batch.out_cache_loc,
        bits,
        layer.scaling,
    )
    out = out.view(-1, heads * _MLA_V)
    if _mode == "check" and not _in_capture(out.device):  # the keys are in the pool: no second write
        record_check(out, original(self, q, k, v, layer, forward_batch, False, *args, **kwargs))
    return out


def fa3_forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, *args, **kwargs):
    """AROUND hook for ``FlashAttentionBackend.forward_extend`` (MLA, page size 1, see the module docstring)."""
    bits = _ancestor_bits(forward_batch) if is_kdtree_verify(forward_batch) else None
    if (
        bits is None
        or args  # sinks and later passed positionally: not ours
        or not getattr(self, "use_mla", False)
        or not _bf16_pool(self)
        or getattr(self, "page_size", 1) != 1
        or getattr(self, "fa_skip_kv_cache", False)
        or kwargs.get("return_lse", False)
        or any(kwargs.get(name) is not None for name in ("q_descale", "k_descale", "v_descale"))
        or not _no_extras(kwargs)
        or not _layer_is_plain_absorbed_mla(layer)
        or _cp_active(forward_batch)
    ):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, *args, **kwargs)
    import torch
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_kdtree.gpu.mla_attention import mla_tree_verify_paged

    if k is not None and save_kv_cache:
        self.token_to_kv_pool.set_mla_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, k_rope)
    heads = layer.tp_q_head_num
    if q_rope is not None:
        q_full = torch.cat([q.view(-1, heads, _MLA_V), q_rope.view(-1, heads, _MLA_QK - _MLA_V)], dim=-1)
    else:
        q_full = q.reshape(-1, heads, _MLA_QK)
    out, _ = mla_tree_verify_paged(
        q_full,
        self.token_to_kv_pool.get_key_buffer(layer.layer_id),
        self.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        forward_batch.out_cache_loc,
        bits,
        layer.scaling,
    )
    out = out.view(-1, heads * _MLA_V)
    if _mode == "check" and not _in_capture(out.device):  # the keys are in the pool: no second write
        record_check(out, original(self, q, k, v, layer, forward_batch, False, q_rope, k_rope, *args, **kwargs))
    return out


def _cp_active(forward_batch) -> bool:
    try:
        from sglang.srt.layers.cp.utils import is_cp_active
    except ImportError:  # older layouts have no context parallelism at all
        return False
    return bool(is_cp_active(forward_batch))


ENV_OPTION = "SGLANG_KDTREE_MLA"
OPTIONS = ("fused", "off", "check")

#: ``check`` mode's running figures per device: float32 [3] = (largest |fused - SGLang| / largest |SGLang output|
#: of a call, largest |fused - SGLang|, routed calls compared)
_check: dict[str, object] = {}


def _in_capture(device) -> bool:
    """SGLang's graph capture: its capture mode (the warm-up runs before a capture, and the capture) or a capturing
    stream."""
    import torch

    if device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return bool(get_is_capture_mode())


def _check_tensor(device):
    import torch

    key = str(device)
    if key not in _check:
        _check[key] = torch.zeros(3, dtype=torch.float32, device=device)
    return _check[key]


def record_check(ours, ref) -> None:
    """Fold one eager routed call's comparison into the device's figures (device ops only, no sync)."""
    import torch

    stat = _check_tensor(ours.device)
    a = ours.float()
    r = ref.float().reshape(a.shape)
    diff = (a - r).abs().amax()
    rel = diff / r.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    stat[:2].copy_(torch.maximum(stat[:2], torch.stack((rel, diff))))
    stat[2].add_(1.0)


def check_stats(device) -> dict | None:
    """``{"calls", "max_rel", "max_abs"}`` of ``check`` mode on ``device`` so far (syncs), or None outside it."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # the worker's device may be plain "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    stat = _check.get(str(device))
    if stat is None:
        return None
    rel, diff, calls = stat.tolist()
    return {"calls": int(calls), "max_rel": rel, "max_abs": diff}


def option() -> str:
    """The normalised ``SGLANG_KDTREE_MLA`` value; an unknown value is an error at registration."""
    import os

    value = os.environ.get(ENV_OPTION, "fused").strip().lower() or "fused"
    if value not in OPTIONS:
        raise ValueError(f"kdtree: {ENV_OPTION}={value!r} is not one of {'|'.join(OPTIONS)}; unset it or pick one")
    return value


def register() -> None:
    """Register both AROUND hooks with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import torch

    global _mode
    _mode = option()
    if _mode == "off":
        logger.info("sglang-kdtree: %s=off, MLA tree verify keeps SGLang's attention path", ENV_OPTION)
        return
    if _mode == "check":
        logger.warning("sglang-kdtree: %s=check, every routed MLA tree verify that runs eagerly also runs SGLang's "
                       "path to compare (a diagnostic: the verify attention runs twice; calls replayed from CUDA "
                       "graphs are not compared: pass --disable-cuda-graph)", ENV_OPTION)
    from sglang_kdtree.gpu.mla_attention import kernel_option

    kernel_option()  # an unknown $SGLANG_KDTREE_MLA_KERNEL fails here, at startup, not in the first verify round

    HookRegistry.register(TRITON_TARGET, triton_forward_extend, HookType.AROUND)
    # fa3's module needs libcuda at import; on a machine without CUDA there is nothing to wrap, and SGLang
    # would log a failed hook application in every process.
    if torch.cuda.is_available():
        HookRegistry.register(FA3_TARGET, fa3_forward_extend, HookType.AROUND)
