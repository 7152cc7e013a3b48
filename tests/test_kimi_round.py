"""CPU tests of benchmarks.kimi_round and its siblings: kimi_model's arithmetic on hand-computed inputs (all-reduce
model, the assembled split, tokens/s, bookkeeping share, the moonshot verdict, missing pieces, the tau curve, the
KDTREE-auto choice, the summary and target checks), kimi_measure's loop on a tiny model with a stub timer (errors
recorded, deadline honoured, job order), the CLI through ``python -m sglang_kdtree bench --kimi-round`` with the
measurement stubbed, ``--from-json``, and plot_kimi_round."""

from __future__ import annotations

import io
import json
import math
import random
import sys
import time
import types

import pytest

from benchmarks import kimi_measure as kmeasure
from benchmarks import plot_kimi_round
from sglang_kdtree.cli import bench

kr = bench.load_kimi_round()
km = kr.kimi_model

key = km.key
FREE_NET = {"gbps": math.inf, "latency_us": 0.0, "gather_logits": False}


def cfg_of(tau=None, **kw):
    """A config; ``tau``: one KDTREE tau at every budget."""
    if tau is not None:
        kw["curve"] = km.TauCurve(((1, tau),))
    return km.RoundConfig(net=km.Network(**kw.pop("net", {})), **kw)


def uniform_times(cfg, batches, contexts, value=0.0, **overrides):
    """Every key the rows read set to ``value``; ``overrides`` by piece name (any dims)."""
    return {k: overrides.get(k.split("[")[0], value) for k in km.required_keys(batches, contexts, cfg)}


def by_mode(rows):
    return {r["mode"]: r for r in rows}


# ---- collectives and forward passes ----------------------------------------------------------------------------


def test_allreduce_formula():
    # 2 (n-1)/n x bytes / bw + latency = 1.75 x 4e6 / 350e9 s = 20 us, + 10 us
    assert km.allreduce_us(4e6, 8, 350, 10) == pytest.approx(30.0)
    assert km.allreduce_us(4e6, 2, 350, 0) == pytest.approx(4e6 / 350e9 * 1e6)
    assert km.allreduce_us(4e6, 1, 350, 10) == 0.0  # no collective on one GPU
    assert km.allgather_us(8e6, 8, 350, 10) == pytest.approx(30.0)  # 0.875 x 8e6 / 350e9 s = 20 us, + 10 us
    assert km.allgather_us(8e6, 1, 350, 10) == 0.0


def test_collectives_per_forward_and_their_bytes():
    """123 all-reduces per target forward (2 per layer + embedding) + 1 logits all-gather; the drafter's 11 + 1."""
    cfg = cfg_of(net={"gbps": math.inf, "latency_us": 1.0, "gather_logits": True})
    times = uniform_times(cfg, [32], [4096])
    assert km.verify_forward(times, 32, 64, 4096, cfg)["allreduce"] == pytest.approx(2 * 61 + 1 + 1)
    d = km.draft_forward(times, 32, 4096, cfg)
    assert d["allreduce"] == pytest.approx(2 * 5 + 1 + 1) and d["total"] == pytest.approx(12)
    cfg = cfg_of(net={"gbps": 450.0, "latency_us": 10.0, "gather_logits": True})
    T = 32 * 64
    want = 123 * (1.75 * T * 7168 * 2 / 450e9 * 1e6 + 10) + (0.875 * T * 163840 * 2 / 450e9 * 1e6 + 10)
    assert km.verify_forward(times, 32, 64, 4096, cfg)["allreduce"] == pytest.approx(want)


