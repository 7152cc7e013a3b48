"""Decode retraction on a real KDTREE CPU server (tiny Llama): SGLang's test switch ``SGLANG_TEST_RETRACT=1``
retracts running requests every third forward (their KV freed, re-prefilled later), which the tree round must
survive without losing or mixing a request's tokens.

Its own module, like ``test_server_small_budget.py``: two servers up at once on the 2-core CI machine, not three.
"""

from __future__ import annotations

import pytest

from conftest import start_server
from server_requests import PROMPTS, _concurrent, _greedy, _kdtree_args

# One target suffices: retraction and re-prefill are the scheduler's, the same for MHA and MLA pools (the tiny
# DeepSeek-V3 was also identical, 18 retractions, in a one-off run).
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.parametrize("plain_server", ["llama"], indirect=True)]


def test_retracted_requests_finish_identical_to_the_plain_server(plain_server, tiny_models, server_logs):
    payloads = [_greedy(p) for p in PROMPTS]
    plain = _concurrent(plain_server, payloads)
    server = start_server(tiny_models / "llama", server_logs, extra=_kdtree_args(tiny_models, "llama"),
                          name="kdtree-retract", env={"SGLANG_TEST_RETRACT": "1"})
    try:
        server.wait_ready()
        spec = _concurrent(server, payloads)
    finally:
        server.stop()
    assert sum(r["meta_info"].get("num_retractions", 0) for r in spec) > 0, "no request was retracted"
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
