"""An allocation failure inside a KDTREE decode round, contained (``KDTreeWorker._contained_round``).

Policy:

1. A round that raises ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class) or
   ``MemoryError`` is run once more, after the batch's fields the round edits are put back
   (``snapshot_batch`` / ``restore_batch``, as SGLang's own ``_forward_isolation`` does) and after what the
   plugin caches is released (``release_round_caches``: on CUDA the GPU backend's grow-only round buffers and
   its captured round graphs, then ``torch.cuda.empty_cache()``; on CPU nothing). A round only writes the KV
   and draft KV of positions ``>= P`` (the verify rows, then the commit into ``P..P+tau-1``), so a second
   attempt starts from the same state as the first; a retry that succeeds changes nobody's output.
2. If the retry fails too, every request of the batch is ended: the round's buffers are sized per batch, so
   there is no request to single out. Each gets ``FINISH_ABORT`` (HTTP 503, SGLang's status for a request
   ended under memory pressure, "retry later") and ``skip_radix_cache_insert``: after this round the scheduler
   counts position ``P`` (the bonus token's) as committed, but its KV slot was never computed, and without the
   flag ``release_kv_cache`` would insert it into the radix cache for later requests with that prefix to reuse
   (``tests/e2e/test_server_kdtree.py`` was checked to fail so).
3. The batch's result (``abort_round_outputs`` / ``abort_logits_output``) is what SGLang's result processing
   accepts for a round in which nothing was verified: one committed token per request (accept length 1, the
   bonus-only round; 0 would make SGLang's ``num_correct_drafts`` negative), that token the request's EOS id
   (the abort set in ``to_finish`` wins over the EOS check in ``Req.update_finish_state``; the request ends as
   an abort, not a stop), ``new_seq_lens = seq_lens + 1``, and for ``return_logprob`` batches logprob fields of
   the shapes ``_apply_decode_logprobs`` reads, holding float32's lowest value (nothing was computed).

Not contained: an allocation failure at tensor parallelism > 1 (the other ranks are inside the round's
collectives and cannot retry with it; the exception propagates as before), an allocation failure that a
library reports as another error (e.g. a cuBLAS ``CUBLAS_STATUS_ALLOC_FAILED`` RuntimeError), and one in the
few small allocations of the abort result itself.

Test-only fault injection (``KDTREE_TEST_FAULTS``): ``round_oom`` raises ``torch.OutOfMemoryError`` from the
backend's ``reserve`` (where the round's buffers are reserved, at the top of the round) on the first attempt
of a round whose batch holds a named request; ``round_oom_twice`` on the retry too.
"""

from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager
from http import HTTPStatus

import torch

#: What the worker treats as an allocation failure of the round.
OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)

#: Test-only fault kinds (``KDTREE_TEST_FAULTS``) -> the attempts (0 = first, 1 = retry) they fire on.
ROUND_OOM_FAULTS = {"round_oom": (0,), "round_oom_twice": (0, 1)}

#: The HTTP status and error type of a request ended by an allocation failure of its round.
ABORT_STATUS = HTTPStatus.SERVICE_UNAVAILABLE
ABORT_ERR_TYPE = "ServiceUnavailableError"

#: The logprob reported for the placeholder token of an ended request (nothing was computed for it).
PLACEHOLDER_LOGPROB = torch.finfo(torch.float32).min