def test_verify_and_draft_forward_hand_computed():
    cfg = cfg_of(net=FREE_NET)
    vals = {"qkv_a": 1, "q_b": 2, "kv_absorb": 3, "o_absorb": 4, "o_proj": 5, "rms_hidden": 6, "rms_q": 7,
            "rms_kv": 8, "router": 9, "shared": 10, "dense_mlp": 11, "lm_head": 12, "moe": 13, "attention": 14}
    v = km.verify_forward(uniform_times(cfg, [1], [4096], **vals), 1, 64, 4096, cfg)
    # per layer: 1+2+3+4+5 + 2x6 + 7 + 8 = 42; x61 + 60 x (router 9 + shared 10) + dense 11 + lm_head 12
    assert v["other"] == pytest.approx(61 * 42 + 60 * 19 + 11 + 12) == 3725
    assert v["attention"] == 61 * 14 and v["moe"] == 60 * 13 and v["allreduce"] == 0 and v["missing"] == []
    times = uniform_times(cfg, [2], [4096], draft_qkv=1, draft_o=2, dense_mlp=3, rms_hidden=4, draft_attention=5)
    times[key("lm_head", T=2 * 15)] = 100.0  # the drafter's head: batch x 15 rows
    d = km.draft_forward(times, 2, 4096, cfg)
    assert d["head"] == 100 and d["total"] == pytest.approx(5 * (1 + 2 + 3 + 2 * 4 + 5) + 100)


# ---- rows ------------------------------------------------------------------------------------------------------


def test_round_rows_split_tokens_and_share():
    cfg = cfg_of(tau=7.0, net=FREE_NET, accept_dflash=5.0, budgets=(63,))
    times = uniform_times(cfg, [32], [4096])
    times[key("attention", bs=32, width=64, ctx=4096)] = 100.0  # KDTREE verify: 61 x 100
    times[key("attention", bs=32, width=16, ctx=4096)] = 50.0  # DFLASH verify: 61 x 50
    times[key("attention", bs=32, width=1, ctx=4096)] = 1000 / 61  # AR verify: 1000
    times[key("draft_attention", bs=32, ctx=4096)] = 100.0  # draft: 5 x 100
    times[key("tree", bs=32)], times[key("accept_commit", bs=32)] = 150.0, 250.0
    rows = by_mode(km.assemble(times, cfg, [32], [4096]))
    assert list(rows) == ["AR", "DFLASH", "KDTREE-63", "KDTREE-auto"]
    kd = rows["KDTREE-63"]
    assert (kd["draft"], kd["tree"], kd["attention"], kd["accept_commit"]) == (500, 150, 6100, 250)
    assert kd["round"] == pytest.approx(7000) and kd["width"] == 64
    assert kd["tok_s"] == pytest.approx(7.0 / 7000e-6) == 1000 and kd["tok_s_batch"] == pytest.approx(32000)
    assert kd["share"] == pytest.approx(400 / 7000)
    df = rows["DFLASH"]
    assert df["round"] == pytest.approx(500 + 61 * 50) and df["tree"] == df["accept_commit"] == 0
    assert df["tok_s"] == pytest.approx(5.0 / (3550e-6)) and df["share"] is None and df["width"] == 16
    ar = rows["AR"]
    assert ar["round"] == pytest.approx(1000) and ar["draft"] == 0 and ar["tok_s"] == pytest.approx(1000)


@pytest.mark.parametrize("seed", range(10))
def test_kdtree_with_accept_one_never_beats_ar_at_the_same_verify_cost(seed):
    """Piece times independent of T; KDTREE accepting 1 token per round pays the draft on top of AR's round."""
    rng = random.Random(seed)
    cfg = cfg_of(tau=1.0, net={"gbps": rng.uniform(50, 900), "latency_us": rng.uniform(0, 20),
                               "gather_logits": rng.random() < 0.5})
    names = sorted({k.split("[")[0] for k in km.required_keys([1, 32], [4096], cfg)})
    vals = {n: rng.uniform(0, 500) for n in names}
    times = uniform_times(cfg, [1, 32], [4096], **vals)
    for r in km.assemble(times, cfg, [1, 32], [4096]):
        if r["mode"].startswith("KDTREE"):
            assert r["tok_s"] <= km.round_row(times, "AR", r["bs"], 4096, cfg)["tok_s"]


def _kd_times(cfg, bk=(10.0, 10.0), attention=1000.0):
    times = uniform_times(cfg, [32], [4096])
    times[key("attention", bs=32, width=64, ctx=4096)] = attention / 61
    times[key("tree", bs=32)], times[key("accept_commit", bs=32)] = bk
    return times


