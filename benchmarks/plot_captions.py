"""What every figure under ``benchmarks/results/`` says about itself, shared by the plot scripts.

Each PNG's title names the device, the target and its drafter, and the run or date; its caption's last line
(``Reading: ...``) says what the figure shows, computed from the same JSON as the curves. The facts come from the
JSON where it records them, else from ``RECORDED`` (``results/runs.json``: the checked-in JSONs that predate the
fields), and a
command-line option (``--run``, ``--date``, ``--device``, ``--commit``) wins over both. A fact found nowhere is
printed as "not recorded" rather than left out, so a reader sees what is missing.

``finish`` lays a figure out so that no text is cut and no legend lies on a curve: the title above the axes, one
legend for the whole figure below them, the footer (command, commit) wrapped under it, and the saved image
trimmed to everything drawn.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

#: Facts that the checked-in JSONs under benchmarks/results/ do not carry, keyed by the JSON's file name, in
#: results/runs.json beside them (copied from the run tables of benchmarks/RESULTS.md, and RESULTS-archive.md for
#: run U): bench_server.py's bench.json records no device, date or commit; kimi_round.py's JSON no date or commit of
#: its pieces' run; testbed's JSONs say "cuda", not the card, and no date. ``pieces`` of a ``kimi_round --from-json``
#: output are looked up under the file it was made from. ``tau_label`` names an accept-length curve given on
#: kimi_round.py's command line (its JSON records only "--tau-curve").
RUNS_FILE = Path(__file__).resolve().parent / "results" / "runs.json"
RECORDED = json.loads(RUNS_FILE.read_text())

FACTS = ("run", "date", "device", "commit")
#: what each fact looks like, for the plot scripts' --help
EXAMPLES = {"run": "run Z", "date": "YYYY-MM-DD", "device": "1 H100", "commit": "a commit hash"}
DPI = 120
UNRECORDED = "not recorded"


def facts(path: str | Path | None, payload: dict | None = None, **given) -> dict:
    """``run`` / ``date`` / ``device`` / ``commit`` (and ``tau_label``) of the JSON at ``path``: ``given`` (the
    command line; None = not given) over the JSON's own top-level fields over ``RECORDED``."""
    out = dict(RECORDED.get(Path(path).name, {})) if path else {}
    for key in FACTS:
        value = (payload or {}).get(key) if isinstance(payload, dict) else None
        if isinstance(value, str) and value:
            out[key] = value
    out.update({k: v for k, v in given.items() if v})
    return out


def run_text(f: dict, *, device: bool = True) -> str:
    """"run Z, 2026-12-05, 1 H100, commit <hash>"; a missing run or date is said to be so."""
    parts = [f.get("run") or f"run {UNRECORDED}", f.get("date") or f"date {UNRECORDED}"]
    if device:
        parts.append(f.get("device") or f"device {UNRECORDED}")
    if f.get("commit"):
        parts.append(f"commit {str(f['commit'])[:12]}")
    return ", ".join(parts)


def ratio_range(values) -> str:
    """``[1.188, 1.19]`` -> "1.19x"; ``[0.9, 1.2]`` -> "0.90-1.20x"."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def wrap(text: str, fig_width_in: float, fontsize: float) -> str:
    """Each line of ``text`` folded to what fits the figure's width at ``fontsize`` (DejaVu Sans averages about
    half an em per character in these captions; a line a little wider still shows: the image is trimmed to it)."""
    width = max(40, int(fig_width_in * 72 / (fontsize * 0.53)))
    return "\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in text.split("\n"))


def legend_entries(axes) -> tuple[list, list[str]]:
    """The handles and labels of every axes, each label once, in drawing order."""
    seen: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def _bottom(fig) -> tuple[float, float]:
    """The left and lowest edge, in figure fractions, of everything drawn so far."""
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
    return max(box.x0, 0) / fig.get_size_inches()[0], box.y0 / fig.get_size_inches()[1]


def finish(fig, title: str, out_png, plt, *, footer: str = "", legend=None, ncol: int = 4) -> None:
    """Lay ``fig`` out (it was made with ``layout="constrained"``) and save it: ``title`` above the axes,
    ``legend`` (handles, labels) as one legend below them, ``footer`` under that, every line wrapped to the
    figure's width, the image trimmed to what was drawn so nothing is cut."""
    width, height = fig.get_size_inches()
    fig.suptitle(wrap(title, width, 9.5), fontsize=9.5)
    fig.set_dpi(DPI)
    fig.canvas.draw()
    # constrained layout placed the axes and the title; what goes below them is placed here, under the lowest
    # thing drawn, with the layout frozen so that saving moves nothing onto it
    fig.set_layout_engine("none")
    gap = 0.06 / height
    x0, y0 = _bottom(fig)
    if legend and legend[0]:
        fig.legend(*legend, loc="upper center", bbox_to_anchor=(0.5, y0 - gap), bbox_transform=fig.transFigure,
                   ncol=min(ncol, len(legend[1])), fontsize=8, frameon=False)
        fig.canvas.draw()
        x0, y0 = _bottom(fig)
    if footer:
        fig.text(x0, y0 - gap, wrap(footer, width, 6.5), fontsize=6.5, color="0.3", ha="left", va="top")
    fig.savefig(out_png, dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def add_fact_options(parser, whose: str, default: str, facts=FACTS, prefix: str = "") -> None:
    """``--run`` / ``--date`` / ``--device`` / ``--commit`` (``facts``, each with ``prefix``): ``whose`` fact for the
    titles; ``default`` says where it comes from when the option is not given."""
    for fact in facts:
        parser.add_argument(f"--{prefix}{fact}", default=None,
                            help=f"{whose} {fact} for the titles (e.g. {EXAMPLES[fact]!r}; default: {default})")
