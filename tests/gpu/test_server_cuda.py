"""Greedy KDTREE == plain, token for token, on real CUDA SGLang servers (the H200; skipped without a GPU).

For each target (the tiny Llama, the tiny DeepSeek-V3, and, when ``KDTREE_KIMI_MODELS`` is set, the
Kimi-shaped W4A16 target with SGLang's MoE path and with ``SGLANG_KDTREE_MOE=marlin``), one plain and one
``--speculative-algorithm kdtree`` server run with CUDA graphs on and with ``--disable-cuda-graph``; all of
them start at once (``tests/e2e/cuda_servers.py``), then ``NUM_PROMPTS`` greedy prompts of mixed lengths go
to each, concurrently.

What is not the shipped stack: the ``sgl_kernel`` binary wheel (built for SGLang's pinned torch) is replaced
by the test-only stand-in ``tests/e2e/sgl_kernel_cuda`` (torch RMSNorm / fused add-RMSNorm / act-and-mul /
MoE sum-reduce / weak_ref_tensor; everything else raises by name), plus import shims for ``soundfile`` and
the CUTLASS-DSL dual GEMM. SGLang's scheduler, model runner, CUDA-graph runners, memory pool, Triton
attention, its JIT kernels and all of sglang-kdtree are the real thing.

Environment: ``KDTREE_SERVER_LOGS`` (keep the server logs, ``summary.json`` and ``table.txt`` there),
``KDTREE_CUDA_DTYPE`` (dtype of the tiny targets, default float32; the Kimi variants are bf16),
``KDTREE_TINY_MODELS`` / ``KDTREE_KIMI_MODELS``, ``KDTREE_CUDA_STARTUP_TIMEOUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
import cuda_servers  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MODELS = ["llama", "dsv3", "kimi", "kimi-marlin"]
MODES = {"graph": True, "eager": False}


@pytest.fixture(scope="session")
def comparison(tmp_path_factory):
    dtype = os.environ.get("KDTREE_CUDA_DTYPE", "float32")
    table = cuda_servers.variants(dtype)
    logs = os.environ.get("KDTREE_SERVER_LOGS")
    log_dir = Path(logs) if logs else tmp_path_factory.mktemp("cuda_servers")
    summary = cuda_servers.compare(list(table.values()), list(MODES.values()), log_dir)
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (log_dir / "table.txt").write_text(cuda_servers.format_table(summary) + "\n")
    return table, summary


def _names(variant, mode):
    graph = MODES[mode]
    return (cuda_servers.server_name(variant, False, graph), cuda_servers.server_name(variant, True, graph),
            f"{variant.name}-{variant.dtype}-{mode}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", MODELS)
def test_servers_start_and_serve(comparison, model, mode):
    table, summary = comparison
    if model not in table:
        pytest.skip("KDTREE_KIMI_MODELS is not set")
    for name in _names(table[model], mode)[:2]:
        rec = summary["servers"][name]
        assert rec["error"] is None, rec["error"][-4000:]
        assert len(rec["output_ids"]) == summary["num_prompts"] >= 32
        assert all(0 < len(ids) <= cuda_servers.NEW_TOKENS for ids in rec["output_ids"])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", MODELS)
def test_greedy_kdtree_identical_to_plain(comparison, model, mode):
    table, summary = comparison
    if model not in table:
        pytest.skip("KDTREE_KIMI_MODELS is not set")
    plain, spec, pair = _names(table[model], mode)
    for name in (plain, spec):
        assert summary["servers"][name]["error"] is None, summary["servers"][name]["error"][-4000:]
    assert summary["pairs"][pair]["identical"], summary["pairs"][pair]["mismatch"]
    assert summary["servers"][plain]["output_ids"] == summary["servers"][spec]["output_ids"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", MODELS)
def test_greedy_logprobs_served_and_close_to_plain(comparison, model, mode):
    """``return_logprob`` on the CUDA KDTREE server: same ids as plain, logprobs of the same tokens close. They
    come from the verify forward's rows, a different batch shape than plain decode's, so they differ in the last
    bits: fp32 targets by < 1e-3 (measured <= 6.3e-4); bf16 ones by up to a couple of bf16 ulps of the logits
    (0.125 at |logit| in [16, 32); measured <= 3.8e-2 at TP 1, 0.107 at TP 2)."""
    table, summary = comparison
    if model not in table:
        pytest.skip("KDTREE_KIMI_MODELS is not set")
    pair = summary["logprob_pairs"][_names(table[model], mode)[2]]
    assert pair["error"] is None, pair["error"]
    assert pair["ids_identical"]
    assert pair["max_abs_diff"] < (0.25 if table[model].dtype == "bfloat16" else 1e-3), pair


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", MODELS)
def test_kdtree_server_ran_gpu_rounds(comparison, model, mode):
    """The KDTREE server said ``gpu backend`` at startup, wrote its round log, took multi-token steps, and
    verified more than one request per round."""
    table, summary = comparison
    if model not in table:
        pytest.skip("KDTREE_KIMI_MODELS is not set")
    _, spec, _ = _names(table[model], mode)
    rec = summary["servers"][spec]
    assert rec["error"] is None, rec["error"][-4000:]
    assert rec["gpu_backend"], f"no 'gpu backend' in {rec['log']}"
    assert rec["round_log_exists"] and rec["rounds"] > 0, f"no round records next to {rec['log']}"
    assert rec["backends"] == ["gpu"], rec["backends"]
    assert rec["max_batch_in_round"] > 1
    assert rec["accept_length"] is not None and rec["accept_length"] > 1.5
    if MODES[mode]:
        assert rec["graph_rounds"] > 0, "no verify forward replayed a CUDA graph"
        # the bookkeeping's own graphs replayed too (greedy batches whose verify replayed SGLang's graph)
        assert rec["tree_graph_replays"] > 0 and rec["commit_graph_replays"] > 0, rec
    else:
        assert rec["graph_rounds"] == 0
        assert rec["tree_graph_replays"] == 0 and rec["commit_graph_replays"] == 0, rec


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model", ["kimi", "kimi-marlin"])
def test_kimi_fused_mla_and_marlin_ran(comparison, model, mode):
    """On the Kimi-shaped target (MLA q/k 576, v 512) the fused MLA tree-verify kernel ran, inside graph
    replays when graphs are on (its device counter grew between the first and last graph-replayed rounds);
    with ``SGLANG_KDTREE_MOE=marlin`` our Marlin MoE path was routed."""
    table, summary = comparison
    if model not in table:
        pytest.skip("KDTREE_KIMI_MODELS is not set")
    _, spec, _ = _names(table[model], mode)
    rec = summary["servers"][spec]
    assert rec["error"] is None, rec["error"][-4000:]
    assert rec["mla_launches"] > 0, "the fused MLA tree-verify kernel never launched"
    from sglang_kdtree.gpu.mla_attention import resolve_kernel

    assert rec["mla_kernels"] == [resolve_kernel(None, 0)], "not the MLA kernel auto/$SGLANG_KDTREE_MLA_KERNEL picks"
    if MODES[mode]:
        assert rec["mla_launches_during_graph_rounds"] > 0, "no MLA launch inside the replayed verify graphs"
    if table[model].env.get("SGLANG_KDTREE_MOE") == "marlin":
        assert rec["marlin_routed"] > 0, "no MoE call was routed to sglang_kdtree.moe"
