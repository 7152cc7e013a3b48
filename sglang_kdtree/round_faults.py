"""Faults of a KDTREE decode round, contained so that only the requests they hit end.

**Bad values** (NaN / +inf logits, an invalid path or slot): no backend raises mid-round (``contract``). At the
round's end ``end_faulty_requests`` reads the backend's device error flags once and ends each flagged request
with ``FINISH_ABORT`` naming the fault (HTTP 500); the rest of the batch goes on.

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


# -- bad values: the device error flags, read once per round ----------------------------------------------------


def _batch_flag_faults(faults: dict, bs: int, tree_bits: int, commit_bits: int, acc_plan, draft_logits) -> None:
    """Trace the per-batch flags (draft log-probs / tree, KV commit) back to requests: those whose draft logits
    hold NaN / +inf, whose commit plan is invalid; failing that, every request of the batch."""
    from sglang_kdtree.gpu.errors import describe_device_error
    from sglang_kdtree.gpu.topk import TOPK_ERRORS

    if tree_bits:
        what = [m for bit, m in TOPK_ERRORS.items() if tree_bits & bit]
        rows = draft_logits.reshape(bs, -1)
        bad = (torch.isnan(rows) | torch.isposinf(rows)).any(dim=1).tolist()
        for b in [b for b in range(bs) if bad[b]] or range(bs):
            faults.setdefault(b, []).extend(f"draft: {m}" for m in what)
    if commit_bits:
        invalid = (acc_plan.src_slots[:, 0] < 0).tolist()
        for b in [b for b in range(bs) if invalid[b]] or range(bs):
            faults.setdefault(b, []).extend(f"commit: {m}" for m in describe_device_error(commit_bits))


def end_faulty_requests(backend, batch, acc, plan, draft_logits) -> None:
    """Read every device error flag of the round once (the round's one host read at its end; the scheduler
    reads the results right after) and end each flagged request with ``FINISH_ABORT`` naming the fault,
    so the rest of the batch goes on. Flags the kernels keep per batch, not per request (draft
    log-probs / tree, KV commit), are traced back to the requests whose draft logits hold NaN / +inf or
    whose commit plan is invalid; failing that, the whole batch is ended. The flags are cleared."""
    tree_flag, commit_flag = backend.tree_errors, backend.commit_errors
    words = torch.cat([tree_flag.to(torch.int64), commit_flag.to(torch.int64), acc.errors.to(torch.int64)])
    host = words.tolist()
    tree_bits, commit_bits, req_bits = host[0], host[1], host[2:]
    if not (tree_bits or commit_bits or any(req_bits)):
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from sglang_kdtree.gpu.errors import describe_device_error

    faults = {b: describe_device_error(bits) for b, bits in enumerate(req_bits) if bits}
    _batch_flag_faults(faults, len(req_bits), tree_bits, commit_bits, plan, draft_logits)
    if tree_bits:
        tree_flag.zero_()
    if commit_bits:
        commit_flag.zero_()
    for b, problems in sorted(faults.items()):
        req = batch.reqs[b]
        message = f"KDTREE round failed for this request: {'; '.join(problems)}"
        logger.error("%s (rid=%s)", message, req.rid)
        req.to_finish = FINISH_ABORT(message, status_code=500, err_type="InternalServerError")


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
    return GenerationBatchResult(
        logits_output=abort_logits_output(batch),
        next_token_ids=next_token_ids,
        accept_lens=accept_lens,
        can_run_cuda_graph=False,
        next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
        speculative_num_draft_tokens=width,
        new_seq_lens=new_seq_lens,
    )
