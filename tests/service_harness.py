"""The harness of the service tests (tests/test_service*.py): the service's paths, fakes of SGLang's HTTP
server, of the service's Python and of systemctl, a site (model directories and env settings), the scripts run
with those fakes, an old DDTree install to upgrade from, and a byte-for-byte snapshot of a root.

For tests against a real server: ``run_healthcheck(base_url, timeout_s)`` (or the ``healthcheck`` fixture of
test_service.py) runs service/healthcheck.sh against it and returns the CompletedProcess.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVICE = REPO / "service"
UNIT_NAME = "sglang-k26-ddtree"
UNIT_FILE = SERVICE / f"{UNIT_NAME}.service"
LIBEXEC = "/usr/local/lib/sglang-kdtree"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}.service"
ENV_PATH = f"/etc/default/{UNIT_NAME}"
STATE_DIR = "var/lib/sglang-kdtree"
SCRIPTS = sorted(SERVICE.glob("*.sh"))

# The service's Python as install.sh's preflight sees it, when everything is in order.
GOOD_PYTHON_REPORT = [
    "python 3.12.3",
    "sglang 0.5.23",
    "sglang-kdtree 0.1.0",
    "sglang-pin 0.5.23",
    "kdtree resolves KDTreeSpec",
    "flags ok",
]


def run_healthcheck(base_url: str, timeout_s: int = 60, *extra: str, env: dict | None = None):
    """Run service/healthcheck.sh against ``base_url`` (e.g. http://127.0.0.1:30000); never raises on failure."""
    return subprocess.run(
        [str(SERVICE / "healthcheck.sh"), "--url", base_url, "--timeout", str(timeout_s), *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s + 360,
        env={**os.environ, **(env or {})},
    )


# ------------------------------------------------------------------------------------------ fakes


class FakeSGLang:
    """An HTTP server on 127.0.0.1 answering GET /health and POST /generate the way SGLang does."""

    def __init__(self, health_503_first=0, generate_status=200, completion_tokens=3):
        self.health_503_left = health_503_first
        self.generate_status = generate_status
        self.completion_tokens = completion_tokens
        self.generate_requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, body=b""):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path != "/health":
                    return self._reply(404)
                if fake.health_503_left > 0:
                    fake.health_503_left -= 1
                    return self._reply(503)
                self._reply(200)

            def do_POST(self):
                if self.path != "/generate":
                    return self._reply(404)
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.generate_requests.append(request)
                if fake.generate_status != 200:
                    return self._reply(fake.generate_status, b'{"error": "boom"}')
                body = {
                    "text": " Paris.",
                    "meta_info": {"prompt_tokens": 5, "completion_tokens": fake.completion_tokens},
                }
                self._reply(200, json.dumps(body).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def closed_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_python(tmp_path: Path, report=GOOD_PYTHON_REPORT) -> Path:
    """A stand-in for the service's Python: prints the preflight report; run with args, prints them."""
    lines = "\n".join(report)
    return write_executable(
        tmp_path / "fake-python",
        "#!/bin/sh\n"
        'if [ "$1" = - ]; then cat >/dev/null; cat <<\'EOF\'\n' + lines + "\nEOF\nexit 0; fi\n"
        'for arg in "$@"; do printf "%s\\n" "$arg"; done\n'
        'printf "HF_HUB_OFFLINE=%s\\n" "$HF_HUB_OFFLINE"\n',
    )


def fake_systemctl(tmp_path: Path, state="active", failing_verb="none") -> tuple[Path, Path]:
    log = tmp_path / "systemctl.log"
    script = write_executable(
        tmp_path / "fake-systemctl",
        f"#!/bin/sh\necho \"$*\" >> '{log}'\n"
        f'case "$1" in is-active) echo {state};; show) echo 0;; {failing_verb}) exit 1;; esac\nexit 0\n',
    )
    return script, log


def systemctl_calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def make_site(tmp_path: Path, **overrides) -> dict:
    """Model and drafter directories, a fake Python and the env settings pointing at them. A setting whose value
    is None is left out of the env file (write_env)."""
    model = tmp_path / "models" / "Kimi-K2.6-INT4"
    drafter = tmp_path / "models" / "Kimi-K2.6-DFlash"
    for path, config in ((model, {"kv_lora_rank": 512, "model_type": "kimi_k2"}), (drafter, {"block_size": 16})):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
    settings = {
        "KDTREE_PYTHON": str(fake_python(tmp_path)),
        "KDTREE_MODEL_PATH": str(model),
        "KDTREE_DRAFT_MODEL_PATH": str(drafter),
        "KDTREE_TP_SIZE": "8",
        "KDTREE_BUDGET": None,  # unset, as in the env example: the plugin's automatic verify widths
        "KDTREE_DFLASH_BLOCK_SIZE": "",
        "KDTREE_ATTENTION_BACKEND": "fa3",
        "KDTREE_HOST": "0.0.0.0",
        "KDTREE_PORT": "30000",
        "KDTREE_EXTRA_ARGS": '"--trust-remote-code"',
        "KDTREE_HEALTH_TIMEOUT_S": "5",
    }
    settings.update(overrides)
    return settings


def write_env(path: Path, settings: dict) -> Path:
    path.write_text("# test site\n" + "".join(f"{k}={v}\n" for k, v in settings.items() if v is not None))
    return path


def script_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SYSTEMCTL", "GPU_COUNT_CMD", "CUDA_VISIBLE_DEVICES")}
    env.update({"GPU_COUNT_CMD": "echo 8", "KDTREE_ENV_FILE": ""})
    env.update(extra)
    return env


def run_script(name: str, *args, timeout=120, **env):
    return subprocess.run(
        [str(SERVICE / name), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=script_env(**env)
    )


OLD_UNIT = b"""[Unit]
Description=Kimi K2.6 with DDTree (old fork)

[Service]
ExecStart=/opt/ddtree/bin/python -m sglang.launch_server --model-path /models/k26 --speculative-algorithm DDTREE
Restart=always

[Install]
WantedBy=multi-user.target
"""
OLD_ENV = b"MODEL=/models/k26\nPORT=30000\n"
SERVICE_GID = 4242


def old_root(tmp_path: Path) -> Path:
    """A root with the old DDTree service installed, plus neighbours install.sh must not touch."""
    root = tmp_path / "root"
    unit = root / UNIT_PATH.lstrip("/")
    unit.parent.mkdir(parents=True)
    unit.write_bytes(OLD_UNIT)
    (root / "etc/systemd/system/other.service").write_bytes(b"[Service]\nExecStart=/bin/true\n")
    env = root / ENV_PATH.lstrip("/")
    env.parent.mkdir(parents=True)
    env.write_bytes(OLD_ENV)
    env.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(env, 0, SERVICE_GID)  # a unit with User= reads its env file through the group
    (root / "usr/local/lib").mkdir(parents=True)
    (root / "var/lib").mkdir(parents=True)
    os.utime(unit, (1_600_000_000, 1_600_000_000))
    return root


def snapshot(root: Path, include_state=True) -> dict:
    """Every path under root with its type, mode, owner and bytes (file contents byte for byte)."""
    result = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not include_state and (rel == STATE_DIR or rel.startswith(STATE_DIR + "/")):
            continue
        info = path.lstat()
        kind = "dir" if path.is_dir() else "file"
        content = None if kind == "dir" else path.read_bytes()
        result[rel] = (kind, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, content)
    return result


def readme_blocks() -> list[list[str]]:
    """The ```bash blocks of service/README.md, in order, as their command lines (comment lines dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (SERVICE / "README.md").read_text(), re.S)
    return [[line for line in block.splitlines() if line.strip() and not line.startswith("#")] for block in blocks]
