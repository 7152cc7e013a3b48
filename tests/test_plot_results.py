"""The plot scripts' words: the names the server bench's legends give its kinds, and the title and caption of
every PNG under benchmarks/results/ as its script builds them from the checked-in JSON (device, target and
drafter, run or date, where the accept lengths come from, the reading). No matplotlib needed except for the
layout test, which draws one figure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import plot_acceptance, plot_captions, plot_kimi_round, plot_rank, plot_results
from benchmarks.plot_results import kind_label

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_every_kind_the_bench_starts_gets_a_readers_name():
    assert kind_label("kdtree", 64) == "KDTREE budget 64"
    assert kind_label("kdtree", None) == "KDTREE"
    assert kind_label("kdtree-15", 64) == "KDTREE budget 15"
    assert kind_label("kdtree-auto", 64) == "KDTREE automatic width"
    assert kind_label("kdtree-auto-log", 64) == "KDTREE automatic width (round log on)"
    assert kind_label("kdtree-log", 64) == "KDTREE (kdtree-log)"


def test_an_overlapped_kind_is_its_kind_with_overlap_on():
    assert kind_label("kdtree-63-overlap", 64) == "KDTREE budget 63, overlap on"
    assert kind_label("kdtree-overlap", 64) == "KDTREE budget 64, overlap on"
    assert kind_label("kdtree-auto-overlap", 64) == "KDTREE automatic width, overlap on"


# ---- every checked-in PNG's caption --------------------------------------------------------------------------


def _load(name: str) -> tuple[Path, dict]:
    path = RESULTS / name
    return path, json.loads(path.read_text())


def _server(name):
    path, bench = _load(name)
    return plot_results.caption(bench, plot_captions.facts(path, bench))


def _kimi(name):
    path, payload = _load(name)
    return plot_kimi_round.title(payload, None, path)


def _rank():
    path, report = _load("rank_h100_12layers.json")
    data = plot_rank.series(report, plot_rank.DEFAULT_SCALE)
    return plot_rank.caption(report, data, plot_captions.facts(path, report.get("run")))


def _tau():
    path, rep = _load("pair_acceptance.json")
    return plot_acceptance.tau_caption(rep, plot_acceptance.tau_series(rep), plot_acceptance.run_facts(path, rep))


def _calibration():
    path, rep = _load("pair_acceptance.json")
    cal = plot_acceptance.calibration_series(rep)
    return plot_acceptance.calibration_caption(rep, cal, plot_acceptance.run_facts(path, rep))


def _training():
    path, meta = _load("pair_metadata.json")
    series = plot_acceptance.training_series(meta)
    return plot_acceptance.training_caption(meta, series, plot_acceptance.training_facts(path, meta))


#: each PNG under benchmarks/results/ -> its caption as the command that draws it builds it (the commands:
#: benchmarks/RESULTS.md next to each figure)
CAPTIONS = {
    "server_tok_s.png": lambda: _server("bench_server_kimi_marlin.json"),
    "server_tok_s_overlap.png": lambda: _server("bench_server_overlap.json"),
    "server_tok_s_overlap_run_z.png": lambda: _server("bench_server_overlap_run_z.json"),
    "kimi_round.png": lambda: _kimi("kimi_round.json"),
    "kimi_round_pair_tau.png": lambda: _kimi("kimi_round_pair_tau.json"),
    "kimi_round_rtx6000_pair_tau.png": lambda: _kimi("kimi_round_rtx6000_pair_tau.json"),
    "kimi_round_rtx6000_paper_tau.png": lambda: _kimi("kimi_round_rtx6000_paper_tau.json"),
    "kimi_round_served_pair_tau.png": lambda: _kimi("kimi_round_served_pair_tau.json"),
    "kimi_round_rtx6000_served_pair_tau.png": lambda: _kimi("kimi_round_rtx6000_served_pair_tau.json"),
    "rank_served_vs_model.png": _rank,
    "acceptance_tau.png": _tau,
    "acceptance_calibration.png": _calibration,
    "pair_training.png": _training,
}
#: what names the drafter in each kind of figure
DRAFTERS = ("drafter: toy DFlash", "trained DFlash drafter", "DFlashDraftModel", "DFlash drafter, assumed")


def test_every_png_in_results_has_a_caption_here():
    assert sorted(p.name for p in RESULTS.glob("*.png")) == sorted(CAPTIONS)


@pytest.mark.parametrize("png", sorted(CAPTIONS))
def test_caption_names_device_target_drafter_run_and_reading(png):
    text = CAPTIONS[png]()
    assert plot_captions.UNRECORDED not in text, text
    assert re.search(r"\b(H100|H200|RTX PRO 6000)\b", text), f"{png}: no device in {text!r}"
    assert "target" in text or "Kimi K2.6 decode round" in text, f"{png}: no target in {text!r}"
    assert any(d in text for d in DRAFTERS), f"{png}: no drafter in {text!r}"
    assert re.search(r"\brun [A-Z]{1,2}\b", text) and re.search(r"\b2026-\d\d-\d\d\b", text), \
        f"{png}: no run and date in {text!r}"
    assert "\nReading" in text, f"{png}: no reading in {text!r}"


def test_kimi_plots_say_projection_and_where_accept_lengths_come_from():
    for png in ("kimi_round.png", "kimi_round_pair_tau.png", "kimi_round_rtx6000_pair_tau.png",
                "kimi_round_rtx6000_paper_tau.png"):
        text = CAPTIONS[png]()
        assert "kimi_round.py model" in text and ("PROJECTION" in text or "ESTIMATE" in text), png
        assert "accept lengths, not Kimi K2.6's" in text, png
        if "pair_tau" in png:
            assert "the testbed pair's measured greedy curve" in text and "1.19x DFLASH" in text, png
        else:
            assert "ASSUMED from the DDTree paper's budget sweep" in text and "1.26x DFLASH" in text, png
    # the model corrected by the served rank (kimi_round --served-rank): what README.md quotes with the pair's curve
    for png, ratio in (("kimi_round_served_pair_tau.png", "1.18x DFLASH"),
                       ("kimi_round_rtx6000_served_pair_tau.png", "1.39-2.03x DFLASH")):
        text = CAPTIONS[png]()
        assert "from a served Kimi rank" in text and "the testbed pair's measured greedy curve" in text, png
        assert ("the target forward of AR / DFLASH / KDTREE from served ranks" in text) == ("rtx6000" in png), png
        assert ratio in text, (png, text)
    # README.md gives the corrected ratios beside their assumptions, never alone in bold
    readme = (ROOT / "README.md").read_text()
    assert "1.18x with the pair's tau, 1.25x with the paper's" in readme
    assert "1.39x-2.03x with the pair's tau (1.48x-2.16x paper's)" in readme
    assert "**1.18x" not in readme and "**1.25x" not in readme and "**1.39x" not in readme


def test_server_captions_name_the_toy_and_its_reading():
    z = CAPTIONS["server_tok_s_overlap_run_z.png"]()
    assert "run Z, 2026-12-05, 1 H100" in z and "512 tokens a request, 2 timed batches" in z
    assert "context-blind (not a real drafter)" in z and "not a ranking for Kimi K2.6" in z
    assert "ahead of the faster of plain and DFLASH at batch 1 (1.15x) and 32 (1.13x), behind at batch 8 (0.69x)" \
        in z and "fastest: batch 1 KDTREE budget 63, overlap on; batch 8 plain; batch 32 KDTREE budget 63" in z


def test_facts_command_line_over_json_over_recorded():
    assert plot_captions.facts("x/bench_server_overlap_run_z.json", {})["device"] == "1 H100"
    f = plot_captions.facts("x/bench_server_overlap_run_z.json", {"device": "1 H200"}, run="run ZZ", date=None)
    assert (f["run"], f["date"], f["device"]) == ("run ZZ", "2026-12-05", "1 H200")
    assert plot_captions.run_text(plot_captions.facts("new.json", {})) == \
        "run not recorded, date not recorded, device not recorded"


def test_server_reading_behind_everywhere_and_wrap():
    bench = {"table": {"1": {"plain": {"tok_s_per_request": 100.0}, "kdtree": {"tok_s_per_request": 80.0}},
                       "8": {"plain": {"tok_s_per_request": 90.0}, "kdtree": {"tok_s_per_request": 45.0}}}}
    assert plot_results.reading(bench) == ("Reading, per request: the best KDTREE server is behind the faster of "
                                           "plain and DFLASH at every batch (0.80x at 1, 0.50x at 8); fastest: "
                                           "batch 1 plain; batch 8 plain")
    assert all(len(line) <= 5 * 72 / (6.5 * 0.5) for line in plot_captions.wrap("word " * 100, 5, 6.5).split("\n"))


def test_server_reading_leads_with_kdtree_at_its_defaults():
    """The server a user gets without flags (automatic width, overlap on where the run has both) comes first, so
    a best pinned budget cannot stand in for it."""
    bench = {"budget": 63, "table": {
        "1": {"plain": {"tok_s_per_request": 100.0}, "kdtree-auto-overlap": {"tok_s_per_request": 85.0},
              "kdtree-auto": {"tok_s_per_request": 95.0}, "kdtree": {"tok_s_per_request": 110.0}}}}
    text = plot_results.reading(bench)
    assert text.startswith("Reading, per request: KDTREE at its defaults (KDTREE automatic width, overlap on) "
                           "against the faster of plain and DFLASH: 0.85x at 1. The best KDTREE server (any width) "
                           "is ahead of the faster of plain and DFLASH at every batch (1.10x at 1)"), text


def test_legend_and_footer_lie_outside_the_axes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    plt = plot_kimi_round.pyplot("test", "")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    path, bench = _load("bench_server_overlap_run_z.json")
    plot_results.plot_server(bench, tmp_path / "s.png", plt, plot_captions.facts(path, bench), "x" * 400)
    (fig,) = figs
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
    legend = fig.legends[0].get_window_extent(renderer)
    footer = fig.texts[-1].get_window_extent(renderer)
    assert legend.y0 > footer.y1 and all(legend.y1 < b.y0 for b in boxes)
    assert fig._suptitle.get_window_extent(renderer).y0 > max(b.y1 for b in boxes)
    monkeypatch.undo()
    plt.close(fig)


def test_rank_plot_reads_the_corrected_model_within_5_percent():
    path, report = _load("rank_h100_12layers.json")
    data = plot_rank.series(report, plot_rank.DEFAULT_SCALE)
    assert sorted(data) == [1, 8, 32] and all(d["widths"] == [16, 32, 64] for d in data.values())
    assert all(0.95 <= s / c <= 1.05 for d in data.values() for s, c in zip(d["served"], d["corrected"]))
    assert "served / corrected model 0.95-0.99x in every cell" in _rank() and "run C, 2026-12-06, 1 H100" in _rank()
