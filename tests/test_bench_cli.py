"""``python -m sglang_kdtree bench``: repeats by default, reports median (min-max) and the run count, and its
``--help`` documents every option with its default."""

from __future__ import annotations

import re

import pytest

from sglang_kdtree.cli import bench

SMALL = ["--batches", "2", "--budgets", "4", "--depths", "3", "--vocab", "64", "--cpu-only"]


def test_help_documents_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    parser = bench._parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {o.dest for o in options} >= {"batches", "budgets", "depths", "vocab", "repeats", "warmup", "cpu_only"}
    for action in options:
        assert action.help, f"{action.option_strings[0]} has no help text"
        default = f"[{', '.join(map(str, action.default))}]" if isinstance(action.default, list) else action.default
        assert f"(default: {default})" in text, f"{action.option_strings[0]}: default {default} not in --help"
    assert text.count("(default:") == len(options)


def test_repeats_by_default():
    args = bench._parser().parse_args([])
    assert args.repeats >= 3 and args.warmup >= 1


def test_figures_are_median_min_max_of_the_timed_runs(monkeypatch):
    """Fake stage times per timed round; the row must hold their exact median, min and max, and warm-up rounds
    must not count."""
    totals = iter([100.0, 7.0, 1.0, 5.0, 3.0])  # first one is the warm-up

    def fake_round(logits, budget, seq_lens, seed=0):
        t = next(totals)
        return {"topk_lse": t, "total": 2 * t}

    monkeypatch.setattr(bench, "cpu_round", fake_round)
    (row,) = bench.run_cpu_bench([2], [4], 3, 64, repeats=4, warmup=1)
    assert row["topk_lse"] == (4.0, 1.0, 7.0)
    assert row["total"] == (8.0, 2.0, 14.0)


def test_output_says_how_many_runs_each_figure_is(capsys):
    assert bench.main(SMALL + ["--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "Each figure: median (min-max) of 3 timed runs after 1 warm-up" in out
    row = out.split("Each figure:")[1].splitlines()[3]  # title's end, header, rule, first row
    cells = [c.strip() for c in row.split("|")]
    assert cells[:2] == ["2", "4"]
    for cell in cells[2:]:
        med, lo, hi = map(float, re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", cell).groups())
        assert lo <= med <= hi
    assert "GPU table: not run (--cpu-only was given)" in out


def test_bad_repeats_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(SMALL + ["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def _row(batch, budget, total, topk):
    """A CPU-table row: ``(median, min, max)`` per stage; the stages other than top-K take the rest equally."""
    rest = (total[0] - topk) / 4
    row = {"batch": batch, "budget": budget, "total": total, "topk_lse": (topk, topk, topk)}
    row.update({k: (rest, rest, rest) for k in ("heap_build", "visibility", "mask_build", "accept")})
    return row


def test_the_summary_flags_noisy_rows_and_concludes_from_the_rows():
    rows = [_row(1, 16, (10.0, 9.0, 11.0), 8.0), _row(32, 16, (2000.0, 1500.0, 5000.0), 1600.0)]
    lines = bench.cpu_summary(rows)
    assert len(lines) == 2  # the batch-32 row's spread is 175 % of its median; batch 1's 20 %
    assert lines[0].startswith("NOISY: batch 32, budget 16: total 1500-5000 ms, a spread of 175 %")
    assert lines[1] == ("Conclusion: on this CPU the reference round's tree machinery costs 10.0 ms (batch 1, "
                        "budget 16) to 2000 ms (batch 32, budget 16) per round, 80 % of it in topk+lse; a server on "
                        "this path pays it every decode round on the host.")
    assert not bench.cpu_summary([_row(1, 16, (10.0, 8.0, 12.0), 5.0)])[0].startswith("NOISY")  # 40 %: not flagged


def test_the_output_ends_the_cpu_table_with_its_conclusion(capsys):
    assert bench.main(SMALL) == 0
    out = capsys.readouterr().out
    assert "Conclusion: on this CPU the reference round's tree machinery costs" in out
    assert "--kimi-round --from-json benchmarks/results/kimi_round.json" in out
