"""``docs/is-it-faster.md``'s step 2 as written, against a real KDTREE CPU server of the tiny Llama target: SGLang's
load generator (``python -m sglang.benchmark.serving``) with a custom JSONL of prompts, fixed output length and a
concurrency, appending its figures under a tag. Smaller numbers than the document's; the same flags.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conftest import server_env, start_server
import make_tiny_models as tiny
from server_requests import _kdtree_args

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_the_documented_load_generator_run_reports_throughput_tpot_and_accept_length(tiny_models, server_logs,
                                                                                       tmp_path):
    rng = random.Random(5)
    prompts = tmp_path / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(12):
            text = " ".join(tiny.word(rng.randrange(tiny.NUM_WORDS)) for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"conversations": [{"content": text}, {"content": "unused"}]}) + "\n")
    out = tmp_path / "compare.jsonl"
    # SGLang's accept length is a lifetime average it updates every --decode-log-interval decode steps (default 40);
    # this short run has fewer
    server = start_server(tiny_models / "llama", server_logs,
                          extra=_kdtree_args(tiny_models, "llama") + ["--decode-log-interval", "4"],
                          name="kdtree-is-it-faster")
    try:
        server.wait_ready()
        run = subprocess.run(
            [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", server.url,
             "--dataset-name", "custom", "--dataset-path", str(prompts), "--sharegpt-output-len", "24",
             "--num-prompts", "12", "--max-concurrency", "4", "--warmup-requests", "2",
             "--output-file", str(out), "--tag", "kdtree-bs4"],
            cwd=str(tmp_path), env=server_env(), capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for label in ("Output token throughput (tok/s):", "Median TPOT (ms):", "Accept length:"):
        assert label in run.stdout, run.stdout[-3000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["tag"] == "kdtree-bs4" and record["completed"] == 12
    assert record["output_throughput"] > 0 and record["median_tpot_ms"] > 0 and record["accept_length"] > 1
