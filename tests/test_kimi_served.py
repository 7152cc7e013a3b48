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
    # medians over the widths: draft 5.0 ms, tree 0.2, accept 0.3; halved; in us; no model pieces: the whole drafter
    assert times[km.key("draft_excess", bs=8, ctx=4096)] == pytest.approx(2500.0)
    assert times[km.key("tree", bs=8)] == pytest.approx(100.0)
    assert times[km.key("accept_commit", bs=8)] == pytest.approx(150.0)
    assert times[km.key("draft_excess", bs=64, ctx=4096)] == pytest.approx(7500.0)  # batch 61 stands for 64
    assert not any("bs=1" in k for k in times)  # nothing served at or below batch 1: the model's pieces stay
    assert any("batch 1: no served batch" in n for n in notes) and any("batch 61 stands for it" in n for n in notes)
    # with model pieces, the excess is the served drafter less the model's (hand-made: every piece 10 us)
    cfg = km.RoundConfig()
    T = 8 * cfg.drafter.block
    pieces = {km.key(n, T=T): 10.0 for n in km.DRAFT_PIECES} | {km.key("draft_attention", bs=8, ctx=4096): 10.0,
                                                               km.key("lm_head", T=8 * 15): 10.0}
    model = cfg.drafter.layers * (10 + 10 + 10 + 2 * 10 + 10) + 10
    more, _ = kimi_served.served_pieces(_report(by), [8], 0.5, pieces, cfg)
    assert more[km.key("draft_excess", bs=8, ctx=4096)] == pytest.approx(2500.0 - model)
    assert km.draft_forward({**pieces, **more}, 8, 4096, cfg)["compute"] == pytest.approx(2500.0)
    with pytest.raises(ValueError, match="kdtree-cycle"):
        kimi_served.served_pieces({"settings": {"context": 4096}, "servers": {"plain": {}}}, [1], 1.0)


def test_the_forward_line_through_ranks_of_several_layer_counts():
    # two layer counts: the straight line (1 ms fixed, 0.5 ms a layer) read off at 61
    assert kimi_served.forward_line([(12, 7000.0), (26, 14000.0)], 61, fixed=123.0) == pytest.approx(31500.0)
    # least squares through three points off that line by +100 / -100 / +100: slope 500 (14 x 14,000 / 392)
    # through their mean (26, 14,033.3)
    pts = [(12, 7100.0), (26, 13900.0), (40, 21100.0)]
    assert kimi_served.forward_line(pts, 61, 0.0) == pytest.approx(42100 / 3 + 500 * 35)
    # one layer count: the model's fixed part kept, the rest per layer
    assert kimi_served.forward_line([(26, 2600.0 + 500.0)], 61, fixed=500.0) == pytest.approx(500.0 + 100.0 * 61)


