"""CPU tests of sglang_kdtree/patches/marlin_moe.py: the wrapped SGLang symbol exists with the argument order the hook
assumes, the hook is registered only when SGLANG_KDTREE_MOE=marlin, and a registered hook routes to
sglang_kdtree.moe only for a supported layer; anything else runs SGLang's original with a warning."""

import inspect
import logging
import pkgutil
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from sglang_kdtree.patches import marlin_moe as hook

E, K, N, GROUP = 4, 256, 128, 32


def test_target_exists_with_expected_signature():
    fn = inspect.unwrap(pkgutil.resolve_name(hook.TARGET))
    assert list(inspect.signature(fn).parameters) == ["self", "layer", "dispatch_output"]
    assert hook.TARGETS == (hook.TARGET,)


def test_patch_module_is_listed():
    from sglang_kdtree import patches

    assert "marlin_moe" in patches.PATCH_MODULES


@pytest.fixture
def registry(monkeypatch):
    """SGLang's HookRegistry with empty, test-local hook tables."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    return HookRegistry


@pytest.mark.parametrize("value", [None, "off", "OFF", ""])
def test_register_is_a_no_op_unless_enabled(registry, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(hook.ENV_OPTION, raising=False)
    else:
        monkeypatch.setenv(hook.ENV_OPTION, value)
    hook.register()
    assert hook.TARGET not in registry._hooks


def test_unknown_option_is_off_with_an_error(registry, monkeypatch, caplog):
    monkeypatch.setenv(hook.ENV_OPTION, "marlyn")
    with caplog.at_level(logging.ERROR, logger=hook.__name__):
        hook.register()
    assert hook.TARGET not in registry._hooks
    assert "marlyn" in caplog.text and "marlin" in caplog.text


def test_register_when_enabled(registry, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookType

    monkeypatch.setenv(hook.ENV_OPTION, " Marlin ")
    hook.register()
    [(hook_type, fn, _source)] = registry._hooks[hook.TARGET]
    assert hook_type == HookType.AROUND and fn is hook.apply_weights


# ------------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------------


def _scheme(**over):
    config = SimpleNamespace(activation="silu", is_gated=True, swiglu_limit=None, gemm1_alpha=None,
                             no_combine=False, routed_scaling_factor=2.5)
    for key in [k for k in over if hasattr(config, k)]:
        setattr(config, key, over.pop(key))
    fields = dict(num_bits=4, sym=True, group_size=GROUP, moe_runner_config=config)
    fields.update(over)
    return SimpleNamespace(**fields)


def _layer(**over):
    fields = dict(
        is_marlin_converted=True,
        w13_weight_packed=torch.zeros((E, K // 16, 4 * N), dtype=torch.int32),
        w13_weight_scale=torch.zeros((E, K // GROUP, 2 * N), dtype=torch.bfloat16),
        w2_weight_packed=torch.zeros((E, N // 16, 2 * K), dtype=torch.int32),
        w2_weight_scale=torch.zeros((E, N // GROUP, K), dtype=torch.bfloat16),
        workspace=torch.zeros(8, dtype=torch.int32),
        w13_weight_g_idx=torch.empty((E, 0), dtype=torch.int32),
        dispatcher=SimpleNamespace(local_expert_mapping=None),
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def _dispatch(dtype=torch.bfloat16, tokens=3):
    from sglang.srt.layers.moe.token_dispatcher import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    topk = StandardTopKOutput(
        topk_weights=torch.rand((tokens, 2), dtype=torch.float32),
        topk_ids=torch.randint(0, E, (tokens, 2), dtype=torch.int32),
        router_logits=torch.zeros((tokens, E)),
    )
    return StandardDispatchOutput(hidden_states=torch.zeros((tokens, K), dtype=dtype), hidden_states_scale=None,
                                  topk_output=topk)


@pytest.fixture
def routed(monkeypatch):
    """A CPU stand-in for a CUDA sm_90 device and a recorder in place of fused_moe_marlin."""
    from sglang_kdtree.moe import forward

    calls = []

    def fake_fused(x, weights, topk_weights, topk_ids, factor, *, out=None):
        calls.append(dict(x=x, weights=weights, topk_weights=topk_weights, topk_ids=topk_ids, factor=factor,
                          out=out))
        return torch.full_like(x, 7.0)

    monkeypatch.setattr(hook, "device_reason", lambda x: None)
    monkeypatch.setattr(forward, "fused_moe_marlin", fake_fused)
    monkeypatch.setattr(hook, "_warned", set())
    return calls


def _original(log):
    def original(self, layer, dispatch_output):
        log.append("original")
        return "sglang-output"

    return original


def test_supported_layer_goes_to_marlin_moe(routed):
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    log = []
    layer, dispatch = _layer(), _dispatch()
    result = hook.apply_weights(_original(log), _scheme(), layer, dispatch)
    assert log == [] and len(routed) == 1
    assert isinstance(result, StandardCombineInput) and torch.all(result.hidden_states == 7.0)
    call = routed[0]
    w = call["weights"]
    assert w.w13 is layer.w13_weight_packed and w.w2 is layer.w2_weight_packed
    assert w.w13_scale is layer.w13_weight_scale and w.w2_scale is layer.w2_weight_scale
    assert w.workspace is layer.workspace and w.group_size == GROUP
    assert (w.num_experts, w.hidden_size, w.intermediate_size) == (E, K, N)
    assert call["factor"] == 2.5 and call["topk_weights"].dtype == torch.float32
    assert torch.equal(call["topk_ids"], dispatch.topk_output.topk_ids)


def test_routed_scaling_factor_none_is_one(routed):
    hook.apply_weights(_original([]), _scheme(routed_scaling_factor=None), _layer(), _dispatch())
    assert routed[0]["factor"] == 1.0


@pytest.mark.parametrize(
    "scheme_over, layer_over, dtype, needle",
    [
        (dict(num_bits=8), {}, torch.bfloat16, "8-bit"),
        (dict(sym=False), {}, torch.bfloat16, "asymmetric"),
        (dict(group_size=128), {}, torch.bfloat16, "group size is 128"),
        ({}, dict(is_marlin_converted=False), torch.bfloat16, "not in Marlin layout"),
        ({}, dict(w13_weight_g_idx=torch.zeros((E, K), dtype=torch.int32)), torch.bfloat16, "reordering"),
        (dict(activation="gelu"), {}, torch.bfloat16, "gelu"),
        (dict(swiglu_limit=7.0), {}, torch.bfloat16, "clamp"),
        (dict(no_combine=True), {}, torch.bfloat16, "no_combine"),
        ({}, dict(dispatcher=SimpleNamespace(local_expert_mapping=torch.arange(E))), torch.bfloat16, "expert parallel"),
        ({}, {}, torch.float16, "float16"),
        ({}, dict(w2_weight_scale=torch.zeros((E, N // GROUP, K), dtype=torch.float16)), torch.bfloat16,
         "not the activation dtype"),
        ({}, dict(w2_weight_packed=torch.zeros((E, 96 // 16, 2 * K), dtype=torch.int32)), torch.bfloat16,
         "tiles"),
    ],
)
def test_unsupported_layer_falls_back_with_one_warning(routed, caplog, scheme_over, layer_over, dtype, needle):
    log = []
    with caplog.at_level(logging.WARNING, logger=hook.__name__):
        for _ in range(2):
            assert hook.apply_weights(_original(log), _scheme(**scheme_over), _layer(**layer_over),
                                      _dispatch(dtype)) == "sglang-output"
    assert log == ["original", "original"] and routed == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and needle in warnings[0]


def test_cpu_activations_fall_back(monkeypatch, caplog):
    """Without the device stand-in, a CPU tensor is refused by the real device check."""
    monkeypatch.setattr(hook, "_warned", set())
    log = []
    with caplog.at_level(logging.WARNING, logger=hook.__name__):
        assert hook.apply_weights(_original(log), _scheme(), _layer(), _dispatch()) == "sglang-output"
    assert log == ["original"] and "activations are on cpu" in caplog.text


def test_hook_wraps_the_installed_class(registry, routed, monkeypatch):
    """Through SGLang's own apply_hooks: the patched CompressedTensorsWNA16MoE.apply_weights reaches our
    hook for a supported layer, and SGLang's original body (down to its fused_marlin_moe call, replaced by
    a recorder) for an unsupported one."""
    import sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe as fused_mod
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as mod

    cls = mod.CompressedTensorsWNA16MoE
    monkeypatch.setattr(cls, "apply_weights", cls.apply_weights)  # restored after the test
    sglang_calls = []

    def fake_fused_marlin_moe(x, w1, w2, *args, **kwargs):
        sglang_calls.append((w1, kwargs["num_bits"]))
        return torch.full_like(x, 3.0)

    monkeypatch.setattr(fused_mod, "fused_marlin_moe", fake_fused_marlin_moe)
    monkeypatch.setenv(hook.ENV_OPTION, "marlin")
    hook.register()
    registry.apply_hooks()
    assert getattr(cls.apply_weights, "__wrapped__", None) is not None

    scheme = cls.__new__(cls)
    scheme.__dict__.update(vars(_scheme()))
    scheme.is_k_full = True
    layer = _layer(w2_weight_g_idx=torch.empty((E, 0), dtype=torch.int32),
                   w13_g_idx_sort_indices=torch.empty((E, 0), dtype=torch.int32),
                   w2_g_idx_sort_indices=torch.empty((E, 0), dtype=torch.int32))
    result = cls.apply_weights(scheme, layer, _dispatch())
    assert len(routed) == 1 and sglang_calls == [] and torch.all(result.hidden_states == 7.0)

    scheme.group_size = 128  # unsupported: SGLang's own body runs
    result = cls.apply_weights(scheme, layer, _dispatch())
    assert len(routed) == 1 and len(sglang_calls) == 1 and torch.all(result.hidden_states == 3.0)
    assert sglang_calls[0][0] is layer.w13_weight_packed