def test_moonshot_holds_and_fails_exactly():
    cfg = cfg_of(net=FREE_NET, budgets=(63,))
    state, line = km.moonshot_verdict(km.assemble(_kd_times(cfg, (10, 10)), cfg, [32], [4096]))
    assert state == "holds" and "HOLDS" in line and "1.96 %" in line  # 20 / 1020
    state, line = km.moonshot_verdict(km.assemble(_kd_times(cfg, (20, 20)), cfg, [32], [4096]))
    assert state == "fails" and "FAILS" in line  # 40 / 1040 = 3.8 %
    state, line = km.moonshot_verdict(km.assemble({}, cfg_of(budgets=(15,)), [32], [4096]))
    assert state == "undetermined" and "budget 63 not in --budgets" in line
    assert "batch 32 not in --batches" in km.moonshot_verdict(km.assemble({}, cfg, [1], [4096]))[1]


def test_missing_pieces_make_lower_bounds_and_the_verdict_honest():
    cfg = cfg_of(net=FREE_NET, budgets=(63,))
    times = _kd_times(cfg, (10, 10))
    del times[key("moe", T=32 * 64)]
    kd = by_mode(km.assemble(times, cfg, [32], [4096]))["KDTREE-63"]
    assert kd["missing"] == [key("moe", T=2048)] and kd["share"] == pytest.approx(20 / 1020)
    table = kr.format_table([kd])
    assert "1020*" in table and "<= 1.96 %" in table and "<= " + kr._f(kd["tok_s"]) in table
    assert km.moonshot_verdict([kd])[0] == "holds"  # an upper bound below 3 % still proves the line
    times = _kd_times(cfg, (20, 20))
    del times[key("moe", T=2048)]
    assert km.moonshot_verdict(km.assemble(times, cfg, [32], [4096]))[0] == "undetermined"
    times = _kd_times(cfg)
    del times[key("tree", bs=32)]
    rows = km.assemble(times, cfg, [32], [4096])
    assert by_mode(rows)["KDTREE-63"]["share"] is None and km.moonshot_verdict(rows)[0] == "undetermined"


# ---- the tau curve ---------------------------------------------------------------------------------------------


def test_tau_curve_interpolates_in_log2_and_extrapolates_the_end_slopes():
    c = km.TauCurve(((64, 9.5), (16, 8.0), (32, 9.0)))  # sorted on construction
    assert c.points == ((16, 8.0), (32, 9.0), (64, 9.5))
    assert c.tau(16) == 8.0 and c.tau(32) == 9.0 and c.tau(64) == 9.5
    assert c.tau(24) == pytest.approx(8.0 + math.log2(1.5))  # slope 1 per doubling between 16 and 32
    assert c.tau(48) == pytest.approx(9.0 + 0.5 * math.log2(1.5))
    assert c.tau(8) == pytest.approx(7.0) and c.tau(4) == pytest.approx(6.0)  # the first segment's slope
    assert c.tau(256) == pytest.approx(10.5)  # the last segment's slope, 0.5 per doubling
    assert km.TauCurve(((2, 1.5), (4, 3.0))).tau(1) == 1.0  # 0 by the slope, clamped to 1
    assert km.TauCurve(((7, 3.0),)).tau(1000) == 3.0  # one point: a constant


def test_paper_curve_is_the_sweep_scaled_to_the_papers_mean():
    c = km.paper_curve()
    s = 7.51 / 9.75
    assert c.tau(64) == pytest.approx(7.51) and c.tau(128) == pytest.approx(10.2 * s)
    assert c.tau(15) == pytest.approx(s * (8.6 + 0.7 * (math.log2(15) - 4)))  # below 16: the first slope
    assert c.tau(63) == pytest.approx(s * (9.3 + 0.45 * (math.log2(63) - 5)))
    assert c.tau(2048) == pytest.approx(s * 11.3)  # past 1024: the last slope, 0.3 per doubling
    c32 = km.paper_curve(32)
    assert c32.tau(32) == pytest.approx(7.51) and c32.tau(64) == pytest.approx(7.51 * 9.75 / 9.3)
    assert km.RoundConfig().curve == c and km.RoundConfig().accept_dflash == 5.19


