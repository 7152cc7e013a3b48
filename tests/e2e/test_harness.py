"""The e2e harness's one retry (``conftest.Server.wait_ready``): a server whose child was SIGKILLed from outside
during startup is started once more; every other startup failure is reported at once. Fast (no SGLang):
the "server" is a small Python program that plays each case."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from conftest import Server, free_port, killed_from_outside

WATCHDOG_LINE = ("[2026-12-01 08:13:43] Subprocess detokenizer (pid=29661) crashed with exit code -9. "
                 "Triggering SIGQUIT for cleanup...")

# argv: --port PORT MARKER MODE. First start (no MARKER yet): writes MARKER, prints what MODE says, dies by
# SIGKILL (or exits 1). A later start serves /health with 200, except in mode external_kill_always.
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, signal, sys
    port, marker, mode = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if not os.path.exists(marker) or mode == "external_kill_always":
        open(marker, "w").close()
        if mode.startswith("external_kill"):
            print(%r, flush=True)
        elif mode == "traceback_kill":
            print("Traceback (most recent call last):\\nRuntimeError: scheduler init failed", flush=True)
        if mode == "exit_1":
            sys.exit(1)
        os.kill(os.getpid(), signal.SIGKILL)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""") % WATCHDOG_LINE


def _fake(tmp_path, mode: str) -> Server:
    args = [sys.executable, "-c", FAKE_SERVER, "--port", str(free_port()), str(tmp_path / "started"), mode]
    return Server(args, tmp_path / "fake.log")


def test_a_child_killed_from_outside_is_started_once_more(tmp_path):
    server = _fake(tmp_path, "external_kill")
    try:
        with pytest.warns(UserWarning, match="its detokenizer was SIGKILLed from outside during startup"):
            server.wait_ready(timeout=30)
        assert server.restarts == 1
        # The killed start's log is kept beside the new one.
        assert WATCHDOG_LINE in (tmp_path / "fake.killed.log").read_text()
        assert WATCHDOG_LINE not in server.log_path.read_text()
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["traceback_kill", "exit_1"])
def test_other_startup_failures_are_reported_at_once(tmp_path, mode):
    server = _fake(tmp_path, mode)
    try:
        with pytest.raises(RuntimeError, match="during startup"):
            server.wait_ready(timeout=30)
        assert server.restarts == 0
        assert not (tmp_path / "fake.killed.log").exists()
    finally:
        server.stop()


def test_the_retry_is_once(tmp_path):
    server = _fake(tmp_path, "external_kill_always")
    try:
        with pytest.warns(UserWarning, match="started once more"), pytest.raises(RuntimeError, match="-9 during startup"):
            server.wait_ready(timeout=30)
        assert server.restarts == 1
    finally:
        server.stop()


def test_killed_from_outside_needs_both_the_sigkill_and_the_watchdog_line():
    assert killed_from_outside(-signal.SIGKILL, "x\n" + WATCHDOG_LINE + "\n") == "detokenizer"
    assert killed_from_outside(-signal.SIGKILL, "Subprocess scheduler (pid=7) crashed with exit code -9.") == "scheduler"
    assert killed_from_outside(-signal.SIGKILL, "Subprocess scheduler (pid=7) crashed with exit code 1.") is None
    assert killed_from_outside(-signal.SIGKILL, "Subprocess scheduler (pid=7) crashed with exit code -90.") is None
    assert killed_from_outside(1, WATCHDOG_LINE) is None
    assert killed_from_outside(None, WATCHDOG_LINE) is None
    assert killed_from_outside(-signal.SIGKILL, "") is None
