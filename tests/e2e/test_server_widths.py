"""Verify-width tiers on a real KDTREE CPU server: the width forced to change between rounds of the same requests
(``SGLANG_KDTREE_WIDTH_POLICY=cycle``) leaves greedy outputs identical to the plain server. The width chosen per
round (``auto``) is tested on ``test_server_no_overlap.py``'s server, which chooses among the same tiers.

Its own module so that the module-wide KDTREE server of ``test_server_kdtree.py`` has stopped before this one
starts (two servers up at once on the 2-core CI machine).
"""

from __future__ import annotations

import json

import pytest

from conftest import start_server
from server_requests import PROMPTS, TIERS, _concurrent, _greedy, _kdtree_args

pytestmark = pytest.mark.slow


def _serve(plain_server, tiny_models, server_logs, policy: str, env: dict | None = None):
    """Greedy outputs of the plain server and of a KDTREE server choosing among ``TIERS`` with ``policy`` (and
    ``env``), and the KDTREE server's round log."""
    name = plain_server.model_name
    payloads = [_greedy(p) for p in PROMPTS]
    plain = _concurrent(plain_server, payloads)
    log = server_logs / f"rounds-widths-{policy}-{name}.jsonl"
    log.unlink(missing_ok=True)
    server = start_server(tiny_models / name, server_logs, extra=_kdtree_args(tiny_models, name, None),
                          name=f"kdtree-widths-{policy}-{name}",
                          env={"SGLANG_KDTREE_VERIFY_WIDTHS": TIERS, "SGLANG_KDTREE_WIDTH_POLICY": policy,
                               "KDTREE_ROUND_LOG": str(log), **(env or {})})
    try:
        server.wait_ready()
        spec = _concurrent(server, payloads)
    finally:
        server.stop()
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    return plain, spec, rounds


@pytest.mark.extended
def test_widths_forced_to_change_every_round_stay_exact(plain_server, tiny_models, server_logs):
    """``cycle``: consecutive rounds of the same running requests verify 4, 8, 17, 4, ... rows."""
    plain, spec, rounds = _serve(plain_server, tiny_models, server_logs, "cycle")
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    widths = [r["width"]["width"] for r in rounds]
    assert set(widths) == {4, 8, 17}
    assert all(a != b for a, b in zip(widths, widths[1:]))  # the width changed between every two rounds
    for r in rounds:  # a cut tree has at most width - 1 nodes; the realised accept length fits the cut
        assert max(r["num_nodes"]) <= r["width"]["width"] - 1
        assert 1 <= r["width"]["realised"] <= r["width"]["width"]
    tiers = rounds[-1]["tiers"]
    assert sum(t["verifies"] for t in tiers.values()) == len(rounds)


@pytest.mark.extended
def test_a_stated_accept_curve_starts_a_server_that_stays_exact(plain_server, tiny_models, server_logs):
    """The benches' hook (``SGLANG_KDTREE_WIDTH_STATED_TAU``) on a real server: it starts, says so in its log, explores
    every tier as usual and serves the plain server's output. The choice it steers is tested in tests/test_widths.py
    (this server's few rounds per (batch, context) cell are all exploration)."""
    widths = sorted(int(w) for w in TIERS.split(","))
    stated = ",".join(f"{w}={50.0 if w == widths[-1] else 1.0}" for w in widths)
    plain, spec, rounds = _serve(plain_server, tiny_models, server_logs, "auto",
                                 {"SGLANG_KDTREE_WIDTH_STATED_TAU": stated})
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert [r["width"]["width"] for r in rounds[:6]] == [w for w in widths for _ in range(2)]
    log = max(server_logs.glob(f"kdtree-widths-auto-{plain_server.model_name}-*.log"), key=lambda f: f.stat().st_mtime)
    assert "SGLANG_KDTREE_WIDTH_STATED_TAU is set" in log.read_text()