def test_tau_curve_options_and_files(tmp_path):
    assert km.parse_tau_curve(["32=9.3", "16=8.6"]).points == ((16, 8.6), (32, 9.3))
    for bad, says in ((["16"], "expected BUDGET=TAU"), (["x=1"], "expected BUDGET=TAU"), (["16=abc"], "BUDGET=TAU"),
                      (["0=2"], "budget 0 is not an integer >= 1"), (["16=0.5"], "tau 0.5 at budget 16"),
                      (["16=8", "16=9"], "budget 16 appears twice"), ([], "at least one")):
        with pytest.raises(ValueError, match=says):
            km.parse_tau_curve(bad)
    curve, dflash = km.curve_from_json({"budgets": [15, 31], "tau": [6.1, 7], "dflash": 5.5}, "F")
    assert curve.points == ((15, 6.1), (31, 7.0)) and dflash == 5.5
    curve, dflash = km.curve_from_json({"curve": {"31": 7, "15": 6.1}}, "F")
    assert curve.points == ((15, 6.1), (31, 7.0)) and dflash is None
    for bad, says in (({"budgets": [1], "tau": [1, 2]}, "one length"), ({"tau": [1]}, "expected"), ([1], "expected"),
                      ({"curve": {"x": 2}}, "not an integer"), ({"curve": {"15": 6}, "dflash": 0.5}, '"dflash" 0.5'),
                      ({"budgets": [15.5], "tau": [6]}, "budget 15.5")):
        with pytest.raises(ValueError, match=says):
            km.curve_from_json(bad, "F")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        km.load_tau_curve_json(tmp_path / "bad.json")


# ---- KDTREE-auto, summary, checks ------------------------------------------------------------------------------

CURVE = km.TauCurve(((15, 6.0), (31, 8.0), (47, 16.0), (63, 17.0)))


def _auto_times(cfg, attention, bk=(30.0, 20.0)):
    """Only attention (per width) and the bookkeeping cost: round(w) = 61 x attention[w] + sum(bk)."""
    times = uniform_times(cfg, [1], [4096])
    for w, a in attention.items():
        times[key("attention", bs=1, width=w, ctx=4096)] = a
    times[key("tree", bs=1)], times[key("accept_commit", bs=1)] = bk
    return times


def test_auto_row_is_the_best_fixed_row_with_the_same_bookkeeping():
    cfg = cfg_of(net=FREE_NET, curve=CURVE, budgets=(15, 31, 47, 63))
    # rates tau / round: 6 / 172, 8 / 172, 16 / 538, 17 / 660 -> width 32 (best_width: tokens / seconds)
    times = _auto_times(cfg, {1: 1.0, 16: 2.0, 32: 2.0, 48: 8.0, 64: 10.0})
    rows = by_mode(km.assemble(times, cfg, [1], [4096]))
    auto, best = rows["KDTREE-auto"], rows["KDTREE-31"]
    assert auto["chose"] == 32 and auto["width"] == 32
    assert {k: v for k, v in auto.items() if k not in ("mode", "chose")} == \
        {k: v for k, v in best.items() if k != "mode"}
    assert auto["tok_s"] == pytest.approx(8.0 / 172e-6) == max(r["tok_s"] for r in rows.values())
    assert auto["tree"] + auto["accept_commit"] == 50 == rows["KDTREE-63"]["bookkeeping"]
    (cell,) = km.summarize(list(rows.values()), cfg)
    assert cell["auto_width"] == 32 and cell["best_fixed"] == "KDTREE-31" and cell["auto_vs_best_fixed"] == 1.0
    assert cell["auto_vs_dflash"] == pytest.approx((8.0 / 172) / (5.19 / (61 * 2.0)))


