"""CPU tests of benchmarks.kimi_box, the device profiles of the Kimi round model: the all-reduce table's
interpolation against hand-computed values, one piece of each kind priced for the RTX PRO 6000 box against an
independent computation from Kimi's shapes and the two boxes' figures, the RTX box's collectives dearer than the
H200's at every message size, the KV room, and ``kimi_round --box`` end to end on the saved H200 measurement
(``--from-json``, no GPU), with the plot's title."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import kimi_box as kb
from benchmarks import kimi_model as km
from benchmarks import plot_kimi_round
from sglang_kdtree.cli import bench

kr = bench.load_kimi_round()
SAVED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "kimi_round.json"
H200, RTX = kb.BOXES["h200"], kb.BOXES["rtx-pro-6000"]
CFG = km.RoundConfig()

# ---- the all-reduce table ----------------------------------------------------------------------------------


def test_table_interpolates_linearly_on_bytes_flat_below_and_on_the_last_slope_beyond():
    pts = ((100, 10.0, "a"), (300, 30.0, "b"), (700, 50.0, "c"))
    assert kb.table_us(pts, 200) == pytest.approx(20.0)
    assert kb.table_us(pts, 500) == pytest.approx(40.0)
    assert kb.table_us(pts, 300) == 30.0 and kb.table_us(pts, 100) == 10.0
    assert kb.table_us(pts, 1) == 10.0  # below the first point: its time (launch-bound)
    assert kb.table_us(pts, 1100) == pytest.approx(70.0)  # the last slope, 20 us per 400 B
    assert kb.table_us(((64, 7.0, "only"),), 1e9) == 7.0
    with pytest.raises(ValueError):
        kb.table_us((), 1)


def test_nccl_table_at_kimi_message_sizes_hand_computed():
    pts = kb.NCCL_PCIE_8
    # one token: 14,336 B, between 8 KiB (24.2 us) and 32 KiB (24.5 us), a quarter of the way
    assert kb.table_us(pts, 14_336) == pytest.approx(24.2 + 0.3 * 6_144 / 24_576)
    # 16 tokens: 229,376 B between 64 KiB (24.1 us) and 256 KiB (39.0 us)
    assert kb.table_us(pts, 16 * 14_336) == pytest.approx(24.1 + 14.9 * 163_840 / 196_608)
    # 32 MiB at 22.2 GB/s bus bandwidth: 1.75 x 33,554,432 B / 22.2e9 B/s
    t32 = 1.75 * 33_554_432 / 22.2e9 * 1e6
    assert pts[-1][1] == pytest.approx(t32) and pytest.approx(2645.06, abs=0.01) == t32
    # 1,024 tokens (14.7 MB) between 512 KiB (60 us) and 32 MiB
    nbytes = 1024 * 14_336
    assert kb.table_us(pts, nbytes) == pytest.approx(60 + (t32 - 60) * (nbytes - 524_288) / (33_554_432 - 524_288))
    assert all(src for _, _, src in pts) and all(src for _, _, src in kb.IPC_PCIE_8)


def test_the_rtx_box_makes_every_collective_dearer_than_the_h200_box():
    rtx, h200 = RTX.net, H200.net
    for tokens in (1, 8, 16, 64, 128, 512, 1024, 4096):
        nbytes = tokens * 14_336
        assert rtx.collective_us(nbytes, 8) > h200.collective_us(nbytes, 8), tokens
        assert rtx.collective_us(tokens * 163_840 * 2, 8, gather=True) > \
            h200.collective_us(tokens * 163_840 * 2, 8, gather=True), tokens
    # an all-gather whose result is S bytes costs the all-reduce of S / 2; nothing on one GPU
    assert rtx.collective_us(2_000_000, 8, gather=True) == kb.table_us(kb.NCCL_PCIE_8, 1_000_000)
    assert rtx.collective_us(2_000_000, 1) == 0.0
    # in the assembled verify forward: 123 all-reduces of T x 14,336 B and one logits all-gather
    cfg_rtx = km.RoundConfig(net=rtx)
    f_rtx = km.verify_forward({}, 1, 16, 4096, cfg_rtx)["allreduce"]
    assert f_rtx == pytest.approx(123 * kb.table_us(kb.NCCL_PCIE_8, 16 * 14_336)
                                  + kb.table_us(kb.NCCL_PCIE_8, 16 * 163_840))
    assert f_rtx > km.verify_forward({}, 1, 16, 4096, CFG)["allreduce"]


# ---- pricing a piece ------------------------------------------------------------------------------------------


def _roof_us(nbytes, flops, gbps, tflops):
    return max(nbytes / (gbps * 1e9), flops / (tflops * 1e12)) * 1e6


def test_a_memory_bound_piece_by_hand():
    """lm_head at one token: x[1, 7168] @ w[7168, 20480] bf16: 2 (7168 x 20480 + 7168 + 20480) B, 2 x 7168 x
    20480 FLOPs (0.99 FLOP/B: memory-bound on both cards)."""
    nbytes, flops = 2 * (7168 * 20480 + 7168 + 20480), 2 * 7168 * 20480
    assert kb.piece_work("lm_head", {"T": 1}, CFG.model, CFG.drafter) == (nbytes, flops)
    h200, rtx = nbytes / 4800e9 * 1e6, nbytes / 1792e9 * 1e6  # 61.18 us and 163.87 us
    t = 80.71
    assert kb.price_piece("lm_head[T=1]", t, CFG, H200, RTX, "excess") == pytest.approx(t + rtx - h200)
    assert kb.price_piece("lm_head[T=1]", t, CFG, H200, RTX, "ratio") == pytest.approx(t * 4800 / 1792)


def test_a_compute_bound_piece_by_hand():
    """The routed MoE at 4,096 tokens: every one of the 384 experts is touched; its FLOPs, 2 x 4096 x 8 x 3 x 7168
    x 256, bind on both cards, so the ratio rule scales by the measured bf16 ratio 784 / 417."""
    flops = 2 * 4096 * 8 * 3 * 7168 * 256
    expert = 7168 * 512 // 2 + 7168 // 32 * 512 * 2 + 256 * 7168 // 2 + 256 // 32 * 7168 * 2  # INT4 + bf16 scales
    nbytes = 384 * (1 - (1 - 8 / 384) ** 4096) * expert + 2 * 2 * 4096 * 7168
    got_bytes, got_flops = kb.piece_work("moe", {"T": 4096}, CFG.model, CFG.drafter)
    assert (got_bytes, got_flops) == (pytest.approx(nbytes), flops)
    assert flops / 784e12 > nbytes / 4800e9 and flops / 417e12 > nbytes / 1792e9
    t = 2665.78
    assert kb.price_piece("moe[T=4096]", t, CFG, H200, RTX, "ratio") == pytest.approx(t * 784 / 417)
    assert kb.price_piece("moe[T=4096]", t, CFG, H200, RTX, "excess") == \
        pytest.approx(t + flops / 417e6 - flops / 784e6)


def test_a_piece_between_the_ridges_by_hand():
    """Tree-verify attention, 1 request x 16 rows over 4,096 + 16 keys: 228 FLOP/B, compute-bound on the H200
    (ridge 163) and memory-bound on the RTX box (ridge 233)."""
    keys = 4096 + 16
    nbytes = 2 * (keys * 576 + 16 * 8 * (576 + 512))
    flops = 2 * 8 * 16 * keys * (576 + 512)
    h200, rtx = _roof_us(nbytes, flops, 4800, 784), _roof_us(nbytes, flops, 1792, 417)
    assert h200 == pytest.approx(flops / 784e6) and rtx == pytest.approx(nbytes / 1792e3)
    k = km.key("attention", bs=1, width=16, ctx=4096)
    assert kb.price_piece(k, 24.21, CFG, H200, RTX, "ratio") == pytest.approx(24.21 * rtx / h200)
    assert 784 / 417 < rtx / h200 < 4800 / 1792
    assert kb.price_piece(k, 24.21, CFG, H200, RTX, "excess") == pytest.approx(24.21 + rtx - h200)


def test_bookkeeping_scales_by_the_bandwidth_ratio_and_every_key_parses():
    for rule in kb.RULES:
        assert kb.price_piece("tree[bs=8]", 48.0, CFG, H200, RTX, rule) == pytest.approx(48.0 * 4800 / 1792)
    assert kb.parse_key(km.key("attention", bs=8, width=16, ctx=4096)) == \
        ("attention", {"bs": 8, "ctx": 4096, "width": 16})
    with pytest.raises(ValueError):
        kb.price_piece("moe[T=8]", 1.0, CFG, H200, RTX, "sideways")
    times = json.loads(SAVED.read_text())["measured"]["times"]
    priced, ratios = kb.price_times(times, CFG, H200, RTX)
    assert priced.keys() == times.keys()
    # every piece costs at least the compute ratio and at most the bandwidth ratio under "ratio"; "excess" keeps
    # the H200 time and adds a non-negative repricing
    _, by_ratio = kb.price_times(times, CFG, H200, RTX, "ratio")
    assert all(784 / 417 - 1e-9 <= r <= 4800 / 1792 + 1e-9 for r in by_ratio.values())
    assert all(priced[k] >= times[k] and priced[k] <= times[k] * by_ratio[k] + 1e-9 for k in times)
    assert kb.ratio_ranges(ratios)["tree"] == [round(4800 / 1792, 3)] * 2


def test_kv_room_and_fit_hand_computed():
    assert kb.kv_gb(1, 4096, CFG.model) == pytest.approx(4096 * 576 * 2 * 61 / 1e9)
    low, high = kb.kv_room_gb(RTX)
    assert low == pytest.approx(0.85 * 96 - 74) and high == pytest.approx(0.85 * 96 * 2 ** 30 / 1e9 - 74, abs=0.01)
    fit = kb.kv_fit([1, 32, 64], [4096], CFG.model, RTX)["cells"]
    assert [fit[f"4096,{bs}"]["fits"] for bs in (1, 32, 64)] == ["yes", "marginal", "no"]


# ---- kimi_round --box end to end ----------------------------------------------------------------------------

PAIR = ["--tau-curve", "15=6.0283", "31=6.5618", "63=6.9876", "127=7.349", "255=7.7117", "--accept-dflash", "5.0557"]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(kr, "gpu_reason", lambda: "torch sees no CUDA device")
    monkeypatch.setattr(kr, "measure", lambda *a, **k: pytest.fail("must not measure"))


def test_box_cli_prices_the_saved_h200_run(no_gpu, capsys, tmp_path):
    out_json = tmp_path / "rtx.json"
    assert kr.main(["--from-json", str(SAVED), "--box", "rtx-pro-6000", *PAIR, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ESTIMATE") and "device: none: ESTIMATE" in out and "beside the published" in out
    saved, got = json.loads(SAVED.read_text()), json.loads(out_json.read_text())
    est = got["estimate"]
    assert est["estimate"] is True and "ESTIMATE" in est["label"] and est["box"] == "rtx-pro-6000"
    assert est["rule"] == kb.DEFAULT_RULE and est["reference_device"] == saved["measured"]["device"]
    assert est["date"] and est["assumptions"][0].startswith("ESTIMATE") and len(est["assumptions"]) >= 8
    # the H200 measurement is kept as measured; the priced pieces are the estimate's
    t = saved["measured"]["times"]["lm_head[T=1]"]
    assert got["measured"]["times"] == saved["measured"]["times"]
    assert est["priced_times"]["lm_head[T=1]"] == pytest.approx(t + (2 * (7168 * 20480 + 7168 + 20480))
                                                                * (1 / 1792e3 - 1 / 4800e3))
    assert got["config"]["net"]["points"][0][:2] == [1024, 24.1]
    # the rows: AR at batch 1 is the priced verify forward plus the table's collectives
    by = {(r["mode"], r["bs"], r["ctx"]): r for r in got["rows"]}
    ar = by[("AR", 1, 4096)]
    assert ar["allreduce"] == pytest.approx(123 * kb.table_us(kb.NCCL_PCIE_8, 14_336)
                                            + kb.table_us(kb.NCCL_PCIE_8, 163_840))
    assert ar["tok_s"] == pytest.approx(1e6 / ar["round"])
    h200 = {(r["mode"], r["bs"], r["ctx"]): r for r in saved["rows"]}
    assert all(by[k]["round"] > h200[k]["round"] for k in by if k in h200)
    # beside the published: the forward of one token against the vLLM sweep's 10.8 ms
    (one,) = [f for f in est["published"]["forward"] if f["tokens"] == 1]
    assert one["model_ms"] == pytest.approx(ar["verify"] / 1e3) and one["model_over_published"] == \
        pytest.approx(ar["verify"] / 1e3 / 10.8, abs=1e-3)
    assert {c["bs"] for c in got["summary"]} == {1, 8, 32, 64} and est["kv"]["cells"]["16384,64"]["fits"] == "no"


def test_box_cli_refusals(no_gpu, capsys, tmp_path):
    with pytest.raises(SystemExit):
        kr.main(["--from-json", str(SAVED), "--price-rule", "ratio"])
    assert "--price-rule" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kr.main(["--from-json", str(SAVED), "--box", "rtx-pro-6000", "--nvlink-gbps", "100"])
    assert "drop --nvlink-gbps" in capsys.readouterr().err
    other = tmp_path / "h100.json"
    other.write_text(json.dumps({"measured": {"times": {"moe[T=1]": 40.0}, "device": "NVIDIA H100"}}))
    assert kr.main(["--from-json", str(other), "--box", "rtx-pro-6000", "--batches", "1"]) == 2
    assert "measured on an H200" in capsys.readouterr().err


def test_default_box_is_the_measured_h200_run(no_gpu, capsys, tmp_path):
    out_json = tmp_path / "h200.json"
    assert kr.main(["--from-json", str(SAVED), "--json", str(out_json)]) == 0
    got, saved = json.loads(out_json.read_text()), json.loads(SAVED.read_text())
    assert "estimate" not in got and "ESTIMATE" not in capsys.readouterr().out
    assert [r["tok_s"] for r in got["rows"]] == pytest.approx([r["tok_s"] for r in saved["rows"]])


def test_estimate_plot_title_and_png(no_gpu, capsys, tmp_path):
    out_json = tmp_path / "rtx.json"
    assert kr.main(["--from-json", str(SAVED), "--box", "rtx-pro-6000", "--json", str(out_json)]) == 0
    payload = json.loads(out_json.read_text())
    title = plot_kimi_round.title(payload)
    assert "ESTIMATE" in title and RTX.label in title and "DDTree paper's budget sweep" in title
    assert payload["estimate"]["date"] in title and "DFLASH 5.19" in title
    assert "pair" in plot_kimi_round.title(payload, "testbed pair")
    assert plot_kimi_round.kv_notes(payload)[(64, 16384)].endswith("does not fit")
    pytest.importorskip("matplotlib")
    png = tmp_path / "rtx.png"
    assert plot_kimi_round.main([str(out_json), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
