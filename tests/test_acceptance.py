"""``testbed.acceptance`` (the pair's acceptance on SGLang servers) and ``benchmarks.plot_acceptance`` on the CPU,
without servers: options, server flags, the aggregation of results and round logs, the report's curve as
``kimi_round`` reads it, and the figures."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from benchmarks import kimi_model as km
from benchmarks import kimi_round as kr
from benchmarks import plot_acceptance as pa
from testbed import acceptance as acc

# ---- options and plan -------------------------------------------------------------------------------------------


def test_options_defaults_and_refusals(capsys):
    a = acc.parse_args(["--pair", "P", "--out", "O"])
    assert (a.device, a.dtype, a.budgets, a.temperatures, a.new_tokens, a.at_once, a.concurrency) == \
        ("cuda", "float32", [15, 31, 63, 127, 255], [0.0, 1.0], 256, None, 48)
    c = acc.parse_args(["--pair", "P", "--out", "O", "--device", "cpu"])
    assert (c.at_once, c.concurrency) == (2, 8)
    with pytest.raises(SystemExit):
        acc.parse_args(["--pair", "P", "--out", "O", "--budgets", "15", "1025"])
    assert "1025 is outside [1, 1024]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        acc.parse_args(["--pair", "P", "--out", "O", "--kinds", "plain", "eagle"])
    assert "plain, dflash or kdtree-B" in capsys.readouterr().err


def test_plan_helpers(tmp_path):
    assert acc.kinds([15, 255]) == ["plain", "dflash", "kdtree-15", "kdtree-255"]
    kinds = ("plain", "dflash", "kdtree-255", "kdtree-63-overlap")
    assert [acc.pinned_budget(k) for k in kinds] == [None, None, 255, 63]
    assert acc.waves(["a", "b", "c"], 2) == [["a", "b"], ["c"]]
    # 48 requests of 64 + 448 tokens, a 256-row tree and a 32-row margin each
    assert acc.kv_tokens(48, 64, 448, 255) == 48 * 800
    (tmp_path / "heldout_prompts.jsonl").write_text("".join(json.dumps({"input_ids": [i]}) + "\n" for i in range(3)))
    assert [p["input_ids"] for p in acc.load_prompts(tmp_path, 2)] == [[0], [1]]
    assert len(acc.load_prompts(tmp_path, None)) == 3
    with pytest.raises(ValueError, match="holds 3 prompts"):
        acc.load_prompts(tmp_path, 4)


class _Recorder:
    """Stands in for a server class: records the launch arguments instead of starting a process."""

    def __init__(self, *args):
        self.args = next(a for a in args if isinstance(a, list))
        self.env = args[-1]


def test_server_flags_per_kind_on_cuda_and_cpu(monkeypatch, tmp_path):
    bench_server, cuda_servers = acc.cuda_harness()
    conftest = acc.cpu_harness()
    monkeypatch.setattr(cuda_servers, "CudaServer", _Recorder)
    monkeypatch.setattr(conftest, "Server", _Recorder)
    pair = tmp_path / "pair"

    def flags(kind, device):
        s = acc.start_server(kind, pair, tmp_path, device, "float32", kv=40000)
        a = s.args
        value = lambda f: a[a.index(f) + 1] if f in a else None  # noqa: E731
        return s, a, value

    s, a, v = flags("kdtree-255", "cuda")
    assert (v("--speculative-algorithm"), v("--speculative-num-draft-tokens"), v("--max-total-tokens")) == \
        ("kdtree", "256", "40000")
    assert v("--model-path") == str(pair / "target") and v("--speculative-draft-model-path") == str(pair / "drafter")
    assert "--disable-overlap-schedule" in a and "--disable-cuda-graph" not in a and v("--dtype") == "float32"
    assert s.env["KDTREE_ROUND_LOG"] == str(tmp_path / "rounds-kdtree-255.jsonl") == str(s.round_log)
    s, a, v = flags("dflash", "cuda")  # SGLang's defaults as its users run it: overlap on, its own draft block
    assert v("--speculative-algorithm") == "DFLASH" and "--disable-overlap-schedule" not in a
    assert v("--speculative-num-draft-tokens") is None and s.round_log is None and s.env == {}
    s, a, v = flags("plain", "cuda")
    assert v("--speculative-algorithm") is None and v("--max-total-tokens") == "40000"
    s, a, v = flags("kdtree-15", "cpu")
    assert (v("--device"), v("--attention-backend"), v("--speculative-num-draft-tokens")) == \
        ("cpu", "torch_native", "16")
    # overlap as on CUDA: off for kdtree-B (the round log's request-rounds are SGLang's verifies), on for -overlap
    assert "--disable-overlap-schedule" in a
    s, a, v = flags("kdtree-15-overlap", "cpu")
    assert v("--speculative-num-draft-tokens") == "16" and "--disable-overlap-schedule" not in a
    s, a, v = flags("dflash", "cpu")
    assert v("--speculative-algorithm") == "DFLASH" and v("--max-total-tokens") == "40000"
    assert "--disable-overlap-schedule" not in a
    s, a, v = flags("plain", "cpu")
    assert "--disable-overlap-schedule" not in a
    small = acc.start_server("plain", pair, tmp_path, "cpu", "bfloat16", kv=10).args
    assert small[small.index("--max-total-tokens") + 1] == "16384" and "bfloat16" in small


# ---- aggregation ------------------------------------------------------------------------------------------------


def _result(ids, tokens=None, rounds=None, tau=None):
    return {"output_ids": ids, "completion_tokens": tokens, "spec_verify_ct": rounds, "spec_accept_length": tau}


def test_tau_summary_mean_and_pooled():
    got = acc.tau_summary([_result([1], 10, 4, 2.5), _result([2], 30, 5, 6.0)])
    assert got == {"requests": 2, "completion_tokens": 40, "verify_rounds": 9, "tau": 4.25, "tau_pooled": 4.4444}
    plain = acc.tau_summary([_result([1], 10), _result([2], 30)])
    assert plain["tau"] is None and plain["tau_pooled"] is None and plain["completion_tokens"] == 40


def _record(lens, siblings, predicted_raw, realised, reach, graph=True):
    return {"accept_lens": lens, "sibling_accepts": siblings, "graph": graph, "depth_reach": reach,
            "width": {"width": 16, "predicted_raw": predicted_raw, "realised": realised}}


def test_round_summary_by_hand():
    records = [_record([3, 1], [1, 0], 2.5, 2.0, [1.5, 0.5]),
               _record([4, 2, 1], [0, 1, 0], 3.0, 7 / 3, [2.0, 1.0, 0.5], graph=False)]
    got = acc.round_summary(records)
    # five request-rounds accepting 3, 1, 4, 2, 1 tokens: 11 tokens, 6 of them draft tokens, 2 through siblings
    assert (got["rounds"], got["request_rounds"], got["tau"], got["graph_rounds"]) == (2, 5, 2.2, 1)
    assert got["sibling_share"] == round(2 / 6, 4)
    assert got["predicted_raw"] == round((2.5 * 2 + 3.0 * 3) / 5, 4) and got["realised"] == 2.2
    # reached depth 1: 3, 4, 2 (3 of 5); depth 2: 3, 4; depth 3: 4
    assert got["depth"] == {"predicted": [0.7, 0.3, 0.1], "realised": [0.6, 0.4, 0.2]}
    assert acc.round_summary([]) is None
    no_reach = acc.round_summary([dict(records[0], depth_reach=None)])
    assert no_reach["depth"] is None and no_reach["tau"] == 2.0


def test_identity_counts_and_lists_mismatches():
    a = [_result([1, 2, 3]), _result([4, 5]), _result([6])]
    b = [_result([1, 2, 3]), _result([4, 9]), _result([6, 7])]
    assert acc.identity(a, b) == {"prompts": 3, "mismatches": 2,
                                  "listed": [{"prompt": 1, "index": 1}, {"prompt": 2, "index": 1}]}


def _servers(dflash_t1_preserved=False):
    def phase(tau, rounds=None, **kw):
        # the mean over requests set apart from the pooled tau, which the curves and plots must use
        return {"tau": None if tau is None else tau + 1.0, "tau_pooled": tau, "rounds": rounds, **kw}

    rounds = {"tau": 6.0, "predicted_raw": 6.5, "realised": 6.0, "sibling_share": 0.1,
              "depth": {"predicted": [0.9, 0.7], "realised": [0.8, 0.6]}}
    return {"plain": {"phases": {"0": phase(None), "1": phase(None)}},
            "dflash": {"phases": {"0": phase(5.1), "1": phase(4.9, sampling_preserved=dflash_t1_preserved)}},
            "kdtree-63": {"phases": {"0": phase(6.2, rounds), "1": phase(5.0, rounds)}},
            "kdtree-15": {"phases": {"0": phase(5.6, rounds), "1": phase(4.4, rounds)}},
            "kdtree-255": {"error": "boom", "phases": {}},
            "kdtree-127": {"phases": {"0": {"skipped": "deadline"}, "1": {"skipped": "deadline"}}}}


def _report(tmp_path=None, **kw):
    settings = {"temperatures": [0.0, 1.0], "device": "cuda", "dtype": "float32", "prompts": 2, "new_tokens": 3,
                "command": "python -m testbed.acceptance --pair P --out O", "commit": "abc123"}
    outputs = {("plain", "0"): [_result([1, 2, 3]), _result([4, 5, 6])],
               ("kdtree-63", "0"): [_result([1, 2, 3]), _result([4, 5, 7])],
               ("dflash", "0"): [_result([1, 2, 3]), _result([4, 5, 6])],
               ("kdtree-63", "1"): [_result([9, 9, 9]), _result([9, 9, 9])]}
    rep = acc.report(settings, {"preset": "full"}, _servers(**kw), outputs, [[1, 2, 3, 4], [4, 5, 0, 0]])
    if tmp_path is not None:
        (tmp_path / "acceptance.json").write_text(json.dumps(rep))
    return rep


def test_report_curves_and_identity():
    rep = _report()
    # budget order; the failed 255 and the skipped 127 absent
    assert rep["curve"] == {"15": 5.6, "63": 6.2} and rep["dflash"] == 5.1
    assert rep["curve_t1"] == {"15": 4.4, "63": 5.0} and "dflash_t1" not in rep  # greedy-verify fallback: no figure
    assert rep["identity"]["kdtree-63"]["mismatches"] == 1 and rep["identity"]["dflash"]["mismatches"] == 0
    assert rep["identity"]["plain_vs_build"] == {"prompts": 2, "mismatches": 1, "listed": [{"prompt": 1, "index": 2}]}
    assert "kdtree-63" in rep["identity"] and len(rep["identity"]) == 3  # T = 1 outputs are not compared
    assert _report(dflash_t1_preserved=True)["dflash_t1"] == 4.9
    table = acc.format_table(rep)
    assert "| kdtree-255 | | not served: boom |" in table
    assert "| kdtree-63 | 0 | 7.200 | 6.200 | 6.000 | 6.500 | 6.000 | 0.100 | 1/2 |" in table
    assert "| dflash | 1 | 5.900 (greedy-verify fallback) |" in table
    assert "| kdtree-127 | 0 | skipped: deadline |" in table


def test_kimi_round_reads_the_measured_curve(tmp_path):
    _report(tmp_path)
    path = str(tmp_path / "acceptance.json")
    curve, dflash = km.load_tau_curve_json(path)
    assert curve.points == ((15, 5.6), (63, 6.2)) and dflash == 5.1
    curve, dflash = kr.curve_of(kr.parser().parse_args(["--tau-curve-json", path]))
    log2 = math.log2  # linear in log2(budget) between the measured points
    assert curve.tau(31) == pytest.approx(5.6 + 0.6 * (log2(31) - log2(15)) / (log2(63) - log2(15))) and dflash == 5.1


# ---- plot_acceptance ----------------------------------------------------------------------------------------------


def test_plot_series():
    series = pa.tau_series(_report())
    assert [(s["temperature"], s["budgets"], s["tau"], s["dflash"]) for s in series] == \
        [(0.0, [15, 63], [5.6, 6.2], 5.1), (1.0, [15, 63], [4.4, 5.0], None)]
    assert series[0]["dflash_note"] is None and "greedy verification" in series[1]["dflash_note"]
    cal = pa.calibration_series(_report())
    assert cal["cuts"] == {0.0: [(15, 6.5, 6.0), (63, 6.5, 6.0)], 1.0: [(15, 6.5, 6.0), (63, 6.5, 6.0)]}
    assert cal["depth"][0.0] == cal["depth"][1.0] == {15: ([0.9, 0.7], [0.8, 0.6]), 63: ([0.9, 0.7], [0.8, 0.6])}
    with pytest.raises(pa.PlotError, match="no 'servers'"):
        pa.tau_series({"rows": []})


def test_plot_writes_pngs_and_refuses_other_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _report(tmp_path)
    assert pa.main([str(tmp_path / "acceptance.json"), str(tmp_path / "png")]) == 0
    for name in ("acceptance_tau.png", "acceptance_calibration.png"):
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    (tmp_path / "other.json").write_text(json.dumps({"table": {}}))
    assert pa.main([str(tmp_path / "other.json"), str(tmp_path / "png")]) == 2
    assert "no 'servers'" in capsys.readouterr().err


def test_plot_without_matplotlib_says_so(monkeypatch, capsys, tmp_path):
    _report(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert pa.main([str(tmp_path / "acceptance.json"), str(Path(tmp_path) / "png")]) == 2
    assert "matplotlib is not importable" in capsys.readouterr().err


def test_training_curves_from_the_pairs_metadata(tmp_path, capsys):
    meta = {"preset": "tiny", "seed": 0, "device": "cpu", "commit": "abc",
            "target": {"architecture": "LlamaForCausalLM", "params": 1e6, "heldout_loss": 3.0,
                       "curve": [{"step": 0, "train_loss": float("nan"), "heldout_loss": 8.3},
                                 {"step": 50, "train_loss": 5.0, "heldout_loss": 5.5}]},
            "drafter": {"architecture": "DFlashDraftModel", "params": 1e5,
                        "curve": [{"step": 0, "heldout_loss": 20.0, "heldout_acc_depth1": 0.0},
                                  {"step": 10, "train_loss": 2.0, "heldout_loss": 2.5, "heldout_acc_depth1": 0.4}]}}
    series = pa.training_series(meta)
    assert series["target"]["heldout"] == [8.3, 5.5] and series["drafter"]["acc1"] == [0.0, 0.4]
    assert series["drafter"]["train"] == [None, 2.0]
    with pytest.raises(pa.PlotError, match="no drafter curve"):
        pa.training_series({"target": meta["target"]})
    (tmp_path / "acceptance.json").write_text(json.dumps(_report()))
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    pytest.importorskip("matplotlib")
    assert pa.main([str(tmp_path / "acceptance.json"), str(tmp_path / "png"),
                    "--training", str(tmp_path / "metadata.json")]) == 0
    assert (tmp_path / "png" / "pair_training.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("{}")
    assert pa.main([str(tmp_path / "acceptance.json"), str(tmp_path / "png"), "--training", str(tmp_path / "bad.json")]) == 2
