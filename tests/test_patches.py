"""Every SGLang symbol our patches touch exists in the installed SGLang (an upgrade that renames or
removes one fails here, loudly, instead of silently running unpatched), and registration is idempotent."""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest

from sglang_kdtree import patches

ALWAYS_HOOKED = ("torch_native_verify", "decode_reserve", "req_to_token_headroom", "cpu_draft_backend",
                 "input_embeds_dtype", "verify_graph_spec_info", "request_validation")
MODULES = [importlib.import_module(f"sglang_kdtree.patches.{name}") for name in patches.PATCH_MODULES]


def _split(target: str) -> tuple[str, list[str]]:
    """(longest importable module path, remaining attribute chain) of a dotted target."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(mod) is not None:
                return mod, parts[i:]
        except (ImportError, ValueError):
            continue
    raise AssertionError(f"no importable module in {target!r}")


def _defined_statically(module: str, chain: list[str]) -> bool:
    """Whether ``module``'s source defines ``chain`` (class / function / assignment, nested by class)."""
    source = importlib.util.find_spec(module).origin
    scope = ast.parse(open(source).read()).body
    for name in chain:
        found = None
        for node in scope:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def _all_targets():
    for module in MODULES:
        for target in module.TARGETS:
            yield pytest.param(target, id=f"{module.__name__.rsplit('.', 1)[1]}:{target.rsplit('.', 2)[-2:]}")


@pytest.mark.parametrize("target", list(_all_targets()))
def test_patched_symbol_exists_in_installed_sglang(target):
    module, chain = _split(target)
    try:
        obj = importlib.import_module(module)
    except Exception:  # modules that need CUDA libraries at import: check the source instead
        assert _defined_statically(module, chain), f"{target} is not defined in the installed SGLang"
        return
    for name in chain:
        assert hasattr(obj, name), f"{target}: {name!r} missing in the installed SGLang"
        obj = getattr(obj, name)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_patch_module_documents_and_registers(module):
    assert module.__doc__ and "SGLang symbol" in module.__doc__, "each patch names the symbol it touches"
    assert module.TARGETS and all(isinstance(t, str) and t.startswith("sglang.") for t in module.TARGETS)
    assert callable(module.register)


def test_register_all_uses_hook_registry_and_is_idempotent():
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        patches.register_all()
        first = {k: len(v) for k, v in HookRegistry._hooks.items()}
        # Patches that always hook (marlin_moe is opt-in by environment, mla_tree_verify partly CUDA-only,
        # torch_native_mla registers through AttentionBackendRegistry: checked below).
        for name in ALWAYS_HOOKED:
            module = importlib.import_module(f"sglang_kdtree.patches.{name}")
            assert module.TARGETS[0] in HookRegistry._hooks, f"{name} registered no HookRegistry hook"
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

        assert "torch_native" in AttentionBackendRegistry._handlers
        assert first  # registrations happened
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(before)


# ---------------------------------------------------------------------------------------------------
# behaviour of the patches on plain objects (no server)
# ---------------------------------------------------------------------------------------------------


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _tree_verify_case(seed=0):
    """Two requests (prefix 3 and 5), N = 4 rows each, a real DDTree tree mask."""
    import numpy as np
    import torch

    from sglang_kdtree import reference

    rng = np.random.default_rng(seed)
    logprobs = np.sort(np.log(rng.dirichlet(np.ones(6), size=(2, 3))).astype(np.float32), axis=-1)[..., ::-1]
    ids = np.argsort(-rng.normal(size=(2, 3, 6)), axis=-1)
    trees = reference.build_trees(np.ascontiguousarray(logprobs), ids.astype(np.int64), 3, np.array([1, 2]))
    prefix = np.array([3, 5])
    vi = reference.verify_inputs(trees, prefix)
    return torch.from_numpy(vi.full_mask), prefix, vi


