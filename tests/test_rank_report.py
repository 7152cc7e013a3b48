"""CPU tests of what the Kimi rank bench concludes (``benchmarks/rank_report.py``) and of the kernel split of a
profiled decode step (``benchmarks/kernel_split.py``), on hand-made reports and traces whose answers are worked out
here by hand."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import kernel_split, rank_report

STATED = {"source": "curve.json", "by_width": {"16": 6.0, "32": 7.0, "64": 8.0}}


def _width_row(rounds, wall_ms, device_ms=None, draft=1.0, tree=0.1, verify=None, accept=0.2):
    device_ms = wall_ms if device_ms is None else device_ms
    verify = device_ms - draft - tree - accept if verify is None else verify
    return {"rounds": rounds, "draft": draft, "tree": tree, "verify": verify, "accept_commit": accept,
            "device_ms": device_ms, "wall_ms": wall_ms, "predicted": 1.0, "realised": 1.0}


def _report(auto_by_width, cycle=None):
    cycle = cycle or {"16": _width_row(40, 10.0), "32": _width_row(40, 12.0), "64": _width_row(40, 20.0)}
    return {"stated_tau": STATED, "servers": {
        "kdtree-cycle-log": {"by_width": {"8": cycle}},
        "kdtree-auto-log": {"by_width": {"8": auto_by_width}},
        "kdtree-31-overlap": {"table": {"8": {"round": {"host_ms": 14.0}}}},
    }}


def test_the_automatic_width_against_the_best_fixed_one():
    # fixed: 6/10 = 0.600, 7/12 = 0.583, 8/20 = 0.400 tokens per ms: width 16 is best (600 tok/s)
    good = rank_report.served_rates(_report({"16": _width_row(118, 10.0), "32": _width_row(2, 12.0)}))["8"]
    assert good["fixed"] == pytest.approx({16: 600.0, 32: 7000 / 12, 64: 400.0})
    assert good["best"] == {"width": 16, "tok_s": pytest.approx(600.0)}
    assert good["pinned"]["kdtree-31-overlap"] == pytest.approx(7000 / 14)
    auto = good["auto"]["kdtree-auto-log"]
    want = (118 * 6 + 2 * 7) / (118 * 10 + 2 * 12) * 1e3  # every round counted, the exploring ones too
    assert auto["tok_s"] == pytest.approx(want) and auto["chose"] == {16: 118, 32: 2}
    assert auto["ratio"] == pytest.approx(want / 600) and auto["pass"]
    # a chooser that settled on width 64: 400 / 600, below the 95 % floor
    bad = rank_report.served_rates(_report({"64": _width_row(100, 20.0)}))["8"]["auto"]["kdtree-auto-log"]
    assert bad["ratio"] == pytest.approx(2 / 3) and not bad["pass"]
    assert rank_report.served_rates({"servers": {}}) == {}  # no stated curve: no tokens per second


def test_ties_between_fixed_widths_go_to_the_smaller():
    tie = {"16": _width_row(1, 6.0), "32": _width_row(1, 7.0), "64": _width_row(1, 8.0)}  # 1 token per ms each
    assert rank_report.served_rates(_report({"16": _width_row(1, 6.0)}, cycle=tie))["8"]["best"]["width"] == 16


def test_overlap_ratio_repeat_by_repeat():
    report = {"servers": {
        "kdtree-auto-overlap": {"table": {"1": {"decode_tok_s_runs": [110.0, 105.0, 120.0]},
                                          "32": {"decode_tok_s_runs": [20.0, 21.0, 19.0]}}},
        "kdtree-auto": {"table": {"1": {"decode_tok_s_runs": [100.0, 100.0, 100.0]},
                                  "32": {"decode_tok_s_runs": [20.0, 20.0, 20.0]}}},
        "plain": {"table": {"1": {"decode_tok_s_runs": [1.0]}}},
    }}
    out = rank_report.overlap_ratios(report)
    assert out["1"]["runs"] == [1.1, 1.05, 1.2] and out["1"]["median"] == pytest.approx(1.1)
    assert (out["1"]["min"], out["1"]["max"]) == (pytest.approx(1.05), pytest.approx(1.2))
    assert out["32"]["median"] == pytest.approx(1.0) and out["32"]["pair"] == ["kdtree-auto-overlap", "kdtree-auto"]
    text = "\n".join(rank_report.analysis_lines(report))
    assert "| 1 | kdtree-auto-overlap / kdtree-auto | 1.100 | 1.050 | 1.200 | 1.100, 1.050, 1.200 |" in text


def test_model_check_piece_by_piece():
    model = {"8": {"AR": {"round": 9.0, "attention": 1.0, "moe": 3.0, "other": 5.0},
                   "KDTREE-15": {"draft": 1.0, "tree": 0.05, "accept_commit": 0.05, "verify": 20.0, "round": 21.1,
                                 "attention": 1.5, "moe": 14.0}}}
    report = {"model": {"cells": model}, "servers": {
        "plain": {"table": {"8": {"round": {"host_ms": 9.5}}},
                  "profile": {"bs": 8, "split": {"ms": {"mla": 0.0, "attention": 1.4, "moe": 3.1, "gemm": 4.0,
                                                        "other": 0.9, "kdtree": 0.0}}}},
        "kdtree-cycle-log": {"by_width": {"8": {"16": _width_row(50, 27.0, device_ms=26.0, draft=5.0, tree=0.1,
                                                                  verify=20.6, accept=0.3)}}},
    }}
    rows = {(r["server"], r["piece"]): r for r in rank_report.model_check(report)}
    plain = rows[("plain", "round")]
    assert plain["ratio"] == pytest.approx(9.5 / 9.0, abs=1e-3) and not plain["off"]
    assert rows[("plain", "attention")]["ratio"] == pytest.approx(1.4, abs=1e-3) and rows[("plain", "attention")]["off"]
    assert rows[("plain", "dense + other")]["served"] == pytest.approx(4.9)
    draft = rows[("kdtree-cycle-log", "draft")]
    assert (draft["served"], draft["model"], draft["ratio"], draft["off"]) == (5.0, 1.0, 5.0, True)
    assert rows[("kdtree-cycle-log", "tree + accept")]["ratio"] == pytest.approx(4.0)
    verify = rows[("kdtree-cycle-log", "verify")]
    assert verify["ratio"] == pytest.approx(1.03) and not verify["off"]
    assert rows[("kdtree-cycle-log", "host")]["served"] == pytest.approx(1.0)
    assert rows[("kdtree-cycle-log", "round")]["ratio"] == pytest.approx(27.0 / 21.1, abs=1e-3)


@pytest.mark.parametrize("name, want", [
    ("void Marlin<...>(...)", "moe"), ("moe_align_i32", "moe"), ("moe_topk_sum_bf16_i32", "moe"),
    ("silu_and_mul_bf16", "moe"), ("mla_tree_verify_wgmma_16", "mla"), ("mla_tree_verify_merge", "mla"),
    ("_fwd_grouped_kernel_stage1", "attention"), ("hist_pass_bf16_v8", "kdtree"), ("topk_merge_partials", "kdtree"),
    ("build_trees_kernel", "kdtree"), ("accept_greedy_cluster", "kdtree"), ("compact_kv_16", "kdtree"),
    ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTT", "gemm"), ("sm90_xmma_gemm_bf16bf16", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4>", "other"), ("triton_rms_norm", "other"),
])
def test_kernel_classes(name, want):
    assert kernel_split.classify(name) == want


def test_kernel_split_of_a_trace(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in (
        ("Marlin", 0, 300), ("mla_tree_verify_body", 300, 100), ("nvjet_x", 400, 200), ("rms", 600, 50),
        ("Marlin", 1000, 300), ("mla_tree_verify_body", 1300, 100), ("nvjet_x", 1400, 200), ("rms", 1600, 50))]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5000})
    path = tmp_path / "x-DECODE.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = kernel_split.split(kernel_split.read_trace(path), steps=2)
    assert out["ms"] == {"kdtree": 0.0, "mla": 0.1, "moe": 0.3, "attention": 0.0, "gemm": 0.2, "other": 0.05}
    assert out["busy_ms"] == pytest.approx(0.65) and out["span_ms"] == pytest.approx(0.825)
    assert out["launches"]["moe"] == 1.0 and out["top"][0] == {"name": "Marlin", "class": "moe", "ms_per_step": 0.3}
    with pytest.raises(ValueError, match="steps"):
        kernel_split.split([], 0)


def test_greedy_tokens_against_plain_request_by_request():
    plain = {"table": {"1": {"output_ids": [[5, 6, 7]]}, "8": {"output_ids": [[1, 2, 3], [4, 5, 6]]}}}
    report = {"servers": {
        "plain": plain,
        "kdtree-cycle-log": {"table": {"1": {"output_ids": [[5, 6, 7]]},
                                       "8": {"output_ids": [[1, 2, 3], [4, 9, 6]]}}},  # request 2 differs at 1
        "dflash": {"table": {"8": {"output_ids": [[1, 2, 3], [4, 5, 6]]}, "32": {"output_ids": [[0]]}}},
    }}
    rows = rank_report.greedy_identity(report)
    assert rows == [
        {"server": "dflash", "bs": 8, "requests": 2, "identical": 2, "tokens": 6, "first_diff": None},
        {"server": "kdtree-cycle-log", "bs": 1, "requests": 1, "identical": 1, "tokens": 3, "first_diff": None},
        {"server": "kdtree-cycle-log", "bs": 8, "requests": 2, "identical": 1, "tokens": 6, "first_diff": 1},
    ]  # batch 32: plain kept no tokens there, nothing to compare
    # plain from another call of the same rank: this report's own plain is compared too
    other = {"servers": {"plain": {"table": {"1": {"output_ids": [[5, 6]]}}}}}
    shorter = {r["server"]: r for r in rank_report.greedy_identity(report, reference=other) if r["bs"] == 1}
    assert shorter["plain"]["first_diff"] == 2 and shorter["plain"]["identical"] == 0
    text = "\n".join(rank_report.analysis_lines(report))
    assert "| kdtree-cycle-log | 8 | 2 | 1 | 6 | 1 |" in text and "| dflash | 8 | 2 | 2 | 6 | - |" in text
    with pytest.raises(ValueError, match="1 requests kept against plain's 2"):
        rank_report.greedy_identity({"servers": {"plain": plain, "x": {"table": {"8": {"output_ids": [[1]]}}}}})


def test_the_device_profile_verdict_and_each_servers_limits_line():
    line = "sm_120 (profile sm_120 on device 0 (NVIDIA H100)): ...; largest shared memory asked: 99,584 B"
    report = {"device_profile": "sm_120", "profile_problems": [],
              "servers": {"kdtree-cycle-log": {"launch_limits": {"line": line}}, "plain": {"launch_limits": None}}}
    text = "\n".join(rank_report.analysis_lines(report))
    assert "KDTREE_DEVICE_PROFILE=sm_120: every KDTREE server's launches within its limits" in text
    assert f"kdtree-cycle-log: {line}" in text and "plain:" not in text
    bad = dict(report, profile_problems=["kdtree-auto: no 'KDTREE launch limits' line in its log"])
    assert "sm_120: kdtree-auto: no 'KDTREE launch limits' line" in "\n".join(rank_report.analysis_lines(bad))
    assert "not checked" in "\n".join(rank_report.analysis_lines(dict(report, profile_problems=None)))
    assert "KDTREE_DEVICE_PROFILE" not in "\n".join(rank_report.analysis_lines({"servers": {}}))
