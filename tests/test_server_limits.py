"""``tests/e2e/server_limits.py`` on log text: the CUDA probe's reading of a KDTREE server's ``KDTREE launch limits``
line (written by ``prewarm.log_launch_limits`` from ``gpu.limits.summary``) and its verdict under a profile."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sglang_kdtree.gpu import limits

_spec = importlib.util.spec_from_file_location("server_limits", Path(__file__).parent / "e2e" / "server_limits.py")
server_limits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_limits)


def _log(lim, records) -> str:
    limits.reset_records()
    for step, (variant, smem) in records.items():
        limits.record_launch(step, variant, smem)
    line = limits.summary(lim)
    limits.reset_records()
    return f"[2026-12-06 01:00:00] INFO noise\n[2026-12-06 01:00:01] KDTREE launch limits: {line}\nmore\n"


def test_reads_the_line_the_worker_writes():
    sm120 = limits.for_arch("12.0")
    got = server_limits.launch_limits(_log(sm120, {"mla_verify": ("mma_compact", 99_584),
                                                   "tree": ("build_trees_verify_list1", 18_224)}))
    assert got["arch"] == "sm_120" and got["largest_smem"] == 99_584
    assert got["variants"] == {"mla_verify": "mma_compact", "tree": "build_trees_verify_list1"}
    assert server_limits.launch_limits("no such line\n") is None


def test_profile_verdict():
    sm120, sm90 = limits.for_arch("12.0"), limits.for_arch("9.0")
    ok = {"launch_limits": server_limits.launch_limits(_log(sm120, {"mla_verify": ("mma_compact", 99_584)})),
          "mla_kernels": ["mma_compact"]}
    wgmma = {"launch_limits": server_limits.launch_limits(_log(sm90, {"mla_verify": ("wgmma", 230_912)})),
             "mla_kernels": ["wgmma"]}
    summary = {"servers": {"llama-kdtree-graph": ok, "llama-plain-graph": {}, "kimi-kdtree-graph": wgmma,
                           "dsv3-kdtree-graph": {"launch_limits": None}}}
    problems = server_limits.profile_holds(summary, "sm_120")
    assert len(problems) == 2
    assert problems[0].startswith("kimi-kdtree-graph: sm_90") and "230,912 B" in problems[0]
    assert problems[1] == "dsv3-kdtree-graph: no 'KDTREE launch limits' line in its log"
    assert server_limits.profile_holds({"servers": {"a-kdtree": ok}}, "sm_120") == []
