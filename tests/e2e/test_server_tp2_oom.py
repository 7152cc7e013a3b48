"""At tensor parallelism 2 (CPU, gloo; ``test_server_tp2.py``), an allocation failure inside a KDTREE round stops
the server. Its own module: the server it starts dies, and the TP 2 pair of ``test_server_tp2.py`` has stopped."""

from __future__ import annotations

import json
import urllib.error

import pytest

from conftest import start_server
from server_requests import PROMPTS, _greedy, _kdtree_args
from test_server_tp2 import TP, TP_ARGS, TP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_round_oom_at_tp2_stops_the_server(tiny_models, server_logs):
    """An allocation failure inside a round at TP > 1 is not retried or confined to its batch as at TP 1
    (``round_faults.run_round``): the error propagates on every rank (the other ranks are inside the round's
    collectives), both schedulers end, the launcher follows, and the request in flight gets no answer. Even
    ``round_oom``, which TP 1 retries successfully, does this. The server must stop promptly, not hang with one
    rank waiting in a collective."""
    faults = server_logs / "faults-tp2-oom.json"
    faults.unlink(missing_ok=True)
    server = start_server(tiny_models / "llama", server_logs, extra=TP_ARGS + _kdtree_args(tiny_models, "llama"),
                          name="kdtree-tp2-oom", env={**TP_ENV, "KDTREE_TEST_FAULTS": str(faults)})
    try:
        server.wait_ready()
        assert len(server.generate(_greedy(PROMPTS[0]))["output_ids"]) > 0
        faults.write_text(json.dumps({"kdtree-oom-tp2": "round_oom"}))
        try:
            answer = server.generate(dict(_greedy(PROMPTS[7]), rid="kdtree-oom-tp2"), timeout=120)
        except urllib.error.HTTPError as exc:  # an answer (TP 1 ends the batch with HTTP 503): not this limit
            answer = f"HTTP {exc.code}: {exc.read().decode(errors='replace')}"
        except (urllib.error.URLError, ConnectionError):
            answer = None
        assert answer is None, answer
        rc = server.proc.wait(timeout=60)
        log = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    assert rc != 0
    for rank in range(TP):
        assert f"TP{rank}] Scheduler hit an exception" in log, log[-3000:]
    # each rank raised the injected failure itself (not a collective error after its peer died)
    assert log.count("torch.OutOfMemoryError: KDTREE test fault round_oom") >= TP, log[-3000:]
    assert "KDTREE round: retrying once" not in log