def abort_message(error: str) -> str:
    return (f"KDTREE round could not allocate memory ({error}); the request was ended, the server continues")


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (torch's CUDA OOM message runs over several lines)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def injected_oom(faults: dict, attempt: int) -> str | None:
    """The test-only OOM to raise on ``attempt`` of this round (``faults`` as ``KDTreeWorker._test_faults``
    returns it: fault kind -> batch rows), or None."""
    for kind, attempts in ROUND_OOM_FAULTS.items():
        if faults.get(kind) and attempt in attempts:
            return (f"KDTREE test fault {kind}: allocation failure injected at the round's buffer reservation "
                    f"(attempt {attempt + 1}, batch rows {list(faults[kind])})")
    return None


@contextmanager
def failing_reserve(backend, message: str | None):
    """While active (``message`` not None), ``backend.reserve(...)`` raises ``torch.OutOfMemoryError(message)``,
    as a real allocation failure there would; the backend's own ``reserve`` is back afterwards."""
    if message is None:
        yield
        return

    def reserve(*args, **kwargs):
        raise torch.OutOfMemoryError(message)

    backend.reserve = reserve  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        del backend.reserve


def snapshot_batch(batch) -> dict:
    """The batch's fields (shallow), to undo what a failed round attempt changed (``batch.out_cache_loc``,
    ``seq_lens_cpu``, and ``prepare_for_verify``'s ``input_ids`` / ``spec_info`` / ``forward_mode``)."""
    if dataclasses.is_dataclass(batch):
        return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return dict(vars(batch))


def restore_batch(batch, snapshot: dict) -> None:
    for name, value in snapshot.items():
        setattr(batch, name, value)


def release_round_caches(backend) -> list[str]:
    """Release what the plugin caches for rounds, before the retry; returns what was released (for the log).

    On the GPU backend: the round graphs (``gpu.round_graphs``: each capture holds a private memory pool) with
    their static inputs (the tree step's head-logits buffer of max batch x depth x vocab), and the
    grow-only round buffers (the ``TreeBuilder`` and the accept / plan / hidden storages), which the retry's
    ``reserve`` and steps allocate again at the size this batch needs (a ``reserve`` that grows allocates the
    new builder while the old one is still held, so dropping it first lowers that peak). Both are caches: the
    graphs are captured again on a later round with the same key, as after any buffer growth. Then Python's
    garbage collector (the failed attempt's tensors may sit in reference cycles) and
    ``torch.cuda.empty_cache()``. The reference backend (CPU) caches nothing.
    """
    released = []
    for name in ("_tree_graphs", "_commit_graphs"):
        graphs = getattr(backend, name, None)
        if graphs is None:
            continue
        if getattr(graphs, "_graphs", None):
            released.append(f"{len(graphs._graphs)} {name[1:]}")
            graphs._graphs.clear()
        if hasattr(graphs, "_builder"):
            graphs._builder = None
        # the graphs' static inputs (the tree step's head-logits buffer is max batch x depth x vocab)
        held = [attr for attr in ("_logits", "_roots", "_seq", "_slots") if getattr(graphs, attr, None) is not None]
        for attr in held:
            setattr(graphs, attr, None)
        if held:
            released.append(f"{name[1:]} inputs")
    if getattr(backend, "_builder", None) is not None:
        backend._builder = None
        released.append("round buffers")
    for name in ("_accept_storage", "_plan_storage", "_hidden_storage"):
        storage = getattr(backend, name, None)
        if isinstance(storage, torch.Tensor) and storage.numel():
            setattr(backend, name, storage.new_empty(0))
            released.append(name[1:])
    device = getattr(backend, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        released.append("CUDA cache")
    return released


def placeholder_tokens(reqs, model_eos) -> list[int]:
    """Per request, the token the scheduler commits for an ended round: the request's smallest EOS id, else the
    model's, else 0 (a special token, hidden from the text by ``skip_special_tokens``)."""
    fallback = min(model_eos) if model_eos else 0
    return [min(req.eos_token_ids) if getattr(req, "eos_token_ids", None) else fallback for req in reqs]


def abort_round_outputs(seq_lens: torch.Tensor, tokens: list[int], width: int):
    """``(next_token_ids [bs * width], accept_lens [bs] int32, new_seq_lens [bs] int64)`` of a round that
    verified nothing: each request commits one token (``tokens[b]``, at column 0 of its stride-``width`` row)."""
    bs = int(seq_lens.shape[0])
    device = seq_lens.device
    out = torch.zeros((bs, width), dtype=torch.int64, device=device)
    out[:, 0] = torch.tensor(tokens, dtype=torch.int64).to(device)
    accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
    new_seq_lens = seq_lens.to(torch.int64) + 1
    return out.reshape(-1), accept_lens, new_seq_lens


def abort_logits_output(batch):
    """A ``LogitsProcessorOutput`` for the ended round: no logits or hidden states; for a ``return_logprob``
    batch, one placeholder entry per request in the layout ``compute_spec_logprobs`` gives a one-column chain
    (``next_token_logprobs`` ``[bs, 1]``; top-logprobs: empty tensors per request; ``token_ids_logprob``: the
    requested ids, each with the placeholder value)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=None)
    if not batch.return_logprob:
        return out
    bs = len(batch.reqs)
    out.next_token_logprobs = torch.full((bs, 1), PLACEHOLDER_LOGPROB, dtype=torch.float32)
    if batch.top_logprobs_nums and any(k > 0 for k in batch.top_logprobs_nums):
        out.next_token_top_logprobs_val = [torch.empty(0, dtype=torch.float32) for _ in range(bs)]
        out.next_token_top_logprobs_idx = [torch.empty(0, dtype=torch.int64) for _ in range(bs)]
    if batch.token_ids_logprobs and any(ids is not None for ids in batch.token_ids_logprobs):
        out.next_token_token_ids_logprobs_val = [
            torch.full((len(ids or []),), PLACEHOLDER_LOGPROB, dtype=torch.float32) for ids in batch.token_ids_logprobs]
        out.next_token_token_ids_logprobs_idx = [list(ids or []) for ids in batch.token_ids_logprobs]
    return out
