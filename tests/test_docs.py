"""The user documents stay user documents: README.md short, README.md and benchmarks/RESULTS.md free of work
history (commit hashes outside RESULTS.md's `commit` columns, work-period numbers), RESULTS.md one section per
component, every relative link resolving, and benchmarks.plot_results drawing its PNGs. Fast, CPU only."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks import plot_results

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
IS_IT_FASTER = ROOT / "docs" / "is-it-faster.md"

MAX_README_LINES = 200
#: 7-40 hex digits with at least one digit and one letter: an abbreviated or full commit hash
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
WORK_PERIOD = re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: RESULTS.md's sections (a word each heading must hold, in this order); all but the last carry a provenance table
SECTIONS = ("Correctness on the GPU", "tree step against the CPU heap path", "MLA", "Marlin", "Kimi round",
            "server bench", "Verify widths")
PROVENANCE = ("date", "device", "command", "commit")


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def without_commit_columns(text: str) -> str:
    """``text`` with the cells of every Markdown table column headed ``commit`` emptied (where RESULTS.md names
    the code behind a figure, on purpose)."""
    separator = re.compile(r"\s*\|(\s*:?-+:?\s*\|)+\s*")
    lines, out, commit_col = text.splitlines(), [], None
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            commit_col = None  # a table ends at its first non-row line
            out.append(line)
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if commit_col is None and separator.fullmatch(following):  # the header row: kept as it is
            header = [c.lower() for c in _cells(line)]
            commit_col = header.index("commit") if "commit" in header else -1
            out.append(line)
            continue
        cells = _cells(line)
        if commit_col is not None and 0 <= commit_col < len(cells) and not separator.fullmatch(line):
            cells[commit_col] = ""
            line = "| " + " | ".join(cells) + " |"
        out.append(line)
    return "\n".join(out)


def test_readme_is_at_most_200_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; keep it to {MAX_README_LINES} (history goes to " \
                                  "benchmarks/RESULTS-archive.md or to git)"


def test_commit_column_stripping_keeps_the_rest():
    table = "x 1234abc\n\n| run | commit | note |\n|---|---|---|\n| A | a23ce36 | 5ea4457 |\nafter"
    assert without_commit_columns(table) == "x 1234abc\n\n| run | commit | note |\n|---|---|---|\n" \
                                            "| A |  | 5ea4457 |\nafter"


@pytest.mark.parametrize("path", [README, RESULTS, IS_IT_FASTER], ids=lambda p: p.name)
def test_no_commit_hashes_or_work_periods(path):
    text = path.read_text()
    if path == RESULTS:
        text = without_commit_columns(text)
    hashes = sorted(set(HASH.findall(text)))
    periods = sorted(set(m.group(0) for m in WORK_PERIOD.finditer(text)))
    assert not hashes, f"{path.name} names commits {hashes} outside a `commit` column: history belongs in " \
                       "benchmarks/RESULTS-archive.md"
    assert not periods, f"{path.name} names work periods {periods}: history belongs in RESULTS-archive.md"


def test_results_has_one_section_per_component_with_provenance():
    text = RESULTS.read_text()
    headings = [h for h in re.findall(r"^## (.+)$", text, re.M)]
    positions = []
    for name in SECTIONS:
        found = [i for i, h in enumerate(headings) if name.lower() in h.lower()]
        assert found, f"RESULTS.md has no section on {name!r}; its sections: {headings}"
        positions.append(found[0])
    assert positions == sorted(positions), f"RESULTS.md's sections are out of order: {headings}"
    bodies = re.split(r"^## .+$", text, flags=re.M)[1:]
    for name, i in zip(SECTIONS[:-1], positions):
        headers = [[c.lower() for c in _cells(line)] for line in bodies[i].splitlines() if line.startswith("|")]
        assert any(all(col in h for col in PROVENANCE) for h in headers), \
            f"section {headings[i]!r} has no table with columns {PROVENANCE}"
    # the verify widths' figures come from runs of the correctness section, named in a `run` column
    widths = [[c.lower() for c in _cells(line)] for line in bodies[positions[-1]].splitlines() if line.startswith("|")]
    assert any("run" in h and "width" in h and "realised" in h for h in widths), \
        "the verify-widths section has no table of runs, widths and realised accept lengths"


@pytest.mark.parametrize("path", [README, RESULTS, IS_IT_FASTER], ids=lambda p: p.name)
def test_relative_links_resolve(path):
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        if not (path.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{path.name} links to files that do not exist: {missing}"


def _shell_commands(path: Path) -> list[str]:
    """The commands of ``path``'s bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split(" #")[0].strip() for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    return commands