def test_auto_row_takes_the_smaller_width_on_a_tie():
    cfg = cfg_of(net=FREE_NET, curve=CURVE, budgets=(15, 31, 47, 63))
    # widths 32 and 48: 8 tokens in 122 us and 16 in 244 us, equal rates; 16 (6 in 122) and 64 (17 in 3050) worse
    times = _auto_times(cfg, {1: 1.0, 16: 2.0, 32: 2.0, 48: 4.0, 64: 50.0}, bk=(0.0, 0.0))
    rows = by_mode(km.assemble(times, cfg, [1], [4096]))
    assert rows["KDTREE-31"]["round"] * 2 == rows["KDTREE-47"]["round"] == 244
    assert rows["KDTREE-31"]["tok_s"] == rows["KDTREE-47"]["tok_s"] > rows["KDTREE-15"]["tok_s"]
    assert rows["KDTREE-auto"]["chose"] == 32
    cfg = cfg_of(tau=5.0, net=FREE_NET, budgets=(15, 31, 47, 63))  # one tau and one round time: all four tie
    times = _auto_times(cfg, {1: 1.0, 16: 2.0, 32: 2.0, 48: 2.0, 64: 2.0})
    assert by_mode(km.assemble(times, cfg, [1], [4096]))["KDTREE-auto"]["chose"] == 16


def _cell(bs, vs_dflash, vs_best=1.0, partial=False, ctx=4096):
    return {"ctx": ctx, "bs": bs, "auto_vs_dflash": vs_dflash, "auto_vs_best_fixed": vs_best, "partial": partial}


def test_target_checks_pass_and_fail():
    states = lambda cells: [c["state"] for c in km.check_targets(cells)]  # noqa: E731
    good = [_cell(1, 1.16), _cell(8, 1.01), _cell(32, 1.10, 0.98), _cell(64, 1.0)]
    assert states(good) == ["PASS"] * 4
    assert states(good[:1] + [_cell(8, 1.2, 0.979)] + good[2:]) == ["FAIL", "PASS", "PASS", "PASS"]
    assert states([_cell(1, 1.149)] + good[1:]) == ["PASS", "FAIL", "PASS", "PASS"]
    assert states(good[:2] + [_cell(32, 1.09)] + good[3:]) == ["PASS", "PASS", "FAIL", "PASS"]
    assert states(good[:3] + [_cell(64, 0.99)]) == ["PASS", "PASS", "PASS", "FAIL"]
    # a cell lacking pieces proves nothing either way; a batch not run is n/a
    assert states(good[:2] + [_cell(32, 0.5, partial=True)] + good[3:]) == \
        ["UNDETERMINED", "PASS", "UNDETERMINED", "UNDETERMINED"]
    assert states([_cell(8, 1.2)]) == ["PASS", "n/a", "n/a", "PASS"]
    line = km.check_targets([_cell(1, 1.3), _cell(1, 1.1, ctx=16384)])[1]["line"]
    assert line == "check: auto >= 1.15x DFLASH per request at batch 1: FAIL (lowest 1.100x at ctx 16384, batch 1)"


# ---- report and inputs -----------------------------------------------------------------------------------------


def test_empty_measurement_still_reports(capsys):
    result = kr.report({"times": {}, "errors": {"setup": "boom"}}, km.RoundConfig(), [1, 32], [4096])
    out = capsys.readouterr().out
    assert "FAILED setup: boom" in out and result["moonshot"]["state"] == "undetermined"
    assert [c["state"] for c in result["checks"]] == ["UNDETERMINED"] * 4
    assert out.rstrip().splitlines()[-1].startswith("check: auto never below DFLASH in any cell: UNDETERMINED")


def test_defaults_and_shapes():
    assert km.PAPER_ACCEPT_DFLASH == 5.19  # (5.58+5.18+5.16+5.13+8.02+7.19+6.32+3.61+3.52+2.22) / 10 = 5.193
    assert km.PAPER_ACCEPT_KDTREE == 7.51  # (8.10+7.55+7.87+7.63+10.72+9.94+8.63+5.71+5.36+3.55) / 10 = 7.506
    args = kr.parser().parse_args([])
    assert (args.batches, args.contexts, args.budgets, args.tau_anchor_budget, args.deadline) == \
        ([1, 8, 32, 64], [4096, 16384], [15, 31, 47, 63], 64, 240.0)
    assert (args.accept_dflash, args.tau_curve, args.tau_curve_json, args.accept_kdtree) == (None,) * 4
    m = km.KIMI
    assert (m.heads_gpu, m.moe_inter_gpu, m.dense_inter_gpu, m.vocab_gpu, m.moe_layers) == (8, 256, 2304, 20480, 60)
    assert km.RoundConfig().widths == {"AR": 1, "DFLASH": 16, "KDTREE-15": 16, "KDTREE-31": 32, "KDTREE-47": 48,
                                       "KDTREE-63": 64}
    assert km.RoundConfig(budgets=[63, 15, 63]).budgets == (15, 63)


