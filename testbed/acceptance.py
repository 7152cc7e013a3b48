"""The testbed pair's acceptance on real SGLang servers: plain, DFLASH and KDTREE at pinned budgets, greedy and at
T = 1, on the pair's held-out prompts.

    python -m testbed.acceptance --pair DIR --out DIR [--device cuda|cpu] [--prompts N] [--new-tokens M]
        [--budgets 15 31 63 127 255] [--temperatures 0 1] [--dtype float32] [--at-once K] [--deadline S]

Servers (one SGLang 0.5.23 launcher each, on 127.0.0.1):

* ``plain``: the target alone;
* ``dflash``: ``--speculative-algorithm DFLASH`` with the pair's drafter, otherwise SGLang's defaults (its draft
  block, its overlap scheduling) as its users run it;
* ``kdtree-B``: ``--speculative-algorithm kdtree --speculative-num-draft-tokens B+1`` (the budget pinned, so every
  round verifies the budget-B tree) with the round log (``KDTREE_ROUND_LOG``).

On CUDA they start through ``tests/e2e/cuda_servers.py`` with ``benchmarks/bench_server.py``'s flags per kind (CUDA
graphs on, Triton attention, the test-only ``sgl_kernel`` stand-in); on the CPU through the e2e harness
(``tests/e2e/conftest.py``: ``torch_native`` attention, the ``sgl_kernel`` stub). On both, SGLang's overlap scheduler
serves plain and DFLASH (its default) and a ``kdtree-B-overlap`` kind, and not ``kdtree-B``: there every request-round
of the round log is a verify SGLang counts. Overlapped, SGLang launches a request whose in-flight round is about to
finish it into one more round (its check that a request finishes in flight counts one token per round), then
drops that round's tokens without counting its verify, while the round log records it.
SGLang 0.5.23 refuses DFLASH on the CPU at startup ("not supported by CpuSRTPlatform"); the report carries that
refusal as the server's error. Budgets go up to ``state.MAX_BUDGET`` (1024), so 255 is allowed.

Every prompt is sent once per temperature (``ignore_eos``: the drafter was trained on continuations that run
through the end-of-file token), ``--at-once`` servers at a time, requests concurrent. ``OUT/acceptance.json``:

* ``servers.KIND.phases.T``: tau, SGLang's ``spec_accept_length`` averaged over requests (as bench_server.py
  reports it; it counts the prefill's token too) and pooled (``completion_tokens / spec_verify_ct`` summed);
  for KDTREE also the round log's figures (``round_summary``): its own tau (accepted tokens per request-round),
  the drafter's prediction ``predicted_raw`` against ``realised`` for the tree cut the server verifies, and
  per depth the drafter's probability of reaching it (``depth_reach``) against the share of request-rounds
  that did;
* ``identity``: per speculative server, its greedy output against plain's, prompt by prompt;
* ``curve`` / ``dflash``: greedy pooled tau by budget and DFLASH's, in the form ``python -m benchmarks.kimi_round
  --tau-curve-json`` reads (``curve_t1`` / ``dflash_t1`` at T = 1);
* a DFLASH phase at T > 0 is marked ``sampling_preserved: false`` when its log says SGLang fell back to greedy
  verification (no ``tree_speculative_sampling_target_only``: the CUDA stand-in lacks FlashInfer).

``OUT/outputs.json.gz`` keeps every request's output ids and metrics; ``OUT/logs`` the server and round logs.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.server_kinds import overlapped, pinned_budget

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "tests" / "e2e"

DEFAULT_BUDGETS = (15, 31, 63, 127, 255)
#: SGLang's warning when a DFLASH server serves T > 0 with greedy verification instead (dflash_worker_v2.py)
DFLASH_GREEDY_FALLBACK = "DFLASH non-greedy verification is unavailable"
#: the servers started and not yet stopped (``_stop_on_sigterm``)
LIVE: list = []
#: a speculative server's greedy mismatches against plain listed in the report (the count covers all)
LISTED_MISMATCHES = 10


# ---- plan -----------------------------------------------------------------------------------------------------


def kinds(budgets) -> list[str]:
    return ["plain", "dflash"] + [f"kdtree-{b}" for b in budgets]


def load_prompts(pair: Path, count: int | None) -> list[dict]:
    """The first ``count`` (all when None) of ``heldout_prompts.jsonl``; ValueError when the file has fewer."""
    path = pair / "heldout_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if count is not None and count > len(rows):
        raise ValueError(f"--prompts {count}: {path} holds {len(rows)} prompts")
    return rows if count is None else rows[:count]


def waves(names: list[str], at_once: int) -> list[list[str]]:
    return [names[i:i + at_once] for i in range(0, len(names), max(1, at_once))]


# ---- servers --------------------------------------------------------------------------------------------------


def cpu_harness():
    """``tests/e2e/conftest.py`` under its own module name: inside a pytest session the name ``conftest`` may be
    ``tests/conftest.py``'s."""
    name = "kdtree_e2e_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, E2E / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def cuda_harness():
    """``benchmarks/bench_server.py`` (its flags per server kind) and the ``cuda_servers`` module it uses."""
    from benchmarks import bench_server

    return bench_server, bench_server.cuda_servers


