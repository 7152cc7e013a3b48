"""Faults of a KDTREE decode round, contained so that only the requests they hit end.

**Bad values** (NaN / +inf logits, an invalid path or slot): no backend raises mid-round (``contract``). At the
round's end ``device_fault_words`` turns the backend's error flags into one fault word per request on the device,
and the host reads them only where SGLang reads the round's accept counts (``DeferredFaults``, from the worker's
``on_verify_complete_cpu``): each flagged request ends with ``FINISH_ABORT`` naming the fault (HTTP 500), the rest
of the batch goes on, and the round never waits for the device.

**Allocation failures** (``contained_round``, around ``KDTreeWorker._tree_round``). Policy:

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

**A grammar in a decode batch** (``ended_grammar_batch``): admission and startup refuse every known source, so this
is a last guard. The batch is ended like an allocation failure's (3. above): HTTP 400 for the requests that carry a
grammar, 503 for the others; the scheduler and other batches go on.

Not contained: an allocation failure at tensor parallelism > 1 (the other ranks are inside the round's
collectives and cannot retry with it; the exception propagates as before), an allocation failure that a
library reports as another error (e.g. a cuBLAS ``CUBLAS_STATUS_ALLOC_FAILED`` RuntimeError), and one in the
few small allocations of the abort result itself.

Test-only fault injection (``KDTREE_TEST_FAULTS``, ``TEST_FAULTS_ENV``): a path; while that file exists it holds
``{"<rid prefix>": "draft_nan" | "target_nan" | "round_oom" | "round_oom_twice"}`` (``read_test_faults``). The
round writes a NaN into the draft (or target verify) logits of every request whose rid starts with a prefix, so
the end-to-end tests can force a fault in one request of a live batch; ``round_oom`` raises
``torch.OutOfMemoryError`` from the backend's ``reserve`` (where the round's buffers are reserved, at the top of
the round) on the first attempt of a round whose batch holds a named request; ``round_oom_twice`` on the retry
too.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from collections import deque
from contextlib import contextmanager
from http import HTTPStatus

import torch

logger = logging.getLogger(__name__)

TEST_FAULTS_ENV = "KDTREE_TEST_FAULTS"

#: What the worker treats as an allocation failure of the round.
OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)

#: Test-only fault kinds (``KDTREE_TEST_FAULTS``) -> the attempts (0 = first, 1 = retry) they fire on.
ROUND_OOM_FAULTS = {"round_oom": (0,), "round_oom_twice": (0, 1)}

#: The HTTP status and error type of a request ended by an allocation failure of its round.
ABORT_STATUS = HTTPStatus.SERVICE_UNAVAILABLE
ABORT_ERR_TYPE = "ServiceUnavailableError"

#: A decode batch holding a grammar (``ended_grammar_batch``): what its requests with one, and the others, are told.
GRAMMAR_MESSAGE = ("KDTREE speculative decoding does not support grammar-constrained decoding (this request carries "
                   "a grammar); the request was ended, the server continues")
GRAMMAR_BATCH_MESSAGE = ("KDTREE round ended its batch because another request in it carries a grammar, which KDTREE "
                         "does not support; retry the request")

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
    """The test-only OOM to raise on ``attempt`` of this round (``faults`` as ``read_test_faults`` returns it:
    fault kind -> batch rows), or None."""
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
    from sglang.srt.utils.common import async_h2d

    bs = int(seq_lens.shape[0])
    device = seq_lens.device
    out = torch.zeros((bs, width), dtype=torch.int64, device=device)
    out[:, 0] = async_h2d(tokens, dtype=torch.int64, device=device)
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


def read_test_faults(path: str | None, batch) -> dict:
    """``{"draft_nan": [b...], "target_nan": [b...], "round_oom": [b...], ...}`` (fault kind -> batch rows) for
    this batch from the ``KDTREE_TEST_FAULTS`` file at ``path`` (empty without one)."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            wanted = json.load(f)
    except (OSError, ValueError):
        return {}
    out: dict = {}
    for b, req in enumerate(batch.reqs):
        for prefix, fault in wanted.items():
            if str(req.rid).startswith(prefix):
                out.setdefault(fault, []).append(b)
    return out


# -- bad values: per-request fault words, computed on the device, read where SGLang reads the round's results ----


def _flag_on_rows(flag: torch.Tensor, rows: torch.Tensor | None, bs: int) -> torch.Tensor:
    """``[bs]`` int64: a batch-level ``flag`` ``[1]`` on the requests ``rows`` marks, and on every request when
    the flag is set but ``rows`` marks none (or there are no rows to trace it with): an untraceable fault ends
    the whole batch rather than serving wrong tokens."""
    if rows is None:
        return flag.expand(bs)
    hit = rows | ~rows.any()
    return torch.where(hit, flag, torch.zeros_like(flag))