def test_needed_tokens_and_required_keys():
    cfg = km.RoundConfig()
    assert km.needed_tokens([1, 32], cfg) == {"verify": [2048, 1536, 1024, 512, 64, 48, 32, 16, 1],
                                              "draft": [512, 16], "head": [480, 15]}
    keys = km.required_keys([1, 32], [4096, 16384], cfg)
    assert len(keys) == len(set(keys)) and key("attention", bs=32, width=48, ctx=16384) in keys
    assert all(not r["missing"] for r in km.assemble({k: 1.0 for k in keys}, cfg, [1, 32], [4096, 16384]))


def test_bookkeeping_overrides():
    assert kr.parse_bookkeeping(["32=150,120", "5.5,6"]) == {32: (150.0, 120.0), None: (5.5, 6.0)}
    for bad in (["32=1"], ["x=1,2"], ["32=-1,2"], ["0=1,2"]):
        with pytest.raises(ValueError):
            kr.parse_bookkeeping(bad)
    times = {}
    assert kr.apply_bookkeeping(times, {32: (1.0, 2.0), None: (3.0, 4.0)}, [1, 32]) == [1, 32]
    assert times == {key("tree", bs=1): 3.0, key("accept_commit", bs=1): 4.0, key("tree", bs=32): 1.0,
                     key("accept_commit", bs=32): 2.0}


# ---- CLI plumbing ----------------------------------------------------------------------------------------------


@pytest.fixture
def stubbed(monkeypatch):
    """kimi_round.main's GPU check passes and its measurement returns fixed piece times."""
    calls = []

    def fake_measure(cfg, batches, contexts, deadline_s, **kw):
        calls.append({"cfg": cfg, "batches": batches, "contexts": contexts, "deadline": deadline_s, **kw})
        times = {k: 2.0 for k in km.required_keys(batches, contexts, cfg)}
        for bs in kw["skip_bookkeeping"]:
            del times[key("tree", bs=bs)], times[key("accept_commit", bs=bs)]
        return {"times": times, "errors": {}, "skipped": [], "notes": ["stub"], "modes": {}, "device": "stub GPU",
                "moe_path": "stub", "elapsed_s": 0.1, "deadline_s": deadline_s}

    monkeypatch.setattr(kr, "measure", fake_measure)
    monkeypatch.setattr(kr, "gpu_reason", lambda: None)
    return calls


def test_bench_flag_reaches_kimi_round_main(stubbed, capsys, tmp_path):
    out_json = tmp_path / "round.json"
    assert bench.main(["--kimi-round", "--batches", "32", "--contexts", "4096", "--deadline", "77",
                       "--accept-kdtree", "8", "--budgets", "31", "15", "--json", str(out_json)]) == 0
    (call,) = stubbed
    assert call["batches"] == [32] and call["contexts"] == [4096] and call["deadline"] == 77
    cfg = call["cfg"]
    assert cfg.budgets == (15, 31) and cfg.curve.tau(15) == cfg.curve.tau(1000) == 8 and call["skip_bookkeeping"] == []
    out = capsys.readouterr().out
    assert "moonshot line" in out and "device: stub GPU" in out and "| 4096 | 32 | KDTREE-auto | 16 |" in out
    assert out.rstrip().splitlines()[-1].startswith("check: auto never below DFLASH in any cell: ")
    saved = json.loads(out_json.read_text())
    assert [r["mode"] for r in saved["rows"]] == ["AR", "DFLASH", "KDTREE-15", "KDTREE-31", "KDTREE-auto"]
    assert saved["summary"][0]["auto_width"] == 16 and len(saved["checks"]) == 4
    assert saved["args"]["budgets"] == [31, 15] and saved["config"]["curve"]["points"] == [[1, 8.0]]


