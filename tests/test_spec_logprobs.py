"""CPU checks of ``sglang_kdtree.round.spec_logprobs``: the logprobs of a round's committed tokens come from the verify
rows of the accepted nodes, in the layout SGLang's scheduler reads (``_apply_decode_logprobs``), and equal an
independent float64 autoregressive computation under SGLang's rule (raw for greedy, ``logits / T`` otherwise)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_kdtree.round.spec_logprobs import accepted_rows, reseed_prefill_logprobs, round_logprobs

BS, WIDTH, VOCAB, COLUMNS = 3, 6, 11, 4


def _round(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((BS, WIDTH, VOCAB), generator=gen) * 3
    # accepted paths (node indices, -1 padded) of lengths 3, 1 and 4
    accepted = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 4]])
    committed = torch.tensor([[7, 1, 9, -1], [4, -1, -1, -1], [0, 10, 2, 3]])
    return logits, accepted, committed


def _batch(temperatures, greedy, top=None, token_ids=None, return_logprob=True):
    sampling = types.SimpleNamespace(is_all_greedy=greedy,
                                     temperatures=torch.tensor(temperatures, dtype=torch.float32).view(-1, 1))
    return types.SimpleNamespace(return_logprob=return_logprob, sampling_info=sampling, seq_lens=torch.zeros(BS),
                                 top_logprobs_nums=top or [0] * BS, token_ids_logprobs=token_ids or [None] * BS)


def _scheduler_view(out, b, tau):
    """What SGLang's ``_apply_decode_logprobs`` reads for request ``b`` with ``tau`` committed tokens."""
    values = out.next_token_logprobs.tolist()[b]
    flat = [b * len(values) + j for j in range(tau)]
    top = None
    if getattr(out, "next_token_top_logprobs_val", None) is not None:
        top = [(out.next_token_top_logprobs_val[i].tolist(), out.next_token_top_logprobs_idx[i].tolist())
               for i in flat]
    ids = None
    if getattr(out, "next_token_token_ids_logprobs_val", None) is not None:
        ids = [(out.next_token_token_ids_logprobs_val[i].tolist(), out.next_token_token_ids_logprobs_idx[i])
               for i in flat]
    return values[:tau], top, ids


def test_accepted_rows_are_the_accepted_nodes_in_chain_order():
    logits, accepted, _ = _round()
    rows = accepted_rows(logits, accepted, COLUMNS).view(BS, COLUMNS, VOCAB)
    for b in range(BS):
        for j in range(COLUMNS):
            node = int(accepted[b, j])
            assert torch.equal(rows[b, j], logits[b, max(node, 0)])  # padding reads the root's row
    # a non-contiguous vocabulary slice (padded logits) gathers the same rows
    padded = torch.cat([logits, torch.full((BS, WIDTH, 5), 99.0)], dim=-1)[:, :, :VOCAB]
    assert torch.equal(accepted_rows(padded, accepted, COLUMNS), rows.view(BS * COLUMNS, VOCAB))


@pytest.mark.parametrize("temperatures, greedy", [([1.0, 1.0, 1.0], True), ([0.7, 1.0, 1.8], False)])
def test_round_logprobs_equal_the_autoregressive_logprobs(temperatures, greedy):
    logits, accepted, committed = _round(1)
    asked_ids = [[3, 0], None, [10]]
    batch = _batch(temperatures, greedy, top=[3, 0, 2], token_ids=asked_ids)
    out = types.SimpleNamespace(next_token_logits=logits.view(BS * WIDTH, VOCAB).clone(),
                                next_token_logprobs=None, next_token_top_logprobs_val=None,
                                next_token_top_logprobs_idx=None, next_token_token_ids_logprobs_val=None,
                                next_token_token_ids_logprobs_idx=None)
    round_logprobs(batch, out, logits, accepted, committed)
    assert torch.equal(out.next_token_logits, logits.view(BS * WIDTH, VOCAB))  # the verify logits stay
    assert out.next_token_logprobs.shape == (BS, COLUMNS)
    for b in range(BS):
        tau = int((accepted[b] >= 0).sum())
        values, top, ids = _scheduler_view(out, b, tau)
        for j in range(tau):
            # independent: the distribution the token at chain position j was chosen from, in float64
            x = logits[b, int(accepted[b, j])].double()
            expected = torch.log_softmax(x if greedy else x / temperatures[b], dim=-1)
            assert values[j] == pytest.approx(float(expected[committed[b, j]]), abs=1e-5)
            if batch.top_logprobs_nums[b]:
                k = batch.top_logprobs_nums[b]
                got_vals, got_ids = top[j]
                assert got_ids == expected.topk(k).indices.tolist()
                assert got_vals == pytest.approx(expected.topk(k).values.tolist(), abs=1e-5)
            if asked_ids[b] is not None:
                got_vals, got_ids = ids[j]
                assert got_ids == asked_ids[b]
                assert got_vals == pytest.approx(expected[asked_ids[b]].tolist(), abs=1e-5)
            else:
                assert ids[j][0] == []


def test_without_return_logprob_nothing_is_gathered_or_written():
    logits, accepted, committed = _round()
    out = types.SimpleNamespace(next_token_logprobs=None)
    round_logprobs(_batch([1.0] * BS, True, return_logprob=False), out, logits, accepted, committed)
    assert out.next_token_logprobs is None and not hasattr(out, "next_token_top_logprobs_val")


def test_reseeded_prefill_rows_report_the_logprob_of_the_new_token():
    gen = torch.Generator().manual_seed(2)
    raw = torch.randn((BS, VOCAB), generator=gen) * 2
    batch = _batch([1.0, 0.5, 2.0], False)
    out = types.SimpleNamespace(next_token_logprobs=torch.tensor([-1.0, -2.0, -3.0]))
    rows, tokens = torch.tensor([1, 2]), torch.tensor([4, 9])
    reseed_prefill_logprobs(batch, out, raw[rows], rows, tokens)
    assert float(out.next_token_logprobs[0]) == -1.0  # a row that was not redrawn keeps SGLang's value
    for row, token in zip(rows.tolist(), tokens.tolist()):
        expected = torch.log_softmax(raw[row].double() / batch.sampling_info.temperatures[row, 0], dim=-1)[token]
        assert float(out.next_token_logprobs[row]) == pytest.approx(float(expected), abs=1e-5)
