"""The testbed pair (``testbed/``, its ``--tiny`` build) served by real SGLang CPU servers through
``python -m testbed.acceptance``: plain and KDTREE at budgets 15 and 63, greedy and T = 1.

The tiny pair is trained for seconds, so its acceptance says nothing about a real drafter (its trees are mostly
one level deep); what this checks is that the pair's checkpoints serve, that KDTREE's greedy output is the plain
server's, and that the report's figures agree with one another. DFLASH does not serve on the CPU: SGLang 0.5.23
refuses it at startup, and the report must say so rather than drop the server. The ``kdtree-B`` servers run without
SGLang's overlap scheduler (as on CUDA), so every request-round of the round log is a verify SGLang counts. About 3
minutes on 2 cores (one server at a time, beside the session's plain server): extended.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.extended]

BUDGETS = (15, 63)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.fixture(scope="module")
def acceptance_dir(tmp_path_factory):
    pair = tmp_path_factory.mktemp("pair")
    build = subprocess.run([sys.executable, "-m", "testbed.build_pair", "--out", str(pair), "--tiny",
                            "--device", "cpu"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    out = tmp_path_factory.mktemp("acceptance")
    # one server at a time: the session's plain server may be up too, and three at once have been OOM-killed in CI
    run = subprocess.run([sys.executable, "-m", "testbed.acceptance", "--pair", str(pair), "--out", str(out),
                          "--device", "cpu", "--prompts", "4", "--new-tokens", "24", "--at-once", "1",
                          "--budgets", *map(str, BUDGETS)],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "greedy output vs plain" in run.stdout
    return out


@pytest.fixture(scope="module")
def report(acceptance_dir) -> dict:
    return json.loads((acceptance_dir / "acceptance.json").read_text())


@pytest.fixture(scope="module")
def outputs(acceptance_dir) -> dict:
    """``{"KIND@T=t": [per request: output_ids and SGLang's meta_info figures]}``"""
    with gzip.open(acceptance_dir / "outputs.json.gz", "rt") as f:
        return json.load(f)


def test_kdtree_greedy_output_is_the_plain_servers(report):
    for b in BUDGETS:
        assert report["identity"][f"kdtree-{b}"] == {"prompts": 4, "mismatches": 0, "listed": []}
    plain = report["servers"]["plain"]["phases"]
    assert plain["0"]["completion_tokens"] == plain["1"]["completion_tokens"] == 4 * 24


def test_dflash_refusal_is_in_the_report(report):
    assert "not supported by CpuSRTPlatform" in report["servers"]["dflash"]["error"]
    assert "dflash" not in report and "dflash" not in report["identity"]


def test_figures_agree_with_one_another(report, outputs):
    assert list(report["curve"]) == list(report["curve_t1"]) == [str(b) for b in BUDGETS]
    for b in BUDGETS:
        for key in ("0", "1"):
            phase = report["servers"][f"kdtree-{b}"]["phases"][key]
            rounds = phase["rounds"]
            assert phase["completion_tokens"] == 4 * 24 and rounds["graph_rounds"] == 0
            # one pinned width: the width choice's realised accept length is the round log's own
            assert rounds["realised"] == pytest.approx(rounds["tau"], abs=1e-3)
            assert 1.0 <= rounds["predicted_raw"] <= b + 1 and 1.0 <= rounds["tau"] <= 16
            # per depth, the drafter's reach sums to its expected accepted draft tokens
            assert sum(rounds["depth"]["predicted"]) == pytest.approx(rounds["predicted_raw"] - 1, abs=2e-3)
            assert sum(rounds["depth"]["realised"]) == pytest.approx(rounds["tau"] - 1, abs=1e-3)
            # the curve is the pooled tau (tokens over verify rounds), not the mean over requests of SGLang's
            # spec_accept_length: with 24 tokens per request the mean of 24 / v_i is at least 24 * 4 / sum(v_i)
            # (arithmetic against harmonic mean), equal only when every request took as many rounds
            requests = outputs[f"kdtree-{b}@T={key}"]
            verifies = [r["spec_verify_ct"] for r in requests]
            assert [r["completion_tokens"] for r in requests] == [24] * 4 and sum(verifies) == phase["verify_rounds"]
            assert phase["tau_pooled"] == round(4 * 24 / sum(verifies), 4) == \
                report["curve" if key == "0" else "curve_t1"][str(b)]
            assert phase["tau"] == round(statistics.fmean(24 / v for v in verifies), 4) >= phase["tau_pooled"]
            # off the overlap scheduler every request-round the round log records is one SGLang counts, and its
            # accepted tokens are the decode's (all but the prefill's token) plus what each request's last round
            # accepted past its 24th token (dropped by SGLang: at most that round's accepted draft tokens)
            assert rounds["request_rounds"] == phase["verify_rounds"]
            accepted = round(rounds["tau"] * rounds["request_rounds"])
            assert 0 <= accepted - (phase["completion_tokens"] - 4) <= 4 * len(rounds["depth"]["realised"])
