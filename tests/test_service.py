"""The sglang-k26-ddtree service files (service/): the unit, launch.sh and the health check.

Everything runs on the CPU under a temporary root: systemctl, the GPU count and the service's Python are
replaced by fakes through SYSTEMCTL, GPU_COUNT_CMD and KDTREE_PYTHON, and the health check talks to a small
HTTP server on 127.0.0.1 that answers like SGLang's /health and /generate (tests/service_harness.py).
install.sh, rollback.sh and service/README.md's own commands: test_service_install.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from service_harness import (
    ENV_PATH,
    LIBEXEC,
    REPO,
    SCRIPTS,
    SERVICE,
    UNIT_FILE,
    UNIT_NAME,
    FakeSGLang,
    closed_port,
    fake_systemctl,
    make_site,
    readme_blocks,
    run_healthcheck,
    run_script,
    write_env,
    write_executable,
)


@pytest.fixture
def healthcheck():
    """``healthcheck(base_url, timeout_s=60, *extra_args)`` -> CompletedProcess of service/healthcheck.sh."""
    return run_healthcheck


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


def assert_shellcheck_passes(script: Path, severity: str) -> None:
    """``shellcheck --severity=SEVERITY`` finds nothing in ``script`` (skipped where shellcheck is missing, except
    on CI, which installs it)."""
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing on CI: apt-get install -y shellcheck")
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    result = subprocess.run(
        [shellcheck, "--external-sources", f"--severity={severity}", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_passes(script):
    assert_shellcheck_passes(script, "style")


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
        "--attention-backend", "fa3",
        "--page-size", "1",
        "--trust-remote-code",
        "--host", "0.0.0.0",
        "--port", "30000",
    ]  # fmt: skip


def readme_box_launch() -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """The top README's recommended launch for the RTX PRO 6000 box (its first launch_server block with
    ``--attention-backend triton``): the environment it sets and its launch_server flags as (flag, value) pairs."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "sglang.launch_server" in b and "--attention-backend triton" in b)
    words = shlex.split(block.replace("\\\n", " "))
    env = {}
    while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, server_flags(words)


def server_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """launch_server's flags in ``argv`` (after ``-m sglang.launch_server``) as sorted (flag, value) pairs."""
    args = argv[argv.index("sglang.launch_server") + 1 :]
    pairs = []
    for i, word in enumerate(args):
        if word.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
            pairs.append((word, value))
    return sorted(pairs)


def example_env_file(tmp_path: Path, site: dict) -> Path:
    """service/sglang-k26-ddtree.env.example unchanged but for its paths, pointed at this test's site."""
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    env_file = tmp_path / "example.env"
    env_file.write_text(
        example.replace("/opt/sglang-kdtree/venv/bin/python", site["KDTREE_PYTHON"])
        .replace("/models/Kimi-K2.6-INT4", site["KDTREE_MODEL_PATH"])
        .replace("/models/Kimi-K2.6-DFlash", site["KDTREE_DRAFT_MODEL_PATH"])
    )
    return env_file


def test_the_env_example_prints_the_readmes_recommended_launch(tmp_path):
    """`launch.sh --env-file <the example> --print` on the box (compute capability 12.0) prints the top README's
    recommended launch: no --speculative-num-draft-tokens (the automatic widths), triton, the memory flags; and the
    server it execs gets the README's environment (Marlin, the widths sized for the card)."""
    site = make_site(tmp_path)
    env_file = example_env_file(tmp_path, site)
    readme_env, readme_flags = readme_box_launch()
    assert readme_env == {"SGLANG_KDTREE_MOE": "marlin", "SGLANG_KDTREE_VERIFY_WIDTHS": "16,32"}, readme_env
    assert "--speculative-num-draft-tokens" not in dict(readme_flags)

    result = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COMPUTE_CAP_CMD="echo 12.0")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[:3] == [site["KDTREE_PYTHON"], "-m", "sglang.launch_server"]
    paths = {"--model-path": site["KDTREE_MODEL_PATH"], "--speculative-draft-model-path": site["KDTREE_DRAFT_MODEL_PATH"]}
    expected = sorted((flag, paths.get(flag, value)) for flag, value in readme_flags)
    assert server_flags(argv) == expected
    assert "--speculative-num-draft-tokens" not in argv and "--speculative-dflash-block-size" not in argv
    assert "--disable-overlap-schedule" not in argv  # SGLang's overlap scheduler, its default

    # The server's environment: every line of the env file is exported to it, the README's variables included.
    env_dump = tmp_path / "server.env"
    python = write_executable(tmp_path / "env-python", f"#!/bin/sh\nenv > '{env_dump}'\n")
    env_file.write_text(env_file.read_text().replace(site["KDTREE_PYTHON"], str(python)))
    clean = {key: "" for key in readme_env}  # the test's own environment must not supply them
    result = run_script("launch.sh", "--env-file", env_file, GPU_COMPUTE_CAP_CMD="echo 12.0", **clean)
    assert result.returncode == 0, result.stderr
    server_env = dict(line.split("=", 1) for line in env_dump.read_text().splitlines() if "=" in line)
    for key, value in readme_env.items():
        assert server_env.get(key) == value, key
    assert server_env.get("HF_HUB_OFFLINE") == "1"


