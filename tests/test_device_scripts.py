"""The GPU machine's shell scripts (``device/*.sh``) pass shellcheck at warning level: the device time a broken
script would waste is scarce. (Their deliberate word splitting of argument lists, ``${BENCH_ARGS:-}``, is style.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_service import assert_shellcheck_passes

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "device").glob("*.sh"))


def test_there_are_scripts():
    assert any(s.name == "device_server.sh" for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_warnings(script):
    assert_shellcheck_passes(script, "warning")
