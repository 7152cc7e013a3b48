"""testbed.near_ties: the greedy divergences from plain, and the float64 logit gap at each, against a direct
computation of the same logits."""

import pytest
import torch

from testbed import near_ties as nt
from testbed import target as tg


def _res(ids):
    return {"output_ids": ids}


def test_divergences_group_servers_by_prompt_position_and_tokens():
    outputs = {"plain@T=0": [_res([1, 2, 3]), _res([4, 5, 6]), _res([7])],
               "dflash@T=0": [_res([1, 9, 3]), _res([4, 5, 6]), _res([7])],
               "kdtree-15@T=0": [_res([1, 9, 8]), _res([4, 5, 2]), _res([7])],
               "kdtree-15@T=1": [_res([0]), _res([0]), _res([0])]}  # sampled: not a greedy comparison
    assert nt.divergences(outputs) == {(0, 1, 2, 9): ["dflash", "kdtree-15"], (1, 2, 6, 2): ["kdtree-15"]}
    assert nt.divergences({"plain@T=0": [_res([1])], "kdtree-63@T=0": [_res([1])]}) == {}
    # an output that only stops earlier has no token pair to check
    assert nt.divergences({"plain@T=0": [_res([1, 2])], "kdtree-63@T=0": [_res([1])]}) == {}


def test_logit_gap_is_the_models_own_float64_logits():
    torch.manual_seed(0)
    model = tg.Llama(tg.TargetShape(vocab_size=64, hidden=32, layers=2, heads=2, head_dim=16, intermediate=48))
    tg.init_weights(model, std=0.2)
    model = model.double().eval()
    ids = [3, 17, 5, 9]
    with torch.no_grad():
        full, _ = model(torch.tensor([ids]))  # every position; the last row is the next-token logits
    row = full[0, -1]
    best = torch.argsort(row, descending=True)[:2].tolist()
    got = nt.logit_gap(model, ids, best[1], best[0])
    # the full forward and the last-row one differ only in float64 rounding (their matmuls have other shapes)
    assert got["top2"] == best and got["top2_gap"] > 0
    assert got["top2_gap"] == pytest.approx(float(row[best[0]] - row[best[1]]), rel=1e-12)
    assert got["a_minus_b"] == -got["top2_gap"]
    assert got["max_abs_logit"] == pytest.approx(float(row.abs().max()), rel=1e-12)
