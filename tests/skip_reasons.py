"""Skips counted by reason for the session's terminal summary (``tests/conftest.py``'s ``pytest_terminal_summary``).

pytest's own summary says only "N skipped"; that number mixes the GPU tests (skipped on a CPU-only machine) with
tests that lack an optional tool or package (matplotlib, shellcheck, NVRTC, ...). ``skip_group`` reduces one skip
reason to its group, with the per-test details normalised away; ``count_by_group`` counts a session's skips;
``summary_lines`` are the lines the hook prints (``write_summary``).
"""

from __future__ import annotations

import re
from collections import Counter

#: the group of every test skipped for want of a CUDA device or CuPy (``tests/conftest.py``'s marker skip, and the
#: GPU tests that call ``pytest.skip(gpu_unavailable_reason())`` themselves)
GPU_GROUP = "needs a CUDA GPU"
#: ``sglang_kdtree.gpu.runtime.gpu_unavailable_reason``'s reasons, as they begin
_GPU_REASONS = ("torch sees no CUDA device", "cupy sees no CUDA device", "cupy does not import",
                "cupy cannot reach the CUDA driver", "torch does not import")

_IMPORT = re.compile(r"^could not import '([^']+)'")
_PATH = re.compile(r"\S*[/\\]\S*|\S+\.(?:cu|cuh|py|so|cubin|ptx|json|safetensors)\b")
_ARCH = re.compile(r"\bsm_?\d+[a-z]?\b")
_NUMBER = re.compile(r"\b\d+(?:\.\d+)*\b")


def skip_group(reason: str) -> str:
    """One skip reason -> its group:

    * pytest's ``Skipped: `` prefix goes;
    * ``importorskip``'s ``could not import 'mod': <error>`` keeps the module (``could not import 'mod'``);
    * otherwise the details after the first ``": "`` go (``needs a CUDA GPU: torch sees no CUDA device`` ->
      ``needs a CUDA GPU``; ``NVRTC unavailable: <error>`` -> ``NVRTC unavailable``), and so does a trailing
      parenthesis (an install hint);
    * a bare GPU reason (``torch sees no CUDA device``, ...) is ``GPU_GROUP``;
    * file paths, GPU architectures and numbers left in the text become ``<file>``, ``<arch>``, ``N``."""
    text = " ".join(str(reason).split())
    text = text.removeprefix("Skipped: ").strip()
    imported = _IMPORT.match(text)
    if imported:
        return f"could not import '{imported.group(1)}'"
    if text.startswith(_GPU_REASONS):
        return GPU_GROUP
    head = text.split(": ", 1)[0].strip()
    head = re.sub(r"\s*\([^()]*\)$", "", head).strip() or text
    head = _PATH.sub("<file>", head)
    head = _ARCH.sub("<arch>", head)
    head = _NUMBER.sub("N", head)
    return head or "(no reason given)"


def report_reason(report) -> str:
    """The skip reason of a skipped test or collection report (its ``longrepr`` is ``(path, line, reason)``)."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


def count_by_group(reasons) -> Counter:
    """``{group: skips}`` of an iterable of skip reasons."""
    return Counter(skip_group(r) for r in reasons)


def summary_lines(counts: Counter) -> list[str]:
    """The hook's lines: a header with the total, then one line per group, the largest first (ties by name)."""
    if not counts:
        return []
    total = sum(counts.values())
    width = len(str(max(counts.values())))
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [f"skipped by reason ({total} in all):"] + [f"  {n:>{width}} {group}" for group, n in rows]


def write_summary(terminalreporter) -> None:
    """``pytest_terminal_summary``'s body: the session's skipped reports (tests, and modules skipped whole at
    collection, as pytest's "N skipped" counts them) by group, under pytest's own summary."""
    skipped = terminalreporter.stats.get("skipped", [])
    for line in summary_lines(count_by_group(report_reason(r) for r in skipped)):
        terminalreporter.write_line(line)