def test_torch_native_verify_honours_the_tree_mask():
    import torch

    from sglang.srt.layers.radix_attention import AttentionType

    from sglang_kdtree.patches import torch_native_verify

    full_mask, prefix, vi = _tree_verify_case()
    width, heads, dim = 4, 2, 8
    slots = 40
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(slots, 1, dim), torch.randn(slots, 1, dim)
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    req_to_token[2, :9] = torch.tensor([30, 31, 32, 5, 6, 7, 8, 0, 0])  # request 0: prefix 3 + 4 rows
    req_to_token[0, :9] = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 23])  # request 1: prefix 5 + 4 rows
    backend = _Obj(token_to_kv_pool=_Obj(get_key_buffer=lambda i: k_cache, get_value_buffer=lambda i: v_cache),
                   req_to_token_pool=_Obj(req_to_token=req_to_token))
    layer = _Obj(tp_q_head_num=heads, tp_k_head_num=1, qk_head_dim=dim, v_head_dim=dim, scaling=0.3,
                 attn_type=AttentionType.DECODER, layer_id=0)
    fb = _Obj(seq_lens=torch.tensor(prefix), req_pool_indices=torch.tensor([2, 0]),
              spec_info=_Obj(draft_token_num=width, custom_mask=full_mask))
    q = torch.randn(2 * width, heads * dim)
    out = torch_native_verify.verify_attention(q, layer, fb, backend).view(2 * width, heads, dim)

    offset = 0
    for b, req in enumerate([2, 0]):
        kv_len = int(prefix[b]) + width
        allowed = full_mask[offset : offset + width * kv_len].view(width, kv_len)
        offset += width * kv_len
        keys, values = k_cache[req_to_token[req, :kv_len].long(), 0], v_cache[req_to_token[req, :kv_len].long(), 0]
        for i in range(width):
            for h in range(heads):
                scores = (keys @ q[b * width + i].view(heads, dim)[h]) * 0.3
                scores[~allowed[i]] = float("-inf")
                expected = torch.softmax(scores, 0) @ values
                torch.testing.assert_close(out[b * width + i, h], expected, rtol=1e-5, atol=1e-5)
    # the case really is a tree (siblings exist), so a causal chain would have attended differently
    assert (vi.retrieve_next_sibling >= 0).any()


def test_graph_spec_info_is_tree_for_kdtree_target_only():
    import torch

    from sglang_kdtree.patches import verify_graph_spec_info as patch
    from sglang_kdtree.round.verify_input import KDTreeVerifyInput

    mask = torch.ones(64, dtype=torch.bool)
    calls = []
    original = lambda self, n: calls.append(n) or "original"  # noqa: E731
    runner = _Obj(model_runner=_Obj(spec_algorithm=_Obj(name="KDTREE"), is_draft_worker=False),
                  buffers=_Obj(custom_mask=mask), captured_req_width=17, max_bs=4)
    info = patch.get_spec_info(original, runner, 34)
    assert isinstance(info, KDTreeVerifyInput)
    assert info.custom_mask is mask and info.draft_token_num == 17 and info.topk == 2
    # the captured input carries ancestor bits: views of one static buffer of the runner (max_bs rows)
    assert tuple(info.ancestor_bits.shape) == (2, 17, 1) and info.ancestor_bits.dtype == torch.int32
    small = patch.get_spec_info(original, runner, 17).ancestor_bits
    assert tuple(small.shape) == (1, 17, 1) and small.data_ptr() == info.ancestor_bits.data_ptr()
    assert getattr(runner, patch._STATIC_BITS).numel() == 4 * 17
    runner.model_runner.is_draft_worker = True
    assert patch.get_spec_info(original, runner, 16) == "original"
    runner.model_runner = _Obj(spec_algorithm=_Obj(name="DFLASH"), is_draft_worker=False)
    assert patch.get_spec_info(original, runner, 16) == "original"
    assert calls == [16, 16]


