"""Steady-state decode rates from SGLang's own decode log, per server and running batch size.

Every ``--decode-log-interval`` decode steps (40 by default) an SGLang server logs one line::

    Decode batch, #running-req: 32, #token: 16801, token usage: 0.51, accept len: 1.98, ...
    gen throughput (token/s): 9540.60, #queue-req: 0

``gen throughput`` is the tokens the server generated over those steps divided by their wall time: a decode rate
with no prefill, queueing or request start in it, which is what overlap scheduling changes. This reads the server
logs of one ``bench_server.py`` run (``--out`` holds ``<kind>.log`` per server) and reports, per server and per
running batch size, the median over the lines of a batch that was full (``#running-req`` equal to the size asked
for) and the median accept length. The first line of each size is dropped: its interval began before the batch
was (prefill, graph warmup).

    python -m benchmarks.decode_log DIR --batches 1 8 32 --json decode_log.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

#: a speculative server's line has an accept length, a plain server's none
_LINE = re.compile(r"Decode batch, #running-req: (\d+),(?:.*?accept len: ([\d.]+),)?.*?"
                   r"gen throughput \(token/s\): ([\d.]+)")


def parse(text: str) -> list[tuple[int, float, float]]:
    """``(running requests, accept length, tokens/s)`` per decode-log line, in order, up to the first profile
    (accept length 1.0 for a server without speculative decoding, whose line has none)."""
    rows = []
    for line in text.splitlines():
        if "Profiling starts" in line:
            break
        m = _LINE.search(line)
        if m:
            rows.append((int(m[1]), float(m[2] or 1.0), float(m[3])))
    return rows


def summarise(rows, batches) -> dict:
    """``{bs: {"tok_s": median, "accept_len": median, "lines": n}}`` over the lines whose running batch is ``bs``,
    without the first such line of each unbroken stretch (its interval began before the batch was full)."""
    out = {}
    for bs in batches:
        kept, previous = [], None
        for running, accept, tok_s in rows:
            if running == bs and previous == bs:
                kept.append((accept, tok_s))
            previous = running
        if kept:
            out[str(bs)] = {"tok_s": statistics.median(t for _, t in kept),
                            "accept_len": statistics.median(a for a, _ in kept), "lines": len(kept)}
    return out


def read_dir(folder: Path, batches) -> dict:
    """``{server: summarise(...)}`` for every ``<server>.log`` in ``folder``."""
    return {path.stem: summarise(parse(path.read_text(errors="replace")), batches)
            for path in sorted(Path(folder).glob("*.log"))}


def format_table(table: dict, batches) -> str:
    names = list(table)
    lines = ["| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for bs in batches:
        cells = []
        for name in names:
            cell = table[name].get(str(bs))
            cells.append(f"{cell['tok_s']:,.0f} (tau {cell['accept_len']:.2f}, {cell['lines']} lines)" if cell else "-")
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a bench_server.py --out folder (one <kind>.log per server)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--json", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    table = read_dir(args.folder, args.batches)
    if not table:
        print(f"no server logs (*.log) in {args.folder}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps({"batches": args.batches, "servers": table}, indent=1))
    print("SGLang's decode log, median tokens/s in all per running batch size:\n" + format_table(table, args.batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
