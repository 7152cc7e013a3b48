"""CPU tests of benchmarks/kimi_round.py: the round arithmetic on hand-computed inputs (all-reduce model, the
assembled split, tokens/s, bookkeeping share, the moonshot verdict, missing pieces), the CLI plumbing through
``python -m sglang_kdtree bench --kimi-round`` with the measurement stubbed, a CPU-only machine's message, and
the measurement loop itself on a tiny model with a stub timer (errors recorded, deadline honoured)."""

from __future__ import annotations

import io
import json
import math
import random
import time

import pytest

from sglang_kdtree import bench

kr = bench.load_kimi_round()
key = kr.key


def cfg_of(**kw):
    net = kr.Network(**kw.pop("net", {}))
    return kr.RoundConfig(net=net, **kw)


FREE_NET = {"gbps": math.inf, "latency_us": 0.0, "gather_logits": False}


def uniform_times(cfg, batches, contexts, value=0.0, **overrides):
    """Every key the rows read set to ``value``; ``overrides`` by piece name (any dims)."""
    times = {}
    for k in kr.required_keys(batches, contexts, cfg):
        name = k.split("[")[0]
        times[k] = overrides.get(name, value)
    return times


# ---- all-reduce / all-gather model --------------------------------------------------------------------------


def test_allreduce_formula():
    # 2 (n-1)/n x bytes / bw + latency = 1.75 x 4e6 / 350e9 s = 20 us, + 10 us
    assert kr.allreduce_us(4e6, 8, 350, 10) == pytest.approx(30.0)
    assert kr.allreduce_us(4e6, 2, 350, 0) == pytest.approx(4e6 / 350e9 * 1e6)
    assert kr.allreduce_us(4e6, 1, 350, 10) == 0.0  # no collective on one GPU
    # all-gather: (n-1)/n x total / bw + latency = 0.875 x 8e6 / 350e9 s = 20 us, + 10 us
    assert kr.allgather_us(8e6, 8, 350, 10) == pytest.approx(30.0)
    assert kr.allgather_us(8e6, 1, 350, 10) == 0.0


def test_collective_counts_per_forward():
    """123 all-reduces per target forward (2 per layer + embedding) + 1 logits all-gather; the drafter's 11 + 1."""
    cfg = cfg_of(net={"gbps": math.inf, "latency_us": 1.0, "gather_logits": True})
    times = uniform_times(cfg, [32], [4096])
    assert kr.verify_forward(times, 32, 65, 4096, cfg)["allreduce"] == pytest.approx(2 * 61 + 1 + 1)
    d = kr.draft_forward(times, 32, 4096, cfg)
    assert d["allreduce"] == pytest.approx(2 * 5 + 1 + 1) and d["total"] == pytest.approx(12)
    nogather = cfg_of(net={"gbps": math.inf, "latency_us": 1.0, "gather_logits": False})
    assert kr.verify_forward(times, 32, 65, 4096, nogather)["allreduce"] == pytest.approx(123)


def test_allreduce_bytes_are_T_x_hidden_bf16():
    cfg = cfg_of(net={"gbps": 450.0, "latency_us": 10.0, "gather_logits": True})
    times = uniform_times(cfg, [32], [4096])
    T = 32 * 65
    want = 123 * (1.75 * T * 7168 * 2 / 450e9 * 1e6 + 10) + (0.875 * T * 163840 * 2 / 450e9 * 1e6 + 10)
    assert kr.verify_forward(times, 32, 65, 4096, cfg)["allreduce"] == pytest.approx(want)


# ---- the assembled forward passes ---------------------------------------------------------------------------


def test_verify_forward_hand_computed():
    cfg = cfg_of(net=FREE_NET)
    vals = {"qkv_a": 1, "q_b": 2, "kv_absorb": 3, "o_absorb": 4, "o_proj": 5, "rms_hidden": 6, "rms_q": 7,
            "rms_kv": 8, "router": 9, "shared": 10, "dense_mlp": 11, "lm_head": 12, "moe": 13, "attention": 14}
    times = uniform_times(cfg, [1], [4096], **vals)
    v = kr.verify_forward(times, 1, 65, 4096, cfg)
    # per layer: 1+2+3+4+5 + 2x6 + 7 + 8 = 42; x61 + 60 x (router 9 + shared 10) + dense 11 + lm_head 12
    assert v["other"] == pytest.approx(61 * 42 + 60 * 19 + 11 + 12) == 3725
    assert v["attention"] == 61 * 14 and v["moe"] == 60 * 13 and v["allreduce"] == 0
    assert v["total"] == pytest.approx(3725 + 854 + 780) and v["missing"] == []