def test_graph_replay_copies_the_rounds_ancestor_bits_into_the_static_buffer():
    import torch

    from sglang_kdtree.patches import verify_graph_spec_info as patch

    runner = _Obj(model_runner=_Obj(spec_algorithm=_Obj(name="KDTREE"), is_draft_worker=False),
                  buffers=_Obj(custom_mask=torch.ones(8, dtype=torch.bool)), captured_req_width=33, max_bs=3)
    captured = patch.get_spec_info(lambda *a: None, runner, 3 * 33).ancestor_bits  # [3, 33, 2]
    captured.fill_(-7)  # poison: whatever a replay reads must come from this round
    live = torch.randint(-2**31, 2**31 - 1, (2, 33, 2), dtype=torch.int32)
    batch = _Obj(spec_info=_Obj(ancestor_bits=live))
    assert patch.load_batch(lambda self, fb: "staged", runner, batch) == "staged"
    assert torch.equal(captured[:2], live)
    assert bool((captured[2] == -7).all())  # padding rows untouched
    too_big = _Obj(spec_info=_Obj(ancestor_bits=torch.zeros((4, 33, 2), dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="static buffer"):
        patch.load_batch(lambda self, fb: None, runner, too_big)
    # runners without the buffer (draft runner, other algorithms) are left alone
    other = _Obj(model_runner=runner.model_runner)
    assert patch.load_batch(lambda self, fb: "plain", other, batch) == "plain"


def test_request_validation_refuses_grammar_only_under_kdtree_and_serves_logprobs(monkeypatch):
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    plain = _Obj(return_logprob=False, sampling_params=_Obj(json_schema=None, regex=None, ebnf=None,
                                                             structural_tag=None))
    logprob = _Obj(return_logprob=True, sampling_params=plain.sampling_params)
    grammar = _Obj(return_logprob=False, sampling_params=_Obj(json_schema="{}", regex=None, ebnf=None,
                                                              structural_tag=None))
    monkeypatch.setattr(state, "_active", None)
    assert patch.validate_dflash_request(original, grammar, False) == "original"
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8))
    assert patch.validate_dflash_request(original, plain, False) == "original"
    assert patch.validate_dflash_request(original, logprob, False) == "original"  # served (spec_logprobs)
    assert "json_schema" in patch.validate_dflash_request(original, grammar, False)


def _sampled_req(ids=(1, 2, 3), **overrides):
    from sglang.srt.sampling.sampling_params import SamplingParams

    min_new = overrides.pop("min_new_tokens", 0)  # normalize(None) refuses it without a tokenizer: set after
    params = SamplingParams(temperature=overrides.pop("temperature", 0.8), **overrides)
    params.normalize(None)  # SGLang's own normalisation: temperature 0 becomes top_k 1, top_k -1 becomes "all"
    params.min_new_tokens = min_new
    return _Obj(return_logprob=False, sampling_params=params, origin_input_ids=list(ids))


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -0.3), ("repetition_penalty", 1.1), ("min_new_tokens", 3),
    ("logit_bias", {"5": 2.0})])
def test_kdtree_refuses_sampling_features_it_would_otherwise_ignore(monkeypatch, field, value):
    """SGLang's penalizers and logit_bias change the logits before even a greedy pick, so they are refused at
    any temperature."""
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8, vocab_size=100))
    error = patch.validate_dflash_request(original, _sampled_req(**{field: value}), False)
    assert error != "original" and field in error
    if not isinstance(value, dict):
        assert str(value) in error
    greedy = patch.validate_dflash_request(original, _sampled_req(temperature=0, **{field: value}), False)
    assert greedy != "original" and field in greedy
    # temperature, top-k, top-p and min-p are served (the tree accept applies them)
    assert patch.validate_dflash_request(original, _sampled_req(), False) == "original"
    assert patch.validate_dflash_request(original, _sampled_req(top_k=40, top_p=0.9), False) == "original"
    # and nothing is refused when this process is not a KDTREE server
    monkeypatch.setattr(state, "_active", None)
    assert patch.validate_dflash_request(original, _sampled_req(**{field: value}), False) == "original"


