"""``contract.RoundBackend``: both backends offer every method, and the reference returns the contract's
dataclasses with the GPU kernels' shapes and dtypes; its grouped calls equal the steps one by one."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_kdtree import contract
from sglang_kdtree.round import pipeline
from sglang_kdtree.state import RoundShape

PROTOCOL_MEMBERS = [name for name in vars(contract.RoundBackend) if not name.startswith("_")] + [
    "name", "device", "tree_errors", "commit_errors"]


@pytest.mark.parametrize("cls", [pipeline.ReferenceBackend, pipeline.GpuBackend])
def test_both_backends_offer_the_whole_contract(cls):
    backend = cls("cpu")  # the GPU backend's class builds on CPU (its kernels load lazily)
    missing = [m for m in PROTOCOL_MEMBERS if not hasattr(backend, m)]
    assert not missing


def _round(bs=3, budget=4, depth=6, vocab=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_size = 16
    rows = torch.randn((bs * depth, hidden_size), generator=gen)
    weight = torch.randn((vocab + 3, hidden_size), generator=gen)  # a padded head: columns past vocab are cut
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    seq = torch.randint(1, 30, (bs,), generator=gen)
    width = budget + 1
    target = torch.randn((bs, width, vocab), generator=gen) * 4
    slots = torch.arange(bs * width).view(bs, width) * 3 + 7
    hidden = torch.randn((bs * width, 8), generator=gen)
    return rows, weight, roots, seq, target, slots, hidden


@pytest.mark.parametrize("budget, depth", [(4, 6), (12, 3)])  # N < L + 1 and N > L + 1
def test_reference_results_have_the_contract_shapes(budget, depth):
    bs, vocab = 3, 20
    rows, weight, roots, seq, target, slots, hidden = _round(bs, budget, depth, vocab)
    backend = pipeline.ReferenceBackend("cpu")
    width = budget + 1
    step = backend.tree_step(rows, weight, RoundShape(budget, width, depth, vocab, (2, width)), roots, seq,
                             int(seq.sum()))
    trees, verify, logits = step.trees, step.verify, step.draft_logits
    assert step.expected.shape == (bs, 2) and step.expected.dtype == torch.float32
    assert isinstance(trees, contract.Trees) and isinstance(verify, contract.VerifyInputs)
    assert logits.shape == (bs * depth, vocab)
    for t in (trees.tokens, trees.depths, trees.parents):
        assert t.shape == (bs, width) and t.dtype == torch.int64
    assert trees.num_nodes.shape == (bs,) and trees.width == width
    assert verify.input_ids.shape == verify.positions.shape == (bs * width,)
    assert verify.full_mask.dtype == torch.bool and verify.full_mask.numel() == pipeline.full_mask_numel(
        int(seq.sum()), width, bs)
    assert verify.ancestor_bits.shape == (bs, width, (width + 31) // 32) and verify.ancestor_bits.dtype == torch.int32
    for t in (verify.retrieve_index, verify.retrieve_next_token, verify.retrieve_next_sibling):
        assert t.shape == (bs, width) and t.dtype == torch.int64
    for acc in (backend.accept_greedy(trees, target, depth),
                backend.accept_sampled(trees, target, torch.full((bs,), 0.8), torch.arange(bs), seq, depth)):
        assert isinstance(acc, contract.AcceptResult)
        assert acc.accepted.shape == (bs, depth + 1) and acc.committed.shape == (bs, width)
        for t in (acc.accept_lens, acc.bonus, acc.errors):
            assert t.shape == (bs,) and t.dtype == torch.int64
        for b, tau in enumerate(acc.accept_lens.tolist()):
            assert 1 <= tau <= min(width, depth + 1)
            assert (acc.committed[b, :tau] >= 0).all() and (acc.committed[b, tau:] == -1).all()
            assert int(acc.committed[b, tau - 1]) == int(acc.bonus[b])
        plan = backend.commit_plan(acc.accepted, acc.accept_lens, slots)
        assert isinstance(plan, contract.CommitPlan) and plan.errors is backend.commit_errors
        assert plan.src_slots.shape == plan.hidden_rows.shape == (bs, depth + 1)
        assert backend.gather_hidden(hidden, plan, width).shape == (bs, min(width, depth + 1), 8)


def test_tree_step_marks_bracket_the_head_gemm(monkeypatch):
    """``prep_mark()`` just before the head GEMM and ``mark()`` just after it, once each, in the reference backend
    and the contract's eager composition: the round log's ``tree_prep`` / ``draft_head`` boundaries."""
    bs, budget, depth, vocab = 2, 5, 3, 20
    rows, weight, roots, seq, *_ = _round(bs, budget, depth, vocab, seed=5)
    backend = pipeline.ReferenceBackend("cpu")
    calls = []
    matmul = torch.matmul

    def recorded(*args, **kwargs):
        calls.append("gemm")
        return matmul(*args, **kwargs)

    monkeypatch.setattr(torch, "matmul", recorded)
    marks = dict(mark=lambda: calls.append("mark"), prep_mark=lambda: calls.append("prep"))
    shape = RoundShape(budget, budget + 1, depth, vocab)
    backend.tree_step(rows, weight, shape, roots, seq, int(seq.sum()), **marks)
    assert calls == ["prep", "gemm", "mark"]
    calls.clear()
    contract.eager_tree_step(backend, rows, weight, shape, roots, seq, int(seq.sum()), **marks)
    assert calls == ["prep", "gemm", "mark"]


def test_reference_grouped_calls_equal_the_steps_one_by_one():
    bs, budget, depth, vocab = 3, 6, 4, 20
    rows, weight, roots, seq, target, slots, hidden = _round(bs, budget, depth, vocab, seed=3)
    backend = pipeline.ReferenceBackend("cpu")
    trees = backend.tree_step(rows, weight, RoundShape(budget, budget + 1, depth, vocab), roots, seq,
                              int(seq.sum())).trees
    moves = []
    pool = types.SimpleNamespace(move_kv_cache=lambda dst, src: moves.append((dst.tolist(), src.tolist())))
    acc, plan, rows_out = backend.accept_commit_greedy(trees, target, depth, slots, pool, hidden, budget + 1)
    e_moves = list(moves)
    moves.clear()
    e_acc, e_plan, e_rows = contract.eager_accept_commit_greedy(backend, trees, target, depth, slots, pool, hidden,
                                                                budget + 1)
    assert moves == e_moves
    for field in ("accepted", "accept_lens", "bonus", "committed", "errors"):
        assert torch.equal(getattr(acc, field), getattr(e_acc, field)), field
    for field in ("src_slots", "dst_slots", "hidden_rows", "accept_lens"):
        assert torch.equal(getattr(plan, field), getattr(e_plan, field)), field
    assert torch.equal(rows_out, e_rows)
