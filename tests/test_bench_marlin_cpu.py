"""CPU smoke test of benchmarks/bench_marlin_moe.py's plumbing (the GPU run is the real one): both reduce
modes, the bf16 baselines, the accuracy sweep and the table, on tiny CPU shapes with the Marlin call
replaced by the float reference rounded to bf16 and the CUDA timers by a counter."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

from sglang_kdtree.moe import forward as fwd  # noqa: E402
from sglang_kdtree.moe import launch  # noqa: E402
from sglang_kdtree.moe import reference as twin  # noqa: E402
from sglang_kdtree.moe import weights as mw  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_marlin_moe.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_marlin_moe_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.DEVICE = "cpu"
    monkeypatch.setattr(module, "SHAPES", {"tiny": (8, 256, 128)})
    monkeypatch.setattr(module, "SWEEP_SHAPES", {"tiny": (8, 256, 128, 2)})
    monkeypatch.setattr(module, "TOP_K", 2)
    calls = []

    def fake_marlin(x, marlin, w, ids, factor=1.0, *, out=None, errors=None, reduce=None):
        assert reduce in (None, *fwd.REDUCE_MODES)
        calls.append(reduce)
        return twin.fused_moe_reference(x, marlin, w, ids, factor).to(torch.bfloat16)

    def fake_repack(packed):  # the stand-in keeps the packed layout; the stage functions below only record
        packed.w13, packed.w2, packed.workspace = packed.w13_packed, packed.w2_packed, None
        return packed

    monkeypatch.setattr(mw, "repack_for_marlin", fake_repack)
    stages = []
    monkeypatch.setattr(launch, "moe_align_block_size", lambda ids, e, block, errors=None: (
        stages.append("align"), twin.moe_align_reference(ids, e, block))[1])
    monkeypatch.setattr(fwd, "marlin_gemm", lambda a, c, w, scale, ws, tables, block, *, top_k, mul_topk_weights,
                        atomic: stages.append(("gemm", c.shape[1], top_k, mul_topk_weights, atomic)))
    monkeypatch.setattr(launch, "silu_and_mul", lambda x, out=None: stages.append("silu"))
    monkeypatch.setattr(launch, "moe_topk_sum", lambda r, ids, e, f=1.0, out=None: stages.append("sum"))
    monkeypatch.setattr(module, "BREAKDOWN_TOKENS", (5,))
    monkeypatch.setattr(fwd, "fused_moe_marlin", fake_marlin)
    timed = []

    def fake_timer(run, calls, trials=5):
        run()
        timed.append(calls)
        return 10.0

    monkeypatch.setattr(module, "cuda_time_us", fake_timer)
    monkeypatch.setattr(module, "graph_of", lambda fns: type("G", (), {"replay": lambda self: [f() for f in fns]})())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    module._calls = calls
    module._stages = stages
    return module


def test_bench_rows_sweep_and_table(bench, capsys):
    rows = []
    bench.run_shape("tiny", [1, 5], 1e12, rows, check_tokens={1})
    assert [r["tokens"] for r in rows] == [1, 5]
    for r in rows:
        assert r["ours_reduce"] == fwd.DEFAULT_REDUCE and r["ours_graph_us"] == r["fp32_graph_us"] == 10.0
        assert r["atomic_graph_us"] == 10.0 and r["bf16_graph_us"] == 10.0 and r["floor_us"] > 0
    # the bf16 model path agrees with the float reference to bf16 accuracy, and so does the stand-in
    assert rows[0]["rel_bf16"] < 2e-2 and rows[0]["rel_atomic"] < 2e-2 and "rel_fp32" not in rows[1]
    assert {"atomic", "fp32", None} <= set(bench._calls)
    assert "stages_us" not in rows[0] and set(rows[1]["stages_us"]) == {"align", "gemm1", "silu", "gemm2",
                                                                      "topk_sum", "sum"}
    # both GEMMs with their shapes and the default reduce (fp32: no atomics)
    assert ("gemm", 256, 2, False, False) in bench._stages and ("gemm", 256, 1, True, False) in bench._stages
    assert {"align", "silu", "sum"} <= set(bench._stages)
    sweep = bench.accuracy_sweep(3, tokens=(1, 2))
    assert {(s[0], s[1], s[2]) for s in sweep} == {("tiny", m, p) for m in (1, 2) for p in ("atomic", "fp32", "bf16")}
    assert all(0 <= s[3] <= s[4] < 2e-2 and s[5] == 0 for s in sweep)
    bench.print_table(rows, 1e12, "cpu")
    out = capsys.readouterr().out
    assert "| tiny | 1 |" in out and "stages on their own" in out and "targets at <= 65 tokens" in out and "accuracy sweep (3 draws" in out