def test_curve_options_reach_the_config(stubbed, capsys, tmp_path):
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"curve": {"15": 6.0, "63": 9.0}, "dflash": 4.5}))
    base = ["--batches", "1", "--contexts", "4096"]
    assert kr.main(base + ["--tau-curve-json", str(path)]) == 0
    assert stubbed[-1]["cfg"].accept_dflash == 4.5 and stubbed[-1]["cfg"].curve.tau(63) == 9.0
    assert kr.main(base + ["--tau-curve-json", str(path), "--accept-dflash", "5"]) == 0
    assert stubbed[-1]["cfg"].accept_dflash == 5.0
    assert kr.main(base + ["--tau-curve", "16=8", "64=10"]) == 0
    assert stubbed[-1]["cfg"].curve.tau(32) == pytest.approx(9.0) and stubbed[-1]["cfg"].accept_dflash == 5.19
    for bad, says in ((["--tau-curve", "16=8", "--accept-kdtree", "7"], "not allowed with"),
                      (["--tau-curve", "16=8", "--tau-anchor-budget", "32"], "scales the default (paper) curve"),
                      (["--tau-curve", "16:8"], "expected BUDGET=TAU"), (["--budgets", "0"], "--budgets: 0"),
                      (["--accept-dflash", "0.5"], "--accept-dflash 0.5"), (["--nvlink-gbps", "0"], "--nvlink-gbps"),
                      (["--bookkeeping-us", "32=oops"], "--bookkeeping-us")):
        with pytest.raises(SystemExit):
            kr.main(base + bad)
        assert says in capsys.readouterr().err


def test_bookkeeping_override_skips_its_measurement(stubbed, capsys):
    assert kr.main(["--batches", "1", "32", "--contexts", "4096", "--bookkeeping-us", "32=100,50"]) == 0
    assert stubbed[0]["skip_bookkeeping"] == [32]
    out = capsys.readouterr().out  # bs 1's bookkeeping came from the stub, bs 32's from the override
    assert "bookkeeping from --bookkeeping-us at batch [32]" in out and "missing pieces" not in out


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(kr, "gpu_reason", lambda: "torch sees no CUDA device")
    monkeypatch.setattr(kr, "measure", lambda *a, **k: pytest.fail("must not measure"))


def test_from_json_reassembles_a_saved_grid_without_a_gpu(no_gpu, capsys, tmp_path):
    cfg = km.RoundConfig(budgets=(15, 63))
    times = {k: 2.0 for k in km.required_keys([32], [4096], cfg)}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps({"args": {"batches": [32], "contexts": [4096], "budgets": [15, 63]},
                                "measured": {"times": times, "device": "saved H200"}}))
    assert kr.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "device: saved H200" in out and "missing pieces" not in out
    assert "| ctx | bs | AR | DFLASH | KDTREE-15 | KDTREE-63 | KDTREE-auto | auto width |" in out
    # batch 1 was not measured: asked for, its rows are lower bounds listed as missing
    assert kr.main(["--from-json", str(path), "--batches", "1", "32"]) == 0
    assert "missing pieces" in capsys.readouterr().out
    # a file from before --budgets: its single budget, so its width-65 pieces are read
    old = {k: 2.0 for k in km.required_keys([32], [4096], km.RoundConfig(budgets=(64,)))}
    path.write_text(json.dumps({"args": {"batches": [32], "contexts": [4096], "budget": 64},
                                "measured": {"times": old}}))
    assert kr.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 4096 | 32 | KDTREE-64 | 65 |" in out and "missing pieces" not in out
    with pytest.raises(SystemExit):
        kr.main(["--from-json", str(tmp_path / "absent.json")])
    assert "cannot read a saved measurement" in capsys.readouterr().err


def test_cpu_only_machine_gets_a_message_not_a_crash(no_gpu, capsys):
    assert bench.main(["--kimi-round"]) == 2
    assert "needs a CUDA GPU (torch sees no CUDA device)" in (err := capsys.readouterr().err) and "--from-json" in err


