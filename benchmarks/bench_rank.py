"""One Kimi K2.6 rank (``testbed/kimi_rank.py``) served on one GPU, one server at a time: the decode round, its
startup and its memory, for ``kimi_round``'s prediction to be checked against.

    python benchmarks/bench_rank.py --rank DIR --kinds plain kdtree-cycle-log kdtree-auto-log \
        --batches 1 8 32 64 --context 4096 --new-tokens 64 --repeats 2 --widths 16,32,64 --out OUT --deadline 420 \
        [--stated-tau-json FILE|none] [--profile-batch 8 --profile-steps 12]

Each server starts from the rank's configs with ``--load-format dummy`` (random weights, the Marlin repack of every
MoE layer as with a checkpoint), ``SGLANG_KDTREE_MOE=marlin`` and ``SGLANG_SIMULATE_UNIFORM_EXPERTS=1`` (random
weights would route nearly every token to the same 8 experts); the rank's memory cannot hold two servers, so they run in
turn. Kinds are ``bench_server.py``'s (``plain``, ``dflash``, ``kdtree-B[-overlap]``, ``kdtree-auto[-overlap]``,
``kdtree-auto-log``), started with its flags, plus ``kdtree-cycle-log``: the automatic server's tiers stepped
through round by round (``SGLANG_KDTREE_WIDTH_POLICY=cycle``) with the round log, i.e. every pinned width's round
on the device clock from one server. Every server gets ``--enable-metrics``, ``KDTREE_HOST_TIMES`` and SGLang's
decode log every 10 steps; prompts are ``--context`` tokens long (``bench_server.measure`` is reused with them).

Per server and batch size it records:

* the round's wall time three ways: ``host_ms`` (the scheduler loop's period per decode pass, mean;
  ``sglang_kdtree/server/host_times.py``), ``log_ms`` (SGLang's decode log: batch x accept length / tokens per
  second), ``request_ms`` (accept length / each request's decode rate after its first token, median);
* for the round-log kinds, the device split (draft, tree, verify, accept+commit; CUDA events) per verify width,
  with the widths chosen and their predicted / realised accept lengths;
* startup and memory from the server log: weights (target, drafter), KV pool (slots, GiB), SGLang's graph
  captures (seconds, GiB) and KDTREE's extra verify tiers (seconds, MiB each), its round rehearsal's peak;
* beside each cell, ``kimi_round``'s prediction for it (``predicted_rounds``, from ``--model-json``): AR for plain,
  DFLASH, and KDTREE at each verify width, piece by piece;
* each server's greedy tokens of its first timed batch per size (``output_ids``), which the report holds to the
  plain server's request by request, and a KDTREE server's ``KDTREE launch limits`` line, checked against
  ``KDTREE_DEVICE_PROFILE`` when that is set (``profile_problems``);
* with ``--profile-batch BS``: each server's decode steps at that batch size split by kernel class
  (``kernel_split.py``: MoE, MLA, other attention, GEMM, bookkeeping, the rest), which splits the verify forward
  the way the model adds it up.

The automatic kinds choose their width with the accept lengths of ``--stated-tau-json`` (the testbed pair's
pooled greedy tau by default; ``SGLANG_KDTREE_WIDTH_STATED_TAU``), since random drafts predict nothing; the report
(``rank_report.py``) turns rounds into tokens per second per request with that curve, puts the automatic width
beside the best fixed one, overlap on beside off repeat by repeat, and the served pieces beside the model's.

``OUT/rank.json`` is rewritten after each batch size, so a call that runs out of time keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT)]  # run as a script: the CUDA harness, and this package
import cuda_servers  # noqa: E402
import server_limits  # noqa: E402

from benchmarks import bench_server, decode_log, kernel_split, rank_report, server_kinds  # noqa: E402
from testbed import kimi_rank  # noqa: E402

#: the kinds this bench adds to bench_server's, and the environment variables it sets (the plugin's names)
CYCLE_PREFIX = "kdtree-cycle"
WIDTHS_ENV, POLICY_ENV = "SGLANG_KDTREE_VERIFY_WIDTHS", "SGLANG_KDTREE_WIDTH_POLICY"
ROUND_LOG_ENV, HOST_TIMES_ENV = "KDTREE_ROUND_LOG", "KDTREE_HOST_TIMES"
#: the width choice's stated accept lengths (sglang_kdtree.round.width_choice.STATED_TAU_ENV; benches only) and
#: SGLang's wait for a full batch before it profiles decode steps
STATED_TAU_ENV, PROFILE_MIN_BS_ENV = "SGLANG_KDTREE_WIDTH_STATED_TAU", "SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS"
#: the test-only profile every KDTREE launch is held to (sglang_kdtree.gpu.limits.PROFILE_ENV), inherited by servers
PROFILE_ENV = "KDTREE_DEVICE_PROFILE"
PHASES = bench_server.PHASES
#: before the first server has been timed: its startup and one batch size's measurement, seconds (guesses; rank
#: servers of 12 layers were ready in 46-87 s on an H100, alone)
STARTUP_GUESS_S, BATCH_GUESS_S = 100.0, 30.0
#: request slots beyond the largest batch (server_plan)
SPARE_REQUEST_SLOTS = 8
#: a stopping server's grace before SIGKILL: short, since the device step's own kill follows its SIGTERM by 10 s
STOP_S = 8


class Stop(BaseException):
    """SIGTERM (the device step's cap): stop the server in hand and write what was measured."""


def _on_sigterm(*_):
    raise Stop()


# ---- servers -------------------------------------------------------------------------------------------------


def replace_flag(args: list, flag: str, *values) -> list:
    """``args`` with ``flag``'s values replaced by ``values`` (every token up to the next ``--`` flag), or with
    ``flag`` and ``values`` appended when absent; no ``values``: the flag alone."""
    out = list(args)
    if flag in out:
        i = out.index(flag)
        j = i + 1
        while j < len(out) and not str(out[j]).startswith("--"):
            j += 1
        out[i + 1: j] = [str(v) for v in values]
    else:
        out += [flag, *map(str, values)]
    return out


def variant(rank: Path):
    """The rank as a ``cuda_servers.Variant``: bf16 target and drafter, the rank's server environment."""
    return cuda_servers.Variant("kimi-rank", rank / kimi_rank.TARGET_DIR, rank / kimi_rank.DRAFT_DIR, "bfloat16",
                                dict(kimi_rank.SERVER_ENV))


def server_plan(kind: str, var, port: int, opts, out: Path) -> tuple[list, dict]:
    """(command line, extra environment) of one rank server: ``bench_server``'s flags for the kind (a cycle kind
    takes the automatic server's), resized for the rank: dummy weights, KV for the largest batch at the context,
    decode graphs at the measured batches only, big prefill chunks."""
    base = kind.replace(CYCLE_PREFIX, "kdtree-auto", 1)
    args = bench_server._args_for(base, var, port, opts.budget, latency_split=True)
    max_bs = max(opts.batches)
    widths = [int(w) for w in opts.widths.split(",")]
    width = max(widths) if server_kinds.chooses_width(base) else (bench_server._kind_budget(base, opts.budget) or 0) + 1
    args = replace_flag(args, "--load-format", "dummy")
    args = replace_flag(args, "--mem-fraction-static", opts.mem_fraction)
    args = replace_flag(args, "--max-total-tokens",
                        kimi_rank.kv_tokens(max_bs, opts.context, opts.new_tokens, max(width, 16)))
    # a speculative server ran 3 requests fewer at once than --max-running-requests (29 of 32, 61 of 64) and the
    # rest after them: room for a few more, so that every batch size runs whole (the bench sends max_bs at most)
    args = replace_flag(args, "--max-running-requests", max_bs + SPARE_REQUEST_SLOTS)
    args = replace_flag(args, "--chunked-prefill-size", opts.prefill_chunk)
    args = replace_flag(args, "--decode-log-interval", 10)
    if "--cuda-graph-bs-decode" in args:
        args = replace_flag(args, "--cuda-graph-max-bs-decode", max_bs)
        args = replace_flag(args, "--cuda-graph-bs-decode", *sorted(set(opts.batches)))
    env = dict(var.env)
    env[HOST_TIMES_ENV] = str(out / f"{kind}.host_times.json")
    if server_kinds.chooses_width(base):
        env[WIDTHS_ENV] = opts.widths
    if kind.startswith(CYCLE_PREFIX):
        env[POLICY_ENV] = "cycle"
    elif server_kinds.chooses_width(base) and getattr(opts, "stated_tau", None):
        env[STATED_TAU_ENV] = ",".join(f"{w}={t:.4f}" for w, t in opts.stated_tau.items())
    if getattr(opts, "profile_batch", None):
        env[PROFILE_MIN_BS_ENV] = str(opts.profile_batch)
    if "-log" in kind:
        env[ROUND_LOG_ENV] = str(out / f"rounds-{kind}.jsonl")
    for name in (HOST_TIMES_ENV, ROUND_LOG_ENV):
        if name in env:
            Path(env[name]).unlink(missing_ok=True)
    return args, env


def context_prompts(bs: int, context: int, seed: int) -> list[list[int]]:
    """``bs`` distinct prompts of ``context`` token ids (the tiny language's words: every rank vocabulary has them)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(cuda_servers.tiny.NUM_WORDS) for _ in range(context)] for _ in range(bs)]


# ---- what a server's logs say --------------------------------------------------------------------------------

_LOAD = re.compile(r"Load weight end\. elapsed=([\d.]+) s.*?avail mem=([\d.]+) GB, mem usage=([\d.]+) GB")
_KV = re.compile(r"KV Cache is allocated\..*?#tokens: (\d+), "
                 r"(?:KV size: ([\d.]+) GB|K size: ([\d.]+) GB, V size: ([\d.]+) GB)")
_CAPTURE = re.compile(r"Capture (.+?) end\. (?:bs=\[[^\]]*\], )?elapsed=([\d.]+) s, mem usage=([\d.]+) GB")
_TIER = re.compile(r"width (\d+): (graphs|no graphs), ([\d.]+) s(?:, (\d+) MiB)?")
_PREWARM = re.compile(r"KDTREE round pre-warm: bs=(\d+) peak=(\d+) B")
_POOL_END = re.compile(r"Memory pool end\. avail mem=([\d.]+) GB")
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def read_server_log(text: str) -> dict:
    """Startup and memory from an SGLang server log (GB in SGLang's lines are GiB): ``loads`` (target, then drafter:
    seconds, GiB), ``kv`` (target pool, then the drafter's: slots, GiB), ``captures`` (SGLang's graph captures:
    name, seconds, GiB), ``tiers`` (KDTREE's extra verify widths: seconds, MiB), ``prewarm_peak_bytes``,
    ``avail_after_pool_gib``, and ``log_span_s`` (first to last time-stamped line up to "ready to roll")."""
    out = {"loads": [], "kv": [], "captures": [], "tiers": {}, "prewarm_peak_bytes": None,
           "avail_after_pool_gib": None, "log_span_s": None}
    stamps = []
    for line in text.splitlines():
        m = _STAMP.match(line)
        if m:
            stamps.append(time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")))
        if (m := _LOAD.search(line)):
            out["loads"].append({"seconds": float(m[1]), "gib": float(m[3]), "avail_gib": float(m[2])})
        elif (m := _KV.search(line)):
            gib = float(m[2]) if m[2] is not None else float(m[3]) + float(m[4])
            out["kv"].append({"tokens": int(m[1]), "gib": gib})
        elif (m := _CAPTURE.search(line)):
            out["captures"].append({"name": m[1], "seconds": float(m[2]), "gib": float(m[3])})
        elif "KDTREE verify widths:" in line:
            for t in _TIER.finditer(line):
                out["tiers"][t[1]] = {"graphs": t[2] == "graphs", "seconds": float(t[3]),
                                      "mib": None if t[4] is None else int(t[4])}
        elif (m := _PREWARM.search(line)):
            out["prewarm_peak_bytes"] = int(m[2])
        elif (m := _POOL_END.search(line)) and out["avail_after_pool_gib"] is None:
            out["avail_after_pool_gib"] = float(m[1])
        if "ready to roll" in line:
            break
    if len(stamps) > 1:
        out["log_span_s"] = stamps[-1] - stamps[0]
    out["sglang_capture_s"] = round(sum(c["seconds"] for c in out["captures"]), 2)
    out["sglang_capture_gib"] = round(sum(c["gib"] for c in out["captures"]), 2)
    out["kdtree_tiers_s"] = round(sum(t["seconds"] for t in out["tiers"].values()), 2)
    return out


def rounds_by_width(path: Path | None, batches) -> dict:
    """``{bs: {width: ...}}`` from a round log: the rounds whose verify replayed a graph, per full batch and width:
    how many, the median device ms per phase and of their sum, the median host wall ms of the round, and the mean
    predicted / realised accept length."""
    if path is None or not path.exists():
        return {}
    groups: dict = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        bs, width = len(r.get("accept_lens", ())), (r.get("width") or {}).get("width")
        if bs in batches and width and r.get("graph"):
            groups.setdefault(str(bs), {}).setdefault(str(width), []).append(r)
    out = {}
    for bs, by_width in groups.items():
        for width, rs in sorted(by_width.items(), key=lambda kv: int(kv[0])):
            row = {"rounds": len(rs), **{p: statistics.median(r["ms"][p] for r in rs) for p in PHASES},
                   "device_ms": statistics.median(sum(r["ms"][p] for p in PHASES) for r in rs),
                   "wall_ms": statistics.median(r["width"].get("round_ms", 0.0) for r in rs),
                   "predicted": statistics.fmean(r["width"]["predicted"] for r in rs),
                   "realised": statistics.fmean(r["width"]["realised"] for r in rs)}
            out.setdefault(bs, {})[width] = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    return out


def round_times(row: dict, host: dict | None, dlog: dict | None, bs: int) -> dict:
    """The round's wall ms three ways (module docstring), None where a source is missing."""
    accept = row.get("accept_len", 1.0)
    out = {"host_ms": host.get("period_mean_ms") if host else None, "log_ms": None, "request_ms": None}
    if dlog and dlog.get("tok_s"):
        out["log_ms"] = bs * dlog["accept_len"] / dlog["tok_s"] * 1e3
    if row.get("decode_tok_s"):
        out["request_ms"] = accept / row["decode_tok_s"] * 1e3
    return out


def predicted_rounds(model_json: Path, shape: dict, batches, context: int, widths) -> dict:
    """``kimi_round``'s prediction for the rank's cells, from a saved measurement (``kimi_round.py --json``): the
    model at the rank's layer count, without collectives, with every ``lm_head`` piece scaled from a TP 8 slice to
    the rank's vocabulary (ASSUMED linear in the rows: 8x at the full vocabulary). ``{bs: {mode: us per piece}}``
    for AR (plain), DFLASH and KDTREE-(w - 1) per verify width w; pieces the file lacks are listed, counted 0."""
    from benchmarks import kimi_model as km

    data = json.loads(Path(model_json).read_text())
    scale = shape["vocab"] / (km.KIMI.vocab // km.KIMI.tp)
    times = {k: v * scale if k.startswith("lm_head[") else v for k, v in data["measured"]["times"].items()}
    cfg = km.RoundConfig(model=km.ModelShape(layers=shape["layers"], dense_layers=shape["dense_layers"]),
                         net=km.Network(gbps=math.inf, latency_us=0.0, gather_logits=False),
                         budgets=tuple(int(w) - 1 for w in widths))
    cells = {}
    for bs in batches:
        for mode in cfg.widths:
            r = km.round_row(times, mode, bs, context, cfg)
            cells.setdefault(str(bs), {})[mode] = {
                "width": r["width"], "missing": r["missing"],
                **{k: round(r[k] / 1e3, 4) for k in ("draft", "tree", "verify", "attention", "moe", "other",
                                                     "accept_commit", "round")}}
    return {"source": str(model_json), "device": data["measured"].get("device"), "lm_head_scale": scale,
            "cells": cells}


# ---- the bench -----------------------------------------------------------------------------------------------


def stated_tau(path, widths) -> dict | None:
    """``{"source", "by_width": {w: tau(w - 1)}}`` at each verify width from a tau curve: a ``testbed.acceptance``
    report's pooled greedy tau of its ``kdtree-B`` servers (committed tokens over all rounds, what throughput sees),
    else ``kimi_model.load_tau_curve_json``'s forms; None for ``none``."""
    if path is None or str(path) == "none":
        return None
    from benchmarks import kimi_model
    from testbed import acceptance

    data = json.loads(Path(path).read_text())
    pooled, _ = acceptance.curves(data["servers"], 0.0) if isinstance(data.get("servers"), dict) else ({}, None)
    if pooled:
        curve, source = kimi_model.curve_from_json({"curve": pooled}, str(path))[0], f"{path} (pooled greedy tau)"
    else:
        curve, source = kimi_model.load_tau_curve_json(path)[0], str(path)
    return {"source": source, "by_width": {int(w): round(curve.tau(int(w) - 1), 4) for w in widths}}


def profile(server, bs: int, steps: int, batch: list, new_tokens: int, out: Path, wait_s: float = 120.0) -> dict:
    """The kernels of ``steps`` decode steps at batch ``bs`` (SGLang's ``/start_profile`` by stage, GPU only: it
    waits for a full batch, ``PROFILE_MIN_BS_ENV``), split by ``kernel_split``; the traces are deleted after."""
    import urllib.request

    folder = out / f"profile-{server.name}"
    folder.mkdir(parents=True, exist_ok=True)
    body = {"output_dir": str(folder), "num_steps": steps, "activities": ["GPU"], "profile_by_stage": True,
            "with_stack": False, "record_shapes": False, "profile_prefix": server.name}
    req = urllib.request.Request(server.url + "/start_profile", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()
    bench_server.run_batch(server, batch, new_tokens)
    deadline = time.time() + wait_s
    while time.time() < deadline:  # the decode trace is written after its last step, while the batch finishes
        traces = sorted(folder.glob("*DECODE*.trace.json.gz"))
        if traces:
            time.sleep(2.0)  # let the writer close it
            try:
                result = {"bs": bs, "trace": traces[0].name, "split": kernel_split.split(kernel_split.read_trace(
                    traces[0]), steps)}
                break
            except (OSError, EOFError, ValueError):
                continue
        time.sleep(1.0)
    else:
        result = {"bs": bs, "error": f"no decode trace in {folder} after {wait_s:.0f} s"}
    for f in folder.glob("*.trace.json.gz"):
        f.unlink()
    return result


def serve(kind: str, var, opts, out: Path, left, record: dict, save) -> None:
    """Start one server, measure every batch size that time allows, stop it; fills ``record`` as it goes."""
    args, env = server_plan(kind, var, cuda_servers.free_port(), opts, out)
    record.update(command=args, env={k: v for k, v in env.items() if k not in (HOST_TIMES_ENV, ROUND_LOG_ENV)})
    server = cuda_servers.CudaServer(kind, args, out / f"{kind}.log", env)
    prompts = lambda bs: context_prompts(bs, opts.context, seed=100 + bs)  # noqa: E731  (measure()'s requests)
    t0 = time.time()
    try:
        failed = cuda_servers.wait_all({kind: server}, timeout=max(30.0, left() - BATCH_GUESS_S))
        record["ready_s"] = server.ready_s
        record["server_log"] = read_server_log(server.log_text())
        record["launch_limits"] = server_limits.launch_limits(server.log_text())
        if failed:
            record["error"] = failed[kind][-3000:]
            return
        record["table"], previous = {}, None
        try:
            for bs in opts.batches:
                # the next size's time from the last one's (prefill grows with the batch, the decode less)
                guess = BATCH_GUESS_S if previous is None else previous[1] * (bs / previous[0]) ** 0.5 + 5
                if left() < guess:
                    record.setdefault("skipped", []).append(f"batch {bs}: {left():.0f} s left, guessed {guess:.0f} s")
                    break
                started = time.time()
                table = bench_server.measure({kind: server}, [bs], opts.new_tokens, opts.repeats, prompts=prompts,
                                             keep_outputs=True)
                record["table"][str(bs)] = table[str(bs)][kind]
                previous = (bs, time.time() - started)
                save()
                if bs == opts.profile_batch and left() > BATCH_GUESS_S:
                    try:
                        record["profile"] = profile(server, bs, opts.profile_steps, prompts(bs), opts.new_tokens, out)
                    except Exception as exc:  # noqa: BLE001  (a profile that fails costs its cell, not the bench)
                        record["profile"] = {"bs": bs, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    save()
            record["host_times"] = bench_server.read_host_times({kind: server}, out, prompts).get(kind, {})
        except Exception as exc:  # noqa: BLE001  (a server that dies mid-bench: recorded, the next one still runs)
            record["error"] = f"{type(exc).__name__}: {exc}\n{server.log_tail(40)}"[-3000:]
    finally:
        server.stop(timeout=STOP_S)
        record["serve_s"] = round(time.time() - t0, 1)
        text = server.log_path.read_text(errors="replace")
        record["decode_log"] = decode_log.summarise(decode_log.parse(text), opts.batches)
        record["by_width"] = rounds_by_width(server.round_log, opts.batches)
        for bs, row in record.get("table", {}).items():
            row["round"] = round_times(row, record.get("host_times", {}).get(bs), record["decode_log"].get(bs),
                                       int(bs))
        save()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=Path, required=True, help="a testbed/kimi_rank.py build (target/, drafter/)")
    ap.add_argument("--kinds", nargs="+", default=["plain", "kdtree-auto-overlap", "kdtree-cycle-log"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per request (default 4096)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed batches per size after one warm-up (default 2)")
    ap.add_argument("--widths", default="16,32,64", help="verify tiers of the automatic and cycle kinds")
    ap.add_argument("--budget", type=int, default=63, help="node budget of KDTREE kinds that pin none (default 63)")
    ap.add_argument("--mem-fraction", type=float, default=0.85,
                    help="--mem-fraction-static: high enough that the KV cap (--max-total-tokens) binds (default 0.85)")
    ap.add_argument("--prefill-chunk", type=int, default=4096,
                    help="--chunked-prefill-size (default 4096: a chunk's routed MoE buffer is chunk x 8 x 7168 bf16)")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for every server together (default 540)")
    ap.add_argument("--model-json", type=Path, default=ROOT / "benchmarks" / "results" / "kimi_round.json",
                    help="a kimi_round.py --json measurement: its prediction goes beside each cell (default the "
                         "committed H200 one; 'none' for no prediction)")
    ap.add_argument("--stated-tau-json", type=Path, default=ROOT / "benchmarks" / "results" / "pair_acceptance.json",
                    help="the accept-length curve the automatic kinds choose with and the report's tokens/s use "
                         "(default the testbed pair's pooled greedy tau; 'none': the drafter's own, which "
                         "predicts nothing on random weights)")
    ap.add_argument("--profile-batch", type=int, default=None,
                    help="after timing this batch size, profile --profile-steps decode steps of every server and "
                         "split their device time by kernel class (benchmarks/kernel_split.py)")
    ap.add_argument("--profile-steps", type=int, default=12,
                    help="decode steps to profile (default 12: a multiple of the cycle's three widths)")
    ap.add_argument("--out", type=Path, required=True)
    opts = ap.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    left = lambda: opts.deadline - (time.time() - start)  # noqa: E731
    manifest = json.loads((opts.rank / kimi_rank.MANIFEST).read_text())
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()}
    report = {"rank": manifest["shape"], "estimate": manifest.get("estimate"), "settings": settings, "servers": {},
              "device_profile": os.environ.get(PROFILE_ENV)}
    report["stated_tau"] = stated_tau(opts.stated_tau_json, opts.widths.split(","))
    opts.stated_tau = (report["stated_tau"] or {}).get("by_width")
    if opts.model_json and str(opts.model_json) != "none" and opts.model_json.exists():
        report["model"] = predicted_rounds(opts.model_json, manifest["shape"], opts.batches, opts.context,
                                           opts.widths.split(","))
    save = lambda: (opts.out / "rank.json").write_text(json.dumps(report, indent=1))  # noqa: E731
    signal.signal(signal.SIGTERM, _on_sigterm)
    var = variant(opts.rank)
    startup_seen = []
    try:
        for kind in opts.kinds:
            record = report["servers"].setdefault(kind, {})
            need = (max(startup_seen) if startup_seen else STARTUP_GUESS_S) + BATCH_GUESS_S
            if left() < need:
                record["status"] = f"skipped: {left():.0f} s left, a server needs about {need:.0f} s"
                save()
                continue
            serve(kind, var, opts, opts.out, left, record, save)
            if record.get("ready_s"):
                startup_seen.append(record["ready_s"])
    except Stop:
        report["stopped"] = f"SIGTERM after {time.time() - start:.0f} s"
    finally:
        if report["device_profile"]:  # every KDTREE server's launches within the profile's limits, by its log
            report["profile_problems"] = server_limits.profile_holds(report, report["device_profile"])
        save()
    text = rank_report.format_report(report)
    (opts.out / "table.txt").write_text(text + "\n")
    print(text)
    return 0 if all(rec.get("table") for rec in report["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
