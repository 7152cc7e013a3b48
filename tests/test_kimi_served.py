"""CPU tests of the Kimi round model corrected by a served rank (``benchmarks/kimi_served.py``): which pieces a rank
report replaces, how they are priced for the model's device, and that the model's rows take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kimi_model as km
from benchmarks import kimi_served

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _row(draft, tree, accept, verify=10.0):
    return {"rounds": 40, "draft": draft, "tree": tree, "verify": verify, "accept_commit": accept}


def _report(by_width, device="1 H100"):
    return {"run": {"device": device}, "settings": {"context": 4096},
            "servers": {"plain": {"table": {}}, "kdtree-cycle-log": {"by_width": by_width}}}


def test_served_pieces_are_the_median_phase_priced_by_bandwidth():
    by = {"8": {"16": _row(4.0, 0.1, 0.3), "32": _row(5.0, 0.2, 0.4), "64": _row(9.0, 0.3, 0.2)},
          "61": {"16": _row(15.0, 0.3, 0.9)}}
    times, notes = kimi_served.served_pieces(_report(by), [1, 8, 64], scale=0.5)
    # medians over the widths: draft 5.0 ms, tree 0.2, accept 0.3; halved; in us
    assert times[km.key("draft_served", bs=8, ctx=4096)] == pytest.approx(2500.0)
    assert times[km.key("tree", bs=8)] == pytest.approx(100.0)
    assert times[km.key("accept_commit", bs=8)] == pytest.approx(150.0)
    assert times[km.key("draft_served", bs=64, ctx=4096)] == pytest.approx(7500.0)  # batch 61 stands for 64
    assert not any("bs=1" in k for k in times)  # nothing served at or below batch 1: the model's pieces stay
    assert any("batch 1: no served batch" in n for n in notes) and any("batch 61 stands for it" in n for n in notes)
    with pytest.raises(ValueError, match="kdtree-cycle"):
        kimi_served.served_pieces({"settings": {"context": 4096}, "servers": {"plain": {}}}, [1], 1.0)


def test_devices_and_the_scale():
    assert kimi_served.device_gbps("1 H100") == 3350.0 and kimi_served.device_gbps("NVIDIA H200") == 4800.0
    with pytest.raises(ValueError, match="no bandwidth known"):
        kimi_served.device_gbps("RTX 5070 Ti")


def test_the_model_takes_the_served_drafter_at_the_served_context_only():
    cfg = km.RoundConfig()
    times = {km.key("draft_served", bs=8, ctx=4096): 3000.0}
    served = km.draft_forward(times, 8, 4096, cfg)
    other = km.draft_forward(times, 8, 16384, cfg)
    assert served["compute"] == 3000.0 and served["total"] == pytest.approx(3000.0 + served["allreduce"])
    assert served["allreduce"] == pytest.approx(other["allreduce"]) and served["allreduce"] > 0  # its collectives count
    assert other["compute"] == 0.0 and other["missing"]  # 16k: the model's own pieces (absent here)


def test_the_committed_rank_corrects_the_committed_model():
    """The committed H200 pieces with the committed served rank (one H100, 12 layers): the drafter becomes the
    served one priced at 3350 / 4800, and the KDTREE-auto row's draft is that plus the model's collectives."""
    measured = json.loads((RESULTS / "kimi_round.json").read_text())["measured"]
    times, notes = kimi_served.load(RESULTS / "rank_h100_12layers.json", measured["device"], [1, 8, 32, 64])
    rank = json.loads((RESULTS / "rank_h100_12layers.json").read_text())
    draft_bs1 = sorted(r["draft"] for r in rank["servers"]["kdtree-cycle-log"]["by_width"]["1"].values())[1]
    assert times[km.key("draft_served", bs=1, ctx=4096)] == pytest.approx(draft_bs1 * 1e3 * 3350 / 4800)
    assert "x0.698" in notes[0] and any("batch 61 stands for it" in n for n in notes)
    row = km.round_row({**measured["times"], **times}, "KDTREE-15", 1, 4096, km.RoundConfig())
    assert row["draft"] > 2 * km.round_row(measured["times"], "KDTREE-15", 1, 4096, km.RoundConfig())["draft"]


def test_the_plot_says_the_drafter_came_from_the_served_rank():
    from benchmarks import plot_kimi_round

    path = RESULTS / "kimi_round_served_pair_tau.json"
    title = plot_kimi_round.title(json.loads(path.read_text()), None, path)
    assert "from a served Kimi rank (1 H100, rank_h100_12layers.json)" in title
    measured = RESULTS / "kimi_round.json"
    plain = plot_kimi_round.title(json.loads(measured.read_text()), None, measured)
    assert "served Kimi rank" not in plain
