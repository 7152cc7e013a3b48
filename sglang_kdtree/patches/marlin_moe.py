"""Opt-in: run compressed-tensors W4A16 MoE layers (Kimi K2.6 routed experts) through
``sglang_kdtree.moe.forward.fused_moe_marlin``.

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):

* ``sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe.
  CompressedTensorsWNA16MoE.apply_weights``: the Marlin scheme SGLang picks for INT4 pack-quantized experts
  on Hopper (``--moe-runner-backend auto|marlin``). It calls ``fused_marlin_moe``, whose alignment, top-k
  sum and scalar types come from the ``sgl_kernel`` binary; ours uses the same JIT Marlin GEMM with CuPy
  glue (one Marlin specialization, live blocks only).

Weights are not touched: SGLang's ``process_weights_after_loading`` has already repacked the layer into
Marlin's layout (``gptq_marlin_moe_repack`` + ``marlin_moe_permute_scales``), which is exactly
``MarlinMoEWeights``; the hook reads the layer's tensors.

Option ``SGLANG_KDTREE_MOE`` (read when the plugin registers, i.e. in every SGLang process):

* ``off`` (default): nothing is registered; SGLang runs unchanged.
* ``marlin``: the hook is registered. A call is routed to our path only when every condition holds:
  the layer is Marlin-converted, 4-bit, symmetric, group size 32, without activation reordering; SiLU
  gated activation without clamp or alpha; no expert-parallel map; combined output (``no_combine`` off);
  bf16 activations on a CUDA GPU of compute capability >= 8.0; Marlin tile shapes (hidden % 128 == 0,
  intermediate % 64 == 0). Otherwise SGLang's original runs and a warning naming the reason is logged
  once per reason: never a silent wrong answer, never a silent switch.

The first routed call compiles the Marlin MoE JIT module if SGLang's cache has none (~6 min, logged;
``python -m sglang_kdtree.moe --warmup`` pre-builds it).
"""

from __future__ import annotations

import functools
import logging
import os

from sglang_kdtree.moe.weights import GROUP_SIZE, MARLIN_K_MULTIPLE, MARLIN_N_MULTIPLE, NUM_BITS

logger = logging.getLogger(__name__)

ENV_OPTION = "SGLANG_KDTREE_MOE"
DEFAULT_OPTION = "off"
OPTIONS = ("off", "marlin")
TARGET = (
    "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe."
    "CompressedTensorsWNA16MoE.apply_weights"
)
TARGETS = (TARGET,)

_SUPPORTED_BITS = NUM_BITS
_SUPPORTED_GROUP_SIZE = GROUP_SIZE
_MIN_CAPABILITY = (8, 0)
_warned: set[str] = set()
#: routed calls in this process (eager calls plus one per CUDA-graph capture, whose replays run the captured
#: kernels without Python): the worker's round log reports it as proof that the hook engaged.
routed_calls = 0


def option() -> str:
    """The normalised ``SGLANG_KDTREE_MOE`` value; an unknown value logs an error and counts as ``off``."""
    value = os.environ.get(ENV_OPTION, DEFAULT_OPTION).strip().lower() or DEFAULT_OPTION
    if value not in OPTIONS:
        logger.error("sglang-kdtree: %s=%r is not one of %s; using %r (SGLang's own MoE path)", ENV_OPTION,
                     value, "|".join(OPTIONS), DEFAULT_OPTION)
        return DEFAULT_OPTION
    return value


def enabled() -> bool:
    return option() == "marlin"


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("sglang-kdtree: %s=marlin but %s; this layer keeps SGLang's Marlin MoE path",
                       ENV_OPTION, reason)


@functools.cache
def _capability(device_index: int):
    import torch

    return torch.cuda.get_device_capability(device_index)


def device_reason(x) -> str | None:
    """None for a tensor on a CUDA GPU of compute capability >= 8.0 (Marlin's minimum), else why not."""
    import torch

    if x.device.type != "cuda":
        return f"activations are on {x.device}"
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _capability(index) < _MIN_CAPABILITY:
        return f"the GPU is sm_{''.join(map(str, _capability(index)))}, older than sm_80"
    return None


