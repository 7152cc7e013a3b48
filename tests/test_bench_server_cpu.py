"""CPU smoke test of ``benchmarks/bench_server.py``'s plumbing (the servers themselves need the H200): server
command lines per kind, the round-log split, the bookkeeping floor and the table."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load():
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    spec = importlib.util.spec_from_file_location("bench_server", REPO / "benchmarks" / "bench_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_kind_gets_its_own_algorithm_and_the_same_drafter(tmp_path):
    bench = _load()
    variant = types.SimpleNamespace(name="v", target=tmp_path / "t", drafter=tmp_path / "d", dtype="bfloat16", env={},
                                    tp=1)
    kd = bench._args_for("kdtree", variant, 1234, budget=64)
    assert kd[kd.index("--speculative-algorithm") + 1] == "kdtree"
    assert kd[kd.index("--speculative-num-draft-tokens") + 1] == "65"
    df = bench._args_for("dflash", variant, 1235, budget=64)
    assert df[df.index("--speculative-algorithm") + 1] == "DFLASH"
    assert df[df.index("--speculative-draft-model-path") + 1] == kd[kd.index("--speculative-draft-model-path") + 1]
    check = bench._args_for("kdtree-check", variant, 1237, budget=64)
    assert check[check.index("--speculative-algorithm") + 1] == "kdtree" and "--disable-cuda-graph" in check
    assert "--disable-cuda-graph" not in kd
    plain = bench._args_for("plain", variant, 1236, budget=64)
    assert "--speculative-algorithm" not in plain and "--disable-cuda-graph" not in plain


def test_baselines_run_at_sglang_defaults_and_kdtree_kinds_pin_or_choose_the_width(tmp_path, monkeypatch):
    bench = _load()
    variant = types.SimpleNamespace(name="v", target=tmp_path / "t", drafter=tmp_path / "d", dtype="bfloat16", env={},
                                    tp=1)
    for kind in ("plain", "dflash"):  # overlap scheduling on, as SGLang's users run them
        assert "--disable-overlap-schedule" not in bench._args_for(kind, variant, 1, budget=64)
        assert "--disable-overlap-schedule" in bench._args_for(kind, variant, 1, budget=64, baselines_overlap=False)
    for kind, width in (("kdtree-15", "16"), ("kdtree-63", "64"), ("kdtree-log", "65")):
        args = bench._args_for(kind, variant, 1, budget=64)
        assert args[args.index("--speculative-num-draft-tokens") + 1] == width
        assert "--disable-overlap-schedule" in args  # the plain KDTREE kinds are the non-overlap side of the A/B
    for kind, width in (("kdtree-63-overlap", "64"), ("kdtree-auto-overlap", None)):
        args = bench._args_for(kind, variant, 1, budget=64)
        assert "--disable-overlap-schedule" not in args and args[args.index("--speculative-algorithm") + 1] == "kdtree"
        assert (args[args.index("--speculative-num-draft-tokens") + 1] if width else
                "--speculative-num-draft-tokens" not in args) == (width or True)
    auto = bench._args_for("kdtree-auto", variant, 1, budget=64)
    assert "--speculative-num-draft-tokens" not in auto and auto[auto.index("--speculative-algorithm") + 1] == "kdtree"
    started = []
    monkeypatch.setattr(bench.cuda_servers, "CudaServer",
                        lambda name, args, log, env: started.append((name, args, env)) or types.SimpleNamespace())
    servers = bench.start(variant, ["kdtree-auto-log"], 64, tmp_path / "out", widths="16,32")
    assert servers["kdtree-auto-log"].round_log.name == "rounds-kdtree-auto.jsonl"
    (name, args, env), = started
    assert env["SGLANG_KDTREE_VERIFY_WIDTHS"] == "16,32" and env["KDTREE_ROUND_LOG"].endswith("kdtree-auto.jsonl")


def test_round_split_uses_only_rounds_of_the_batch_size(tmp_path):
    bench = _load()
    log = tmp_path / "rounds.jsonl"
    rows = [{"accept_lens": [3], "ms": {"draft": 1, "tree": 2, "verify": 3, "accept_commit": 4}},
            {"accept_lens": [3, 4], "ms": {"draft": 9, "tree": 9, "verify": 9, "accept_commit": 9}}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    server = types.SimpleNamespace(round_log=log)
    assert bench._log_len(server) == 2
    assert [r["ms"]["draft"] for r in bench._rounds(server, 0, 1)] == [1]
    assert bench._rounds(server, 1, 1) == []


def test_floor_and_table():
    bench = _load()
    # bs 32, L 15, V 163840 bf16 = 157 MB of draft logits at 4.19 TB/s
    assert abs(bench.bookkeeping_floor_ms(32, 15, 163840) - 32 * 15 * 163840 * 2 / 4.19e12 * 1e3) < 1e-12
    table = {"1": {"plain": {"tok_s_per_request": 100.0, "tok_s_total": 100.0, "accept_len": 1.0, "runs": 3},
                   "kdtree-log": {"tok_s_per_request": 300.0, "tok_s_total": 300.0, "accept_len": 4.5, "runs": 3,
                                  "split_ms": {"draft": 1.0, "tree": 0.1, "verify": 2.0, "accept_commit": 0.05,
                                               "bookkeeping": 0.15}}}}
    text = bench.format_table(table, 15, 163840)
    assert "| 1 | plain | 100.0 |" in text and "| 1 | kdtree-log | 300.0 | 300.0 | 4.50 | 1.000 | 0.100 |" in text


def test_compare_dumps_measures_same_input_rounds_and_skips_diverged_ones(tmp_path):
    import torch

    bench = _load()
    ids = torch.arange(6)
    logits = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(3))
    torch.save({"input_ids": ids, "positions": ids, "logits": logits, "graph": True}, tmp_path / "dump-fused.0.pt")
    shifted = logits.clone()
    shifted[0, 2, 5] += 0.25
    torch.save({"input_ids": ids, "positions": ids, "logits": shifted, "graph": True}, tmp_path / "dump-sglang.0.pt")
    torch.save({"input_ids": ids, "positions": ids, "logits": logits, "graph": True}, tmp_path / "dump-fused.1.pt")
    torch.save({"input_ids": ids + 1, "positions": ids, "logits": logits, "graph": True},
               tmp_path / "dump-sglang.1.pt")
    rows = bench.compare_dumps(tmp_path)
    assert len(rows) == 2
    assert rows[0]["same_inputs"] and abs(rows[0]["max_abs"] - 0.25) < 1e-6 and rows[0]["rows"] == 6
    # 0.25 is over 2^-6 of the largest |logit| (a few units here) for that one row only
    assert rows[0]["rows_over"] == (1 if 0.25 > bench.AB_REL_TOL * float(shifted.abs().max()) else 0) == 1
    assert abs(rows[0]["rel_to_max_logit"] - rows[0]["max_abs"] / float(shifted.abs().max())) < 1e-12
    assert rows[1] == {"round": 1, "same_inputs": False, "graph": (True, True)}


def test_compare_dumps_matches_nodes_by_token_path_when_the_order_differs(tmp_path):
    """Two servers' trees with the same nodes in another order (near ties) compare node for node by path."""
    import torch

    bench = _load()
    # tree A: root 7 -> children 3 (node 1), 5 (node 2); 3 -> 9 (node 3); tree B lists 5 before 3
    tok_a, par_a = torch.tensor([[7, 3, 5, 9]]), torch.tensor([[-1, 0, 0, 1]])
    tok_b, par_b = torch.tensor([[7, 5, 3, 9]]), torch.tensor([[-1, 0, 0, 2]])
    logits_a = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(5))
    logits_b = logits_a[:, [0, 2, 1, 3]].clone()
    logits_b[0, 3, 4] += 0.5  # node path (7, 3, 9): differs by 0.5
    pos = torch.tensor([10, 11, 11, 12])
    for name, tok, par, lg in (("fused", tok_a, par_a, logits_a), ("sglang", tok_b, par_b, logits_b)):
        torch.save({"input_ids": tok.view(-1), "positions": pos, "tokens": tok, "parents": par, "logits": lg,
                    "graph": True}, tmp_path / f"dump-{name}.0.pt")
    (row,) = bench.compare_dumps(tmp_path)
    assert row["same_inputs"] and row["rows"] == 4
    assert abs(row["max_abs"] - 0.5) < 1e-6 and row["rows_over"] == 1
    # a swapped-but-unmatched order (compared row by row) would have seen differences far above 0.5
    assert float((logits_a - logits_b).abs().max()) > 0.5