def kv_tokens(concurrency: int, prompt_len: int, new_tokens: int, max_budget: int) -> int:
    """KV slots for ``concurrency`` requests at their longest, each with a verify tree of the largest width and a
    draft block beside it: the harnesses' ``--max-total-tokens`` (32,768 on CUDA) is too small for 48 requests
    of 512 tokens with a 256-row tree, and a full pool would retract requests in the middle of the measurement."""
    return concurrency * (prompt_len + new_tokens + max_budget + 1 + 32)


def start_server(kind: str, pair: Path, logs: Path, device: str, dtype: str, kv: int = 0):
    """One server of ``kind``, started (not yet ready), with at least ``kv`` KV slots; KDTREE kinds write
    ``logs/rounds-KIND.jsonl``."""
    env = {}
    round_log = logs / f"rounds-{kind}.jsonl"
    if kind.startswith("kdtree"):
        round_log.unlink(missing_ok=True)
        env["KDTREE_ROUND_LOG"] = str(round_log)
    if device == "cuda":
        bench_server, cuda_servers = cuda_harness()
        variant = cuda_servers.Variant("pair", pair / "target", pair / "drafter", dtype)
        args = bench_server._args_for(kind, variant, cuda_servers.free_port(), pinned_budget(kind) or 0)
        _raise_kv(args, kv)
        server = cuda_servers.CudaServer(kind, args, logs / f"{kind}.log", env)
    else:
        conftest = cpu_harness()
        # overlap as on CUDA (bench_server._args_for): SGLang's default for plain and DFLASH, a KDTREE kind's name
        overlap = not kind.startswith("kdtree") or overlapped(kind)
        args = conftest.base_server_args(pair / "target", conftest.free_port(), overlap=overlap)
        args[args.index("--dtype") + 1] = dtype
        if kind == "dflash":
            args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(pair / "drafter")]
        elif kind.startswith("kdtree"):
            args += ["--speculative-algorithm", "kdtree", "--speculative-draft-model-path", str(pair / "drafter"),
                     "--speculative-num-draft-tokens", str(pinned_budget(kind) + 1)]
        _raise_kv(args, kv)
        server = conftest.Server(args, logs / f"{kind}.log", env)
        server.args = args
    server.round_log = round_log if kind.startswith("kdtree") else None
    return server


def _raise_kv(args: list, kv: int) -> None:
    i = args.index("--max-total-tokens") + 1
    args[i] = str(max(int(args[i]), kv))


def wait_ready(servers: dict, device: str, timeout: float) -> dict[str, str]:
    """``{kind: error}`` for the servers that did not become healthy within ``timeout`` (those are stopped)."""
    if device == "cuda":
        return cuda_harness()[1].wait_all(servers, timeout)
    failed = {}
    for kind, server in servers.items():
        try:
            server.wait_ready(timeout)
        except (RuntimeError, TimeoutError) as exc:
            failed[kind] = str(exc)
            server.stop()
    return failed


def _log_lines(path: Path | None) -> int:
    return len(path.read_text().splitlines()) if path is not None and path.exists() else 0


def serve_phase(server, prompts: list[dict], temperature: float, new_tokens: int, concurrency: int) -> dict:
    """Every prompt once at ``temperature``; the outputs and the round-log lines this phase wrote."""
    first = _log_lines(server.round_log)

    def one(prompt):
        payload = {"input_ids": prompt["input_ids"],
                   "sampling_params": {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}}
        r = server.generate(payload)
        meta = r.get("meta_info", {})
        return {"output_ids": r["output_ids"],
                **{k: meta.get(k) for k in ("completion_tokens", "spec_verify_ct", "spec_accept_length")}}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - t0
    records = []
    if server.round_log is not None and server.round_log.exists():
        lines = server.round_log.read_text().splitlines()[first:]
        records = [json.loads(x) for x in lines if x.strip()]
    return {"results": results, "records": records, "seconds": round(seconds, 2)}


