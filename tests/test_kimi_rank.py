"""CPU tests of one Kimi K2.6 rank: ``testbed/kimi_rank.py``'s configs (a tiny build: 4 layers, vocab 4,096, every
other size Kimi's per GPU at TP 8), its memory estimate, and ``benchmarks/bench_rank.py``'s plumbing (server
command lines, the server-log and round-log readers, the report). The servers themselves need the GPU machine
(``device/device_rank.sh``). SGLang's own readers of the configs take its ~25 s import: ``extended``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from testbed import kimi_rank

GIB = kimi_rank.GIB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank")
    shape = kimi_rank.from_kimi_model(4, vocab=4096)
    manifest = kimi_rank.build(out, shape, log=lambda *_: None)
    return types.SimpleNamespace(out=out, shape=shape, manifest=manifest,
                                 target=json.loads((out / "target" / "config.json").read_text()),
                                 drafter=json.loads((out / "drafter" / "config.json").read_text()))


def test_tiny_target_config_is_kimi_per_gpu(tiny):
    t = tiny.target
    assert t["architectures"] == ["DeepseekV3ForCausalLM"] and t["model_type"] == "deepseek_v3"
    assert t["num_hidden_layers"] == 4 and t["first_k_dense_replace"] == 1 and t["vocab_size"] == 4096
    assert t["hidden_size"] == 7168 and t["intermediate_size"] == 18432 // 8
    # MLA: 64 heads / TP 8, SGLang's absorbed widths q/k 512 + 64 = 576, v 512
    assert (t["num_attention_heads"], t["kv_lora_rank"], t["qk_rope_head_dim"]) == (8, 512, 64)
    assert (t["q_lora_rank"], t["qk_nope_head_dim"], t["v_head_dim"]) == (1536, 128, 128)
    assert (t["n_routed_experts"], t["num_experts_per_tok"], t["moe_intermediate_size"]) == (384, 8, 2048 // 8)
    assert t["n_shared_experts"] == 1 and (t["topk_method"], t["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert t["dtype"] == "bfloat16" and t["max_position_embeddings"] == 32_768
    q = t["quantization_config"]
    weights = q["config_groups"]["group_0"]["weights"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "pack-quantized")
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["type"]) == (4, 32, True, "int")
    assert "lm_head" in q["ignore"] and "re:.*self_attn.*" in q["ignore"]


def test_tiny_drafter_config_is_the_assumed_kimi_drafter_per_gpu(tiny):
    d = tiny.drafter
    assert d["architectures"] == ["DFlashDraftModel"] and d["torch_dtype"] == "bfloat16"
    assert (d["num_hidden_layers"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (5, 8, 1, 128)
    assert (d["hidden_size"], d["intermediate_size"], d["vocab_size"]) == (7168, 2304, 4096)
    assert d["block_size"] == d["dflash_config"]["block_size"] == 16 and d["num_target_layers"] == 4
    assert d["dflash_config"]["target_layer_ids"] == kimi_rank.target_layer_ids(4, 5)
    assert d["dflash_config"]["mask_token_id"] == tiny.manifest["mask_id"]


def test_tokenizer_covers_the_vocabulary_and_the_context(tiny):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.out / "drafter"))
    assert len(tok) == 4096 and tok.model_max_length == 32_768
    assert tok.decode([4095]) == "x4095"
    cfg = AutoConfig.from_pretrained(str(tiny.out / "target"))
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.qk_head_dim) == (4, 384, 192)


def test_manifest_names_the_serving_flags_and_the_estimate(tiny):
    m = tiny.manifest
    assert m["server_env"] == {"SGLANG_KDTREE_MOE": "marlin", "SGLANG_SIMULATE_UNIFORM_EXPERTS": "1"}
    assert m["server_flags"] == ["--load-format", "dummy"] and m["shape"]["layers"] == 4
    assert m == json.loads((tiny.out / kimi_rank.MANIFEST).read_text())


def test_rank_shape_is_kimi_model_at_its_tp():
    from benchmarks.kimi_model import KIMI, DrafterShape

    s, d = kimi_rank.from_kimi_model(61), DrafterShape()
    assert (s.heads, s.moe_inter, s.dense_inter) == (KIMI.heads_gpu, KIMI.moe_inter_gpu, KIMI.dense_inter_gpu)
    assert s.shared_experts * s.moe_inter == KIMI.shared_inter_gpu and s.vocab == KIMI.vocab  # the whole vocabulary
    assert (s.draft_layers, s.block, s.draft_head_dim) == (d.layers, d.block, d.head_dim)
    assert (s.draft_heads, s.draft_kv_heads) == (d.heads // KIMI.tp, d.kv_heads // KIMI.tp)
    # SGLang's spacing (dflash_utils.build_target_layer_ids) for Kimi's 61 layers and the default 40
    assert kimi_rank.target_layer_ids(61, 5) == [1, 15, 30, 44, 58]
    assert kimi_rank.target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    with pytest.raises(ValueError, match="at least one MoE layer"):
        kimi_rank.from_kimi_model(1)


def test_memory_estimate_of_61_layers_and_the_default_fit():
    w = kimi_rank.weight_bytes(kimi_rank.from_kimi_model(61))
    # 384 experts x (gate, up, down) x 7168 x 256 INT4 codes + one bf16 scale per 32: 1.107 GiB a layer
    assert w["routed_experts_per_layer"] == 384 * 3 * 7168 * 256 // 2 + 384 * 3 * 7168 * 256 // 32 * 2
    full = kimi_rank.estimate(kimi_rank.from_kimi_model(61))
    assert 74 < full["gib"]["target_weights"] < 76  # the "about 80 GB" (decimal) with the whole vocabulary
    assert full["total_gib"] > kimi_rank.H100_GIB  # 61 layers need an H200
    default = kimi_rank.estimate(kimi_rank.from_kimi_model(kimi_rank.DEFAULT_LAYERS))
    assert default["total_gib"] <= kimi_rank.H100_GIB - 5
    assert kimi_rank.largest_fit(kimi_rank.H100_GIB) == kimi_rank.DEFAULT_LAYERS
    assert default["kv_tokens"] >= 32 * (4096 + 64) and default["kv_tokens"] % 1024 == 0
    assert "| 61 |" in kimi_rank.format_estimate(kimi_rank.H100_GIB)


@pytest.mark.extended
def test_sglang_reads_the_rank(tiny):
    import torch
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16MoE
    from sglang.srt.speculative.dflash_utils import build_target_layer_ids, parse_dflash_draft_config

    mc = ModelConfig(str(tiny.out / "target"))
    assert mc.attention_arch == AttentionArch.MLA and mc.num_attention_heads == 8
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.vocab_size) == (512, 64, 4096)
    assert mc.quantization == "compressed-tensors" and mc.dtype == torch.bfloat16
    parsed = parse_dflash_draft_config(draft_hf_config=tiny.drafter)
    assert parsed.block_size == 16 and parsed.target_layer_ids == build_target_layer_ids(4, 5)
    for layers in (40, 61):
        assert kimi_rank.target_layer_ids(layers, 5) == build_target_layer_ids(layers, 5)
    qc = CompressedTensorsConfig.from_config(tiny.target["quantization_config"])
    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    scheme = qc.get_moe_scheme(layer, "model.layers.3.mlp.experts")
    assert type(scheme) is CompressedTensorsWNA16MoE and (scheme.num_bits, scheme.group_size) == (4, 32)
    assert qc.get_scheme_dict(None, "model.layers.3.self_attn.o_proj") is None


# ---- benchmarks/bench_rank.py ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    from benchmarks import bench_rank

    return bench_rank


def _opts(**kw):
    base = dict(batches=[1, 8, 32], widths="16,32,64", budget=63, mem_fraction=0.85, context=4096, new_tokens=64,
                prefill_chunk=4096)
    return types.SimpleNamespace(**dict(base, **kw))


def _flag(args, flag):
    i = args.index(flag)
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    return args[i + 1: j]


def test_rank_servers_are_bench_server_kinds_resized(bench, tiny, tmp_path):
    var = bench.variant(tiny.out)
    plain, env = bench.server_plan("plain", var, 1234, _opts(), tmp_path)
    assert _flag(plain, "--load-format") == ["dummy"] and "--speculative-algorithm" not in plain
    assert _flag(plain, "--cuda-graph-bs-decode") == ["1", "8", "32"]
    assert _flag(plain, "--max-running-requests") == [str(32 + bench.SPARE_REQUEST_SLOTS)]
    assert int(_flag(plain, "--max-total-tokens")[0]) == kimi_rank.kv_tokens(32, 4096, 64, 64)
    assert kimi_rank.kv_tokens(32, 4096, 64, 64) >= 32 * (4096 + 64 + 16 * 64)
    assert "--disable-overlap-schedule" not in plain and "--enable-metrics" in plain
    assert env["SGLANG_SIMULATE_UNIFORM_EXPERTS"] == "1" and env["SGLANG_KDTREE_MOE"] == "marlin"
    assert env["KDTREE_HOST_TIMES"].endswith("plain.host_times.json") and "KDTREE_ROUND_LOG" not in env
    auto, env = bench.server_plan("kdtree-auto-overlap", var, 1234, _opts(), tmp_path)
    assert "--speculative-num-draft-tokens" not in auto and "--disable-overlap-schedule" not in auto
    assert env["SGLANG_KDTREE_VERIFY_WIDTHS"] == "16,32,64" and "SGLANG_KDTREE_WIDTH_POLICY" not in env
    assert "SGLANG_KDTREE_WIDTH_STATED_TAU" not in env and "SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS" not in env
    stated = bench.stated_tau(Path(__file__).resolve().parents[1] / "benchmarks/results/pair_acceptance.json",
                              ["16", "32", "64"])
    assert set(stated["by_width"]) == {16, 32, 64} and bench.stated_tau("none", ["16"]) is None
    # width 32 = budget 31: run O's pooled greedy tau, what throughput sees (not the per-request mean "curve")
    assert stated["by_width"] == {16: 6.0283, 32: 6.5618, 64: 6.9876} and "pooled" in stated["source"]
    flat = tmp_path / "curve.json"
    flat.write_text(json.dumps({"curve": {"15": 2.0, "63": 4.0}}))
    # budget 31 lies 0.506 of the way from 15 to 63 in log2(budget)
    assert bench.stated_tau(flat, ["16", "32", "64"])["by_width"] == pytest.approx({16: 2.0, 32: 3.0117, 64: 4.0})
    auto, env = bench.server_plan("kdtree-auto-log", var, 1234, _opts(stated_tau=stated["by_width"], profile_batch=8),
                                  tmp_path)
    from sglang_kdtree.round.width_choice import parse_stated_tau

    assert parse_stated_tau(env[bench.STATED_TAU_ENV], (16, 32, 64)) == pytest.approx(stated["by_width"], abs=1e-4)
    assert env["SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS"] == "8"
    cycle, env = bench.server_plan("kdtree-cycle-log", var, 1234, _opts(stated_tau={16: 2.0}), tmp_path)
    assert _flag(cycle, "--speculative-algorithm") == ["kdtree"] and "--disable-overlap-schedule" in cycle
    assert env["SGLANG_KDTREE_WIDTH_POLICY"] == "cycle" and bench.STATED_TAU_ENV not in env  # the cycle ignores it
    assert env["KDTREE_ROUND_LOG"].endswith("rounds-kdtree-cycle-log.jsonl")
    pinned, env = bench.server_plan("kdtree-31-overlap", var, 1234, _opts(batches=[8]), tmp_path)
    assert _flag(pinned, "--speculative-num-draft-tokens") == ["32"] and "SGLANG_KDTREE_VERIFY_WIDTHS" not in env
    assert _flag(pinned, "--cuda-graph-bs-decode") == ["8"]
    assert bench.replace_flag(["a", "--x", "1", "2", "--y"], "--x", 3) == ["a", "--x", "3", "--y"]
    assert bench.replace_flag(["a"], "--z") == ["a", "--z"]


#: SGLang's and the plugin's startup lines as they print them (one line each; split here for length)
SERVER_LOG = "\n".join((
    "[2026-12-06 10:00:00] Load weight begin. avail mem=78.50 GB",
    "[2026-12-06 10:00:20] Load weight end. elapsed=20.10 s, type=DeepseekV3ForCausalLM, quant=compressed-tensors, "
    "avail mem=28.31 GB, mem usage=50.19 GB.",
    "[2026-12-06 10:00:21] Load weight end. elapsed=1.20 s, type=DFlashDraftModel, avail mem=27.20 GB, "
    "mem usage=1.09 GB.",
    "[2026-12-06 10:00:22] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 137216, KV size: 5.89 GB",
    "[2026-12-06 10:00:22] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 137216, K size: 0.16 GB, "
    "V size: 0.16 GB",
    "[2026-12-06 10:00:23] Memory pool end. avail mem=20.90 GB",
    "[2026-12-06 10:00:40] Capture target verify CUDA graph end. bs=[1, 8, 32], elapsed=12.50 s, mem usage=4.80 GB, "
    "avail mem=15.00 GB.",
    "[2026-12-06 10:00:55] KDTREE verify widths: extra verify tiers built (width 16: graphs, 6.1 s, 1210 MiB; "
    "width 32: graphs, 7.0 s, 2390 MiB)",
    "[2026-12-06 10:00:58] KDTREE round pre-warm: bs=32 peak=1610612736 B (buffers kept for serving), logprob "
    "headroom 0 B",
    "[2026-12-06 10:01:00] The server is fired up and ready to roll!",
    "[2026-12-06 10:01:05] Capture something else CUDA graph end. bs=[1], elapsed=99.00 s, mem usage=9.00 GB, "
    "avail mem=1.00 GB.",
))


def test_server_log_reader(bench):
    log = bench.read_server_log(SERVER_LOG)
    assert [x["gib"] for x in log["loads"]] == [50.19, 1.09] and log["loads"][0]["seconds"] == 20.10
    assert log["kv"] == [{"tokens": 137216, "gib": 5.89}, {"tokens": 137216, "gib": 0.32}]
    assert log["captures"] == [{"name": "target verify CUDA graph", "seconds": 12.5, "gib": 4.8}]  # up to ready
    assert log["tiers"]["32"] == {"graphs": True, "seconds": 7.0, "mib": 2390} and log["kdtree_tiers_s"] == 13.1
    assert log["prewarm_peak_bytes"] == 1.5 * GIB and log["avail_after_pool_gib"] == 20.9 and log["log_span_s"] == 60


def _round(bs, width, ms, graph=True):
    return {"accept_lens": [1] * bs, "graph": graph, "ms": dict(zip(("draft", "tree", "verify", "accept_commit"),
                                                                      ms)),
            "width": {"width": width, "predicted": 1.5, "realised": 1.0, "round_ms": sum(ms) + 1}}


def test_round_log_by_width_and_the_report(bench, tmp_path):
    path = tmp_path / "rounds.jsonl"
    rows = [_round(8, 16, (1, 0.5, 4, 0.5)), _round(8, 16, (1, 0.5, 6, 0.5)), _round(8, 64, (1, 0.5, 9, 0.5)),
            _round(8, 64, (9, 9, 9, 9), graph=False), _round(3, 16, (1, 1, 1, 1))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    by = bench.rounds_by_width(path, [1, 8, 32])
    assert set(by) == {"8"} and by["8"]["16"]["rounds"] == 2 and by["8"]["16"]["verify"] == 5
    assert by["8"]["64"] == {"rounds": 1, "draft": 1, "tree": 0.5, "verify": 9, "accept_commit": 0.5,
                             "device_ms": 11.0, "wall_ms": 12.0, "predicted": 1.5, "realised": 1.0}
    row = {"accept_len": 2.0, "decode_tok_s": 100.0}
    times = bench.round_times(row, {"period_mean_ms": 19.5}, {"tok_s": 800.0, "accept_len": 2.0}, 8)
    assert times == {"host_ms": 19.5, "log_ms": 20.0, "request_ms": 20.0}
    report = {"rank": {"layers": 40, "vocab": 163840}, "settings": {"context": 4096, "widths": "16,32,64"},
              "servers": {"kdtree-cycle-log": {"ready_s": 130.0, "table": {"8": dict(row, round=times)},
                                               "by_width": by, "server_log": bench.read_server_log(SERVER_LOG)},
                          "kdtree-auto-overlap": {"status": "skipped: 10 s left"}}}
    from benchmarks import rank_report

    text = rank_report.format_report(report)
    assert "| kdtree-cycle-log | 8 | 19.50 | 20.00 | 20.00 | - | 2.00 | 100.0 | 130 |" in text
    assert "| kdtree-cycle-log | 8 | 64 | 1 |" in text and "skipped: 10 s left" in text
    assert "137,216 / 5.89" in text and "16: 6.1 / 1210" in text


def test_model_prediction_is_kimi_round_at_the_ranks_layers(bench):
    """The committed H200 measurement, re-assembled for a 40-layer rank: layer sums at 40 (39 MoE), no
    collectives, the head scaled to the whole vocabulary."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "kimi_round.json"
    times = json.loads(path.read_text())["measured"]["times"]
    shape = {"layers": 40, "dense_layers": 1, "vocab": 163_840}
    model = bench.predicted_rounds(path, shape, [1, 32], 4096, ["16", "64"])
    assert model["lm_head_scale"] == 8 and set(model["cells"]["32"]) == {"AR", "DFLASH", "KDTREE-15", "KDTREE-63"}
    wide = model["cells"]["32"]["KDTREE-63"]
    assert wide["moe"] == pytest.approx(39 * times["moe[T=2048]"] / 1e3, abs=1e-3) and not wide["missing"]
    assert wide["attention"] == pytest.approx(40 * times["attention[bs=32,ctx=4096,width=64]"] / 1e3, abs=1e-3)
    assert wide["round"] == pytest.approx(sum(wide[p] for p in ("draft", "tree", "verify", "accept_commit")), abs=1e-3)
    ar = model["cells"]["1"]["AR"]
    assert ar["draft"] == 0 and ar["width"] == 1 and ar["round"] < model["cells"]["1"]["KDTREE-15"]["round"]