def test_round_parts_groups_kernel_records_per_replay():
    """``round_parts.py --trace``'s grouping of CUPTI kernel records (the profiling itself needs the H200)."""
    spec = importlib.util.spec_from_file_location("round_parts", REPO / "benchmarks" / "round_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    records = []
    for r, t0 in enumerate((0.0, 100.0, 200.0)):  # 3 replays: a, then b and c side by side (c starts 1 us into b)
        slow = 1.0 if r == 2 else 0.0
        records += [(t0, t0 + 10.0 + slow, "a"), (t0 + 10.5 + slow, t0 + 14.5 + slow, "b"),
                    (t0 + 11.5 + slow, t0 + 13.5 + slow, "c")]
    out = parts.group_kernel_records(list(reversed(records)), 3)
    assert [name for name, _, _ in out["kernels"]] == ["a", "b", "c"]
    assert [dur for _, dur, _ in out["kernels"]] == [10.0, 4.0, 2.0]
    assert [gap for _, _, gap in out["kernels"]] == [0.0, 0.5, -3.0]  # c overlaps b: a concurrent branch
    assert out["span"] == 14.5
    bad = parts.group_kernel_records(records[:-1], 3)  # a record missing: not split into replays
    assert "not grouped" in bad["kernels"][0][0] and bad["span"] != bad["span"]


def _round_parts_recording(monkeypatch, switch):
    """``benchmarks/round_parts.py`` loaded with its GPU work (``_parts``, which needs the H200) stood in for by a
    recorder of ``(bs, switch())`` per call that fails for batch 99; returns the module and the records."""
    spec = importlib.util.spec_from_file_location("round_parts", REPO / "benchmarks" / "round_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    seen = []

    def fake_parts(bs, *args):
        seen.append((bs, switch()))
        if bs == 99:
            raise RuntimeError("boom")
        return {"bs": bs}

    monkeypatch.setattr(parts, "_parts", fake_parts)
    return parts, seen


def test_round_parts_ab_runs_each_batch_fused_and_as_two_launches(monkeypatch):
    """``round_parts.py --ab``: each batch's parts once with the fused tree + verify launch and once with
    ``gpu.tree.FUSE_VERIFY`` off (the two launches), labelled, the switch restored even when a run fails."""
    pytest.importorskip("cupy")
    from sglang_kdtree.gpu import tree

    parts, seen = _round_parts_recording(monkeypatch, lambda: tree.FUSE_VERIFY)
    rows = [parts.parts(bs, 64, 15, 1000, 256, 3, 0.75, False, fused) for bs in (1, 8) for fused in (True, False)]
    assert seen == [(1, True), (1, False), (8, True), (8, False)] and tree.FUSE_VERIFY is True
    assert [r["variant"] for r in rows] == ["fused", "two launches"] * 2
    with pytest.raises(RuntimeError, match="boom"):
        parts.parts(99, 64, 15, 1000, 256, 3, 0.75, False, False)
    assert tree.FUSE_VERIFY is True


def test_round_parts_ab_pdl_runs_each_batch_with_and_without_dependent_launches(monkeypatch):
    """``round_parts.py --ab-pdl``: each batch's parts with ``gpu.runtime.PDL`` on (the worker's launches) and off,
    labelled, the switch restored even when a run fails; PDL turned off by the environment stays off."""
    pytest.importorskip("cupy")
    from sglang_kdtree.gpu import runtime

    parts, seen = _round_parts_recording(monkeypatch, lambda: runtime.PDL)
    monkeypatch.setattr(runtime, "PDL", True)
    rows = [parts.parts(bs, 64, 15, 1000, 256, 3, 0.75, False, True, pdl) for bs in (1, 8) for pdl in (True, False)]
    assert seen == [(1, True), (1, False), (8, True), (8, False)] and runtime.PDL is True
    assert [r["variant"] for r in rows] == ["fused", "fused, no PDL"] * 2
    with pytest.raises(RuntimeError, match="boom"):
        parts.parts(99, 64, 15, 1000, 256, 3, 0.75, False, True, False)
    assert runtime.PDL is True
    monkeypatch.setattr(runtime, "PDL", False)  # SGLANG_KDTREE_PDL=0
    seen.clear()
    parts.parts(1, 64, 15, 1000, 256, 3, 0.75, False, True, True)
    assert seen == [(1, False)] and runtime.PDL is False


def test_mla_check_reads_the_check_servers_last_record_and_judges_it(tmp_path):
    bench = _load()
    assert bench.mla_check(None) is None
    log = tmp_path / "rounds-kdtree-check.jsonl"
    server = types.SimpleNamespace(round_log=log)
    assert bench.mla_check(server) is None  # no log yet
    rows = [{"accept_lens": [3], "graph": False, "mla_check": {"calls": 3, "max_rel": 0.001, "max_abs": 0.01}},
            {"accept_lens": [3], "graph": True, "mla_check": {"calls": 6, "max_rel": 0.004, "max_abs": 0.03}},
            {"accept_lens": [3], "graph": True}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    check = bench.mla_check(server)
    assert check == {"calls": 6, "max_rel": 0.004, "max_abs": 0.03, "rounds": 3, "graph_rounds": 2}
    assert "6 routed layer calls over 3 rounds (2 replayed a graph: not compared)" in bench.format_check(check)
    assert bench.format_check(check).endswith("PASS)")
    assert bench.format_check(dict(check, max_rel=0.02)).endswith("FAIL)")
    assert bench.format_check(dict(check, calls=0, max_rel=0.0)).endswith("FAIL)")  # nothing compared is no pass


def test_latency_split_starts_every_server_with_metrics_and_reports_first_token_and_decode(tmp_path):
    bench = _load()
    variant = types.SimpleNamespace(name="v", target=tmp_path / "t", drafter=tmp_path / "d", dtype="bfloat16", env={},
                                    tp=1)
    for kind in ("plain", "dflash", "kdtree-63", "kdtree-63-overlap"):
        assert "--enable-metrics" in bench._args_for(kind, variant, 1, budget=64, latency_split=True)
        assert "--enable-metrics" not in bench._args_for(kind, variant, 1, budget=64)
    # per call (first token s, decode tok/s): the warm-up batch's, then the two timed batches' of one request each
    stats = iter([(9.0, 1.0), (0.010, 500.0), (0.030, 300.0)])

    def generate(payload):
        first, rate = next(stats)
        return {"output_ids": [0] * payload["sampling_params"]["max_new_tokens"],
                "meta_info": {"e2e_latency": 0.1, "first_token_latency": first, "decode_throughput": rate}}

    timed = types.SimpleNamespace(generate=generate, round_log=None)
    without_stats = types.SimpleNamespace(round_log=None,
                                          generate=lambda payload: {"output_ids": [0], "meta_info": {"e2e_latency": 0.1}})
    table = bench.measure({"kdtree-63-overlap": timed, "plain": without_stats}, [1], new_tokens=4, repeats=2)
    row = table["1"]["kdtree-63-overlap"]
    assert row["first_token_ms"] == pytest.approx(20.0) and row["decode_tok_s"] == pytest.approx(400.0)
    assert "first_token_ms" not in table["1"]["plain"]  # a server without the stats keeps the plain row
    split = bench.format_table(table, 15, 163840).split("first-token latency")[1]
    assert "| 1 | kdtree-63-overlap | 20.0 | 400.0 |" in split and "plain" not in split


def test_timed_batches_take_turns_across_servers_and_stay_with_their_server():
    """Every server's warm-up first, then each turn runs every server once, the next turn starting one server later;
    each row is built from its own server's batches only (a per-server wall time tells them apart)."""
    bench = _load()
    calls = []

    def server(name, latency):
        def generate(payload):
            calls.append(name)
            return {"output_ids": [0] * payload["sampling_params"]["max_new_tokens"],
                    "meta_info": {"e2e_latency": latency, "spec_accept_length": 2.0}}
        return types.SimpleNamespace(generate=generate, round_log=None)

    servers = {"a": server("a", 0.1), "b": server("b", 0.2), "c": server("c", 0.4)}
    table = bench.measure(servers, [1], new_tokens=8, repeats=3)
    assert calls == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: r["tok_s_per_request"] for k, r in table["1"].items()} == pytest.approx({"a": 80, "b": 40, "c": 20})
    assert all(r["runs"] == 3 for r in table["1"].values())


def test_kept_outputs_are_the_first_timed_batch_request_by_request():
    """``keep_outputs``: each row keeps its own server's first timed batch's token ids in prompt order (not the
    warm-up's, not a later repeat's), so servers run in different calls can be held to each other token for token."""
    bench = _load()
    calls = {"a": 0}

    def generate(payload):
        calls["a"] += 1
        return {"output_ids": [payload["input_ids"][0], calls["a"]], "meta_info": {"e2e_latency": 0.1}}

    server = types.SimpleNamespace(generate=generate, round_log=None)
    prompts = lambda bs: [[100 + i] for i in range(bs)]  # noqa: E731
    row = bench.measure({"a": server}, [1], new_tokens=2, repeats=2, prompts=prompts, keep_outputs=True)["1"]["a"]
    assert row["output_ids"] == [[100, 2]]  # call 1 was the warm-up, call 2 the first timed batch
    assert "output_ids" not in bench.measure({"a": server}, [1], new_tokens=2, repeats=1, prompts=prompts)["1"]["a"]
    four = bench.measure({"a": server}, [4], new_tokens=2, repeats=1, prompts=prompts, keep_outputs=True)["4"]["a"]
    assert [ids[0] for ids in four["output_ids"]] == [100, 101, 102, 103]  # prompt order, whatever finished first


def test_host_times_go_to_every_server_and_are_read_after_a_flushing_request(tmp_path, monkeypatch):
    """``--host-times``: each server gets its own ``KDTREE_HOST_TIMES`` file; after the timed batches one short
    request at batch 1 makes the server write its last size, then the files are read and tabled."""
    from sglang_kdtree.server import host_times

    bench = _load()
    assert set(host_times.TABLE_COLUMNS) == set(host_times.COLUMNS)
    variant = types.SimpleNamespace(name="v", target=tmp_path / "t", drafter=tmp_path / "d", dtype="bfloat16", env={},
                                    tp=1)
    started = {}

    class FakeServer:
        def __init__(self, kind, args, log, env):
            started[kind] = env

    monkeypatch.setattr(bench.cuda_servers, "CudaServer", FakeServer)
    bench.start(variant, ["plain", "kdtree-63", "kdtree-63-overlap"], 64, tmp_path, host_times=True)
    assert started["plain"]["KDTREE_HOST_TIMES"] == str(tmp_path / "plain.host_times.json")
    assert started["kdtree-63"]["KDTREE_HOST_TIMES"] == str(tmp_path / "kdtree-63.host_times.json")
    bench.start(variant, ["kdtree-63"], 64, tmp_path)
    assert "KDTREE_HOST_TIMES" not in started["kdtree-63"]

    sent = []
    row = {"rounds": 40, **{f"{c}_ms": 0.25 * (n + 1) for n, c in enumerate(host_times.COLUMNS)}}
    summary = {"32": dict(row, rounds=1), "1": row}

    def generate(payload, kind):
        sent.append((kind, payload["sampling_params"]["max_new_tokens"]))
        if kind == "kdtree-63":  # the server writes its file on the size change
            (tmp_path / "kdtree-63.host_times.json").write_text(json.dumps(summary))
        return {"output_ids": [0], "meta_info": {"e2e_latency": 0.1}}

    servers = {kind: types.SimpleNamespace(generate=lambda p, kind=kind: generate(p, kind))
               for kind in ("plain", "kdtree-63", "kdtree-63-overlap")}
    host = bench.read_host_times(servers, tmp_path)
    assert sent == [("plain", 4), ("kdtree-63", 4), ("kdtree-63-overlap", 4)] and host == {"kdtree-63": summary}
    lines = bench.format_host_times(host).splitlines()
    assert lines[0].startswith("| batch | server | rounds | period ms | schedule ms | launch ms | worker ms |")
    # batch sizes in numeric order; each cell the column's own figure
    assert lines[2].startswith("| 1 | kdtree-63 | 40 | 0.250 | 0.750 | 1.000 | 1.750 |") and "| 32 |" in lines[3]


def test_a_run_cut_off_in_its_traces_keeps_the_timed_table(tmp_path, monkeypatch, capsys):
    """The profiled traces come last and are the slow part: ``bench.json`` and the printed table already hold the
    timed batches and the host times when a trace fails (or the call's deadline stops it), and every server is
    stopped either way."""
    bench = _load()
    variant = types.SimpleNamespace(name="v", target=tmp_path / "t", drafter=tmp_path / "d", dtype="bfloat16", env={},
                                    tp=1)
    stopped = []
    servers = {k: types.SimpleNamespace(stop=lambda k=k: stopped.append(k), gc_frozen=True)
               for k in ("plain", "kdtree")}
    row = {"tok_s_per_request": 100.0, "tok_s_total": 100.0, "accept_len": 2.5, "runs": 1}
    host = {"kdtree": {"1": {"rounds": 3}}}
    monkeypatch.setattr(bench.cuda_servers, "variants", lambda dtype: {"v": variant})
    monkeypatch.setattr(bench, "start", lambda *a, **k: dict(servers))
    monkeypatch.setattr(bench.cuda_servers, "wait_all", lambda s: {})
    monkeypatch.setattr(bench, "measure", lambda s, b, n, r: {"1": {"plain": row, "kdtree": row}})
    monkeypatch.setattr(bench, "read_host_times", lambda s, out: host)
    monkeypatch.setattr(bench, "format_host_times", lambda h, extra=(): "HOST TABLE")
    monkeypatch.setattr(bench, "_geometry", lambda v: (7, 1000))

    def trace(*args):
        raise TimeoutError("the trace ran out of time")

    monkeypatch.setattr(bench.idle_gaps, "trace_servers", trace)
    with pytest.raises(TimeoutError):
        bench.main(["--out", str(tmp_path), "--variant", "v", "--batches", "1", "--host-times", "--idle-steps", "5"])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["table"]["1"]["kdtree"] == row and saved["host_times"] == host and "idle" not in saved
    out = capsys.readouterr().out
    assert "| 1 | kdtree | 100.0 | 100.0 | 2.50 |" in out and "HOST TABLE" in out
    assert sorted(stopped) == ["kdtree", "plain"]