def unsupported_reason(scheme, layer, dispatch_output) -> str | None:
    """None when ``fused_moe_marlin`` computes exactly what SGLang's ``apply_weights`` would, else why not."""
    import torch

    if getattr(scheme, "num_bits", None) != _SUPPORTED_BITS:
        return f"the checkpoint is {getattr(scheme, 'num_bits', '?')}-bit (only 4-bit is supported)"
    if not getattr(scheme, "sym", False):
        return "the checkpoint is asymmetric (zero points are not supported)"
    if getattr(scheme, "group_size", None) != _SUPPORTED_GROUP_SIZE:
        return f"the group size is {getattr(scheme, 'group_size', '?')} (only {_SUPPORTED_GROUP_SIZE} is supported)"
    if not getattr(layer, "is_marlin_converted", False):
        return "the layer's weights are not in Marlin layout (process_weights_after_loading has not run)"
    g_idx = getattr(layer, "w13_weight_g_idx", None)
    if g_idx is not None and g_idx.numel() > 0:
        return "the checkpoint uses activation reordering (g_idx)"
    config = getattr(scheme, "moe_runner_config", None)
    if config is None:
        return "the scheme has no moe_runner_config"
    if getattr(config, "activation", "silu") != "silu" or not getattr(config, "is_gated", True):
        return f"the activation is {getattr(config, 'activation', '?')} (only gated SiLU is supported)"
    if getattr(config, "swiglu_limit", None) is not None or getattr(config, "gemm1_alpha", None) is not None:
        return "the activation has a SwiGLU clamp or alpha"
    if getattr(config, "no_combine", False):
        return "no_combine is set (per-route outputs are requested)"
    dispatcher = getattr(layer, "dispatcher", None)
    if getattr(dispatcher, "local_expert_mapping", None) is not None:
        return "expert parallelism maps expert ids (local_expert_mapping)"
    x = getattr(dispatch_output, "hidden_states", None)
    topk = getattr(dispatch_output, "topk_output", None)
    if not isinstance(x, torch.Tensor) or getattr(topk, "topk_ids", None) is None:
        return "the dispatch output is not a standard (hidden_states, top-k) pair"
    if x.dtype != torch.bfloat16:
        return f"activations are {x.dtype} (only bfloat16 is supported)"
    reason = device_reason(x)
    if reason is not None:
        return reason
    scale_dtypes = {getattr(layer, name).dtype for name in ("w13_weight_scale", "w2_weight_scale")}
    if scale_dtypes != {x.dtype}:
        return f"the scales are {sorted(map(str, scale_dtypes))}, not the activation dtype {x.dtype}"
    hidden = x.shape[-1]
    intermediate = layer.w2_weight_packed.shape[1] * 16
    if hidden % MARLIN_N_MULTIPLE or intermediate % MARLIN_K_MULTIPLE:
        return f"hidden {hidden} / intermediate {intermediate} do not fit Marlin's tiles"
    return None


def apply_weights(original, self, layer, dispatch_output):
    """AROUND hook for ``CompressedTensorsWNA16MoE.apply_weights`` (routing rule in the module docstring)."""
    reason = unsupported_reason(self, layer, dispatch_output)
    if reason is not None:
        _warn_once(reason)
        return original(self, layer, dispatch_output)
    global routed_calls
    routed_calls += 1
    import torch
    from sglang.srt.layers import zero_copy_context
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    from sglang_kdtree.moe.forward import fused_moe_marlin
    from sglang_kdtree.moe.weights import MarlinMoEWeights

    x = dispatch_output.hidden_states.contiguous()
    topk = dispatch_output.topk_output
    weights = MarlinMoEWeights(
        w13=layer.w13_weight_packed,
        w13_scale=layer.w13_weight_scale,
        w2=layer.w2_weight_packed,
        w2_scale=layer.w2_weight_scale,
        workspace=layer.workspace,
        group_size=self.group_size,
    )
    factor = self.moe_runner_config.routed_scaling_factor
    output = fused_moe_marlin(
        x,
        weights,
        topk.topk_weights.to(torch.float32),
        topk.topk_ids,
        1.0 if factor is None else float(factor),
        out=zero_copy_context.get_moe_output(x),
    )
    return StandardCombineInput(hidden_states=output)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` when ``SGLANG_KDTREE_MOE=marlin``."""
    if not enabled():
        logger.debug("sglang-kdtree: %s=%s, SGLang's MoE path unchanged", ENV_OPTION, option())
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, apply_weights, HookType.AROUND)
    logger.info("sglang-kdtree: %s=marlin, compressed-tensors W4A16 MoE layers use sglang_kdtree.moe",
                ENV_OPTION)