def _served_rank(layers, plain_ms, dflash_ms=None, verify_ms=None, profile=None):
    servers = {"plain": {"table": {"8": {"round": {"host_ms": plain_ms}}}},
               "kdtree-cycle-log": {"by_width": {"8": {"16": {**_row(4.0, 0.1, 0.3), "verify": verify_ms or 1.0}}}}}
    if dflash_ms is not None:
        servers["dflash"] = {"table": {"8": {"round": {"host_ms": dflash_ms}}}}
    return {"run": {"device": "1 H200"}, "settings": {"context": 4096}, "device_profile": profile,
            "rank": {"layers": layers, "dense_layers": 1, "vocab": km.KIMI.vocab // km.KIMI.tp}, "servers": servers}


def test_served_forwards_are_excesses_over_the_model_at_its_layers():
    cfg = km.RoundConfig(budgets=(15,))
    ranks = [_served_rank(12, 7.0, dflash_ms=4.0 + 20.0), _served_rank(26, 14.0)]
    times, notes = kimi_served.served_forwards(ranks, ("AR", "DFLASH"), [8], {}, cfg, "H200")
    # no model pieces: the excess is the whole served forward; AR on the line 1 + 0.5 x layers ms
    assert times[km.key("forward_excess:AR", bs=8, ctx=4096)] == pytest.approx(31500.0)
    # DFLASH: its step less the drafter phase (4 ms), from one rank of 12 layers: 20 ms / 12 a layer x 61
    assert times[km.key("forward_excess:DFLASH", bs=8, ctx=4096)] == pytest.approx(20000.0 * 61 / 12)
    assert not any("KDTREE" in k for k in times) and any("AR at batch 8: forward served at [12, 26]" in n
                                                         for n in notes)
    row = km.round_row(times, "AR", 8, 4096, cfg)
    assert row["verify"] == pytest.approx(31500.0 + row["allreduce"]) and row["attention"] == pytest.approx(31500.0)
    # the check beside each rank: served, model (none here) and the line, in ms
    check = {(r["mode"], r["layers"]): r for r in kimi_served.forward_check(ranks, {}, "H200", ("AR",))}
    assert check[("AR", 12)]["served"] == 7.0 and check[("AR", 26)]["line"] == pytest.approx(14.0)


def test_load_takes_kdtree_forwards_from_the_profile_ranks_only(tmp_path):
    paths = []
    for i, rank in enumerate([_served_rank(26, 14.0, verify_ms=10.0), _served_rank(26, 14.0, verify_ms=13.0,
                                                                                    profile="sm_120")]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rank))
    cfg = km.RoundConfig(budgets=(15,))
    times, _ = kimi_served.load(paths, "H200", [8], {}, cfg, ("KDTREE",), "sm_120")
    assert times[km.key("forward_excess:KDTREE-15", bs=8, ctx=4096)] == pytest.approx(13000.0 * 61 / 26)
    assert km.key("forward_excess:AR", bs=8, ctx=4096) not in times
    with pytest.raises(ValueError, match="no report served under profile 'sm_120'"):
        kimi_served.load(paths[:1], "H200", [8], {}, cfg, ("KDTREE",), "sm_120")


def test_another_box_keeps_an_excess_in_microseconds():
    from benchmarks import kimi_box

    ref, box = kimi_box.BOXES["h200"], kimi_box.BOXES["rtx-pro-6000"]
    k = km.key("forward_excess:AR", bs=8, ctx=4096)
    assert kimi_box.price_piece(k, 1000.0, km.RoundConfig(), ref, box, "excess") == 1000.0
    assert kimi_box.price_piece(k, 1000.0, km.RoundConfig(), ref, box, "ratio") == pytest.approx(1000.0 * 4800 / 1792)


def test_devices_and_the_scale():
    assert kimi_served.device_gbps("1 H100") == 3350.0 and kimi_served.device_gbps("NVIDIA H200") == 4800.0
    with pytest.raises(ValueError, match="no bandwidth known"):
        kimi_served.device_gbps("RTX 5070 Ti")


def test_the_model_takes_the_served_drafter_at_the_served_context_only():
    cfg = km.RoundConfig()
    times = {km.key("draft_excess", bs=8, ctx=4096): 3000.0}
    served = km.draft_forward(times, 8, 4096, cfg)
    other = km.draft_forward(times, 8, 16384, cfg)
    assert served["compute"] == 3000.0 and served["total"] == pytest.approx(3000.0 + served["allreduce"])
    assert served["allreduce"] == pytest.approx(other["allreduce"]) and served["allreduce"] > 0  # its collectives count
    assert other["compute"] == 0.0 and other["missing"]  # 16k: the model's own pieces (absent here)


def test_the_committed_rank_corrects_the_committed_model():
    """The committed H200 pieces with the committed served rank (one H100, 12 layers): the drafter becomes the
    served one priced at 3350 / 4800, and the KDTREE-auto row's draft is that plus the model's collectives."""
    measured = json.loads((RESULTS / "kimi_round.json").read_text())["measured"]
    cfg = km.RoundConfig()
    times, notes = kimi_served.load(RESULTS / "rank_h100_12layers.json", measured["device"], [1, 8, 32, 64],
                                    measured["times"], cfg)
    rank = json.loads((RESULTS / "rank_h100_12layers.json").read_text())
    draft_bs1 = sorted(r["draft"] for r in rank["servers"]["kdtree-cycle-log"]["by_width"]["1"].values())[1]
    full = kimi_served.rank_times(measured["times"], rank)  # the rank's drafter head is all 163,840 rows: x8
    assert full[km.key("lm_head", T=15)] == pytest.approx(8 * measured["times"][km.key("lm_head", T=15)])
    model = km.draft_forward(full, 1, 4096, kimi_served._bare(cfg))["compute"]
    assert times[km.key("draft_excess", bs=1, ctx=4096)] == pytest.approx(draft_bs1 * 1e3 * 3350 / 4800 - model)
    assert km.draft_forward({**full, **times}, 1, 4096, kimi_served._bare(cfg))["compute"] == \
        pytest.approx(draft_bs1 * 1e3 * 3350 / 4800)
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


def test_kimi_round_takes_served_forwards_by_box_unless_told(capsys, tmp_path):
    """``--served-forward`` unset: none on the h200 box (its SGLang default is fa3, which no rank served), plain's and
    DFLASH's on an sm_120 box (Triton, what the ranks ran); given, what it names."""
    from benchmarks import kimi_round as kr

    ranks = [str(RESULTS / f"rank_h100_{n}.json") for n in ("12layers", "26layers_auto", "26layers_sm120")]
    base = ["--from-json", str(RESULTS / "kimi_round.json"), "--contexts", "4096", "--batches", "8", "--budgets", "15",
            "--served-rank", *ranks]

    def notes(*extra):
        out = tmp_path / "out.json"
        assert kr.main([*base, *extra, "--json", str(out)]) == 0
        capsys.readouterr()
        return " ".join(json.loads(out.read_text())["measured"]["notes"])

    assert "forward served" not in notes()
    box = notes("--box", "rtx-pro-6000")
    assert "AR at batch 8: forward served at [12, 26]" in box and "DFLASH at batch 8" in box and "KDTREE" not in box
    told = notes("--served-forward", "KDTREE", "--served-profile", "sm_120")
    assert "KDTREE-15 at batch 8: forward served at [26]" in told and "AR at batch" not in told
