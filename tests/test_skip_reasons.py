"""The terminal summary's skips by reason (``tests/skip_reasons.py``, printed by ``tests/conftest.py``)."""

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from skip_reasons import GPU_GROUP, count_by_group, report_reason, skip_group, summary_lines


def test_reasons_group_with_their_details_normalised_away():
    assert skip_group("Skipped: needs a CUDA GPU: torch sees no CUDA device") == GPU_GROUP
    assert skip_group("needs a CUDA GPU: cupy does not import (No module named 'cupy'); install cupy-cuda13x") \
        == GPU_GROUP
    # the GPU tests that skip with gpu_unavailable_reason() itself
    assert skip_group("Skipped: torch sees no CUDA device") == GPU_GROUP
    assert skip_group("cupy cannot reach the CUDA driver: CUDARuntimeError") == GPU_GROUP
    # importorskip keeps the module, drops the error
    assert skip_group("Skipped: could not import 'matplotlib': No module named 'matplotlib'") \
        == "could not import 'matplotlib'"
    assert skip_group("could not import 'sglang.kernels.ops.moe.moe_align': cannot import name 'x'") \
        == "could not import 'sglang.kernels.ops.moe.moe_align'"
    # an exception's text after the colon, an install hint in parentheses
    assert skip_group("NVRTC unavailable: CUDA driver version is insufficient") == "NVRTC unavailable"
    assert skip_group("NVRTC unavailable: libnvrtc.so.13: cannot open shared object file") == "NVRTC unavailable"
    assert skip_group("Skipped: shellcheck is not installed (apt-get install -y shellcheck)") \
        == "shellcheck is not installed"
    # per-test files and architectures
    assert skip_group("mla/mla_tree_verify_wgmma.cu exists for sm_90a only, not sm_120") \
        == skip_group("topk/hist_g2.cu exists for sm_100a only, not sm_90") == "<file> exists for <arch> only, not <arch>"
    assert skip_group("no launcher picks a kernel of mla/mma.cu on sm_120") == "no launcher picks a kernel of <file> on <arch>"
    assert skip_group("KDTREE_KIMI_MODELS is not set") == "KDTREE_KIMI_MODELS is not set"
    assert skip_group("   ") == "(no reason given)"


def test_counts_and_lines():
    reasons = ["Skipped: needs a CUDA GPU: torch sees no CUDA device"] * 3 + [
        "Skipped: could not import 'matplotlib': No module named 'matplotlib'",
        "Skipped: torch sees no CUDA device",
        "Skipped: KDTREE_KIMI_MODELS is not set",
        "Skipped: could not import 'matplotlib': No module named 'matplotlib'",
    ]
    counts = count_by_group(reasons)
    assert counts == Counter({GPU_GROUP: 4, "could not import 'matplotlib'": 2, "KDTREE_KIMI_MODELS is not set": 1})
    assert summary_lines(counts) == ["skipped by reason (7 in all):", "  4 needs a CUDA GPU",
                                     "  2 could not import 'matplotlib'", "  1 KDTREE_KIMI_MODELS is not set"]
    assert summary_lines(Counter()) == []


def test_report_reason_reads_the_longrepr_tuple():
    assert report_reason(SimpleNamespace(longrepr=("tests/x.py", 3, "Skipped: no bash"))) == "Skipped: no bash"
    assert report_reason(SimpleNamespace(longrepr=None)) == ""


def test_the_session_prints_the_lines(tmp_path):
    """The hook end to end: a pytest run of three skips in two groups prints them just above pytest's "3 skipped"
    line (the run's conftest wires ``write_summary`` as ``tests/conftest.py`` does)."""
    here = Path(__file__).resolve().parent
    assert "write_summary(terminalreporter)" in (here / "conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(
        "def pytest_terminal_summary(terminalreporter, exitstatus, config):\n"
        "    from skip_reasons import write_summary\n\n"
        "    write_summary(terminalreporter)\n")
    (tmp_path / "test_some.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.skip(reason="needs a CUDA GPU: torch sees no CUDA device")
        def test_a():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_b(n):
            pytest.importorskip("no_such_module_here")
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here)] + ([os.environ["PYTHONPATH"]]
                                                                     if os.environ.get("PYTHONPATH") else [])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          "-c", os.devnull, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    at = lines.index("skipped by reason (3 in all):")
    assert lines[at:at + 4] == ["skipped by reason (3 in all):", "  2 could not import 'no_such_module_here'",
                                "  1 needs a CUDA GPU", lines[at + 3]] and lines[at + 3].startswith("3 skipped in ")
