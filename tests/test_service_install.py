"""The sglang-k26-ddtree service's install.sh and rollback.sh (service/), and service/README.md as written.

Everything runs on the CPU under a temporary root, with the fakes of tests/service_harness.py (systemctl, the
GPU count, the service's Python, SGLang's HTTP server). ``test_readme_steps_work_as_written_in_a_scratch_root``
runs service/README.md's commands themselves, under a temporary root, with a real venv, a real install of the
plugin and its real Python checks.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from service_harness import (
    ENV_PATH,
    GOOD_PYTHON_REPORT,
    LIBEXEC,
    REPO,
    SERVICE,
    SERVICE_GID,
    STATE_DIR,
    UNIT_FILE,
    UNIT_NAME,
    UNIT_PATH,
    FakeSGLang,
    closed_port,
    fake_python,
    fake_systemctl,
    make_site,
    old_root,
    readme_blocks,
    run_script,
    script_env,
    snapshot,
    systemctl_calls,
    write_env,
    write_executable,
)


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
    assert "+KDTREE_TP_SIZE=8" in out  # and the env diff
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
        ("flags refused", "the command line would not start: KDTREE: --speculative-eagle-topk 8 does not apply"),
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
        report[-1] = "flags error KDTREE: --speculative-eagle-topk 8 does not apply (DDTree's per-depth top-K ...)"
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


def test_preflight_lists_every_problem_of_the_env_file(tmp_path):
    """An env file with several problems: the install's preflight shows each of them as a FAIL line (launch.sh
    reports them all in one run) and changes nothing."""
    root = old_root(tmp_path)
    systemctl, log = fake_systemctl(tmp_path)
    site = make_site(tmp_path, KDTREE_MODEL_PATH="/nonexistent/Kimi-K2.6-INT4", KDTREE_BUDGET="2048",
                     KDTREE_PORT="0")  # fmt: skip
    env_file = write_env(tmp_path / "site.env", site)
    before = snapshot(root)
    result = install(root, env_file, "--dry-run", systemctl=systemctl, GPU_COUNT_CMD="echo 2")
    assert result.returncode != 0
    fails = [line for line in result.stderr.splitlines() if line.startswith("  FAIL ")]
    for message in ("KDTREE_MODEL_PATH '/nonexistent/Kimi-K2.6-INT4' is not a directory",
                    "KDTREE_TP_SIZE=8 but only 2 GPU(s) are visible", "KDTREE_BUDGET '2048'", "KDTREE_PORT '0'"):
        assert sum(message in line for line in fails) == 1, result.stderr
    assert len(fails) == 4, result.stderr
    assert "preflight failed; nothing was changed" in result.stderr
    assert snapshot(root) == before
    assert systemctl_calls(log) == []


def test_launch_print_refuses_what_install_refuses_with_the_real_python(tmp_path):
    """With this environment's Python (SGLang and the plugin installed): an env file with
    --speculative-eagle-topk 8, which the server refuses at startup, is refused by `launch.sh --print` and by the
    install's dry run alike, before anything changes. (One refused flag here, the wiring: what
    ``doctor_launch.launch_args_problem`` refuses is tested in-process in test_doctor.py; each run here costs a
    Python that imports SGLang.)"""
    site = make_site(tmp_path, KDTREE_PYTHON=sys.executable,
                     KDTREE_EXTRA_ARGS='"--trust-remote-code --speculative-eagle-topk 8"')
    env_file = write_env(tmp_path / "site.env", site)
    refusal = re.compile(r"FAIL the command line would not start: .*--speculative-eagle-topk 8 does not apply")

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
    python3 is this interpreter; pip runs offline (--no-deps --no-index --no-build-isolation), and
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
        assert argv[0] == f"{root}/opt/sglang-kdtree/venv/bin/python" and "--trust-remote-code" in argv
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
