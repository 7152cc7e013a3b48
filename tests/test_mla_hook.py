"""CPU tests of sglang_kdtree/patches/mla_tree_verify.py: it wraps symbols that exist in the installed SGLang with the
argument order it assumes, and it routes only KDTREE TARGET_VERIFY batches of absorbed MLA to our kernel."""

import inspect
import pkgutil
from types import SimpleNamespace

import pytest
import torch

from sglang_kdtree.patches import mla_tree_verify as hook


class _Mode:
    def __init__(self, verify: bool):
        self.verify = verify

    def is_target_verify(self):
        return self.verify

    def is_context_parallel_extend(self):  # read by SGLang's is_cp_active (fa3 path)
        return False


class _Bits:
    """Stands in for the CUDA ancestor-bits tensor (the hook only checks that it is on the GPU)."""

    is_cuda = True


def _batch(algo="KDTREE", verify=True, bits=True):
    return SimpleNamespace(
        forward_mode=_Mode(verify),
        spec_algorithm=SimpleNamespace(name=algo),
        spec_info=SimpleNamespace(ancestor_bits=_Bits() if bits else None),
        out_cache_loc=torch.arange(6),
        req_pool_indices=torch.zeros(2, dtype=torch.int64),
        seq_lens=torch.tensor([5, 7]),
    )


def _layer(**over):
    fields = dict(qk_head_dim=576, head_dim=576, v_head_dim=512, tp_q_head_num=4, tp_k_head_num=1, k_scale=None,
                  logit_cap=0.0, sliding_window_size=-1, scaling=0.1, layer_id=0)
    fields.update(over)
    return SimpleNamespace(**fields)


class _Pool:
    def __init__(self, dtype=torch.bfloat16):
        self.writes = []
        self.dtype = dtype  # the KV cache dtype (SGLang's KVCache.dtype)

    def get_key_buffer(self, layer_id):
        return "kv-buffer"

    def set_mla_kv_buffer(self, layer, loc, k, k_rope):
        self.writes.append(("mla", k, k_rope))


def _backend(pool_dtype=torch.bfloat16, **over):
    pool = _Pool(pool_dtype)
    fields = dict(use_mla=True, dcp_size=1, page_size=1, fa_skip_kv_cache=False, token_to_kv_pool=pool,
                  req_to_token="req-to-token",
                  forward_metadata=SimpleNamespace(kv_indptr="indptr", kv_indices="indices", swa_out_cache_loc=None))
    fields.update(over)
    be = SimpleNamespace(**fields)
    be.kv_writes = []
    be._set_kv_buffer = lambda fb, layer, loc, k, v: be.kv_writes.append((loc, k, v))
    return be


@pytest.fixture
def calls(monkeypatch):
    """Replace the kernel launchers and KVWriteLoc with recorders (no GPU here)."""
    import sglang.srt.mem_cache.memory_pool as memory_pool

    from sglang_kdtree.gpu import mla_attention

    log = []

    def fake_csr(q, kv, indptr, indices, tree_slots, bits, scale):
        log.append(("csr", q.shape, kv, indptr, indices, bits, scale))
        return torch.zeros(q.shape[0], q.shape[1], 512), None

    def fake_paged(q, kv, table, pool_idx, prefix, tree_slots, bits, scale):
        log.append(("paged", q.shape, kv, table, bits, scale, q.clone()))
        return torch.zeros(q.shape[0], q.shape[1], 512), None

    monkeypatch.setattr(mla_attention, "mla_tree_verify", fake_csr)
    monkeypatch.setattr(mla_attention, "mla_tree_verify_paged", fake_paged)
    fake_loc = SimpleNamespace(for_batch=lambda fb, swa_loc=None: "loc", for_layer=lambda fb, layer: "loc")
    monkeypatch.setattr(memory_pool, "KVWriteLoc", fake_loc)
    return log


def _original(log):
    def original(*args, **kwargs):
        log.append(("original",))
        return "original-output"

    return original


