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
    # the new columns: compute floor and binding floor on every row, glue split and stage floors where split
    E, K, N = bench.SHAPES["tiny"]
    for r in rows:
        assert r["flops"] == 2.0 * r["tokens"] * 2 * (K * 2 * N + N * K)
        assert r["compute_floor_us"] == pytest.approx(r["flops"] / bench.BF16_PEAK_FLOPS * 1e6)
        assert r["bound_floor_us"] == max(r["floor_us"], r["compute_floor_us"])
        assert r["pct_bound"] == pytest.approx(100 * r["bound_floor_us"] / 10.0)
    glue = rows[1]["glue"]  # every stand-in stage times 10 us, the whole call 10 us
    assert glue["glue_us"] == 30.0 and glue["gemm_us"] == 20.0 and glue["rest_us"] == -40.0 and glue["flag"]
    assert glue["align_pct"] == glue["silu_pct"] == glue["topk_sum_pct"] == 100.0 and glue["glue_pct"] == 300.0
    assert set(rows[1]["stage_floors_us"]) == {"gemm1", "silu", "gemm2", "topk_sum"}
    bench.print_table(rows, 1e12, "cpu", 700e12)
    out = capsys.readouterr().out
    assert "| tiny | 1 |" in out and "stages on their own" in out and "targets at <= 65 tokens" in out and "accuracy sweep (3 draws" in out
    assert "binding floor" in out and "measured cuBLAS bf16 matmul 700 TFLOP/s" in out and "**YES**" in out
    assert out.rstrip().splitlines()[-1].startswith("| tiny | 5 |")  # the binding-floor table prints last


def test_compute_floor_and_binding(bench):
    """Kimi TP 8 numbers by hand: 130 tokens x 8 routes x (7168 x 512 + 256 x 7168) x 2 FLOPs."""
    flops = bench.moe_flops(130, 8, 7168, 256)
    assert flops == 2 * 130 * 8 * (7168 * 512 + 256 * 7168) == 11_450_449_920
    assert bench.BF16_PEAK_FLOPS == 989e12
    # 11.45 GFLOP / 989 TFLOP/s = 11.58 us: under a 261 us weight floor, so the weights bind
    b = bench.bound_by(261.0, flops, 384.7)
    assert b["compute_floor_us"] == pytest.approx(11.5778, abs=1e-3)
    assert b["bound"] == "weights" and b["bound_floor_us"] == 261.0
    assert b["pct_bound"] == pytest.approx(100 * 261.0 / 384.7)
    assert b["tflops"] == pytest.approx(flops / 384.7e-6 / 1e12)
    # a compute-heavy call: 1 TFLOP at a 989 TFLOP/s peak = 1011.1 us > 500 us of weights; ours 2000 us = 50.6 %
    b = bench.bound_by(500.0, 1e12, 2000.0)
    assert b["bound"] == "compute" and b["bound_floor_us"] == pytest.approx(1011.12, abs=0.01)
    assert b["pct_bound"] == pytest.approx(50.556, abs=1e-3)
    b = bench.bound_by(10.0, 1e9, 20.0, peak=1e14)  # a stated peak: 1e9 / 1e14 = 10 us ties: weights named
    assert b["bound"] == "weights" and b["pct_bound"] == 50.0
    # the INT4 layout: packed nibbles + a bf16 scale per 32 inputs; both GEMMs together = one expert
    assert bench.gemm_weight_bytes(7168, 512) == 7168 * 512 // 2 + 224 * 512 * 2
    assert bench.expert_bytes(7168, 256) == bench.gemm_weight_bytes(7168, 512) + bench.gemm_weight_bytes(256, 7168)
    assert bench.expert_bytes(7168, 256) == (7168 * 512 + 256 * 7168) // 2 + (224 * 512 + 8 * 7168) * 2


def test_glue_split_and_stage_floors(bench):
    stages = {"align": 5.0, "gemm1": 160.0, "silu": 2.0, "gemm2": 120.0, "topk_sum": 8.0, "sum": 295.0}
    g = bench.glue_split(stages, 300.0)
    assert g["glue_us"] == 15.0 and g["glue_pct"] == 5.0 and not g["flag"]
    assert g["align_pct"] == pytest.approx(5 / 3) and g["topk_sum_pct"] == pytest.approx(8 / 3)
    assert g["gemm_us"] == 280.0 and g["rest_us"] == 5.0
    assert bench.glue_split(dict(stages, topk_sum=24.0), 300.0)["flag"]  # 31 us = 10.3 % > 10 %
    assert not bench.glue_split(dict(stages, topk_sum=23.0), 300.0)["flag"]  # exactly 10 %: not over
    # 2080 tokens at TP 8, every expert touched, 4 TB/s: the top-k sum reads 16640 x 7168 bf16 and writes 2080 x 7168
    f = bench.stage_floors_us(2080, 8, 7168, 256, 384.0, 4e12)
    assert f["topk_sum"] == pytest.approx((16640 + 2080) * 7168 * 2 / 4e12 * 1e6)
    assert f["silu"] == pytest.approx(16640 * (512 + 256) * 2 / 4e12 * 1e6)
    assert f["gemm1"] == pytest.approx(384 * bench.gemm_weight_bytes(7168, 512) / 4e12 * 1e6)  # weights bind
    assert f["gemm2"] == pytest.approx(384 * bench.gemm_weight_bytes(256, 7168) / 4e12 * 1e6)
    # at a tiny peak the FLOPs bind instead
    f = bench.stage_floors_us(2080, 8, 7168, 256, 384.0, 4e12, peak=1e12)
    assert f["gemm1"] == pytest.approx(2.0 * 16640 * 7168 * 512 / 1e12 * 1e6)


def test_cli_token_lists(bench, monkeypatch):
    """--tokens / --breakdown-tokens / --rotate / --repeat reach the run (torch.cuda absent: main stops at 2)."""
    assert bench.int_list("130,520,2080") == [130, 520, 2080] and bench.int_list("1, 8,") == [1, 8]
    assert set(bench.VERIFY_TOKENS) <= set(bench.TOKENS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--tokens", "130,520,2080", "--breakdown-tokens", "130,2080", "--rotate", "4",
                       "--repeat", "2"]) == 2
    assert bench.BREAKDOWN_TOKENS == (130, 2080) and (bench.ROTATE, bench.REPEAT) == (4, 2)