def _bad_draft_rows(draft_logits: torch.Tensor | None, bs: int) -> torch.Tensor | None:
    """``[bs]`` bool: requests whose draft logits hold NaN or +inf. One fp32 sum per request reads the logits
    once: it is NaN with a NaN (or +inf next to -inf), +inf with a +inf, and -inf, never flagged, when -inf
    (an impossible token, legitimate) is the only non-finite value."""
    if draft_logits is None:
        return None
    # splitting the leading dimension is a view even of the head's column-cut logits: no copy
    total = draft_logits.reshape(bs, -1, draft_logits.shape[-1]).sum(dim=(1, 2), dtype=torch.float32)
    return torch.isnan(total) | torch.isposinf(total)


def device_fault_words(backend, acc, plan, draft_logits) -> torch.Tensor:
    """The round's faults per request as ``[bs, 3]`` int64 ``(accept bits, draft bits, commit bits)``, computed
    on the device without a host read, and the backend's batch-level flags cleared (stream-ordered after the
    read). The draft / tree flag and the commit flag are kept per batch by the kernels: they are traced to the
    requests whose draft logits hold NaN / +inf and whose commit plan is invalid (``src_slots[:, 0] < 0``);
    failing that, to every request of the batch."""
    bs = int(acc.errors.shape[0])
    accept = acc.errors.to(torch.int64).reshape(bs)
    draft = _flag_on_rows(backend.tree_errors.to(torch.int64), _bad_draft_rows(draft_logits, bs), bs)
    commit = _flag_on_rows(backend.commit_errors.to(torch.int64), plan.src_slots[:, 0] < 0, bs)
    words = torch.stack([accept, draft, commit], dim=1)
    backend.tree_errors.zero_()
    backend.commit_errors.zero_()
    return words


def union_over_ranks(words: torch.Tensor, group=None) -> torch.Tensor:
    """``device_fault_words`` OR-ed over the tensor-parallel ``group``, on the device (an all-gather of the
    ``[bs, 3]`` words, no host read).

    Each rank traces draft faults on its own vocabulary shard of the draft logits, so the ranks' words can differ
    (a NaN in one shard); every rank must end the same requests, or their schedulers fall out of step."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return words
    parts = [torch.empty_like(words) for _ in range(world)]
    dist.all_gather(parts, words.contiguous(), group=group)
    out = parts[0]
    for part in parts[1:]:
        out = out | part
    return out


def fault_messages(accept_bits: int, draft_bits: int, commit_bits: int) -> list[str]:
    """What a request's fault word says, per fault (accept faults as they are, then ``draft:`` and ``commit:``)."""
    from sglang_kdtree.gpu.errors import TREE_ERRORS, describe_device_error

    return (describe_device_error(accept_bits) if accept_bits else []) + [
        f"draft: {m}" for bit, m in TREE_ERRORS.items() if draft_bits & bit] + (
        [f"commit: {m}" for m in describe_device_error(commit_bits)] if commit_bits else [])


def finish_faulty_requests(reqs, words_cpu) -> list:
    """End each request whose fault word (``device_fault_words``, now on the host) is nonzero with
    ``FINISH_ABORT`` (HTTP 500) naming its faults; the rest of the batch goes on. A request already finished
    or retracted is left alone: SGLang discards that round's output for it. Returns the ended requests."""
    ended = []
    for req, (accept_bits, draft_bits, commit_bits) in zip(reqs, words_cpu.tolist()):
        if not (accept_bits or draft_bits or commit_bits) or req.finished() or req.is_retracted:
            continue
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        problems = fault_messages(accept_bits, draft_bits, commit_bits)
        message = f"KDTREE round failed for this request: {'; '.join(problems)}"
        logger.error("%s (rid=%s)", message, req.rid)
        req.to_finish = FINISH_ABORT(message, status_code=500, err_type="InternalServerError")
        ended.append(req)
    return ended


class DeferredFaults:
    """The fault words of every decode result the worker returned, in launch order, until SGLang hands that
    result's accept counts to ``on_verify_complete_cpu`` (once per decode result, in order, in both scheduler
    modes, after the result's ``copy_done`` and before its tokens are appended). The words' device-to-host copy
    is issued on the round's stream before the scheduler's result copy, so it has landed by then; the faulty
    requests end when their round's result is processed, with that round's tokens and the same status as if
    the round had read its flags itself."""

    def __init__(self):
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, reqs, words: torch.Tensor | None) -> None:
        """The round's requests (a snapshot of the list: SGLang rebinds ``batch.reqs`` as it filters) and its
        device fault words (None: a result with no fault to read, e.g. an ended batch's)."""
        from sglang.srt.utils.common import async_d2h

        self._queue.append((list(reqs), None if words is None else async_d2h(words)))

    def land(self, batch_size: int) -> list:
        """The oldest result's faults: end its faulty requests; returns them."""
        if not self._queue:
            raise RuntimeError("KDTREE: SGLang reported a decode result the worker has no fault words for")
        reqs, words_cpu = self._queue.popleft()
        if len(reqs) != batch_size:
            raise RuntimeError(f"KDTREE: SGLang reported a decode result of {batch_size} requests, but the oldest "
                               f"round in flight had {len(reqs)}: results out of order")
        return [] if words_cpu is None else finish_faulty_requests(reqs, words_cpu)


