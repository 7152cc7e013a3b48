"""End-to-end fixtures: tiny checkpoints built offline, and real SGLang servers on CPU as subprocesses.

The server runs with ``SGLANG_USE_CPU_ENGINE=1`` and this folder's ``sgl_kernel_stub`` first on
``PYTHONPATH`` (the CPU engine imports ``sgl_kernel`` CPU ops that no installable wheel provides; see the
stub's docstring). The tiny models are built once per session into ``$KDTREE_TINY_MODELS`` (default: a
pytest temp dir); a folder that already holds a build of the current generator is reused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STUB_DIR = HERE / "sgl_kernel_stub"
REPO = HERE.parent.parent

sys.path.insert(0, str(HERE))
import make_tiny_models  # noqa: E402

STARTUP_TIMEOUT_S = float(os.environ.get("KDTREE_E2E_STARTUP_TIMEOUT", "240"))


# The generator's output, committed (1.6 MB): fitting the four models takes 10-20 min on 2 cores, more than
# the rest of the suite. tests/test_tiny_models.py fails when it no longer matches the generator.
COMMITTED_TINY_MODELS = HERE / "tiny_models"


def committed_models_current() -> bool:
    """Whether the committed models were built by this exact generator (its manifest's source hash)."""
    manifest = COMMITTED_TINY_MODELS / "MANIFEST.json"
    return (manifest.exists()
            and json.loads(manifest.read_text()).get("source_hash") == make_tiny_models.source_hash())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    root = os.environ.get("KDTREE_TINY_MODELS")
    if root:
        out = Path(root)
    elif committed_models_current():
        return COMMITTED_TINY_MODELS
    else:
        out = tmp_path_factory.mktemp("tiny_models")
    make_tiny_models.ensure_built(out)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # every round checks that SGLang's host lengths, which the round reads instead of the device's, are exact
    env.setdefault("KDTREE_CHECK_HOST_LENS", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(STUB_DIR), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    # Two slow cores: one intra-op thread per process keeps the scheduler and tokenizer processes from
    # fighting over them.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def base_server_args(model_path: Path, port: int, overlap: bool = True) -> list[str]:
    """``overlap``: SGLang's overlap scheduler, on by default as in SGLang (off: ``--disable-overlap-schedule``)."""
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--dtype", "float32",
        "--disable-cuda-graph",
        *([] if overlap else ["--disable-overlap-schedule"]),
        "--mem-fraction-static", "0.05",
        "--max-total-tokens", "16384",
        "--max-running-requests", "32",
        "--chunked-prefill-size", "1024",
        "--page-size", "1",
        "--skip-server-warmup",
        # an idle SGLang scheduler otherwise polls at 100 % of a core (SGLang's IdleSleeper docstring): the
        # session's servers that wait for their next test would take CPU from the one under test
        "--sleep-on-idle",
        "--log-level", "warning",
    ]


# SGLang's subprocess watchdog (polling once a second) prints this when a scheduler or detokenizer has died;
# "-9" means SIGKILL. Neither our code nor SGLang's sends it to a child that is still starting, except the
# launcher's own cleanup (``kill_process_tree``), which SIGKILLs the launcher right after its children, before
# the watchdog can look; that path also logs the failure that caused it. On a small shared CI box the sender
# is the kernel's OOM killer (seen in CI: a third server's detokenizer, two servers up).
_EXTERNAL_KILL = re.compile(r"Subprocess (\w+) \(pid=\d+\) crashed with exit code -9\b")


def killed_from_outside(returncode: int | None, log_text: str) -> str | None:
    """The name of the server subprocess that was SIGKILLed from outside during startup, else None.

    Both must hold: the launcher ended by SIGKILL (SGLang's cleanup after a dead child) and SGLang's
    watchdog reported a child that itself died of SIGKILL. A startup that fails in our code or SGLang's
    (a refused flag, a traceback) does not match and is never retried."""
    if returncode != -signal.SIGKILL:
        return None
    match = _EXTERNAL_KILL.search(log_text)
    return match.group(1) if match else None


class Server:
    """A running ``sglang.launch_server`` subprocess on 127.0.0.1; ``stop()`` ends its process group."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._args, self._env = args, env
        self.restarts = 0
        self._spawn()

    def _spawn(self) -> None:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self._args, env=server_env(self._env), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO))

    def _restart_after_external_kill(self, child: str) -> None:
        """Start the same server once more, keeping the killed start's log beside the new one."""
        self.stop()
        killed_log = self.log_path.with_suffix(".killed.log")
        self.log_path.replace(killed_log)
        warnings.warn(f"server on port {self.port}: its {child} was SIGKILLed from outside during startup "
                      f"(on a small CI box, the OOM killer); started once more. First log: {killed_log}")
        self.restarts += 1
        self._spawn()

    def log_tail(self, n: int = 60) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if not self._log.closed:
                    self._log.flush()
                child = killed_from_outside(self.proc.returncode, self.log_path.read_text(errors="replace"))
                if child is not None and self.restarts == 0:
                    self._restart_after_external_kill(child)
                    deadline = time.time() + timeout
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def generate(self, payload: dict, timeout: float = 300) -> dict | list:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM the whole process group (launcher, scheduler, detokenizer), then SIGKILL stragglers.
        Returns the launcher's exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # children (scheduler, detokenizer) share the group; make sure none outlives the test
        try:
            os.killpg(self.proc.pid, 0)
            time.sleep(2)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return self.proc.returncode


def start_server(model_path: Path, log_dir: Path, extra: list[str] | None = None, name: str = "server",
                 env: dict | None = None, overlap: bool = True) -> Server:
    port = free_port()
    args = base_server_args(model_path, port, overlap) + list(extra or [])
    return Server(args, log_dir / f"{name}-{port}.log", env)


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server_logs")


# The DeepSeek-V3 target (MLA + MoE through the CPU verify patches) doubles every server module's time: it is in
# the extended set, not CI's (tests/e2e/README.md).
@pytest.fixture(scope="session", params=["llama", pytest.param("dsv3", marks=pytest.mark.extended)])
def plain_server(request, tiny_models, server_logs):
    """The target served without speculative decoding and without overlap scheduling (the reference for
    exactness: the KDTREE servers, overlapped or not, must equal it)."""
    server = start_server(tiny_models / request.param, server_logs, name=f"plain-{request.param}", overlap=False)
    server.wait_ready()
    server.model_name = request.param
    yield server
    server.stop()
