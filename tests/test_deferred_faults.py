"""A round's faults end only the requests they hit, read without the round waiting for the device: the backend's
error flags become per-request fault words on the device (``round_faults.device_fault_words``), and the words
are read where SGLang reads the round's results (``round_faults.DeferredFaults``, from the worker's
``on_verify_complete_cpu``), in launch order, one round late under overlap."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_kdtree.round import pipeline
from sglang_kdtree.round import faults as round_faults
from sglang_kdtree.gpu.errors import ERR_LOGITS_NAN, ERR_LOGITS_POSINF, ERR_LOGPROB_NAN


def _fake_backend(tree_bits=0, commit_bits=0, device="cpu"):
    return types.SimpleNamespace(tree_errors=torch.tensor([tree_bits], dtype=torch.int32, device=device),
                                 commit_errors=torch.tensor([commit_bits], dtype=torch.int32, device=device))


class _Req:
    def __init__(self, rid, finished=False, retracted=False):
        self.rid, self.to_finish, self._finished, self.is_retracted = rid, None, finished, retracted

    def finished(self):
        return self._finished


def _batch(bs):
    return types.SimpleNamespace(reqs=[_Req(f"r{b}") for b in range(bs)])


def _round(bs, req_bits=None, bad_plan_rows=(), nan_rows=()):
    acc = types.SimpleNamespace(errors=torch.tensor(req_bits or [0] * bs, dtype=torch.int64))
    src = torch.arange(bs * 3, dtype=torch.int64).view(bs, 3)
    for b in bad_plan_rows:
        src[b] = -1
    plan = types.SimpleNamespace(src_slots=src)
    logprobs = torch.log_softmax(torch.randn(bs, 2, 4), dim=-1)
    logprobs[:, :, -1] = float("-inf")  # impossible tokens are legitimate, never a fault
    for b in nan_rows:
        logprobs[b, 1, 0] = float("nan")
    return acc, plan, logprobs


def _end(backend, batch, acc, plan, draft):
    """The round's words, then the host's read of them (what a result's processing does)."""
    return round_faults.finish_faulty_requests(batch.reqs, round_faults.device_fault_words(backend, acc, plan, draft))


def test_clean_round_ends_nobody():
    backend, batch = _fake_backend(), _batch(3)
    assert _end(backend, batch, *_round(3)) == []
    assert all(r.to_finish is None for r in batch.reqs)


def test_per_request_accept_bits_end_only_that_request():
    backend, batch = _fake_backend(), _batch(4)
    _end(backend, batch, *_round(4, req_bits=[0, 8, 0, 0]))
    assert [r.to_finish is not None for r in batch.reqs] == [False, True, False, False]
    message = batch.reqs[1].to_finish.message
    assert "KDTREE" in message and "NaN in a visited target logits row" in message
    assert batch.reqs[1].to_finish.status_code == 500


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draft_flag_is_traced_to_the_request_with_bad_draft_values_and_cleared(bad):
    backend, batch = _fake_backend(tree_bits=ERR_LOGPROB_NAN), _batch(3)
    acc, plan, draft = _round(3)
    draft[2, 0, 1] = bad  # the other rows hold -inf: legitimate
    _end(backend, batch, acc, plan, draft)
    assert [r.to_finish is not None for r in batch.reqs] == [False, False, True]
    assert "draft: logprobs contains NaN" in batch.reqs[2].to_finish.message
    assert int(backend.tree_errors[0]) == 0  # cleared for the next round


def test_commit_flag_is_traced_to_the_invalid_plan_row():
    backend, batch = _fake_backend(commit_bits=64), _batch(3)
    _end(backend, batch, *_round(3, bad_plan_rows=[0]))
    assert [r.to_finish is not None for r in batch.reqs] == [True, False, False]
    assert "commit:" in batch.reqs[0].to_finish.message and int(backend.commit_errors[0]) == 0


@pytest.mark.parametrize("tree_bits, commit_bits", [(0, 128), (ERR_LOGITS_NAN, 0)])
def test_untraceable_flag_ends_the_whole_batch_rather_than_serving_wrong_tokens(tree_bits, commit_bits):
    backend, batch = _fake_backend(tree_bits, commit_bits), _batch(2)
    _end(backend, batch, *_round(2))
    assert all(r.to_finish is not None for r in batch.reqs)


def test_a_draft_flag_without_draft_logits_ends_the_whole_batch():
    backend, batch = _fake_backend(tree_bits=ERR_LOGITS_NAN), _batch(2)
    acc, plan, _ = _round(2)
    _end(backend, batch, acc, plan, None)
    assert all("draft: logits contains NaN" in r.to_finish.message for r in batch.reqs)


def test_the_words_are_computed_without_a_host_read():
    """Every input on the meta device: a host read of any of them (``.tolist()``, ``bool()``, a boolean-mask
    gather) raises, so the round's fault words cost it no wait."""
    backend = _fake_backend(ERR_LOGITS_NAN, 64, device="meta")
    acc = types.SimpleNamespace(errors=torch.zeros(4, dtype=torch.int64, device="meta"))
    plan = types.SimpleNamespace(src_slots=torch.zeros((4, 3), dtype=torch.int64, device="meta"))
    words = round_faults.device_fault_words(backend, acc, plan, torch.zeros((8, 50), device="meta"))
    assert words.shape == (4, 3) and words.dtype == torch.int64 and words.device.type == "meta"


def test_finished_and_retracted_requests_are_left_alone():
    """Under overlap the round in flight for a request that ended meanwhile is discarded by SGLang: its faults
    must not touch the request (a retracted one is decoded again later)."""
    reqs = [_Req("a", finished=True), _Req("b", retracted=True), _Req("c")]
    words = torch.tensor([[8, 0, 0], [8, 0, 0], [8, 0, 0]])
    assert round_faults.finish_faulty_requests(reqs, words) == [reqs[2]]
    assert reqs[0].to_finish is None and reqs[1].to_finish is None


def test_reference_backend_isolates_a_faulty_request_and_leaves_the_others_bit_identical():
    """NaN / +inf draft logits or NaN target logits in one request: the reference no longer raises (which
    would stop the scheduler for every request); that request is marked, the others' results are exactly
    those of a clean batch, and only the marked one ends."""
    gen = torch.Generator().manual_seed(4)
    bs, depth, vocab, budget = 3, 4, 50, 6
    draft = torch.randn((bs, depth, vocab), generator=gen)
    clean = pipeline.ReferenceBackend("cpu")
    lp_c, ids_c = clean.topk(draft, budget)
    roots = torch.tensor([1, 2, 3])
    trees_c = clean.build(lp_c, ids_c, budget, roots)
    target = torch.randn((bs, budget + 1, vocab), generator=gen)
    acc_c = clean.accept_greedy(trees_c, target, depth)
    assert int(clean.tree_errors) == 0 and acc_c.errors.tolist() == [0, 0, 0]

    backend = pipeline.ReferenceBackend("cpu")
    bad_draft = draft.clone()
    bad_draft[1, 2, 7] = float("nan")
    bad_draft[2, 0, 3] = float("inf")
    lp, ids = backend.topk(bad_draft, budget)
    assert int(backend.tree_errors) == ERR_LOGITS_NAN | ERR_LOGITS_POSINF  # the GPU top-K's bits
    assert torch.equal(lp[0], lp_c[0]) and torch.equal(ids[0], ids_c[0])
    assert bool(torch.isnan(lp[1]).all()) and bool(torch.isnan(lp[2]).all())
    trees = backend.build(lp, ids, budget, roots)
    for field in ("tokens", "parents", "num_nodes"):
        assert torch.equal(getattr(trees, field)[0], getattr(trees_c, field)[0])

    bad_target = target.clone()
    bad_target[0, 3, 11] = float("nan")
    acc = backend.accept_greedy(trees_c, bad_target, depth)
    assert acc.errors.tolist() == [8, 0, 0]
    for field in ("accepted", "accept_lens", "bonus", "committed"):
        assert torch.equal(getattr(acc, field)[1:], getattr(acc_c, field)[1:]), field
    sampled = backend.accept_sampled(trees_c, bad_target, torch.tensor([0.7, 0.7, 0.0]), torch.tensor([1, 2, 3]),
                                     torch.tensor([10, 10, 10]), depth)
    assert sampled.errors.tolist() == [8, 0, 0]

    batch = _batch(bs)
    plan = types.SimpleNamespace(src_slots=torch.zeros((bs, 2), dtype=torch.int64))
    _end(backend, batch, acc, plan, bad_draft)
    assert [r.to_finish is not None for r in batch.reqs] == [True, True, True]  # 0: target, 1-2: draft
    assert "NaN in a visited target logits row" in batch.reqs[0].to_finish.message
    assert "draft: logits contains NaN" in batch.reqs[1].to_finish.message
    assert "draft: logits contains +inf" in batch.reqs[2].to_finish.message
    assert "draft" not in batch.reqs[0].to_finish.message
    assert int(backend.tree_errors) == 0


# -- the hand-over: one entry per decode result, read in launch order --------------------------------------------


def _words(*rows):
    return torch.tensor([[bits, 0, 0] for bits in rows], dtype=torch.int64)


def test_each_result_ends_its_own_rounds_faulty_requests_in_launch_order():
    """Overlap: round k+1 is launched before round k's result is processed. Each processed result ends the
    requests its own round flagged, not the newer round's."""
    deferred = round_faults.DeferredFaults()
    a, b, c = _Req("a"), _Req("b"), _Req("c")
    deferred.push([a, b], _words(0, 8))  # round k: b faulty
    deferred.push([a, b, c], _words(8, 0, 0))  # round k+1, in flight: a faulty
    assert len(deferred) == 2
    assert deferred.land(2) == [b]  # round k's result
    assert a.to_finish is None
    b._finished = True  # SGLang finishes b while processing round k
    assert deferred.land(3) == [a] and len(deferred) == 0


def test_an_ended_batchs_result_lands_without_words_and_a_mismatch_is_loud():
    deferred = round_faults.DeferredFaults()
    deferred.push([_Req("a")], None)
    assert deferred.land(1) == []
    with pytest.raises(RuntimeError, match="no fault words"):
        deferred.land(1)
    deferred.push([_Req("a"), _Req("b")], _words(0, 0))
    with pytest.raises(RuntimeError, match="out of order"):
        deferred.land(3)


def test_the_pushed_list_is_a_snapshot():
    """SGLang rebinds or edits the running batch's request list between rounds; the entry keeps the round's."""
    deferred = round_faults.DeferredFaults()
    reqs = [_Req("a"), _Req("b")]
    deferred.push(reqs, _words(0, 8))
    reqs.pop()
    assert [r.rid for r in deferred.land(2)] == ["b"]


def test_the_worker_lands_a_result_when_sglang_reports_its_accept_counts():
    from sglang_kdtree.round.worker import KDTreeWorker

    worker = object.__new__(KDTreeWorker)
    worker.deferred_faults = round_faults.DeferredFaults()
    reqs = [_Req("a"), _Req("b")]
    worker.deferred_faults.push(reqs, _words(0, 16))
    worker.on_verify_complete_cpu([0, 3], batch_size=2)
    assert reqs[0].to_finish is None and "bad sampling input" in reqs[1].to_finish.message