@pytest.mark.parametrize("temperature", [0.8, 0])
@pytest.mark.parametrize("filters", [{"min_p": 0.05}, {"min_p": 1.0}, {"min_p": 0.3, "top_k": 20, "top_p": 0.9}])
def test_kdtree_serves_min_p_with_or_without_top_k_and_top_p(monkeypatch, temperature, filters):
    """min-p is applied by the tree accept (``reference.filter_top_k_top_p``, ``sglang_kdtree/kernels/tree_accept.cu``):
    it reaches SGLang's own check at any temperature, alone or with top-k / top-p."""
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8, vocab_size=100))
    req = _sampled_req(temperature=temperature, **filters)
    assert req.sampling_params.min_p == filters["min_p"]
    assert patch.validate_dflash_request(original, req, False) == "original"
    # while a refused field next to it is still refused
    assert "presence_penalty" in patch.validate_dflash_request(
        original, _sampled_req(temperature=temperature, presence_penalty=0.5, **filters), False)


def test_kdtree_refuses_custom_logit_processors(monkeypatch):
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8))
    req = _sampled_req(temperature=0)
    req.custom_logit_processor = "serialized-processor"
    assert "custom_logit_processor" in patch.validate_dflash_request(original, req, False)


def test_kdtree_refuses_return_sampling_mask(monkeypatch):
    """Without the refusal the CPU server answered a greedy request with an internal error (HTTP 500, "The sampling
    backend did not return captured sampling support.")."""
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8, vocab_size=100))
    for temperature in (0, 0.8):
        req = _sampled_req(temperature=temperature)
        req.return_sampling_mask = True
        assert "drop return_sampling_mask" in patch.validate_dflash_request(original, req, False)
        req.return_sampling_mask = False
        assert patch.validate_dflash_request(original, req, False) == "original"


@pytest.mark.parametrize("ids, bad", [([0, 99], None), ([5, 100], 100), ([-1, 3], -1), ([], None)])
def test_kdtree_refuses_token_ids_outside_the_vocabulary(monkeypatch, ids, bad):
    from sglang_kdtree import state
    from sglang_kdtree.patches import request_validation as patch

    original = lambda req, enable_overlap: "original"  # noqa: E731
    monkeypatch.setattr(state, "_active", state.Geometry(budget=64, block_size=8, vocab_size=100))
    result = patch.validate_dflash_request(original, _sampled_req(ids, temperature=0), False)
    if bad is None:
        assert result == "original"
    else:
        assert f"input token id {bad} is outside the model's vocabulary [0, 100)" in result


def test_req_to_token_headroom_covers_the_kdtree_reservation(monkeypatch):
    """Under KDTREE a req_to_token row gets at least 4 + 2 * max(M, 32) slots past the context length (the decode
    reservation is twice the larger of the verify width and the drafter block); other algorithms keep SGLang's."""
    import sglang.srt.runtime_context as runtime_context

    from sglang_kdtree.patches import req_to_token_headroom as patch

    sglang_extra = lambda: 4 + 65  # noqa: E731  (SGLang's own: 4 + max_speculative_num_draft_tokens)
    monkeypatch.setattr(runtime_context, "max_speculative_num_draft_tokens", lambda: 65)
    monkeypatch.setattr(runtime_context, "get_spec", lambda: type("S", (), {"speculative_algorithm": "KDTREE"})())
    assert patch.get_req_to_token_extra_context_len(sglang_extra) == 4 + 2 * 65
    monkeypatch.setattr(runtime_context, "max_speculative_num_draft_tokens", lambda: 3)  # budget 2, block up to 32
    assert patch.get_req_to_token_extra_context_len(lambda: 7) == 4 + 2 * 32
    assert patch.get_req_to_token_extra_context_len(lambda: 500) == 500  # never narrower than SGLang's
    monkeypatch.setattr(runtime_context, "get_spec", lambda: type("S", (), {"speculative_algorithm": "DFLASH"})())
    assert patch.get_req_to_token_extra_context_len(sglang_extra) == 69
