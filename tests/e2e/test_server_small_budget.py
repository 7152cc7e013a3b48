"""Budget 2 on a real KDTREE CPU server (tiny Llama): the smallest tree, below half the draft block.

Its own module so that the module-wide KDTREE server of ``test_server_kdtree.py`` has stopped before this one
starts: two servers up at once (plain + this one), not three, on the 2-core CI machine.
"""

from __future__ import annotations

import pytest

from conftest import start_server
from server_requests import PROMPTS, _concurrent, _greedy, _kdtree_args

# One target suffices for the reservation geometry.
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.parametrize("plain_server", ["llama"], indirect=True)]


def test_small_budget_below_half_the_draft_block(plain_server, tiny_models, server_logs):
    """Budget 2 (N = 3 < block_size / 2): the draft block (8 rows) is wider than SGLang's DFLASH reserve
    of 2N slots, which ``sglang_kdtree/patches/decode_reserve.py`` widens; outputs stay identical to the plain
    server."""
    payloads = [_greedy(p) for p in PROMPTS]
    plain = _concurrent(plain_server, payloads)
    server = start_server(tiny_models / "llama", server_logs, extra=_kdtree_args(tiny_models, "llama", width=3),
                          name="kdtree-budget2")
    try:
        server.wait_ready()
        spec = _concurrent(server, payloads)
    finally:
        server.stop()
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    assert sum(r["meta_info"]["completion_tokens"] for r in spec) > sum(r["meta_info"]["spec_verify_ct"] for r in spec)