def test_draft_forward_hand_computed():
    cfg = cfg_of(net=FREE_NET)
    times = uniform_times(cfg, [2], [4096], draft_qkv=1, draft_o=2, dense_mlp=3, rms_hidden=4, draft_attention=5)
    times[key("lm_head", T=2 * 15)] = 100.0  # the drafter's head: batch x 15 rows
    d = kr.draft_forward(times, 2, 4096, cfg)
    assert d["head"] == 100 and d["total"] == pytest.approx(5 * (1 + 2 + 3 + 2 * 4 + 5) + 100)


def test_round_rows_split_tokens_and_share():
    cfg = cfg_of(net=FREE_NET, accept_dflash=5.0, accept_kdtree=7.0)
    times = uniform_times(cfg, [32], [4096])
    times[key("attention", bs=32, width=65, ctx=4096)] = 100.0  # KDTREE verify: 61 x 100
    times[key("attention", bs=32, width=16, ctx=4096)] = 50.0  # DFLASH verify: 61 x 50
    times[key("attention", bs=32, width=1, ctx=4096)] = 1000 / 61  # AR verify: 1000
    times[key("draft_attention", bs=32, ctx=4096)] = 100.0  # draft: 5 x 100
    times[key("tree", bs=32)], times[key("accept_commit", bs=32)] = 150.0, 250.0
    rows = {r["mode"]: r for r in kr.assemble(times, cfg, [32], [4096])}
    kd = rows["KDTREE"]
    assert (kd["draft"], kd["tree"], kd["attention"], kd["accept_commit"]) == (500, 150, 6100, 250)
    assert kd["round"] == pytest.approx(7000) and kd["width"] == 65
    assert kd["tok_s"] == pytest.approx(7.0 / 7000e-6) == 1000
    assert kd["tok_s_batch"] == pytest.approx(32 * 1000)
    assert kd["share"] == pytest.approx(400 / 7000)
    df = rows["DFLASH"]
    assert df["round"] == pytest.approx(500 + 61 * 50) and df["tree"] == df["accept_commit"] == 0
    assert df["tok_s"] == pytest.approx(5.0 / (3550e-6)) and df["share"] is None and df["width"] == 16
    ar = rows["AR"]
    assert ar["round"] == pytest.approx(1000) and ar["draft"] == 0 and ar["tokens"] == 1
    assert ar["tok_s"] == pytest.approx(1000)


@pytest.mark.parametrize("seed", range(20))
def test_kdtree_with_accept_one_never_beats_ar_at_the_same_verify_cost(seed):
    """Piece times independent of T (same verify cost for every width); KDTREE accepting 1 token per round with
    zero bookkeeping pays the draft on top, so it is never faster than AR."""
    rng = random.Random(seed)
    cfg = cfg_of(net={"gbps": rng.uniform(50, 900), "latency_us": rng.uniform(0, 20),
                      "gather_logits": rng.random() < 0.5},
                 accept_dflash=1.0, accept_kdtree=1.0)
    names = sorted({k.split("[")[0] for k in kr.required_keys([1, 32], [4096], cfg)})
    vals = {n: rng.uniform(0, 500) for n in names}
    vals["tree"] = vals["accept_commit"] = 0.0
    times = uniform_times(cfg, [1, 32], [4096], **vals)
    for bs in (1, 32):
        ar = kr.round_row(times, "AR", bs, 4096, cfg)
        kd = kr.round_row(times, "KDTREE", bs, 4096, cfg)
        assert kd["tok_s"] <= ar["tok_s"]


