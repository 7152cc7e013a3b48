"""Tensor parallelism 2 on the real SGLang server (CPU, gloo): ``--speculative-algorithm kdtree --tp 2`` against
the same tiny Llama target served plain at ``--tp 2``.

Each server is two scheduler processes (one per rank) joined by gloo; at TP 2 the worker takes its step-by-step
path with the vocab-parallel top-K (``pipeline.vocab_parallel_topk``: each rank's top-K of its half of the
vocabulary, one all-gather, the same merge on both ranks). The tests of ``test_server_kdtree.py`` that hold at any
TP are imported and run here against this module's TP 2 servers (pytest resolves their fixtures in this module);
the allocation-failure ones are not, because at TP > 1 such a failure stops the server, which
``test_server_tp2_oom.py`` pins (its own module, so that no more than two servers run at once).
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import start_server
from server_requests import PROMPTS, _kdtree_args
from test_plain_server import hf_greedy
from test_server_kdtree import (greedy_results, test_a_fault_in_one_request_ends_only_that_request,  # noqa: F401
                                test_acceptance_through_non_first_sibling, test_greedy_logprobs_match_the_plain_server,
                                test_greedy_outputs_identical_to_plain_server,
                                test_host_times_split_each_decode_round_by_step_of_the_scheduler_loop,
                                test_max_new_tokens_cut,
                                test_mean_accept_length_and_metrics, test_sampling_with_seed_is_reproducible_and_exact,
                                test_stop_token_inside_accepted_path)

pytestmark = [pytest.mark.slow, pytest.mark.extended]

TP = 2

#: SGLang's CPU path at TP > 1 needs two settings on these machines (tests/e2e/README.md, "Tensor parallelism"):
#: * ``SGLANG_CPU_OMP_THREADS_BIND``: without it ``numa_utils.init_threads_binding`` asserts one NUMA node per
#:   rank (these machines have one). The cores it names are bound only on CPUs with AMX or on arm64
#:   (``bootstrap._init_cpu_threads_env``); here it only satisfies that check.
#: * ``SGLANG_NCCL_SO_PATH`` naming no library: the CUDA build of torch installed here finds ``libnccl.so.2``
#:   (the nvidia-nccl wheel), so every group would build a ``PyNcclCommunicator`` and fail on
#:   ``torch.cuda.device("cpu")``; a library that does not load disables PyNccl and leaves gloo.
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}

#: gloo needs no custom all-reduce; without the flag SGLang tries it and logs a warning per rank.
TP_ARGS = ["--tp", str(TP), "--disable-custom-all-reduce"]


@pytest.fixture(scope="module")
def plain_server(tiny_models, server_logs):
    """The tiny Llama target at TP 2 without speculative decoding (the reference)."""
    server = start_server(tiny_models / "llama", server_logs, extra=TP_ARGS, name="plain-tp2", env=TP_ENV)
    server.wait_ready()
    server.model_name = "llama"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def kdtree_server(plain_server, tiny_models, server_logs):
    round_log = server_logs / "rounds-tp2.jsonl"
    round_log.unlink(missing_ok=True)
    faults = server_logs / "faults-tp2.json"
    faults.unlink(missing_ok=True)
    host_times = server_logs / "host-times-tp2.json"  # rank 1 writes host-times-tp2.json.tp1
    for path in (host_times, host_times.with_name(host_times.name + ".tp1")):
        path.unlink(missing_ok=True)
    server = start_server(tiny_models / "llama", server_logs, extra=TP_ARGS + _kdtree_args(tiny_models, "llama"),
                          name="kdtree-tp2", env={**TP_ENV, "KDTREE_ROUND_LOG": str(round_log),
                                                  "KDTREE_TEST_FAULTS": str(faults), "KDTREE_HOST_TIMES": str(host_times)})
    server.wait_ready()
    server.model_name = "llama"
    server.round_log = round_log
    server.faults = faults
    server.host_times = host_times
    yield server
    server.stop()


def test_each_rank_writes_its_own_host_times(kdtree_server, greedy_results):
    """``KDTREE_HOST_TIMES`` at TP 2: both ranks run the loop and each keeps its own file (rank 1's with ``.tp1``),
    so neither overwrites the other's figures; the ranks run the same rounds."""
    kdtree_server.generate({"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
    kdtree_server.generate({"input_ids": PROMPTS[:2], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    rank1 = kdtree_server.host_times.with_name(kdtree_server.host_times.name + ".tp1")
    deadline = time.time() + 30
    while not rank1.exists() and time.time() < deadline:
        time.sleep(0.5)
    per_rank = [json.loads(p.read_text()) for p in (kdtree_server.host_times, rank1)]
    assert "1" in per_rank[0] and "1" in per_rank[1]
    assert per_rank[0]["1"]["worker_ms"] > 0 and per_rank[1]["1"]["worker_ms"] > 0


def test_plain_tp2_server_matches_hf_greedy(plain_server, tiny_models):
    """The reference itself: SGLang's TP 2 CPU path (row- and column-parallel layers, a vocab-parallel head,
    gloo all-reduces) returns Hugging Face's greedy continuation."""
    prompts = PROMPTS[:3]
    out = plain_server.generate({"input_ids": prompts, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    for prompt, result in zip(prompts, out):
        assert result["output_ids"] == hf_greedy(tiny_models / "llama", prompt, 12)


def _records_by_rank(round_log, timeout: float = 30) -> dict[int, list[dict]]:
    """The round log's records per ``tp_rank``, once every rank has written as many (a rank may append its
    record a moment after the response went out)."""
    deadline = time.time() + timeout
    while True:
        by_rank: dict[int, list[dict]] = {}
        for line in round_log.read_text().splitlines():
            record = json.loads(line)
            by_rank.setdefault(record["tp_rank"], []).append(record)
        if len({len(v) for v in by_rank.values()}) <= 1 or time.time() > deadline:
            return by_rank
        time.sleep(0.5)


def test_both_ranks_run_the_same_rounds(kdtree_server, greedy_results):
    """Every rank runs every round and builds the same trees: the round log holds one record per rank per round,
    and the two ranks' sequences of tree sizes, accept lengths and sibling accepts are equal (a rank that
    merged the vocab-parallel top-K differently would build another tree)."""
    by_rank = _records_by_rank(kdtree_server.round_log)
    assert sorted(by_rank) == list(range(TP)), sorted(by_rank)
    fields = ("num_nodes", "accept_lens", "sibling_accepts")
    first, *others = [[tuple(tuple(r[f]) for f in fields) for r in records] for records in by_rank.values()]
    assert first, "no round records"
    for other in others:
        assert other == first
    assert all(r["backend"] == "reference" for records in by_rank.values() for r in records)
