"""CI's CPU install set (.ci/requirements-cpu.txt) stays complete and consistent with the installed SGLang.

CI installs that file with ``pip install --no-deps``, so nothing would notice a missing requirement until an
import failed somewhere; these tests notice it first."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lock_module():
    spec = importlib.util.spec_from_file_location("_ci_lock_cpu", ROOT / ".ci" / "lock_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins():
    pins = {}
    for line in (ROOT / ".ci" / "requirements-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name] = version
    return pins


def test_lock_pins_the_sglang_that_pyproject_pins():
    pyproject = (ROOT / "pyproject.toml").read_text()
    wanted = re.search(r'"sglang==([^"]+)"', pyproject).group(1)
    assert _pins()["sglang"] == wanted


def test_lock_leaves_out_only_the_gpu_only_libraries():
    lock = _lock_module()
    from packaging.utils import canonicalize_name

    assert not {canonicalize_name(n) for n in lock.GPU_ONLY} & set(_pins())


def test_lock_is_the_installed_closure():
    """Every requirement reachable from sglang-kdtree[test] outside the GPU-only subtrees is pinned, at the
    installed version (closure() exits naming the first requirement that is not installed)."""
    pytest.importorskip("sglang")
    assert _lock_module().closure() == _pins()