# ---- aggregation (pure: tests/test_acceptance.py) ---------------------------------------------------------------


def tau_summary(results: list[dict]) -> dict:
    """SGLang's per-request metrics: ``tau`` the mean of ``spec_accept_length`` (None without speculation),
    ``tau_pooled`` completion tokens over verify rounds, both summed over the requests."""
    lens = [r["spec_accept_length"] for r in results if r.get("spec_accept_length") is not None]
    tokens = sum(r.get("completion_tokens") or 0 for r in results)
    rounds = sum(r.get("spec_verify_ct") or 0 for r in results)
    return {"requests": len(results), "completion_tokens": tokens, "verify_rounds": rounds,
            "tau": round(statistics.fmean(lens), 4) if lens else None,
            "tau_pooled": round(tokens / rounds, 4) if rounds else None}


def round_summary(records: list[dict]) -> dict | None:
    """A KDTREE server's round-log records of one phase -> its acceptance and the drafter's calibration:

    * ``tau``: accepted tokens (bonus included) per request-round; ``sibling_share``: of the accepted draft
      tokens, those that were not their parent's first child (what a chain could not have accepted);
    * ``predicted_raw`` / ``realised``: per request-round, the drafter's expected accept length of the verified
      cut (1 + the sum of exp(path score) over its nodes) and the accept length it had;
    * ``depth``: per depth d = 1.., ``predicted`` the drafter's probability of reaching d (``depth_reach``) and
      ``realised`` the share of request-rounds that accepted at least d draft tokens.

    None without records."""
    if not records:
        return None
    lens = [a for r in records for a in r["accept_lens"]]
    n = len(lens)
    widths = [r for r in records if r.get("width")]
    weight = sum(len(r["accept_lens"]) for r in widths)
    reach = [r["depth_reach"] for r in records if r.get("depth_reach") is not None]
    depth = None
    if reach:
        deepest = max(max(len(x) for x in reach), max(lens) - 1)
        predicted = [sum(x[d] for x in reach if d < len(x)) / n for d in range(deepest)]
        realised = [sum(a - 1 >= d + 1 for a in lens) / n for d in range(deepest)]
        depth = {"predicted": [round(x, 5) for x in predicted], "realised": [round(x, 5) for x in realised]}
    return {
        "rounds": len(records), "request_rounds": n, "tau": round(sum(lens) / n, 4),
        "sibling_share": round(sum(sum(r.get("sibling_accepts", [])) for r in records) / max(sum(lens) - n, 1), 4),
        "graph_rounds": sum(bool(r.get("graph")) for r in records),
        "predicted_raw": round(sum(r["width"]["predicted_raw"] * len(r["accept_lens"]) for r in widths) / weight, 4)
        if weight else None,
        "realised": round(sum(r["width"]["realised"] * len(r["accept_lens"]) for r in widths) / weight, 4)
        if weight else None,
        "depth": depth,
    }


def first_difference(x: list, y: list) -> int | None:
    """The first index where two token lists differ, ``min(len)`` when one is a prefix of the other, None when
    they are equal."""
    if x == y:
        return None
    return next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))


def identity(reference: list[dict], other: list[dict]) -> dict:
    """Prompt by prompt, ``other``'s output ids against ``reference``'s: the mismatch count and the first
    ``LISTED_MISMATCHES`` mismatches with the first differing index."""
    listed, count = [], 0
    for i, (a, b) in enumerate(zip(reference, other)):
        index = first_difference(a["output_ids"], b["output_ids"])
        if index is not None:
            count += 1
            if len(listed) < LISTED_MISMATCHES:
                listed.append({"prompt": i, "index": index})
    return {"prompts": min(len(reference), len(other)), "mismatches": count, "listed": listed}


def phase_key(temperature: float) -> str:
    return f"{temperature:g}"


def curves(servers: dict, temperature: float) -> tuple[dict, float | None]:
    """``{budget: tau}`` of the KDTREE servers and DFLASH's tau at ``temperature``, pooled (tokens over verify
    rounds, what a round-time model multiplies by: the mean over requests weights a looping request's few long
    rounds as much as another's many short ones); a DFLASH phase that did not preserve the sampling distribution
    gives None."""
    key = phase_key(temperature)
    curve = {}
    for kind, s in servers.items():
        phase = s.get("phases", {}).get(key)
        if pinned_budget(kind) is not None and phase and phase.get("tau_pooled") is not None:
            curve[str(pinned_budget(kind))] = phase["tau_pooled"]
    phase = servers.get("dflash", {}).get("phases", {}).get(key)
    dflash = phase.get("tau_pooled") if phase and phase.get("sampling_preserved", True) else None
    return dict(sorted(curve.items(), key=lambda kv: int(kv[0]))), dflash


