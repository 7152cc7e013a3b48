"""The GPU machine's shell scripts (``device/*.sh``) pass shellcheck at warning level: the device time a broken
script would waste is scarce. (Their deliberate word splitting of argument lists, ``${BENCH_ARGS:-}``, is style.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "device").glob("*.sh"))


def test_there_are_scripts():
    assert any(s.name == "device_server.sh" for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_warnings(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing on CI: apt-get install -y shellcheck")
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    result = subprocess.run([shellcheck, "--external-sources", "--severity=warning", str(script)],
                            capture_output=True, text=True, timeout=120, cwd=script.parent)
    assert result.returncode == 0, result.stdout + result.stderr
