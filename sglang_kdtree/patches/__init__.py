"""SGLang patches (installed as ``sglang_kdtree.patches``): one small module per patched SGLang symbol.

Each module names the SGLang symbol it touches and why, and exposes ``register()`` (HookRegistry
registrations) and ``TARGETS`` (the dotted SGLang symbols it patches; ``tests/test_patches.py`` asserts they
exist in the installed SGLang so an upgrade fails loudly). ``register_all()`` is called by
``sglang_kdtree.plugin.register`` before SGLang applies its hooks.
"""

from __future__ import annotations

import importlib

#: Patch modules, in registration order.
PATCH_MODULES: tuple[str, ...] = (
    "mla_tree_verify",
    "marlin_moe",
    "torch_native_verify",
    "torch_native_mla",
    "decode_reserve",
    "req_to_token_headroom",
    "cpu_draft_backend",
    "input_embeds_dtype",
    "verify_graph_spec_info",
    "request_validation",
    "scheduler_loop_times",
)


def register_all() -> None:
    for name in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
