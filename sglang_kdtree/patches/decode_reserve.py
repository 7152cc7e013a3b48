"""Size the per-round KV reservation of a KDTREE decode step for both of its windows.

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode``.

Why: it reserves ``2 * speculative_num_draft_tokens`` KV slots past each request's committed length, the
DFLASH chain's block. A KDTREE round writes two windows from the same start ``P``: the draft block
(``block_size`` rows) and the tree verify (``N = budget + 1`` rows, which is what
``speculative_num_draft_tokens`` means for KDTREE). With a small budget (``N < block_size / 2``) the draft
block would write past the reservation into another request's slots. Under KDTREE the original runs with
``speculative_num_draft_tokens = max(N, block_size)`` (``state.Geometry.kv_reserve`` of the geometry the worker
published); every other algorithm is untouched.
"""

from __future__ import annotations

TARGET = "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode"
TARGETS = (TARGET, "sglang.srt.runtime_context.get_spec")


def prepare_for_decode(original, self, batch, *args, **kwargs):
    from sglang.srt.runtime_context import get_spec

    from sglang_kdtree import state

    geometry = state.active()  # None: this process runs no KDTREE worker
    spec = get_spec()
    if geometry is None or geometry.kv_reserve <= int(spec.speculative_num_draft_tokens):
        return original(self, batch, *args, **kwargs)
    with spec.override(speculative_num_draft_tokens=geometry.kv_reserve):
        return original(self, batch, *args, **kwargs)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, prepare_for_decode, HookType.AROUND)