# -- allocation failures: one retry, then the batch ends -----------------------------------------------------


def contained_round(worker, batch, on_publish):
    """``worker._tree_round(batch, on_publish)`` with its allocation failures contained (module docstring).

    A round raising ``torch.OutOfMemoryError`` or ``MemoryError`` runs once more, after the batch's fields
    are put back and the plugin's round caches are released (on CUDA: the GPU backend's round buffers and
    round graphs, then ``torch.cuda.empty_cache()``; on CPU nothing). If the retry fails too, every request
    of the batch (the round's memory is per batch) is ended with ``FINISH_ABORT`` (HTTP 503) and kept out
    of the radix cache, and the scheduler gets a result committing one placeholder token per request
    (``ended_round_result``); other batches and later rounds go on. At tensor parallelism > 1 the error
    propagates as before (the other ranks are inside the round's collectives)."""
    from sglang.srt.runtime_context import get_parallel

    faults = read_test_faults(worker._test_faults_path, batch)
    snapshot = snapshot_batch(batch)
    error = None
    for attempt in (0, 1):
        if attempt:
            restore_batch(batch, snapshot)
            released = release_round_caches(worker.backend)
            logger.warning("KDTREE round: retrying once after releasing %s", ", ".join(released) or "nothing")
        try:
            with failing_reserve(worker.backend, injected_oom(faults, attempt)):
                return worker._tree_round(batch, on_publish)
        except OOM_ERRORS as exc:
            parallel = get_parallel()
            if parallel.tp_size != 1 or getattr(parallel, "pp_size", 1) != 1:
                raise
            error = describe_error(exc)
            logger.warning("KDTREE round (batch of %d, attempt %d) could not allocate memory: %s",
                           len(batch.reqs), attempt + 1, error, exc_info=True)
        # the exception and its traceback (the failed attempt's tensors) are dropped here, before the retry
    restore_batch(batch, snapshot)
    return ended_round_result(worker, batch, error, on_publish)


def ended_round_result(worker, batch, error: str, on_publish=None):
    """End every request of ``batch`` after its round failed twice to allocate memory; the result commits
    one placeholder token per request (``placeholder_tokens``, ``abort_round_outputs``)."""
    message = abort_message(error)
    logger.error("%s (batch of %d: rids %s)", message, len(batch.reqs), [req.rid for req in batch.reqs])
    return _end_batch(worker, batch, lambda req: (message, ABORT_STATUS, ABORT_ERR_TYPE), on_publish)


def ended_grammar_batch(worker, batch, on_publish=None):
    """End a decode batch that holds a grammar, instead of raising in the scheduler (which would stop the server).

    Admission refuses grammar requests (``sglang_kdtree/patches/request_validation.py``) and startup refuses
    ``--enable-strict-thinking``, so reaching this means some other path attached a grammar. The tree accept cannot
    apply one, and the round's buffers are per batch: each request with a grammar ends with HTTP 400 naming the
    cause, each other request of the batch with HTTP 503 (retry); other batches go on."""
    logger.error("KDTREE round: a decode batch holds a grammar (rids %s); ending the batch",
                 [req.rid for req in batch.reqs if getattr(req, "grammar", None) is not None])

    def finish(req):
        if getattr(req, "grammar", None) is not None:
            return GRAMMAR_MESSAGE, HTTPStatus.BAD_REQUEST, "BadRequestError"
        return GRAMMAR_BATCH_MESSAGE, ABORT_STATUS, ABORT_ERR_TYPE

    return _end_batch(worker, batch, finish, on_publish)


def _end_batch(worker, batch, finish, on_publish=None):
    """End every request of ``batch`` with ``FINISH_ABORT(*finish(req))`` and return the result SGLang's result
    processing accepts for a round that verified nothing: one placeholder token per request."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    for req in batch.reqs:
        if req.to_finish is None:
            message, status, err_type = finish(req)
            req.to_finish = FINISH_ABORT(message, status_code=status, err_type=err_type)
        # the scheduler counts position P (the bonus token) as committed after this round, but its KV was never
        # computed: the request must not be checkpointed into the radix cache for later requests to reuse
        req.skip_radix_cache_insert = True
    model_eos = getattr(worker.target_worker.model_runner.model_config, "hf_eos_token_id", None)
    width = worker.verify_width
    next_token_ids, accept_lens, new_seq_lens = abort_round_outputs(
        batch.seq_lens, placeholder_tokens(batch.reqs, model_eos), width)
    bonus = next_token_ids.view(-1, width)[:, 0]
    if on_publish is not None:
        on_publish(new_seq_lens)
    worker.deferred_faults.push(batch.reqs, None)  # SGLang reports every decode result, this one too
    return GenerationBatchResult(
        logits_output=abort_logits_output(batch),
        next_token_ids=next_token_ids,
        accept_lens=accept_lens,
        can_run_cuda_graph=False,
        next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
        speculative_num_draft_tokens=width,
        new_seq_lens=new_seq_lens,
    )