@pytest.mark.parametrize("path", [README, IS_IT_FASTER], ids=lambda p: p.name)
def test_documented_launches_pass_sglangs_parser_and_the_plugins_checks(path):
    """Each documented ``sglang.launch_server`` command line would get past SGLang's argument parser and, for
    ``kdtree``, the plugin's startup checks (the checkpoints aside)."""
    from sglang_kdtree.cli.doctor_launch import launch_args_problem, server_argv

    launches = [c for c in _shell_commands(path) if "sglang.launch_server" in c]
    assert launches, f"{path.name} shows no launch"
    for command in launches:
        assert launch_args_problem(server_argv(command)) is None, command


def test_documented_benchmark_flags_exist_in_sglangs_load_generator():
    """Every flag docs/is-it-faster.md passes to ``python -m sglang.benchmark.serving`` is one that the installed
    SGLang's module defines (read from its source: importing it starts nothing, but costs seconds)."""
    import importlib.util

    source = Path(importlib.util.find_spec("sglang.benchmark.serving").origin).read_text()
    runs = [c for c in _shell_commands(IS_IT_FASTER) if "sglang.benchmark.serving" in c]
    assert runs
    flags = {f for c in runs for f in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", c)}
    step_2 = IS_IT_FASTER.read_text().split("## 2.")[1].split("## 3.")[0]  # the load generator's step
    inline = set(re.findall(r"`(--[a-z][a-z0-9-]*)[ `]", step_2))
    unknown = sorted(f for f in flags | inline if f'"{f}"' not in source)
    assert not unknown, f"sglang.benchmark.serving has no {unknown}"


# ---- plot_results.py -------------------------------------------------------------------------------------------


def _bench_json(tmp_path) -> Path:
    table = {str(bs): {"plain": {"tok_s_per_request": 800.0 / bs ** 0.2, "accept_len": 1.0},
                       "dflash": {"tok_s_per_request": 1000.0 / bs ** 0.2, "accept_len": 3.2},
                       "kdtree": {"tok_s_per_request": 950.0 / bs ** 0.25, "accept_len": 3.4}}
             for bs in (1, 8, 32)}
    table["8"]["kdtree-auto"] = {"tok_s_per_request": 760.0}  # a kind that ran at one batch only
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"variant": "kimi", "budget": 64, "table": table}))
    return path


def test_server_series_from_bench_json(tmp_path):
    batches, series = plot_results.server_series(json.loads(_bench_json(tmp_path).read_text()))
    assert batches == [1, 8, 32]
    assert list(series) == ["plain", "dflash", "kdtree", "kdtree-auto"]
    assert series["plain"][0] == 800.0 and series["kdtree-auto"] == [None, 760.0, None]
    with pytest.raises(plot_results.PlotError, match="no 'table'"):
        plot_results.server_series({"variant": "kimi"})


def test_plot_without_matplotlib_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert plot_results.main(["--bench", str(_bench_json(tmp_path)), "--out", str(tmp_path)]) == 2
    assert "matplotlib is not importable" in capsys.readouterr().err


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    kimi = tmp_path / "kimi_round.json"
    kimi.write_text(json.dumps({"rows": [
        {"mode": "AR", "bs": 1, "ctx": 4096, "width": 1, "tok_s": 90.0},
        {"mode": "DFLASH", "bs": 1, "ctx": 4096, "width": 16, "tok_s": 280.0},
        {"mode": "KDTREE-15", "bs": 1, "ctx": 4096, "width": 16, "tok_s": 240.0},
        {"mode": "KDTREE-63", "bs": 1, "ctx": 4096, "width": 64, "tok_s": 250.0},
        {"mode": "KDTREE-auto", "bs": 1, "ctx": 4096, "width": 64, "chose": 64, "tok_s": 250.0}]}))
    out = tmp_path / "png"
    assert plot_results.main(["--bench", str(_bench_json(tmp_path)), "--kimi", str(kimi), "--out", str(out)]) == 0
    for name in ("server_tok_s.png", "kimi_round.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_plot_refuses_a_file_that_is_not_bench_json(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert plot_results.main(["--bench", str(bad), "--out", str(tmp_path)]) == 2
    assert "no 'table'" in capsys.readouterr().err
