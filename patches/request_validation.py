"""Refuse, per request, what the KDTREE round does not implement yet, instead of failing the batch.

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.speculative.dflash_utils.validate_dflash_request`` (the scheduler's admission check for every
DFLASH-family algorithm; a returned message aborts just that request with it).

Why: the tree round has no logprob output and no grammar-constrained walk yet. Without this check such a
request would reach the worker, whose ``ValueError`` would stop the scheduler for every request. Under
KDTREE a request asking for ``return_logprob`` or a grammar (``json_schema`` / ``regex`` / ``ebnf`` /
``structural_tag``) is aborted at admission with a message naming the field; others go to SGLang's check.
"""

from __future__ import annotations

TARGET = "sglang.srt.speculative.dflash_utils.validate_dflash_request"
TARGETS = (TARGET, "sglang.srt.managers.scheduler.validate_dflash_request")

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def kdtree_request_error(req) -> str | None:
    """The reason KDTREE cannot serve ``req``, or None."""
    if getattr(req, "return_logprob", False):
        return "KDTREE speculative decoding does not return logprobs yet; drop return_logprob"
    params = getattr(req, "sampling_params", None)
    for field in GRAMMAR_FIELDS:
        if getattr(params, field, None):
            return f"KDTREE speculative decoding does not support grammar-constrained decoding yet; drop {field}"
    return None


def validate_dflash_request(original, req, *args, **kwargs):
    from sglang_kdtree import worker

    if worker.ACTIVE_BLOCK_SIZE is not None:  # this process runs a KDTreeWorker
        error = kdtree_request_error(req)
        if error is not None:
            return error
    return original(req, *args, **kwargs)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_dflash_request, HookType.AROUND)
