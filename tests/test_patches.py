"""Every SGLang symbol our patches touch exists in the installed SGLang (an upgrade that renames or
removes one fails here, loudly, instead of silently running unpatched), and registration is idempotent."""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest

from sglang_kdtree import patches

ALWAYS_HOOKED = ("torch_native_verify", "decode_reserve", "cpu_draft_backend", "input_embeds_dtype")
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