def _signature_params(target):
    """Parameter names of the target in the installed SGLang. The fa3 backend module needs libcuda to import
    (sgl_kernel), so on a CPU-only machine its installed source is read with ``ast`` instead."""
    import ast
    import importlib.util

    try:
        return list(inspect.signature(inspect.unwrap(pkgutil.resolve_name(target))).parameters)
    except (ImportError, AttributeError):
        module, cls, method = target.rsplit(".", 2)
        origin = importlib.util.find_spec(module).origin
        tree = ast.parse(open(origin).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == method:
                        return [a.arg for a in item.args.args]
        raise AssertionError(f"{target} is not defined in the installed SGLang ({origin})")


@pytest.mark.parametrize("target", hook.TARGETS)
def test_targets_exist_with_the_assumed_arguments(target):
    params = _signature_params(target)
    assert params[:7] == ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"]
    if target == hook.FA3_TARGET:
        assert params[7:9] == ["q_rope", "k_rope"]


@pytest.mark.parametrize("cuda", [True, False])
def test_register_adds_around_hooks_for_both_backends(monkeypatch, cuda):
    """Both backends are wrapped on CUDA; without CUDA the fa3 module cannot even import, so it is skipped."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    hook.register()
    assert [(t, h) for t, h, _ in HookRegistry._hooks[hook.TRITON_TARGET]] == [
        (HookType.AROUND, hook.triton_forward_extend)
    ]
    fa3 = [(t, h) for t, h, _ in HookRegistry._hooks[hook.FA3_TARGET]]
    assert fa3 == ([(HookType.AROUND, hook.fa3_forward_extend)] if cuda else [])


def test_register_refuses_an_unknown_mla_kernel(monkeypatch):
    """$SGLANG_KDTREE_MLA_KERNEL is checked when the plugin registers (server startup), naming the variable."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setenv("SGLANG_KDTREE_MLA_KERNEL", "flashmla")
    with pytest.raises(ValueError, match="SGLANG_KDTREE_MLA_KERNEL.*auto|wgmma|mma"):
        hook.register()
    monkeypatch.setenv("SGLANG_KDTREE_MLA_KERNEL", " MMA ")
    hook.register()
    assert HookRegistry._hooks[hook.TRITON_TARGET]


def test_triton_routes_kdtree_verify_to_kernel(calls):
    be, layer = _backend(), _layer()
    q = torch.zeros(6, 4 * 576)
    out = hook.triton_forward_extend(_original(calls), be, q, "k", "v", layer, _batch())
    assert calls[0][0] == "csr"
    assert calls[0][1] == (6, 4, 576)
    assert calls[0][2:6] == ("kv-buffer", "indptr", "indices", calls[0][5])
    assert isinstance(calls[0][5], _Bits) and calls[0][6] == 0.1
    assert be.kv_writes == [("loc", "k", "v")]  # the tree rows were written before the kernel read them
    assert out.shape == (6, 4 * 512)


@pytest.mark.parametrize(
    "batch_kw, layer_kw, backend_kw",
    [
        (dict(algo="EAGLE"), {}, {}),
        (dict(algo="DFLASH"), {}, {}),
        (dict(verify=False), {}, {}),
        (dict(bits=False), {}, {}),
        ({}, dict(k_scale=0.5), {}),
        ({}, dict(qk_head_dim=128, head_dim=128, v_head_dim=128), {}),
        ({}, dict(sliding_window_size=128), {}),
        ({}, {}, dict(use_mla=False)),
        ({}, {}, dict(dcp_size=2)),
        ({}, {}, dict(pool_dtype=torch.float8_e4m3fn)),  # --kv-cache-dtype fp8_e4m3: the kernels read bf16 only
        ({}, {}, dict(pool_dtype=torch.float16)),
    ],
)
def test_triton_falls_back_for_everything_else(calls, batch_kw, layer_kw, backend_kw):
    be = _backend(**backend_kw)
    out = hook.triton_forward_extend(_original(calls), be, torch.zeros(6, 4 * 576), "k", "v", _layer(**layer_kw),
                                     _batch(**batch_kw))
    assert out == "original-output" and calls == [("original",)] and be.kv_writes == []


def test_triton_falls_back_with_sinks(calls):
    out = hook.triton_forward_extend(_original(calls), _backend(), torch.zeros(6, 4 * 576), "k", "v", _layer(),
                                     _batch(), True, sinks=torch.zeros(4))
    assert out == "original-output"


def test_fa3_routes_kdtree_verify_with_split_query(calls):
    be = _backend()
    q_nope = torch.randn(6, 4 * 512)
    q_rope = torch.randn(6, 4 * 64)
    out = hook.fa3_forward_extend(_original(calls), be, q_nope, "k", "v", _layer(), _batch(), True, q_rope, "k_rope")
    kind, shape, kv, table, bits, scale, q_full = calls[0]
    assert (kind, shape, kv, table, scale) == ("paged", (6, 4, 576), "kv-buffer", "req-to-token", 0.1)
    assert torch.equal(q_full[..., :512], q_nope.view(6, 4, 512))
    assert torch.equal(q_full[..., 512:], q_rope.view(6, 4, 64))
    assert be.token_to_kv_pool.writes == [("mla", "k", "k_rope")]
    assert out.shape == (6, 4 * 512)


@pytest.mark.parametrize(
    "batch_kw, backend_kw, extra",
    [
        (dict(algo="EAGLE"), {}, {}),
        (dict(verify=False), {}, {}),
        (dict(bits=False), {}, {}),
        ({}, dict(page_size=16), {}),
        ({}, dict(use_mla=False), {}),
        ({}, dict(pool_dtype=torch.float8_e4m3fn), {}),
        ({}, {}, dict(return_lse=True)),
    ],
)
def test_fa3_falls_back_for_everything_else(calls, batch_kw, backend_kw, extra):
    be = _backend(**backend_kw)
    out = hook.fa3_forward_extend(_original(calls), be, torch.zeros(6, 4 * 512), "k", "v", _layer(),
                                  _batch(**batch_kw), True, torch.zeros(6, 4 * 64), "k_rope", **extra)
    assert out == "original-output" and calls == [("original",)] and be.token_to_kv_pool.writes == []


def test_is_kdtree_verify_only_for_kdtree_target_verify():
    assert hook.is_kdtree_verify(_batch())
    assert not hook.is_kdtree_verify(_batch(algo="EAGLE"))
    assert not hook.is_kdtree_verify(_batch(verify=False))
    assert not hook.is_kdtree_verify(SimpleNamespace(forward_mode=_Mode(True), spec_algorithm=None))


@pytest.fixture
def check_mode(monkeypatch):
    """SGLANG_KDTREE_MLA=check as registered, with fresh figures."""
    monkeypatch.setattr(hook, "_mode", "check")
    monkeypatch.setattr(hook, "_check", {})


def test_check_mode_runs_the_original_on_the_same_call_and_keeps_the_fused_output(calls, check_mode):
    seen = []

    def original(self, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs):
        seen.append((q, k, v, save_kv_cache, args, kwargs))
        return torch.full((6, 4 * 512), 0.25)  # the fake fused output is zeros

    be = _backend()
    q = torch.zeros(6, 4 * 576)
    out = hook.triton_forward_extend(original, be, q, "k", "v", _layer(), _batch())
    assert calls[0][0] == "csr" and torch.equal(out, torch.zeros(6, 4 * 512))  # the fused output is what returns
    assert len(seen) == 1 and seen[0][0] is q and seen[0][1:] == ("k", "v", False, (), {})  # no second KV write
    assert be.kv_writes == [("loc", "k", "v")]
    assert hook.check_stats(torch.device("cpu")) == {"calls": 1, "max_rel": 1.0, "max_abs": 0.25}


def test_check_mode_on_fa3_passes_the_split_query_to_the_original(calls, check_mode):
    seen = []

    def original(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, *args, **kwargs):
        seen.append((q, save_kv_cache, q_rope, k_rope))
        return torch.zeros(6, 4 * 512)

    q_nope, q_rope = torch.randn(6, 4 * 512), torch.randn(6, 4 * 64)
    hook.fa3_forward_extend(original, _backend(), q_nope, "k", "v", _layer(), _batch(), True, q_rope, "k_rope")
    assert len(seen) == 1 and seen[0][0] is q_nope and seen[0][1] is False and seen[0][2] is q_rope
    assert hook.check_stats(torch.device("cpu"))["calls"] == 1


def test_check_figures_keep_the_largest_difference_over_calls(check_mode):
    """Independent of the hook: the running maxima of |a - b| and of |a - b| / max|b| per call, and the count."""
    cpu = torch.device("cpu")
    assert hook.check_stats(cpu) is None  # nothing compared yet
    ref = torch.tensor([[2.0, -4.0], [1.0, 0.5]])
    hook.record_check(ref + torch.tensor([[0.0, 0.5], [0.0, 0.0]]), ref)  # 0.5 off, max|ref| 4
    hook.record_check(torch.tensor([1.0, 1.25]), torch.tensor([[1.0], [1.0]]))  # other shapes: flattened alike
    hook.record_check(ref.to(torch.bfloat16), ref)  # exact
    stats = hook.check_stats(cpu)
    assert stats == {"calls": 3, "max_rel": 0.25, "max_abs": 0.5}


def test_check_is_an_accepted_option_and_registers_the_hooks(monkeypatch):
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hook, "_mode", "fused")
    monkeypatch.setenv(hook.ENV_OPTION, " Check ")
    hook.register()
    assert hook._mode == "check" and HookRegistry._hooks[hook.TRITON_TARGET]
    monkeypatch.setenv(hook.ENV_OPTION, "both")
    with pytest.raises(ValueError, match="SGLANG_KDTREE_MLA='both' is not one of fused|off|check"):
        hook.option()


