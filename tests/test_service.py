"""The sglang-k26-ddtree service files (service/): unit, launch, install, rollback and health check.

Everything runs on the CPU under a temporary root: systemctl, the GPU count and the service's Python are
replaced by fakes through SYSTEMCTL, GPU_COUNT_CMD and KDTREE_PYTHON, and the health check talks to a small
HTTP server on 127.0.0.1 that answers like SGLang's /health and /generate.

``test_readme_steps_work_as_written_in_a_scratch_root`` runs service/README.md's commands themselves, under a
temporary root, with a real venv, a real install of the plugin and its real Python checks.

For tests against a real server: ``run_healthcheck(base_url, timeout_s)`` (or the ``healthcheck`` fixture)
runs service/healthcheck.sh against it and returns the CompletedProcess.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path

import pytest

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


@pytest.fixture
def healthcheck():
    """``healthcheck(base_url, timeout_s=60, *extra_args)`` -> CompletedProcess of service/healthcheck.sh."""
    return run_healthcheck


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
    """Model and drafter directories, a fake Python and the env settings pointing at them."""
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
        "KDTREE_BUDGET": "64",
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


# ------------------------------------------------------------------------------------------ unit and lint


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install -y systemd)")
    text = UNIT_FILE.read_text()
    # `verify` insists that ExecStart*= binaries exist: point the installed paths at copies under tmp_path.
    assert text.count(LIBEXEC + "/") == 3  # Documentation=, ExecStart=, ExecStartPost=
    libexec = tmp_path / "libexec"
    libexec.mkdir()
    for script in ("launch.sh", "healthcheck.sh"):
        shutil.copy2(SERVICE / script, libexec / script)
    unit = tmp_path / UNIT_FILE.name
    unit.write_text(text.replace(LIBEXEC, str(libexec)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    complaints = [line for line in result.stderr.splitlines() if UNIT_FILE.name in line]
    assert result.returncode == 0 and not complaints, result.stderr

    # The check has teeth: a missing ExecStart binary and an unknown key are both reported.
    (libexec / "launch.sh").unlink()
    unit.write_text(unit.read_text().replace("LimitCORE=0", "LimitCORES=0"))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "LimitCORES" in result.stderr


def test_unit_runs_the_installed_launcher_with_the_installed_env_file():
    lines = UNIT_FILE.read_text().splitlines()
    assert f"ExecStart={LIBEXEC}/launch.sh --env-file {ENV_PATH}" in lines
    assert f"ExecStartPost={LIBEXEC}/healthcheck.sh --env-file {ENV_PATH}" in lines
    assert "Restart=on-failure" in lines and "TimeoutStartSec=45min" in lines
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    # The health wait in the example must end before systemd's start timeout kills the unit.
    health_s = int(next(l for l in example.splitlines() if l.startswith("KDTREE_HEALTH_TIMEOUT_S=")).split("=")[1])
    assert health_s < 45 * 60


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_passes(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing on CI: apt-get install -y shellcheck")
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    result = subprocess.run(
        [shellcheck, "--external-sources", "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------ launch.sh


def test_launch_prints_the_production_command(tmp_path):
    site = make_site(tmp_path)
    env_file = write_env(tmp_path / "site.env", site)
    result = run_script("launch.sh", "--env-file", env_file, "--print")
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout) == [
        site["KDTREE_PYTHON"], "-m", "sglang.launch_server",
        "--model-path", site["KDTREE_MODEL_PATH"],
        "--tp", "8",
        "--speculative-algorithm", "kdtree",
        "--speculative-draft-model-path", site["KDTREE_DRAFT_MODEL_PATH"],
        "--speculative-num-draft-tokens", "65",
        "--attention-backend", "fa3",
        "--page-size", "1",
        "--trust-remote-code",
        "--host", "0.0.0.0",
        "--port", "30000",
    ]  # fmt: skip


def test_launch_reads_the_example_env_file(tmp_path):
    site = make_site(tmp_path)
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    example = (
        example.replace("/opt/sglang-kdtree/venv/bin/python", site["KDTREE_PYTHON"])
        .replace("/models/Kimi-K2.6-INT4", site["KDTREE_MODEL_PATH"])
        .replace("/models/Kimi-K2.6-DFlash", site["KDTREE_DRAFT_MODEL_PATH"])
    )
    env_file = tmp_path / "example.env"
    env_file.write_text(example)
    result = run_script("launch.sh", "--env-file", env_file, "--print")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "65"
    assert argv[argv.index("--attention-backend") + 1] == "fa3"
    assert "--speculative-dflash-block-size" not in argv  # empty: the drafter's own block size
    assert argv[-6:] == ["--trust-remote-code", "--disable-overlap-schedule", "--host", "0.0.0.0", "--port", "30000"]


def readme_blocks() -> list[list[str]]:
    """The ```bash blocks of service/README.md, in order, as their command lines (comment lines dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (SERVICE / "README.md").read_text(), re.S)
    return [[line for line in block.splitlines() if line.strip() and not line.startswith("#")] for block in blocks]


def test_env_example_python_is_the_venv_that_the_readme_creates():
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    python = next(line for line in example.splitlines() if line.startswith("KDTREE_PYTHON=")).split("=", 1)[1]
    (venv_line,) = [line for line in readme_blocks()[0] if " -m venv " in line]
    assert python == venv_line.split(" -m venv ")[1].split()[0] + "/bin/python"
    readme = (SERVICE / "README.md").read_text()
    # the key table has a row for the interpreter, and every key of the example is documented
    assert re.search(r"^\|[^|\n]+\| `KDTREE_PYTHON`", readme, re.M), "KDTREE_PYTHON is missing from the key table"
    for key in sorted(set(re.findall(r"^(KDTREE_[A-Z_]+)=", example, re.M))):
        assert f"`{key}`" in readme, f"{key} is in the env example but not in service/README.md"
    # the plugin is not on the package index: the README installs it from a path or a wheel
    installs = [line for block in readme_blocks() for line in block if "pip install" in line]
    assert installs and not any(re.search(r"pip install\b.*\bsglang-kdtree\b", line) for line in installs)


@pytest.mark.parametrize(
    ("budget", "block_size", "expected_width"),
    [("1", "", "2"), ("1024", "", "1025"), ("63", "16", "64")],
)
def test_launch_maps_budget_and_block_size(tmp_path, budget, block_size, expected_width):
    site = make_site(tmp_path, KDTREE_BUDGET=budget, KDTREE_DFLASH_BLOCK_SIZE=block_size)
    result = run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site), "--print")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == expected_width
    if block_size:
        assert argv[argv.index("--speculative-dflash-block-size") + 1] == block_size
    else:
        assert "--speculative-dflash-block-size" not in argv


@pytest.mark.parametrize(
    ("overrides", "gpus", "message"),
    [
        ({"KDTREE_MODEL_PATH": "/nonexistent/model"}, "8", "KDTREE_MODEL_PATH '/nonexistent/model' is not a directory"),
        ({"KDTREE_DRAFT_MODEL_PATH": "/nonexistent/dflash"}, "8", "KDTREE_DRAFT_MODEL_PATH '/nonexistent/dflash'"),
        ({}, "4", "KDTREE_TP_SIZE=8 but only 4 GPU(s) are visible"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "8", "narrowed by CUDA_VISIBLE_DEVICES='0,1,2,3'"),
        ({"KDTREE_ATTENTION_BACKEND": "flashmla"}, "8", "KDTREE_ATTENTION_BACKEND 'flashmla' cannot verify a tree"),
        ({"KDTREE_ATTENTION_BACKEND": "flashinfer"}, "8", "does not apply the tree mask for MLA models"),
        ({"KDTREE_BUDGET": "0"}, "8", "KDTREE_BUDGET '0' must be an integer in 1..1024"),
        ({"KDTREE_BUDGET": "1025"}, "8", "KDTREE_BUDGET '1025'"),
        ({"KDTREE_BUDGET": "064"}, "8", "KDTREE_BUDGET '064'"),
        ({"KDTREE_DFLASH_BLOCK_SIZE": "64"}, "8", "KDTREE_DFLASH_BLOCK_SIZE '64' must be an integer in 2..32"),
        ({"KDTREE_PORT": "70000"}, "8", "KDTREE_PORT '70000'"),
        ({"KDTREE_EXTRA_ARGS": '"--page-size 16"'}, "8", "KDTREE_EXTRA_ARGS repeats '--page-size'"),
        ({"KDTREE_EXTRA_ARGS": "--tp=4"}, "8", "KDTREE_EXTRA_ARGS repeats '--tp'"),
        ({"KDTREE_PYTHON": None}, "8", "KDTREE_PYTHON is not set"),
        ({"KDTREE_PYTHON": "/nonexistent/python"}, "8", "KDTREE_PYTHON '/nonexistent/python' is not an executable"),
    ],
)
def test_launch_refuses_a_bad_site(tmp_path, overrides, gpus, message):
    site = make_site(tmp_path, **overrides)
    result = run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site), "--print",
                        GPU_COUNT_CMD=f"echo {gpus}")  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr
    assert result.stdout == ""


def test_launch_accepts_flashinfer_for_an_mha_model(tmp_path):
    site = make_site(tmp_path, KDTREE_ATTENTION_BACKEND="flashinfer")
    Path(site["KDTREE_MODEL_PATH"], "config.json").write_text('{"model_type": "llama", "num_key_value_heads": 8}')
    result = run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site), "--print")
    assert result.returncode == 0, result.stderr
    assert "--attention-backend flashinfer" in result.stdout


def test_launch_execs_the_server_with_the_env_file_exported(tmp_path):
    site = make_site(tmp_path, HF_HUB_OFFLINE="'1'", KDTREE_API_KEY="s3cret")
    result = run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site))
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()  # the fake Python prints its argv, then HF_HUB_OFFLINE
    assert printed[:2] == ["-m", "sglang.launch_server"]
    assert printed[-3:] == ["--api-key", "s3cret", "HF_HUB_OFFLINE=1"]
    shown = run_script("launch.sh", "--env-file", tmp_path / "s.env", "--print")
    assert "s3cret" not in shown.stdout
    assert shlex.split(shown.stdout)[-2:] == ["--api-key", "<KDTREE_API_KEY>"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("KDTREE_BUDGET=$BUDGET", "contains '$' or '\\'"),
        ("export KDTREE_BUDGET=64", "drop the 'export' keyword"),
        ("KDTREE BUDGET 64", "expected KEY=VALUE"),
    ],
)
def test_env_file_parser_refuses_ambiguous_lines(tmp_path, line, message):
    env_file = write_env(tmp_path / "s.env", make_site(tmp_path))
    env_file.write_text(env_file.read_text() + line + "\n")
    result = run_script("launch.sh", "--env-file", env_file, "--print")
    assert result.returncode != 0
    lineno = len(env_file.read_text().splitlines())
    assert f"s.env:{lineno}: " in result.stderr and message in result.stderr


# ------------------------------------------------------------------------------------------ healthcheck.sh


def test_healthcheck_passes_against_a_server_that_generates(healthcheck):
    with FakeSGLang(health_503_first=2) as server:
        result = healthcheck(server.url, 20)
    assert result.returncode == 0, result.stderr
    assert "healthy" in result.stdout and "generated 3 token(s)" in result.stdout
    assert server.generate_requests == [
        {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    ]


def test_healthcheck_fails_against_a_closed_port(healthcheck):
    port = closed_port()
    started = time.monotonic()
    result = healthcheck(f"http://127.0.0.1:{port}", 2)
    assert time.monotonic() - started < 30  # bounded: 2 s of waiting plus per-attempt limits
    assert result.returncode == 1
    assert f"http://127.0.0.1:{port}/health not ready after 2s" in result.stderr
    assert "no connection" in result.stderr


@pytest.mark.parametrize(
    ("server_kwargs", "message"),
    [
        ({"generate_status": 500}, "/generate answered HTTP 500"),
        ({"completion_tokens": 0}, "without completion tokens"),
        ({"health_503_first": 1000}, "last: GET /health answered HTTP 503"),
    ],
)
def test_healthcheck_reports_why_it_fails(healthcheck, server_kwargs, message):
    with FakeSGLang(**server_kwargs) as server:
        result = healthcheck(server.url, 2)
    assert result.returncode == 1
    assert message in result.stderr


def test_healthcheck_reads_host_and_port_from_the_env_file(tmp_path):
    with FakeSGLang() as server:
        site = make_site(tmp_path, KDTREE_HOST="0.0.0.0", KDTREE_PORT=str(server.port), KDTREE_API_KEY="k")
        result = run_script("healthcheck.sh", "--env-file", write_env(tmp_path / "s.env", site))
    assert result.returncode == 0, result.stderr
    assert f"healthy: http://127.0.0.1:{server.port}" in result.stdout


def test_healthcheck_gives_up_early_when_the_unit_failed(tmp_path):
    systemctl, _ = fake_systemctl(tmp_path, state="failed")
    started = time.monotonic()
    result = run_script("healthcheck.sh", "--url", f"http://127.0.0.1:{closed_port()}", "--timeout", "600",
                        "--unit", UNIT_NAME, SYSTEMCTL=str(systemctl))  # fmt: skip
    assert time.monotonic() - started < 60
    assert result.returncode == 1 and f"unit {UNIT_NAME} is failed" in result.stderr


# ------------------------------------------------------------------------------------------ install / rollback


def install(root, env_file, *args, systemctl=None, **env):
    extra = {"SYSTEMCTL": str(systemctl)} if systemctl else {}
    return run_script("install.sh", "--env-file", env_file, "--root", root, *args, **extra, **env)


def rollback(root, *args, systemctl=None):
    extra = {"SYSTEMCTL": str(systemctl)} if systemctl else {}
    return run_script("rollback.sh", "--root", root, *args, **extra)


def test_install_dry_run_changes_nothing(tmp_path):
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    env_file = write_env(tmp_path / "site.env", make_site(tmp_path, KDTREE_API_KEY="s3cret"))
    before = snapshot(root)
    result = install(root, env_file, "--dry-run", systemctl=systemctl)
    assert result.returncode == 0, result.stderr
    assert snapshot(root) == before
    assert "s3cret" not in result.stdout + result.stderr and "+KDTREE_API_KEY=<hidden>" in result.stdout
    assert systemctl_calls(log) == []
    out = result.stdout
    assert f"replace {root}{UNIT_PATH}" in out and f"replace {root}{ENV_PATH}" in out
    assert f"create  {root}{LIBEXEC}/launch.sh (mode 0755)" in out
    assert "-ExecStart=/opt/ddtree/bin/python" in out  # the unit diff is shown
    assert "+KDTREE_BUDGET=64" in out  # and the env diff
    assert f"restart {UNIT_NAME}" in out and "dry run: nothing was changed" in out


def test_install_then_rollback_restores_the_old_service_byte_for_byte(tmp_path):
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    before = snapshot(root)
    with FakeSGLang() as server:
        site = make_site(tmp_path, KDTREE_HOST="127.0.0.1", KDTREE_PORT=str(server.port))
        env_file = write_env(tmp_path / "site.env", site)
        first = install(root, env_file, systemctl=systemctl)
        assert first.returncode == 0, first.stderr
        assert "installed and healthy" in first.stdout
        assert len(server.generate_requests) == 1

        assert (root / UNIT_PATH.lstrip("/")).read_bytes() == UNIT_FILE.read_bytes()
        installed_env = root / ENV_PATH.lstrip("/")
        assert installed_env.read_bytes() == env_file.read_bytes()
        assert stat.S_IMODE(installed_env.stat().st_mode) == 0o640
        if os.geteuid() == 0:
            assert installed_env.stat().st_gid == SERVICE_GID
        assert os.access(root / LIBEXEC.lstrip("/") / "launch.sh", os.X_OK)
        assert systemctl_calls(log) == ["is-active sglang-k26-ddtree", "daemon-reload",
                                        f"restart {UNIT_NAME}", f"show -p NRestarts --value {UNIT_NAME}"]  # fmt: skip

        # Idempotent: the same inputs again change nothing and push no second backup.
        log.unlink(missing_ok=True)
        again = install(root, env_file, systemctl=systemctl)
        assert again.returncode == 0, again.stderr
        assert "already installed" in again.stdout
        assert systemctl_calls(log) == []
        assert len(list((root / STATE_DIR / "backups").glob("[0-9]*"))) == 1

        # The installed launcher builds the command from the installed env file.
        shown = subprocess.run(
            [str(root / LIBEXEC.lstrip("/") / "launch.sh"), "--env-file", str(installed_env), "--print"],
            capture_output=True, text=True, timeout=60, env=script_env())  # fmt: skip
        assert shown.returncode == 0 and "--speculative-algorithm kdtree" in shown.stdout, shown.stderr

    log.unlink(missing_ok=True)
    undone = rollback(root, systemctl=systemctl)
    assert undone.returncode == 0, undone.stderr
    assert snapshot(root, include_state=False) == before
    assert systemctl_calls(log) == [f"stop {UNIT_NAME}", "daemon-reload", f"start --no-block {UNIT_NAME}"]
    # Nothing left to undo.
    assert rollback(root, systemctl=systemctl).returncode != 0


def test_backups_stack_so_two_rollbacks_walk_back_two_installs(tmp_path):
    root = old_root(tmp_path)
    before = snapshot(root)
    first_env = write_env(tmp_path / "a.env", make_site(tmp_path, KDTREE_BUDGET="64"))
    second_env = write_env(tmp_path / "b.env", make_site(tmp_path, KDTREE_BUDGET="128"))
    assert install(root, first_env, "--no-restart").returncode == 0
    after_first = snapshot(root, include_state=False)
    result = install(root, second_env, "--no-restart")
    assert result.returncode == 0, result.stderr
    assert "-KDTREE_BUDGET=64" in result.stdout and "+KDTREE_BUDGET=128" in result.stdout
    assert rollback(root).returncode == 0
    assert snapshot(root, include_state=False) == after_first
    assert rollback(root).returncode == 0
    assert snapshot(root, include_state=False) == before


def test_install_on_a_fresh_box_and_rollback_leaves_no_trace(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "var/lib").mkdir(parents=True)
    before = snapshot(root)
    systemctl, log = fake_systemctl(tmp_path, state="inactive")
    env_file = write_env(tmp_path / "site.env", make_site(tmp_path))
    result = install(root, env_file, "--no-restart", systemctl=systemctl)
    assert result.returncode == 0, result.stderr
    assert (root / LIBEXEC.lstrip("/") / "rollback.sh").exists()
    # The installed copy of rollback.sh undoes its own installation.
    undone = subprocess.run([str(root / LIBEXEC.lstrip("/") / "rollback.sh"), "--root", str(root)],
                            capture_output=True, text=True, timeout=60, env=script_env(SYSTEMCTL=str(systemctl)))  # fmt: skip
    assert undone.returncode == 0, undone.stderr
    assert snapshot(root, include_state=False) == before
    assert "it stays stopped" in undone.stdout
    assert f"start --no-block {UNIT_NAME}" not in systemctl_calls(log)


def test_install_rolls_back_by_itself_when_the_healthcheck_fails(tmp_path):
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    before = snapshot(root)
    site = make_site(tmp_path, KDTREE_HOST="127.0.0.1", KDTREE_PORT=str(closed_port()), KDTREE_HEALTH_TIMEOUT_S="2")
    result = install(root, write_env(tmp_path / "site.env", site), systemctl=systemctl)
    assert result.returncode != 0
    assert "the healthcheck failed after the restart" in result.stderr
    assert "the previous files were restored and the previous service restarted" in result.stderr
    assert "not ready after 2s" in result.stderr
    assert snapshot(root, include_state=False) == before
    calls = systemctl_calls(log)
    assert calls[-3:] == [f"stop {UNIT_NAME}", "daemon-reload", f"start --no-block {UNIT_NAME}"]


def test_install_rolls_back_by_itself_when_the_restart_fails(tmp_path):
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path, failing_verb="restart")
    before = snapshot(root)
    result = install(root, write_env(tmp_path / "site.env", make_site(tmp_path)), systemctl=systemctl)
    assert result.returncode != 0
    assert f"systemctl restart {UNIT_NAME} failed" in result.stderr
    assert "the previous files were restored" in result.stderr
    assert snapshot(root, include_state=False) == before
    assert systemctl_calls(log)[-3:] == [f"stop {UNIT_NAME}", "daemon-reload", f"start --no-block {UNIT_NAME}"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing model", "KDTREE_MODEL_PATH '/nonexistent/Kimi-K2.6-INT4' is not a directory"),
        ("too few GPUs", "KDTREE_TP_SIZE=8 but only 2 GPU(s) are visible"),
        ("plugin not found", "--speculative-algorithm kdtree does not resolve after sglang.srt.plugins.load_plugins()"),
        ("plugin not installed", "sglang-kdtree is not installed in the environment of KDTREE_PYTHON"),
        ("wrong sglang", "SGLang 0.5.9 is installed but sglang-kdtree 0.1.0 needs sglang==0.5.23"),
        ("old python", "Python 3.10.12 is too old"),
        ("flags refused", "the command line would not start: KDTREE: overlap scheduling is not supported yet"),
        ("python does not run", "could not run the service's Python (KDTREE_PYTHON"),
        ("drop-in overrides ExecStart", "overrides ExecStart="),
    ],
)
def test_preflight_failure_stops_the_install_and_launch_print_refuses_it_too(tmp_path, case, message):
    """What install.sh's preflight refuses, `launch.sh --print` refuses with the same message: both run
    launch.sh's checks and kdtree_service_checks. The drop-in is the exception: it is about the installed unit,
    not the env file, so only the install checks it."""
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    site = make_site(tmp_path)
    gpus = "8"
    report = list(GOOD_PYTHON_REPORT)
    if case == "missing model":
        site["KDTREE_MODEL_PATH"] = "/nonexistent/Kimi-K2.6-INT4"
    elif case == "too few GPUs":
        gpus = "2"
    elif case == "plugin not found":
        report[report.index("kdtree resolves KDTreeSpec")] = "kdtree error ValueError: Unknown speculative algorithm name: KDTREE"
    elif case == "plugin not installed":
        report[2:4] = ["sglang-kdtree missing", "sglang-pin none"]
    elif case == "wrong sglang":
        report[1] = "sglang 0.5.9"
    elif case == "old python":
        report[0] = "python 3.10.12"
    elif case == "flags refused":
        report[-1] = "flags error KDTREE: overlap scheduling is not supported yet; add --disable-overlap-schedule"
    elif case == "python does not run":
        site["KDTREE_PYTHON"] = str(write_executable(tmp_path / "broken-python", "#!/bin/sh\necho boom >&2\nexit 3\n"))
    elif case == "drop-in overrides ExecStart":
        dropin = root / (UNIT_PATH.lstrip("/") + ".d") / "override.conf"
        dropin.parent.mkdir()
        dropin.write_text("[Service]\nExecStart=\nExecStart=/opt/ddtree/run.sh\n")
    if report != GOOD_PYTHON_REPORT:
        fake_python(tmp_path, report)
    env_file = write_env(tmp_path / "site.env", site)
    before = snapshot(root)
    result = install(root, env_file, "--dry-run", systemctl=systemctl, GPU_COUNT_CMD=f"echo {gpus}")
    assert result.returncode != 0
    assert message in result.stderr, result.stdout + result.stderr
    assert "preflight failed; nothing was changed" in result.stderr
    assert snapshot(root) == before
    assert systemctl_calls(log) == []

    shown = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COUNT_CMD=f"echo {gpus}")
    if case == "drop-in overrides ExecStart":
        assert shown.returncode == 0, shown.stderr
    else:
        assert shown.returncode != 0 and shown.stdout == ""
        assert message in shown.stderr, shown.stderr


def test_launch_print_refuses_what_install_refuses_with_the_real_python(tmp_path):
    """With this environment's Python (SGLang and the plugin installed): an env file without
    --disable-overlap-schedule, which the server refuses at startup, is refused by `launch.sh --print` and by the
    install's dry run alike, before anything changes. (One refused flag here, the wiring: what
    ``doctor_launch.launch_args_problem`` refuses is tested in-process in test_doctor.py; each run here costs a
    Python that imports SGLang.)"""
    site = make_site(tmp_path, KDTREE_PYTHON=sys.executable, KDTREE_EXTRA_ARGS='"--trust-remote-code"')
    env_file = write_env(tmp_path / "site.env", site)
    refusal = re.compile(r"FAIL the command line would not start: .*overlap")

    shown = run_script("launch.sh", "--env-file", env_file, "--print", timeout=600)
    assert shown.returncode != 0 and shown.stdout == "", shown.stdout + shown.stderr
    assert refusal.search(shown.stderr), shown.stderr
    assert "ok   --speculative-algorithm kdtree resolves after load_plugins()" in shown.stderr

    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    before = snapshot(root)
    result = install(root, env_file, "--dry-run", systemctl=systemctl, timeout=600)
    assert result.returncode != 0
    assert refusal.search(result.stderr), result.stdout + result.stderr
    assert "preflight failed; nothing was changed" in result.stderr
    assert snapshot(root) == before
    assert systemctl_calls(log) == []


# ------------------------------------------------------------------------------------------ the README, as written


def test_readme_steps_work_as_written_in_a_scratch_root(tmp_path):
    """Every command of service/README.md, in order, under a scratch root: a new venv with the plugin installed
    from this checkout, doctor, `launch.sh --print`, the dry run, the install (restart and healthcheck), the check
    and the rollback; and the wheel route of step 1 into a second venv. What is changed to run here, and only
    that: paths under / move under the scratch root (install.sh and rollback.sh get --root); `sudo` is dropped;
    python3.12 / python3 is this interpreter; pip runs offline (--no-deps --no-index --no-build-isolation), and
    the new venvs see this environment's packages (SGLang and the rest) through a .pth line in place of
    downloading them (without a setuptools of their own, as python3.12's venv has none); systemctl is a fake,
    and the systemctl / journalctl lines of step 4 are skipped; the server the healthcheck talks to is a fake on
    127.0.0.1. The env file is the example with the model paths, host, port and health timeout of this test;
    its KDTREE_PYTHON goes through the same path rewrite as the commands, so it must name the venv that step 1
    creates."""
    blocks = readme_blocks()
    assert len(blocks) == 6, "service/README.md's bash blocks changed: update this walk-through"
    install_block, wheel_block, check_block, install_steps, check_steps, rollback_steps = blocks
    root, wheel_root, dist = tmp_path / "root", tmp_path / "wheel-root", tmp_path / "dist"
    old_root(tmp_path)
    before = snapshot(root)
    wheel_root.mkdir()
    systemctl, log = fake_systemctl(tmp_path)
    site = make_site(tmp_path)
    env_file = tmp_path / "site.env"
    installed_env = root / ENV_PATH.lstrip("/")

    def under_root(text: str, under: Path) -> str:
        return text.replace("/opt/sglang-kdtree", f"{under}/opt/sglang-kdtree").replace(LIBEXEC, f"{under}{LIBEXEC}")

    def rewrite(line: str, under: Path) -> str:
        line = under_root(re.sub(r"^sudo ", "", line), under)
        line = re.sub(r"\bpython3(\.\d+)? ", f"{sys.executable} ", line)
        line = line.replace("pip install ", "pip install --no-deps --no-index --no-build-isolation ")
        line = line.replace("pip wheel ", "pip wheel --no-build-isolation ")
        line = re.sub(r"\b(install|rollback)\.sh\b", rf"\1.sh --root {under}", line)
        return line.replace(" dist", f" {dist}").replace("site.env", str(env_file))

    def run(line: str, under: Path = root) -> subprocess.CompletedProcess:
        env = script_env(SYSTEMCTL=str(systemctl), KDTREE_ENV_FILE=str(installed_env),
                         PIP_DISABLE_PIP_VERSION_CHECK="1")
        result = subprocess.run(["bash", "-c", rewrite(line, under)], cwd=REPO, capture_output=True, text=True,
                                timeout=900, env=env)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        return result

    def see_these_packages(under: Path) -> None:
        """Stand in for downloading SGLang and the rest: the new venv sees this environment's packages."""
        python = under / "opt/sglang-kdtree/venv/bin/python"
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        Path(purelib, "these-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        # Python 3.12's venv has no setuptools; an older one's would shadow this environment's build tools
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True,
                       capture_output=True, env=script_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))

    # Step 1, from a path.
    assert install_block[0].startswith("cd /path/to/sglang-kdtree")  # the checkout: every command runs from REPO
    for line in install_block[1:]:
        result = run(line)
        if " -m venv " in line:
            see_these_packages(root)
    assert "python -m sglang_kdtree doctor" in install_block[-1]
    assert "ok    install: sglang-kdtree 0.1.0, installed" in result.stdout, result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("status: OK"), result.stdout

    # Step 1, from a wheel: built in the checkout, installed into a second venv.
    wheel = re.search(r"dist/(\S+\.whl)", wheel_block[-1]).group(1)
    run(next(line for line in install_block if " -m venv " in line), wheel_root)
    for line in wheel_block:
        run(line, wheel_root)
    assert (dist / wheel).is_file(), f"the README names {wheel}; built: {sorted(p.name for p in dist.iterdir())}"
    (info,) = (wheel_root / "opt/sglang-kdtree/venv/lib").glob("python3*/site-packages/sglang_kdtree-*.dist-info")
    assert not (info / "direct_url.json").exists() or "editable" not in (info / "direct_url.json").read_text()

    with FakeSGLang() as server:
        example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
        env_file.write_text(
            under_root(example, root)
            .replace("/models/Kimi-K2.6-INT4", site["KDTREE_MODEL_PATH"])
            .replace("/models/Kimi-K2.6-DFlash", site["KDTREE_DRAFT_MODEL_PATH"])
            .replace("KDTREE_HOST=0.0.0.0", "KDTREE_HOST=127.0.0.1")
            .replace("KDTREE_PORT=30000", f"KDTREE_PORT={server.port}")
            .replace("KDTREE_HEALTH_TIMEOUT_S=2400", "KDTREE_HEALTH_TIMEOUT_S=60")
        )
        # Step 2: the command line, with the checks of the service's Python.
        (line,) = check_block
        shown = run(line)
        argv = shlex.split(shown.stdout)
        assert argv[0] == f"{root}/opt/sglang-kdtree/venv/bin/python" and "--disable-overlap-schedule" in argv
        assert "ok   the command line passes SGLang's argument parser and KDTREE's startup checks" in shown.stderr

        # Step 3: the dry run changes nothing; the install restarts and passes the healthcheck.
        dry, done = (run(line) for line in install_steps)
        assert "dry run: nothing was changed" in dry.stdout
        assert "ok   SGLang 0.5.23, sglang-kdtree 0.1.0" in dry.stdout
        assert "ok   --speculative-algorithm kdtree resolves after load_plugins()" in dry.stdout
        assert "installed and healthy" in done.stdout
        assert (root / UNIT_PATH.lstrip("/")).read_bytes() == UNIT_FILE.read_bytes()
        assert installed_env.read_bytes() == env_file.read_bytes()

        # Step 4: the healthcheck line (systemctl and journalctl need a real systemd).
        skipped = [line for line in check_steps if line.startswith(("systemctl ", "journalctl "))]
        assert len(skipped) == 2
        for line in check_steps:
            if line not in skipped:
                assert "healthy" in run(line).stdout
        assert len(server.generate_requests) == 2  # the install's healthcheck, and step 4's

    # Step 5: the dry run lists, the rollback restores the old service byte for byte.
    log.unlink(missing_ok=True)
    dry, done = (run(line) for line in rollback_steps)
    after = snapshot(root, include_state=False)
    # the new venv stays (step 1 put it beside the old one, and the rollback leaves files it did not install)
    assert after.pop("opt/sglang-kdtree/venv/bin/python")
    assert {path: v for path, v in after.items() if path != "opt" and not path.startswith("opt/")} == before
    assert systemctl_calls(log) == [f"stop {UNIT_NAME}", "daemon-reload", f"start --no-block {UNIT_NAME}"]
