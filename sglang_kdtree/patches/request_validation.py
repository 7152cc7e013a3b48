"""Refuse, per request, what the KDTREE round does not implement yet, instead of failing the batch.

SGLang symbol wrapped (``HookType.AROUND``, SGLang 0.5.23):
``sglang.srt.speculative.dflash_utils.validate_dflash_request`` (the scheduler's admission check for every
DFLASH-family algorithm; a returned message aborts just that request with it).

Why: the tree round has no grammar-constrained walk and, at T > 0, samples from ``softmax(logits / T)``
filtered by top-k, top-p and min-p only (logprobs are served: ``sglang_kdtree/round/spec_logprobs.py``). Without
this check a grammar request would reach the worker, which can only end its whole decode batch
(``round_faults.ended_grammar_batch``), and the others would be served a different distribution than they asked
for. Under KDTREE a request is aborted at
admission with a message naming the field when it asks for

* a grammar (``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``);
* at any temperature, what SGLang's sampler applies to the logits before it picks, even the argmax, and the
  tree accept does not: ``frequency_penalty`` / ``presence_penalty`` other than 0, ``repetition_penalty``
  other than 1, ``min_new_tokens`` > 0 (these are SGLang's penalizers), a ``logit_bias``, a custom logit
  processor;
* ``return_sampling_mask`` (SGLang's sampler records the mask; the tree accept does not run it);
* an input token id outside ``[0, vocab)`` of the target (SGLang 0.5.23's own server crashes on one).

Temperature, top-k, top-p and min-p are served: at T > 0 the tree accept applies them at every node as SGLang's
sampler does (``reference.filter_top_k_top_p``; ``sglang_kdtree/kernels/tree_accept.cu`` on CUDA), and at T = 0 none of
them changes the argmax. Other requests go to SGLang's check.
"""

from __future__ import annotations

TARGET = "sglang.srt.speculative.dflash_utils.validate_dflash_request"
TARGETS = (TARGET, "sglang.srt.managers.scheduler.validate_dflash_request")

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


#: (field, value that means "off") of SGLang's penalizers, which change the logits before any pick (greedy too)
_UNSERVED_ANY_T = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                   ("min_new_tokens", 0))


def _first_on(params, fields) -> tuple[str, object] | None:
    """``(field, value)`` of the first of ``fields`` (``(name, off value)`` pairs) that ``params`` turns on."""
    for field, off in fields:
        value = getattr(params, field, off)
        if value is not None and float(value) != off:
            return field, value
    return None


def _sampling_error(req, params) -> str | None:
    on = _first_on(params, _UNSERVED_ANY_T)
    if on is not None:
        return (f"KDTREE speculative decoding does not apply {on[0]} yet (SGLang's sampler applies it even at "
                f"temperature 0, so the output would differ): drop {on[0]} (got {on[1]})")
    if getattr(params, "logit_bias", None):
        return "KDTREE speculative decoding does not apply logit_bias yet: drop logit_bias"
    if getattr(req, "custom_logit_processor", None):
        return "KDTREE speculative decoding does not run custom logit processors yet: drop custom_logit_processor"
    return None


def kdtree_request_error(req, vocab_size: int | None = None) -> str | None:
    """The reason KDTREE cannot serve ``req``, or None."""
    params = getattr(req, "sampling_params", None)
    for field in GRAMMAR_FIELDS:
        if getattr(params, field, None):
            return f"KDTREE speculative decoding does not support grammar-constrained decoding yet; drop {field}"
    error = _sampling_error(req, params)
    if error is not None:
        return error
    if getattr(req, "return_sampling_mask", False):
        # SGLang's DFLASH path answers it with an internal error (HTTP 500, greedy) or its own DFLASH message
        return ("KDTREE speculative decoding does not return sampling masks yet (the tree accept does not run "
                "SGLang's sampler): drop return_sampling_mask")
    ids = getattr(req, "origin_input_ids", None)
    if vocab_size is not None and ids is not None and len(ids):
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            return f"input token id {bad} is outside the model's vocabulary [0, {vocab_size}); fix the prompt's ids"
    return None


def validate_dflash_request(original, req, *args, **kwargs):
    from sglang_kdtree import state

    geometry = state.active()
    if geometry is not None:  # this process runs a KDTreeWorker
        error = kdtree_request_error(req, geometry.vocab_size)
        if error is not None:
            return error
    return original(req, *args, **kwargs)


def register() -> None:
    """Register the AROUND hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, validate_dflash_request, HookType.AROUND)