def test_check_stats_finds_a_cuda_devices_figures_under_plain_cuda(check_mode, monkeypatch):
    """The worker's device may be the string "cuda"; the figures are kept under the tensors' "cuda:N"."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hook._check["cuda:0"] = torch.tensor([0.5, 1.0, 2.0])
    assert hook.check_stats("cuda") == {"calls": 2, "max_rel": 0.5, "max_abs": 1.0}
    assert hook.check_stats(torch.device("cuda", 0))["calls"] == 2
    assert hook.check_stats("cuda:1") is None


def test_check_mode_compares_no_call_inside_sglangs_graph_capture(calls, check_mode, monkeypatch):
    """Capture-time calls (SGLang's warm-up runs and the capture) run on placeholder inputs: not compared."""
    seen = []
    monkeypatch.setattr(hook, "_in_capture", lambda device: True)
    hook.triton_forward_extend(lambda *a, **k: seen.append(a), _backend(), torch.zeros(6, 4 * 576), "k", "v",
                               _layer(), _batch())
    assert calls[0][0] == "csr" and seen == [] and hook.check_stats(torch.device("cpu")) is None


def test_in_capture_follows_sglangs_capture_mode_and_the_capturing_stream(monkeypatch):
    from sglang.srt.model_executor.runner_utils import capture_mode

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(capture_mode, "is_capture_mode", False)
    assert not hook._in_capture(cuda) and not hook._in_capture(torch.device("cpu"))
    monkeypatch.setattr(capture_mode, "is_capture_mode", True)  # the warm-up runs before a capture
    assert hook._in_capture(cuda) and not hook._in_capture(torch.device("cpu"))
    monkeypatch.setattr(capture_mode, "is_capture_mode", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert hook._in_capture(cuda)