def test_kimi_round_help_through_bench(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--kimi-round", "--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0 and "python -m sglang_kdtree bench --kimi-round" in text and "--tau-curve" in text


# ---- plot ------------------------------------------------------------------------------------------------------


def _plot_rows():
    cfg = cfg_of(net=FREE_NET, curve=CURVE, budgets=(15, 31, 47, 63))
    return km.assemble(_auto_times(cfg, {1: 1.0, 16: 2.0, 32: 2.0, 48: 8.0, 64: 10.0}), cfg, [1], [4096])


def test_plot_panels_from_rows():
    (p,) = plot_kimi_round.panels(_plot_rows())
    assert (p["bs"], p["ctx"], p["widths"], p["auto_width"], p["partial"]) == (1, 4096, [16, 32, 48, 64], 32, False)
    assert p["tok_s"][1] == p["auto_tok_s"] == pytest.approx(8 / 172e-6) and p["ar"] == pytest.approx(1 / 61e-6)


def test_plot_without_matplotlib_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot_kimi_round.main([str(tmp_path / "x.json"), str(tmp_path / "x.png")]) == 2
    assert "matplotlib is not importable" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "r.json").write_text(json.dumps({"rows": _plot_rows()}))
    assert plot_kimi_round.main([str(tmp_path / "r.json"), str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the measurement loop on a tiny CPU model (stub timer) -----------------------------------------------------

TINY = dict(model=km.ModelShape(layers=3, dense_layers=1, hidden=64, heads=8, q_lora=32, kv_lora=16, qk_nope=8,
                                qk_rope=8, v_head=8, experts=8, top_k=2, moe_inter=128, shared_inter=64,
                                dense_inter=128, vocab=256, tp=8),
            drafter=km.DrafterShape(layers=2, heads=8, kv_heads=8, head_dim=16, block=4), budgets=(4, 7))


def test_jobs_cover_every_width_once_priority_batches_first():
    cfg = km.RoundConfig(**TINY)
    names = [n for n, _ in kmeasure._jobs(types.SimpleNamespace(cfg=cfg), [64, 8, 32, 1], [32], set(), None)]
    assert len(names) == len(set(names))
    need = km.required_keys([64, 8, 32, 1], [32], cfg)
    assert {k for k in need if not k.startswith(("tree[", "accept_commit["))} <= set(names)
    assert names[0] == key("qkv_a", T=8)  # batch 1 at the widest verify (width 8 = budget 7 + 1) first
    want = []
    for bs in (1, 32, 8, 64):
        want += [key("attention", bs=bs, ctx=32, width=w) for w in (8, 5, 4, 1)]
        want += [f"bookkeeping[bs={bs}]", key("draft_attention", bs=bs, ctx=32)]
    assert [n for n in names if n.startswith(("attention[", "bookkeeping[", "draft_attention["))] == want


def test_measure_runs_every_piece_records_errors_and_goes_on():
    torch = pytest.importorskip("torch")
    cfg = km.RoundConfig(**TINY)
    m = kr.measure(cfg, [1, 2], [32], 60, device="cpu", timer=lambda fns: ([f() for f in fns], (1.0, "stub"))[1],
                   log=lambda s: None)
    assert m["device"] == "cpu" and not m["skipped"]
    need = km.required_keys([1, 2], [32], cfg)
    linear = [k for k in need if k.split("[")[0] in km.VERIFY_PIECES + km.DRAFT_PIECES + ("moe", "draft_attention")]
    assert all(m["times"].get(k) == 1.0 for k in linear), [k for k in linear if k not in m["times"]]
    # the MLA kernel and round_parts need CUDA: their failures are recorded, one per piece
    assert any(k.startswith("attention[") for k in m["errors"]) and "bookkeeping[bs=2]" in m["errors"]
    assert "FALLBACK" in m["moe_path"] and any("NOT Marlin" in n for n in m["notes"]) and torch


def test_measure_stops_at_the_deadline_inside_a_piece():
    cfg = km.RoundConfig(**TINY)

    def slow_timer(fns):
        time.sleep(5)
        return 1.0, "stub"

    t0 = time.monotonic()
    m = kr.measure(cfg, [1], [32], 0.3, device="cpu", timer=slow_timer, log=lambda s: None)
    assert time.monotonic() - t0 < 3
    assert m["skipped"] and m["skipped"][0] == key("qkv_a", T=8) and not m["times"]
    kr.report(m, cfg, [1], [32], out=(out := io.StringIO()))
    assert "deadline or SIGTERM): " + key("qkv_a", T=8) in out.getvalue()
