"""SGLang's scheduler loop per decode round, overlap off and on, on real CPU servers: the loop's own host work.

    python -m benchmarks.host_loop_cpu --batches 1 4 --new-tokens 200 --out DIR

On a CPU server the forward runs inside the host's launch, so nothing can overlap and a round's period is its host
work. What overlap scheduling changes there is only the loop's own work per round (futures, the result queue, the
batch copy), which this measures for plain and KDTREE servers of the tiny Llama target (``tests/e2e``), each
with ``--disable-overlap-schedule`` and without, one server at a time: ``KDTREE_HOST_TIMES``
(``sglang_kdtree/server/host_times.py``) per batch size. The CUDA calls of the GPU path (streams, events, copies) are not
in it; on a GPU the same columns come from ``benchmarks/bench_server.py --host-times``.

``loop`` in the table is the period less the forward: less ``worker`` for KDTREE (its round), less ``launch`` for
plain (whose ``run_batch`` is its forward).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT)]
import make_tiny_models  # noqa: E402
from server_requests import PROMPTS, _kdtree_args  # noqa: E402

from sglang_kdtree.server import host_times  # noqa: E402

# the CPU server harness of the end-to-end tests, by path: under pytest another ``conftest`` may hold the name
_spec = importlib.util.spec_from_file_location("e2e_conftest", ROOT / "tests" / "e2e" / "conftest.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

KINDS = ("plain", "plain-overlap", "kdtree", "kdtree-overlap")


def models() -> Path:
    if e2e.committed_models_current():
        return e2e.COMMITTED_TINY_MODELS
    out = ROOT / ".tiny_models"
    make_tiny_models.ensure_built(out)
    return out


def serve(kind: str, tiny: Path, out: Path):
    times = out / f"{kind}.host_times.json"
    times.unlink(missing_ok=True)
    extra = _kdtree_args(tiny, "llama") if kind.startswith("kdtree") else []
    server = e2e.start_server(tiny / "llama", out, extra=extra, name=kind, overlap=kind.endswith("-overlap"),
                              env={"KDTREE_HOST_TIMES": str(times)})
    server.wait_ready()
    return server, times


def run(server, bs: int, new_tokens: int) -> None:
    payloads = [{"input_ids": PROMPTS[i % len(PROMPTS)],
                 "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
                for i in range(bs)]
    with ThreadPoolExecutor(max_workers=bs) as pool:
        list(pool.map(server.generate, payloads))


def loop_ms(kind: str, row: dict) -> float:
    return row["period_ms"] - (row["worker_ms"] if kind.startswith("kdtree") else row["launch_ms"])


def measure(kinds, batches, new_tokens: int, repeats: int, out: Path) -> dict:
    tiny, found = models(), {}
    for kind in kinds:
        server, times = serve(kind, tiny, out)
        try:
            for bs in batches:
                for _ in range(repeats):
                    run(server, bs, new_tokens)
            run(server, 1, 4)  # a new size: the last one is written
        finally:
            server.stop()
        per_bs = json.loads(times.read_text())
        found[kind] = {str(bs): dict(per_bs[str(bs)], loop_ms=loop_ms(kind, per_bs[str(bs)]))
                       for bs in batches if str(bs) in per_bs}
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True,
                    help="folder for server logs, host-time files and host_loop.json")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    found = measure(args.kinds, args.batches, args.new_tokens, args.repeats, args.out)
    (args.out / "host_loop.json").write_text(json.dumps({"new_tokens": args.new_tokens, "repeats": args.repeats,
                                                         "host_times": found}, indent=1))
    print(host_times.format_table(found, extra=("loop",)))
    for bs in map(str, args.batches):
        pairs = [(k, f"{k}-overlap") for k in ("plain", "kdtree") if bs in found.get(k, {})
                 and bs in found.get(f"{k}-overlap", {})]
        for off, on in pairs:
            print(f"batch {bs}, {off}: the loop's own host work per round {found[off][bs]['loop_ms']:.3f} ms without "
                  f"overlap, {found[on][bs]['loop_ms']:.3f} ms with it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
