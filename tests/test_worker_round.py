"""CPU checks of the round's plumbing that the CUDA server relies on: device error flags end only the flagged
requests (``KDTreeWorker._round_faults``), the commit helpers shared by both backends, the grow-only buffer
rule and the round log's time split."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_kdtree import pipeline
from sglang_kdtree.worker import KDTreeWorker, _RoundMarks


def _fake_worker(tree_bits=0, commit_bits=0):
    backend = types.SimpleNamespace(tree_errors=torch.tensor([tree_bits], dtype=torch.int32),
                                    commit_errors=torch.tensor([commit_bits], dtype=torch.int32))
    return types.SimpleNamespace(backend=backend)


def _batch(bs):
    return types.SimpleNamespace(reqs=[types.SimpleNamespace(rid=f"r{b}", to_finish=None) for b in range(bs)])


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


def test_clean_round_ends_nobody():
    worker, batch = _fake_worker(), _batch(3)
    KDTreeWorker._round_faults(worker, batch, *_round(3))
    assert all(r.to_finish is None for r in batch.reqs)


def test_per_request_accept_bits_end_only_that_request():
    worker, batch = _fake_worker(), _batch(4)
    KDTreeWorker._round_faults(worker, batch, *_round(4, req_bits=[0, 8, 0, 0]))
    assert [r.to_finish is not None for r in batch.reqs] == [False, True, False, False]
    message = batch.reqs[1].to_finish.message
    assert "KDTREE" in message and "NaN in a visited target logits row" in message


def test_draft_flag_is_traced_to_the_request_with_nan_logprobs_and_cleared():
    worker, batch = _fake_worker(tree_bits=8), _batch(3)
    KDTreeWorker._round_faults(worker, batch, *_round(3, nan_rows=[2]))
    assert [r.to_finish is not None for r in batch.reqs] == [False, False, True]
    assert "draft: logprobs contains NaN" in batch.reqs[2].to_finish.message
    assert int(worker.backend.tree_errors[0]) == 0  # read once, reset for the next round


def test_commit_flag_is_traced_to_the_invalid_plan_row():
    worker, batch = _fake_worker(commit_bits=64), _batch(3)
    KDTreeWorker._round_faults(worker, batch, *_round(3, bad_plan_rows=[0]))
    assert [r.to_finish is not None for r in batch.reqs] == [True, False, False]
    assert "commit:" in batch.reqs[0].to_finish.message and int(worker.backend.commit_errors[0]) == 0


def test_untraceable_flag_ends_the_whole_batch_rather_than_serving_wrong_tokens():
    worker, batch = _fake_worker(commit_bits=128), _batch(2)
    KDTreeWorker._round_faults(worker, batch, *_round(2))
    assert all(r.to_finish is not None for r in batch.reqs)


def test_backend_without_flags_is_left_to_raise():
    worker = types.SimpleNamespace(backend=types.SimpleNamespace())
    batch = _batch(1)
    KDTreeWorker._round_faults(worker, batch, types.SimpleNamespace(accepted=None), None, None)
    assert batch.reqs[0].to_finish is None


def test_reference_backend_isolates_a_faulty_request_and_leaves_the_others_bit_identical():
    """NaN / +inf draft logits or NaN target logits in one request: the reference no longer raises (which
    would stop the scheduler for every request); that request is marked, the others' results are exactly
    those of a clean batch, and the worker then ends only the marked one."""
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
    assert int(backend.tree_errors) == 8 | 16
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

    worker = types.SimpleNamespace(backend=backend)
    batch = _batch(bs)
    plan = types.SimpleNamespace(src_slots=torch.zeros((bs, 2), dtype=torch.int64))
    KDTreeWorker._round_faults(worker, batch, acc, plan, bad_draft)
    assert [r.to_finish is not None for r in batch.reqs] == [True, True, True]  # 0: target, 1-2: draft
    assert "NaN in a visited target logits row" in batch.reqs[0].to_finish.message
    assert "draft: logprobs contains NaN" in batch.reqs[1].to_finish.message
    assert int(backend.tree_errors) == 0


def test_reference_gather_hidden_takes_the_accepted_rows_not_the_first_tau():
    backend = pipeline.ReferenceBackend("cpu")
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(10, 3)
    plan = types.SimpleNamespace(hidden_rows=torch.tensor([[0, 2, 3, -1], [5, 9, -1, -1]]))
    out = backend.gather_hidden(hidden, plan, width=3)
    assert out.shape == (2, 3, 3)
    assert torch.equal(out[0], hidden[[0, 2, 3]])
    assert torch.equal(out[1, :2], hidden[[5, 9]])


def test_move_kv_with_sglang_moves_only_changed_rows():
    calls = []
    pool = types.SimpleNamespace(move_kv_cache=lambda dst, src: calls.append((dst.tolist(), src.tolist())))
    plan = types.SimpleNamespace(src_slots=torch.tensor([[10, 12, -1], [20, 21, 22]]),
                                 dst_slots=torch.tensor([[10, 11, -1], [20, 21, 22]]))
    pipeline.move_kv_with_sglang(pool, plan)
    assert calls == [([11], [12])]
    calls.clear()
    pipeline.move_kv_with_sglang(pool, types.SimpleNamespace(src_slots=plan.dst_slots, dst_slots=plan.dst_slots))
    assert calls == []  # nothing moves: no call at all


@pytest.mark.parametrize("current, needed, expect", [(0, 5, 5), (8, 5, 8), (8, 9, 16), (8, 40, 40)])
def test_buffers_grow_at_least_twofold_and_never_shrink(current, needed, expect):
    assert pipeline._grown(current, needed) == expect


def test_round_marks_split_in_order_and_off_by_default():
    marks = _RoundMarks("cpu", enabled=True)
    for name in ("draft", "tree", "verify", "accept_commit"):
        marks.mark(name)
    split = marks.split()
    assert list(split) == ["draft", "tree", "verify", "accept_commit"]
    assert all(v >= 0 for v in split.values())
    off = _RoundMarks("cpu", enabled=False)
    off.mark("draft")
    assert off.split() == {} and off.detail() == {"ms": {}, "host_ms": {}}


def test_round_marks_sum_steps_into_their_phases():
    import time

    marks = _RoundMarks("cpu", enabled=True)
    steps = ("draft", "draft_head", "topk", "build", "verify_inputs", "prepare", "verify", "accept", "commit",
             "features", "accept_commit")
    for name in steps:
        time.sleep(0.001)
        marks.mark(name)
    split, detail = marks.split(), marks.detail()
    assert list(split) == ["draft", "tree", "verify", "accept_commit"]
    assert list(detail["ms"]) == list(steps) == list(detail["host_ms"])
    ms = detail["ms"]
    assert abs(split["draft"] - (ms["draft"] + ms["draft_head"])) < 1e-3  # the head GEMM is the drafter's
    assert abs(split["tree"] - (ms["topk"] + ms["build"] + ms["verify_inputs"] + ms["prepare"])) < 1e-3
    assert abs(split["accept_commit"] - (ms["accept"] + ms["commit"] + ms["features"] + ms["accept_commit"])) < 1e-3
    assert all(v >= 0.9 for v in ms.values())  # each step slept 1 ms on the host clock (CPU marks)


def test_startup_rehearsal_runs_the_rounds_steps_on_either_backend():
    """``rehearse_round`` (the CUDA server's startup rehearsal, two ``pipeline.bookkeeping_round`` calls) runs on
    the reference backend too, so a contract slip in the shared step sequence shows up on CPU."""
    from sglang_kdtree.worker import rehearse_round

    backend = pipeline.ReferenceBackend("cpu")
    used = rehearse_round(backend, bs=3, budget=6, depth=4, vocab=40, device="cpu", hidden_size=16)
    assert used == 3 * 7 * 40 * 4  # the fp32 verify logits it rehearsed with
    assert int(backend.tree_errors) == 0 and int(backend.commit_errors) == 0


def test_bookkeeping_round_equals_the_steps_called_one_by_one():
    gen = torch.Generator().manual_seed(9)
    bs, budget, depth, vocab, width = 2, 5, 3, 30, 6
    draft = torch.randn((bs, depth, vocab), generator=gen)
    target = torch.randn((bs, width, vocab), generator=gen)
    seq = torch.tensor([4, 9])
    slots = torch.arange(bs * width).view(bs, width) + 100
    hidden = torch.randn((bs * width, 8), generator=gen)
    roots = torch.tensor([1, 2])
    b = pipeline.ReferenceBackend("cpu")
    trees, verify, acc, plan, rows = pipeline.bookkeeping_round(b, draft, budget, depth, roots, seq, 13, target, slots,
                                                                hidden)
    lp, ids = b.topk(draft, budget)
    t2 = b.build(lp, ids, budget, roots)
    a2 = b.accept_greedy(t2, target, depth)
    p2 = b.commit_plan(a2.accepted, a2.accept_lens, slots)
    assert torch.equal(trees.tokens, t2.tokens) and torch.equal(acc.committed, a2.committed)
    assert torch.equal(plan.src_slots, p2.src_slots)
    assert torch.equal(verify.full_mask, b.verify_inputs(t2, seq, 13).full_mask)
    assert torch.equal(rows, b.gather_hidden(hidden, p2, width))