def test_free_draft_and_no_bookkeeping_ties_with_ar():
    cfg = cfg_of(net=FREE_NET, accept_kdtree=1.0)
    times = {k: 0.0 for k in kr.required_keys([1], [4096], cfg)}
    for w in (1, 65):
        times[key("attention", bs=1, width=w, ctx=4096)] = 10.0
        times[key("moe", T=w)] = 20.0
    ar, kd = kr.round_row(times, "AR", 1, 4096, cfg), kr.round_row(times, "KDTREE", 1, 4096, cfg)
    assert kd["round"] == pytest.approx(ar["round"]) and kd["tok_s"] == pytest.approx(ar["tok_s"])


# ---- missing pieces and the moonshot verdict --------------------------------------------------------------


def _kd_times(cfg, bk=(10.0, 10.0), attention=1000.0):
    times = uniform_times(cfg, [32], [4096])
    times[key("attention", bs=32, width=65, ctx=4096)] = attention / 61
    times[key("tree", bs=32)], times[key("accept_commit", bs=32)] = bk
    return times


def test_moonshot_holds_and_fails_exactly():
    cfg = cfg_of(net=FREE_NET)
    state, line = kr.moonshot_verdict(kr.assemble(_kd_times(cfg, (10, 10)), cfg, [32], [4096]))
    assert state == "holds" and "HOLDS" in line and "1.96 %" in line  # 20 / 1020
    state, line = kr.moonshot_verdict(kr.assemble(_kd_times(cfg, (20, 20)), cfg, [32], [4096]))
    assert state == "fails" and "FAILS" in line  # 40 / 1040 = 3.8 %


def test_missing_pieces_make_lower_bounds_and_the_verdict_honest():
    cfg = cfg_of(net=FREE_NET)
    times = _kd_times(cfg, (10, 10))
    del times[key("moe", T=32 * 65)]
    (kd,) = [r for r in kr.assemble(times, cfg, [32], [4096]) if r["mode"] == "KDTREE"]
    assert kd["missing"] == [key("moe", T=2080)] and kd["share"] == pytest.approx(20 / 1020)
    table = kr.format_table([kd])
    assert "1020*" in table and "<= 1.96 %" in table and "<= " + kr._f(kd["tok_s"]) in table
    # an upper bound below 3 % still proves the line; above it decides nothing
    assert kr.moonshot_verdict([kd])[0] == "holds"
    times = _kd_times(cfg, (20, 20))
    del times[key("moe", T=2080)]
    assert kr.moonshot_verdict(kr.assemble(times, cfg, [32], [4096]))[0] == "undetermined"
    # bookkeeping itself missing: no share at all
    times = _kd_times(cfg)
    del times[key("tree", bs=32)]
    rows = kr.assemble(times, cfg, [32], [4096])
    assert [r["share"] for r in rows if r["mode"] == "KDTREE"] == [None]
    assert kr.moonshot_verdict(rows)[0] == "undetermined"
    assert "n/a" in kr.format_table(rows)


def test_moonshot_needs_batch_32_and_budget_64():
    cfg = cfg_of(net=FREE_NET)
    rows = kr.assemble(uniform_times(cfg, [1], [4096]), cfg, [1], [4096])
    state, line = kr.moonshot_verdict(rows)
    assert state == "undetermined" and "not in --batches" in line
    assert kr.moonshot_verdict(rows, budget=128)[0] == "undetermined"


def test_empty_measurement_still_reports(capsys):
    cfg = cfg_of(accept_dflash=5, accept_kdtree=7)
    result = kr.report({"times": {}, "errors": {"setup": "boom"}}, cfg, [1, 32], [4096])
    out = capsys.readouterr().out
    assert "FAILED setup: boom" in out and result["moonshot"]["state"] == "undetermined"
    assert out.rstrip().splitlines()[-1].startswith("| 4096 | 32 | KDTREE |")


# ---- inputs -----------------------------------------------------------------------------------------------


def test_paper_defaults_are_the_table_means():
    assert kr.PAPER_ACCEPT_DFLASH == 5.19  # (5.58+5.18+5.16+5.13+8.02+7.19+6.32+3.61+3.52+2.22) / 10 = 5.193
    assert kr.PAPER_ACCEPT_KDTREE == 7.51  # (8.10+7.55+7.87+7.63+10.72+9.94+8.63+5.71+5.36+3.55) / 10 = 7.506
    args = kr.parser().parse_args([])
    assert (args.accept_dflash, args.accept_kdtree, args.batches, args.contexts, args.budget, args.deadline) == \
        (5.19, 7.51, [1, 32], [4096, 16384], 64, 150.0)
    assert (args.nvlink_gbps, args.allreduce_latency_us, args.draft_layers) == (450.0, 10.0, 5)