def report(settings: dict, pair_meta: dict, servers: dict, outputs: dict, build_greedy=None) -> dict:
    """The JSON report: ``servers`` (their phases summarised), greedy ``identity`` against plain (and plain against
    ``build_greedy``, the pair's own greedy continuations, where given), the curves."""
    out = {"settings": settings, "pair": pair_meta, "servers": servers, "identity": {}}
    greedy = phase_key(0.0)
    plain = outputs.get(("plain", greedy))
    for (kind, key), results in outputs.items():
        if key == greedy and kind != "plain" and plain is not None:
            out["identity"][kind] = identity(plain, results)
    if plain is not None and build_greedy and all(build_greedy):
        # the build's greedy ran in bf16 autocast on CUDA: a difference here is numerics, informational only
        build = [{"output_ids": ids[:len(r["output_ids"])]} for ids, r in zip(build_greedy, plain)]
        out["identity"]["plain_vs_build"] = identity(build, plain)
    for t in settings["temperatures"]:
        curve, dflash = curves(servers, t)
        suffix = "" if t == 0 else f"_t{t:g}"
        out["curve" + suffix] = curve
        if dflash is not None:
            out["dflash" + suffix] = dflash
    return out


def format_table(rep: dict) -> str:
    rows = ["| server | T | tau (meta_info) | tau pooled | round-log tau | predicted (drafter) | realised | "
            "sibling share | greedy mismatches vs plain |", "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    for kind, s in rep["servers"].items():
        if s.get("error"):
            rows.append(f"| {kind} | | not served: {s['error'].splitlines()[-1][:100]} | | | | | | |")
            continue
        for key, p in s.get("phases", {}).items():
            if "skipped" in p:
                rows.append(f"| {kind} | {key} | skipped: {p['skipped']} | | | | | | |")
                continue
            rl = p.get("rounds") or {}
            ident = rep["identity"].get(kind) if key == "0" else None
            mis = f"{ident['mismatches']}/{ident['prompts']}" if ident else ""
            note = "" if p.get("sampling_preserved", True) else " (greedy-verify fallback)"
            rows.append(f"| {kind} | {key} | {f(p['tau'])}{note} | {f(p['tau_pooled'])} | {f(rl.get('tau'))} | "
                        f"{f(rl.get('predicted_raw'))} | {f(rl.get('realised'))} | {f(rl.get('sibling_share'))} | "
                        f"{mis} |")
    return "\n".join(rows)


# ---- run ------------------------------------------------------------------------------------------------------


def _commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def pair_metadata(pair: Path) -> dict:
    meta = json.loads((pair / "metadata.json").read_text()) if (pair / "metadata.json").exists() else {}
    target, drafter = meta.get("target", {}), meta.get("drafter", {})
    offline = drafter.get("heldout_offline_acceptance", {})
    return {"path": str(pair), "preset": meta.get("preset"), "code_digest": meta.get("code_digest"),
            "commit": meta.get("commit"), "target_heldout_loss": target.get("heldout_loss"),
            "drafter_heldout_loss": (drafter.get("curve") or [{}])[-1].get("heldout_loss"),
            "offline_dflash_tau": offline.get("dflash_tau"),
            "offline_accuracy_by_depth": offline.get("accuracy_by_depth")}


def run(args) -> dict:
    started, commit = time.time(), _commit()
    deadline = started + args.deadline if args.deadline else None
    left = lambda: float("inf") if deadline is None else deadline - time.time()  # noqa: E731
    prompts = load_prompts(args.pair, args.prompts)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = kinds(args.budgets) if not args.kinds else args.kinds
    kv = kv_tokens(args.concurrency, max(len(p["input_ids"]) for p in prompts), args.new_tokens,
                   max([pinned_budget(k) or 0 for k in names] + [16]))
    servers, outputs = {}, {}
    for wave in waves(names, args.at_once or len(names)):
        running = {}
        try:
            for k in wave:
                running[k] = start_server(k, args.pair, logs, args.device, args.dtype, kv)
                LIVE.append(running[k])
            failed = wait_ready(running, args.device, min(args.startup_timeout, max(left(), 1.0)))
            for kind, server in running.items():
                servers[kind] = {"args": [str(a) for a in server.args], "error": failed.get(kind), "phases": {}}

            def phases(kind):
                server = running[kind]
                for t in args.temperatures:
                    if left() <= 0:
                        servers[kind]["phases"][phase_key(t)] = {"skipped": "deadline"}
                        continue
                    got = serve_phase(server, prompts, t, args.new_tokens, args.concurrency)
                    outputs[(kind, phase_key(t))] = got["results"]
                    p = {**tau_summary(got["results"]), "seconds": got["seconds"],
                         "rounds": round_summary(got["records"])}
                    if kind == "dflash" and t > 0:
                        p["sampling_preserved"] = DFLASH_GREEDY_FALLBACK not in server.log_path.read_text(
                            errors="replace")
                    servers[kind]["phases"][phase_key(t)] = p

            with ThreadPoolExecutor(max_workers=len(running)) as pool:
                for kind, fut in [(k, pool.submit(phases, k)) for k in running if k not in failed]:
                    try:
                        fut.result()
                    except Exception as exc:  # one server's failure must not lose the others' figures
                        servers[kind]["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for server in running.values():
                server.stop()
                LIVE.remove(server)
    settings = {"device": args.device, "dtype": args.dtype, "prompts": len(prompts), "new_tokens": args.new_tokens,
                "budgets": list(args.budgets), "temperatures": list(args.temperatures), "kinds": names,
                "at_once": args.at_once, "concurrency": args.concurrency, "cuda_graph": args.device == "cuda",
                "command": " ".join(["python -m testbed.acceptance", *sys.argv[1:]]), "commit": commit,
                "seconds": round(time.time() - started, 1)}
    rep = report(settings, pair_metadata(args.pair), servers, outputs, [p.get("target_greedy_ids") for p in prompts])
    with gzip.open(args.out / "outputs.json.gz", "wt") as f:
        json.dump({f"{k}@T={t}": v for (k, t), v in outputs.items()}, f)
    (args.out / "acceptance.json").write_text(json.dumps(rep, indent=1) + "\n")
    return rep


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m testbed.acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, required=True, help="a testbed.build_pair output folder")
    p.add_argument("--out", type=Path, required=True, help="folder for acceptance.json, outputs and logs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default="float32",
                   help="served dtype (default float32: greedy identity then tests the round, not bf16 near-ties)")
    p.add_argument("--prompts", type=int, default=None, help="the first N held-out prompts (default all)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS))
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--kinds", nargs="+", default=None, help="servers to run (default plain dflash kdtree-B...)")
    p.add_argument("--at-once", type=int, default=None,
                   help="servers started together (default: all on CUDA, 2 on the CPU)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight per server (default 48 on CUDA: cuda_servers.MAX_RUNNING; 8 on the CPU)")
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--deadline", type=float, default=None, help="seconds; phases not begun by then are skipped")
    args = p.parse_args(argv)
    from sglang_kdtree.state import MAX_BUDGET

    bad = [b for b in args.budgets if not 1 <= b <= MAX_BUDGET]
    if bad:
        p.error(f"--budgets: {bad[0]} is outside [1, {MAX_BUDGET}] (the verify width is budget + 1)")
    if args.kinds and any(k not in ("plain", "dflash") and pinned_budget(k) is None for k in args.kinds):
        p.error(f"--kinds: each is plain, dflash or kdtree-B, got {args.kinds}")
    if args.at_once is None and args.device == "cpu":
        args.at_once = 2
    if args.concurrency is None:
        args.concurrency = 48 if args.device == "cuda" else 8
    return args


def _stop_on_sigterm(signum, frame) -> None:
    """The servers run in their own process sessions: a timeout's SIGTERM must stop them, not orphan them."""
    for server in list(LIVE):
        server.stop(timeout=10)
    os._exit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    rep = run(args)
    print(format_table(rep))
    curve = ", ".join(f"{b}: {t:.3f}" for b, t in rep["curve"].items())
    print(f"greedy tau by budget: {curve or 'none'}; DFLASH {rep.get('dflash', 'not measured')}")
    print("greedy output vs plain, prompts differing: " + ", ".join(
        f"{k} {v['mismatches']}/{v['prompts']}" for k, v in rep["identity"].items()))
    print(f"wrote {args.out / 'acceptance.json'}")
    return 0 if all(not s.get("error") or k == "dflash" and args.device == "cpu"
                    for k, s in rep["servers"].items()) else 1


if __name__ == "__main__":
    sys.exit(main())
