"""Widen each ``req_to_token`` row by the KDTREE round's decode reservation, so a request near the model's context
length cannot write its reservation past the end of its row.

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len`` (the headroom of a ``req_to_token``
row beyond the model's context length, read once when the pool is built).

Why: before every decode round the DFLASH-family ``prepare_for_decode`` maps ``2 * speculative_num_draft_tokens``
slots past a request's committed length (``2 * max(N, block_size)`` under KDTREE:
``sglang_kdtree/patches/decode_reserve.py``) into its ``req_to_token`` row, but the row's headroom is only
``4 + max_speculative_num_draft_tokens``. A request whose committed length comes within about one reservation of the
context length (SGLang admits requests up to ``context_len - 1`` tokens) then writes past its row: on the CPU server
the scheduler died (prompt 990 + 30 new tokens on a 1,024-token model at verify width 65), and on CUDA SGLang's
row-assign kernel would write into the next row, another request's slot map. Under KDTREE the headroom becomes at
least ``4 + 2 * max(M, 32)`` (``M`` = ``max_speculative_num_draft_tokens``, 32 the largest drafter block): a few
hundred int32 per row, no KV memory. Request lengths are unaffected (SGLang bounds them by the context length, not by
the row width). Other algorithms are untouched.
"""

from __future__ import annotations

TARGET = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"
TARGETS = (TARGET, "sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len",
           "sglang.srt.runtime_context.max_speculative_num_draft_tokens")


def kdtree_headroom(max_draft_tokens: int | None) -> int:
    """The row headroom a KDTREE decode reservation needs: ``4 + 2 * max(M, MAX_BLOCK_SIZE)`` (the reservation is
    twice the larger of the verify width and the drafter block, which is at most ``MAX_BLOCK_SIZE``)."""
    from sglang_kdtree.state import MAX_BLOCK_SIZE

    return 4 + 2 * max(int(max_draft_tokens or 0), MAX_BLOCK_SIZE)


def get_req_to_token_extra_context_len(original, *args, **kwargs):
    from sglang.srt.runtime_context import get_spec, max_speculative_num_draft_tokens

    from sglang_kdtree import state

    extra = original(*args, **kwargs)
    if not state.is_kdtree(get_spec().speculative_algorithm):
        return extra
    return max(extra, kdtree_headroom(max_speculative_num_draft_tokens()))


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, get_req_to_token_extra_context_len, HookType.AROUND)