def test_kimi_shape():
    m = kr.KIMI
    assert (m.heads_gpu, m.moe_inter_gpu, m.shared_inter_gpu, m.dense_inter_gpu, m.vocab_gpu) == (8, 256, 256, 2304,
                                                                                                 20480)
    assert (m.layers, m.moe_layers, m.experts, m.top_k, m.hidden) == (61, 60, 384, 8, 7168)
    assert kr.RoundConfig(budget=64).widths == {"AR": 1, "DFLASH": 16, "KDTREE": 65}


def test_needed_tokens_and_required_keys():
    cfg = kr.RoundConfig()
    assert kr.needed_tokens([1, 32], cfg) == {"verify": [2080, 512, 65, 32, 16, 1], "draft": [512, 16],
                                              "head": [480, 15]}
    keys = kr.required_keys([1, 32], [4096, 16384], cfg)
    times = {k: 1.0 for k in keys}
    assert all(not r["missing"] for r in kr.assemble(times, cfg, [1, 32], [4096, 16384]))
    assert len(keys) == len(set(keys))


def test_bookkeeping_overrides():
    assert kr.parse_bookkeeping(["32=150,120", "5.5,6"]) == {32: (150.0, 120.0), None: (5.5, 6.0)}
    for bad in (["32=1"], ["x=1,2"], ["32=-1,2"], ["0=1,2"]):
        with pytest.raises(ValueError):
            kr.parse_bookkeeping(bad)
    times = {}
    assert kr.apply_bookkeeping(times, {32: (1.0, 2.0), None: (3.0, 4.0)}, [1, 32]) == [1, 32]
    assert times == {key("tree", bs=1): 3.0, key("accept_commit", bs=1): 4.0, key("tree", bs=32): 1.0,
                     key("accept_commit", bs=32): 2.0}


# ---- CLI plumbing -----------------------------------------------------------------------------------------


@pytest.fixture
def stubbed(monkeypatch):
    """kimi_round.main's GPU check passes and its measurement returns fixed piece times."""
    calls = []

    def fake_measure(cfg, batches, contexts, deadline_s, **kw):
        calls.append({"cfg": cfg, "batches": batches, "contexts": contexts, "deadline": deadline_s, **kw})
        times = {k: 2.0 for k in kr.required_keys(batches, contexts, cfg)}
        for bs in kw["skip_bookkeeping"]:
            del times[key("tree", bs=bs)], times[key("accept_commit", bs=bs)]
        return {"times": times, "errors": {}, "skipped": [], "notes": ["stub"], "modes": {}, "device": "stub GPU",
                "moe_path": "stub", "elapsed_s": 0.1, "deadline_s": deadline_s}

    monkeypatch.setattr(kr, "measure", fake_measure)
    monkeypatch.setattr(kr, "gpu_reason", lambda: None)
    return calls


def test_bench_flag_reaches_kimi_round_main(stubbed, capsys, tmp_path):
    out_json = tmp_path / "round.json"
    rc = bench.main(["--kimi-round", "--batches", "32", "--contexts", "4096", "--deadline", "77",
                     "--accept-kdtree", "8", "--json", str(out_json)])
    assert rc == 0
    (call,) = stubbed
    assert call["batches"] == [32] and call["contexts"] == [4096] and call["deadline"] == 77
    assert call["cfg"].accept_kdtree == 8 and call["cfg"].budget == 64 and call["skip_bookkeeping"] == []
    out = capsys.readouterr().out
    assert "moonshot line" in out and "device: stub GPU" in out
    assert out.rstrip().splitlines()[-1].startswith("| 4096 | 32 | KDTREE | 65 |")
    saved = json.loads(out_json.read_text())
    assert saved["moonshot"]["state"] in ("holds", "fails") and len(saved["rows"]) == 3