def test_the_env_example_leaves_the_budget_unset_and_says_how_to_pin_it():
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    assert not re.search(r"^\s*KDTREE_BUDGET=", example, re.M), "the example must leave KDTREE_BUDGET unset"
    assert re.search(r"^#\s*KDTREE_BUDGET=\d+$", example, re.M), "the example shows how to pin a width"
    flat = " ".join(line.lstrip("# ") for line in example.splitlines())
    # the cost of pinning is stated, as the projection it is
    assert "0.77x" in flat and "0.51x" in flat and "benchmarks/kimi_round.py" in flat and "not measurements" in flat
    lines = example.splitlines()
    assert "KDTREE_ATTENTION_BACKEND=triton" in lines and "SGLANG_KDTREE_MOE=marlin" in lines


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
    [("1", "", "2"), ("1024", "", "1025"), ("63", "16", "64"), (None, "", None), ("", "8", None)],
)
def test_launch_maps_budget_and_block_size(tmp_path, budget, block_size, expected_width):
    site = make_site(tmp_path, KDTREE_BUDGET=budget, KDTREE_DFLASH_BLOCK_SIZE=block_size)
    result = run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site), "--print")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    if expected_width is None:  # unset or empty: no width pinned, the plugin's automatic widths
        assert "--speculative-num-draft-tokens" not in argv
    else:
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
        ({"KDTREE_BUDGET": "auto"}, "8", "KDTREE_BUDGET 'auto' must be an integer in 1..1024 (or unset for the"),
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


def test_launch_lists_every_problem_of_a_broken_env_file_in_one_run(tmp_path):
    """Several bad values and bad lines: one run reports each, one error line apiece, exits 1 and prints no
    command. A key whose line the parser refused is reported at its line, not again as unset."""
    site = make_site(tmp_path, KDTREE_MODEL_PATH="/nonexistent/model", KDTREE_BUDGET="0",
                     KDTREE_DFLASH_BLOCK_SIZE="64", KDTREE_ATTENTION_BACKEND="flashmla", KDTREE_PORT="70000",
                     KDTREE_EXTRA_ARGS='"--trust-remote-code --page-size 16"', KDTREE_HOST=None,
                     KDTREE_TP_SIZE=None)  # fmt: skip
    env_file = write_env(tmp_path / "s.env", site)
    env_file.write_text(env_file.read_text() + "KDTREE_TP_SIZE=$TP\nexport HF_HUB_OFFLINE=1\nnot a setting\n")
    lines = len(env_file.read_text().splitlines())
    result = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COUNT_CMD="echo 4")
    assert result.returncode == 1 and result.stdout == ""
    expected = [
        f"s.env:{lines - 2}: 'KDTREE_TP_SIZE' contains '$' or '\\'",
        f"s.env:{lines - 1}: drop the 'export' keyword",
        f"s.env:{lines}: expected KEY=VALUE, got 'not a setting'",
        "KDTREE_MODEL_PATH '/nonexistent/model' is not a directory",
        "KDTREE_BUDGET '0' must be an integer in 1..1024",
        "KDTREE_DFLASH_BLOCK_SIZE '64' must be an integer in 2..32",
        "KDTREE_ATTENTION_BACKEND 'flashmla' cannot verify a tree",
        "KDTREE_HOST is not set",
        "KDTREE_PORT '70000' must be an integer in 1..65535",
        "KDTREE_EXTRA_ARGS repeats '--page-size'",
    ]
    errors = result.stderr.splitlines()
    assert all(line.startswith("launch.sh: error: ") for line in errors), result.stderr
    assert len(errors) == len(expected), result.stderr
    for message in expected:
        assert sum(message in line for line in errors) == 1, f"{message!r} not reported once:\n{result.stderr}"
    # The TP line was refused, so TP_SIZE is neither reported unset nor compared with the 4 visible GPUs.
    assert "KDTREE_TP_SIZE is not set" not in result.stderr and "GPU(s) are visible" not in result.stderr


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