def test_profile_asks_sglang_for_decode_steps_and_splits_the_trace(bench, tmp_path):
    """``bench_rank.profile`` against a stand-in server: the /start_profile body it sends, the batch it runs, the
    decode trace it waits for and splits, and the traces it deletes after."""
    import gzip
    import http.server
    import threading

    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Start profiling.\n")

        def log_message(self, *_):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    class Server:  # the CudaServer calls profile makes: name, url, generate
        name, url = "plain", f"http://127.0.0.1:{httpd.server_address[1]}"

        def generate(self, payload):
            folder = Path(bodies[-1][1]["output_dir"])
            events = [{"cat": "kernel", "name": "Marlin", "ts": 0, "dur": 600},
                      {"cat": "kernel", "name": "nvjet_x", "ts": 600, "dur": 400}]
            for stage in ("EXTEND", "DECODE"):
                with gzip.open(folder / f"plain-1-TP-0-{stage}.trace.json.gz", "wt") as f:
                    json.dump({"traceEvents": events}, f)
            return {"output_ids": [1], "meta_info": {}}

    try:
        out = bench.profile(Server(), 8, 2, [[1, 2, 3]], 4, tmp_path, wait_s=10)
    finally:
        httpd.shutdown()
    path, body = bodies[0]
    assert path == "/start_profile" and body["num_steps"] == 2 and body["profile_by_stage"] is True
    assert body["activities"] == ["GPU"] and body["with_stack"] is False
    assert out["bs"] == 8 and out["trace"].endswith("DECODE.trace.json.gz")
    assert out["split"]["ms"]["moe"] == 0.3 and out["split"]["ms"]["gemm"] == 0.2
    assert not list((tmp_path / "profile-plain").glob("*.gz"))  # the traces are not kept