def test_bookkeeping_override_skips_its_measurement(stubbed, capsys):
    assert kr.main(["--batches", "1", "32", "--contexts", "4096", "--bookkeeping-us", "32=100,50"]) == 0
    assert stubbed[0]["skip_bookkeeping"] == [32]
    out = capsys.readouterr().out
    assert "bookkeeping from --bookkeeping-us at batch [32]" in out
    assert "missing pieces" not in out  # bs 1's came from the stub, bs 32's from the override


def test_from_json_reassembles_without_a_gpu(stubbed, monkeypatch, capsys, tmp_path):
    out_json = tmp_path / "round.json"
    assert kr.main(["--batches", "32", "--contexts", "4096", "--json", str(out_json)]) == 0
    first = capsys.readouterr().out.rstrip().splitlines()[-3:]
    monkeypatch.setattr(kr, "gpu_reason", lambda: "torch sees no CUDA device")
    monkeypatch.setattr(kr, "measure", lambda *a, **k: pytest.fail("must not measure"))
    assert kr.main(["--batches", "32", "--contexts", "4096", "--from-json", str(out_json)]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-3:] == first


def test_cpu_only_machine_gets_a_message_not_a_crash(monkeypatch, capsys):
    monkeypatch.setattr(kr, "gpu_reason", lambda: "torch sees no CUDA device")
    monkeypatch.setattr(kr, "measure", lambda *a, **k: pytest.fail("must not measure"))
    assert bench.main(["--kimi-round"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU (torch sees no CUDA device)" in err and "--from-json" in err


def test_kimi_round_help_through_bench(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--kimi-round", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "python -m sglang_kdtree bench --kimi-round" in text and "--bookkeeping-us" in text


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        kr.main(["--bookkeeping-us", "32=oops"])
    assert "--bookkeeping-us" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kr.main(["--nvlink-gbps", "0"])


# ---- the measurement loop on a tiny CPU model (stub timer) ----------------------------------------------------

TINY = dict(model=kr.ModelShape(layers=3, dense_layers=1, hidden=64, heads=8, q_lora=32, kv_lora=16, qk_nope=8,
                                qk_rope=8, v_head=8, experts=8, top_k=2, moe_inter=128, shared_inter=64,
                                dense_inter=128, vocab=256, tp=8),
            drafter=kr.DrafterShape(layers=2, heads=8, kv_heads=8, head_dim=16, block=4), budget=4)


def _stub_timer(fns):
    for f in fns:
        f()
    return 1.0, "stub"


def test_measure_runs_every_piece_records_errors_and_goes_on():
    torch = pytest.importorskip("torch")
    cfg = kr.RoundConfig(**TINY, accept_dflash=2, accept_kdtree=3)
    logs = []
    m = kr.measure(cfg, [1, 2], [32], 60, device="cpu", timer=_stub_timer, log=logs.append)
    assert m["device"] == "cpu" and not m["skipped"]
    need = kr.required_keys([1, 2], [32], cfg)
    linear = [k for k in need if k.split("[")[0] in kr.VERIFY_PIECES + kr.DRAFT_PIECES + ("moe", "draft_attention")]
    assert all(m["times"].get(k) == 1.0 for k in linear), [k for k in linear if k not in m["times"]]
    # the MLA kernel and round_parts need CUDA: their failures are recorded, one per piece
    assert any(k.startswith("attention[") for k in m["errors"]) and "bookkeeping[bs=2]" in m["errors"]
    assert "FALLBACK" in m["moe_path"] and any("NOT Marlin" in n for n in m["notes"])
    del torch


def test_measure_stops_at_the_deadline_inside_a_piece():
    cfg = kr.RoundConfig(**TINY)

    def slow_timer(fns):
        time.sleep(5)
        return 1.0, "stub"

    t0 = time.monotonic()
    m = kr.measure(cfg, [1], [32], 0.3, device="cpu", timer=slow_timer, log=lambda s: None)
    assert time.monotonic() - t0 < 3
    assert m["skipped"] and m["skipped"][0] == key("qkv_a", T=5) and not m["times"]
    out = io.StringIO()
    kr.report(m, cfg, [1], [32], out=out)
    assert "deadline or SIGTERM): " + key("qkv_a", T=5) in out.getvalue()
