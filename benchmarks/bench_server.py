"""Plain vs DFLASH (linear chain) vs KDTREE on real CUDA SGLang servers of one target, side by side in one run.

    python benchmarks/bench_server.py --variant kimi --batches 1 8 32 --budget 64 --new-tokens 64 --out DIR

All servers start at once on the same GPU (``tests/e2e/cuda_servers.py``: SGLang's launcher, scheduler,
CUDA-graph runners and Triton attention are real; the ``sgl_kernel`` binary is the test-only stand-in), with
CUDA graphs on and the same drafter for DFLASH and KDTREE:

* ``plain``: autoregressive, at SGLang's defaults (overlap scheduling on; ``--baselines-no-overlap`` turns it off);
* ``dflash``: ``--speculative-algorithm DFLASH`` (one chain of the drafter's block per round), at SGLang's
  defaults too (overlap on, as its users run it);
* ``kdtree``: ``--speculative-algorithm kdtree`` with ``--speculative-num-draft-tokens budget+1``, no round
  log (its tokens/s); ``kdtree-B`` (e.g. ``kdtree-15``): the same at budget B (verify width B + 1);
* ``...-overlap`` after a KDTREE kind (``kdtree-63-overlap``): the same on SGLang's overlap scheduler (the other
  KDTREE kinds run with ``--disable-overlap-schedule``);
* ``kdtree-auto``: no ``--speculative-num-draft-tokens``: the verify width chosen per round among ``--widths``
  (``sglang_kdtree.round.width_choice``); ``kdtree-auto-log``: the same with the round log, which gives the widths
  chosen and the predicted vs realised accept lengths per width (``widths`` in the JSON);
* ``kdtree-nomla``: KDTREE with ``SGLANG_KDTREE_MLA=off`` (SGLang's MLA verify attention instead of the fused
  kernel); it and ``kdtree-log`` dump their first rounds' verify logits (``KDTREE_DUMP_VERIFY``), compared
  after the run (``compare_dumps``). Two servers: their trees and MoE reductions may differ, so a row whose
  routing flips between them differs by more than the attention does;
* ``kdtree-check``: KDTREE with ``SGLANG_KDTREE_MLA=check`` (the fused kernel's output is used, and SGLang's MLA path
  runs beside it on every routed call, same inputs) and a round log, with ``--disable-cuda-graph`` (check mode
  compares eager calls only): the largest |fused - SGLang| over every layer of every verify forward, relative to
  the largest |SGLang output| (``mla_check``);
* ``kdtree-log``: the same with ``KDTREE_ROUND_LOG`` (CUDA events per phase and one extra host read per
  round), which gives the per-round time split: ``draft`` (drafter forward), ``tree`` (draft top-K, tree,
  verify inputs, SGLang's verify preparation), ``verify`` (target forward), ``accept_commit`` (accept, KV
  commit, drafter features, result). Per step (``steps`` in the round log), KDTREE's own bookkeeping is
  ``tree_prep + tree_step + accept_commit_kv + result`` with graphs (``topk + build + verify_inputs`` and
  ``accept + commit`` step by step): draft logits -> verify inputs, accept and commit, and the tree step's host
  work before the drafter's head GEMM (``tree_prep``, which includes the step graph's lookup and its static
  inputs' copy, issued before the GEMM); ``prepare`` (DFLASH's
  ``prepare_for_verify``: SGLang's attention metadata for the verify forward) and ``features`` (DFLASH's drafter
  KV append of the accepted rows) are SGLang code that a DFLASH round runs too, reported beside it
  (``sglang_side``), not in it.

For each batch size, one warm-up batch per server, then ``--repeats`` timed batches of ``bs`` concurrent greedy
requests of ``--new-tokens`` tokens each (``ignore_eos``), the servers taking turns (``measure``); per server it
reports tokens/s per request (median over requests and repeats), aggregate tokens/s, and the mean accept length
from SGLang's ``spec_accept_length``.
With ``--idle-steps N``, every server then profiles N decode steps at each ``--idle-batches`` size and reports the
GPU's idle time between rounds (``benchmarks/idle_gaps.py``): what overlap scheduling hides, measured on the same
servers in the same run. With ``--latency-split`` every server starts with ``--enable-metrics`` (SGLang's
per-request time stats), and each row adds the requests' median first-token latency and decode rate after it:
whether a server loses its time per request before the first token or while decoding. With ``--host-times`` every
server times its decode rounds' host work by step of SGLang's scheduler loop, KDTREE's round inside it and the
loop's wait for the device (``sglang_kdtree/server/host_times.py``; no profiler): where an overlapped round's time goes on
a host-paced target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT)]  # run as a script: the CUDA harness, and this package
import cuda_servers  # noqa: E402

from benchmarks import idle_gaps, server_kinds  # noqa: E402
from sglang_kdtree.server.host_times import format_round_steps, format_table as format_host_times  # noqa: E402

PHASES = ("draft", "tree", "verify", "accept_commit")
#: the round-log steps that are KDTREE's bookkeeping ("accept_commit" is the step that builds the result),
#: and the SGLang (DFLASH) steps inside the tree / accept_commit phases
OWN_STEPS = ("tree_prep", "tree_step", "topk", "build", "verify_inputs", "accept_commit_kv", "accept", "commit",
             "accept_commit")
SGLANG_STEPS = ("prepare", "features")
#: tokens each traced request may generate per profiled step: more than a round commits (at most the drafter's
#: block, 8 for the bench's drafters), so every request outlasts the window; 30 steps still fit a 4,096-token context
IDLE_TOKENS_PER_STEP = 64
#: device-to-device copy bandwidth measured on the H200 (benchmarks/RESULTS.md), for the bookkeeping floor
HBM_BYTES_PER_S = 4.19e12
#: the fused MLA kernel's verify logits vs SGLang's, relative to the largest |logit|: both run bf16 matmuls
#: around fp32-accumulated attention, so they may differ by a few bf16 ulps of the logits (2^-8 relative)
AB_REL_TOL = 2 ** -6


def bookkeeping_floor_ms(bs: int, depths: int, vocab: int, logit_bytes: int = 2) -> float:
    """The least the tree step can take: reading the bf16 draft logits ``[bs, L, V]`` once from HBM."""
    return bs * depths * vocab * logit_bytes / HBM_BYTES_PER_S * 1e3


def _geometry(variant) -> tuple[int, int]:
    """(draft depths L = block - 1, vocab V) from the drafter's and the target's config.json."""
    target = json.loads((Path(variant.target) / "config.json").read_text())
    drafter = json.loads((Path(variant.drafter) / "config.json").read_text())
    block = drafter.get("block_size") or (drafter.get("dflash_config") or {}).get("block_size")
    return int(block) - 1, int(target["vocab_size"])


def _kind_budget(kind: str, budget: int) -> int | None:
    """The node budget of a KDTREE kind: the one its name pins, else ``budget``; None for ``kdtree-auto*``."""
    return None if server_kinds.chooses_width(kind) else (server_kinds.pinned_budget(kind) or budget)


def _args_for(kind: str, variant, port: int, budget: int, baselines_overlap: bool = True,
              latency_split: bool = False) -> list[str]:
    args = cuda_servers.server_args(variant, port, kdtree=kind.startswith("kdtree"), cuda_graph=True)
    if latency_split:  # every server alike: SGLang then reports each request's first-token latency and decode rate
        args.append("--enable-metrics")
    i = args.index("--speculative-num-draft-tokens") if "--speculative-num-draft-tokens" in args else None
    if kind.startswith("kdtree"):
        pinned = _kind_budget(kind, budget)
        if pinned is None and i is not None:
            del args[i: i + 2]
        elif pinned is not None:
            if i is None:
                args += ["--speculative-num-draft-tokens", str(pinned + 1)]
            else:
                args[i + 1] = str(pinned + 1)
        if server_kinds.overlapped(kind):
            args.remove("--disable-overlap-schedule")
    else:
        if kind == "dflash":
            args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(variant.drafter)]
        if baselines_overlap:  # SGLang's default, as users run plain and DFLASH
            args.remove("--disable-overlap-schedule")
    # SGLANG_KDTREE_MLA=check compares eager calls only (sglang_kdtree/patches/mla_tree_verify.py)
    if kind == "kdtree-check":
        args.append("--disable-cuda-graph")
    return args


def start(variant, kinds, budget: int, out: Path, widths: str | None = None, baselines_overlap: bool = True,
          latency_split: bool = False, host_times: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    servers = {}
    for kind in kinds:
        env = dict(variant.env)
        round_log = None
        if host_times:
            (out / f"{kind}.host_times.json").unlink(missing_ok=True)
            env["KDTREE_HOST_TIMES"] = str(out / f"{kind}.host_times.json")
        if kind.startswith("kdtree-auto"):
            if widths:
                env["SGLANG_KDTREE_VERIFY_WIDTHS"] = widths
            if kind == "kdtree-auto-log":
                round_log = out / "rounds-kdtree-auto.jsonl"
                round_log.unlink(missing_ok=True)
                env["KDTREE_ROUND_LOG"] = str(round_log)
        elif kind == "kdtree-log":
            round_log = out / "rounds-kdtree.jsonl"
            round_log.unlink(missing_ok=True)
            env["KDTREE_ROUND_LOG"] = str(round_log)
            env["KDTREE_DUMP_VERIFY"] = str(out / "dump-fused")
        elif kind == "kdtree-check":  # both MLA paths on the same calls: their attention outputs compared
            round_log = out / "rounds-kdtree-check.jsonl"
            round_log.unlink(missing_ok=True)
            env["KDTREE_ROUND_LOG"] = str(round_log)
            env["SGLANG_KDTREE_MLA"] = "check"
        elif kind == "kdtree-nomla":  # SGLang's MLA verify path: A/B of the verify logits and of tokens/s
            env["SGLANG_KDTREE_MLA"] = "off"
            env["KDTREE_DUMP_VERIFY"] = str(out / "dump-sglang")
        server = cuda_servers.CudaServer(kind, _args_for(kind, variant, cuda_servers.free_port(), budget,
                                                         baselines_overlap, latency_split), out / f"{kind}.log", env)
        server.round_log = round_log
        servers[kind] = server
    return servers


def _payload(prompt, new_tokens: int) -> dict:
    return {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}


def batch_of(bs: int) -> list[list[int]]:
    """The ``bs`` prompts every server gets at batch size ``bs`` (timed batches and the idle trace alike)."""
    return cuda_servers.prompts(max(bs, 9), seed=100 + bs)[:bs]


def read_host_times(servers: dict, out: Path, prompts=batch_of) -> dict:
    """``{kind: {bs: ...}}`` from each server's ``KDTREE_HOST_TIMES`` file (``sglang_kdtree/server/host_times.py``),
    after one short request at batch 1 (from ``prompts``) has made it write the last batch size it timed."""
    found = {}
    for kind, server in servers.items():
        run_batch(server, prompts(1), 4)
        path = out / f"{kind}.host_times.json"
        if path.exists():
            found[kind] = json.loads(path.read_text())
    return found


def run_batch(server, batch, new_tokens: int) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        results = list(pool.map(lambda p: server.generate(_payload(p, new_tokens)), batch))
    return time.perf_counter() - t0, results


def _rounds(server, start_line: int, bs: int) -> list[dict]:
    if server.round_log is None or not server.round_log.exists():
        return []
    lines = server.round_log.read_text().splitlines()[start_line:]
    return [r for r in (json.loads(x) for x in lines if x.strip()) if len(r["accept_lens"]) == bs]


def _log_len(server) -> int:
    if server.round_log is None or not server.round_log.exists():
        return 0
    return len(server.round_log.read_text().splitlines())


def measure(servers: dict, batches, new_tokens: int, repeats: int, prompts=batch_of,
            keep_outputs: bool = False) -> dict:
    """Per batch size (its requests from ``prompts(bs)``): every server's warm-up batch, then the timed batches taken in turns, one server after
    another and each turn starting one server later, so that a change of the shared host's speed during the run
    falls on every server alike instead of on whichever ran last (on a host-paced target every step of one server's
    round has run 10-20 % faster or slower than its neighbour's, with the sign changing between batch sizes).
    ``keep_outputs``: each row also keeps the first timed batch's greedy token ids, request by request
    (``output_ids``), for servers run apart to be compared token for token."""
    table = {}
    kinds = list(servers)
    for bs in batches:
        batch = prompts(bs)
        for server in servers.values():
            run_batch(server, batch, new_tokens)  # warm-up (graph sizes, allocator)
        start_lines = {kind: _log_len(server) for kind, server in servers.items()}
        timed = {kind: [] for kind in kinds}
        for turn in range(repeats):
            for i in range(len(kinds)):
                kind = kinds[(turn + i) % len(kinds)]
                timed[kind].append(run_batch(servers[kind], batch, new_tokens))
        for kind, server in servers.items():
            per_request, walls, accepts, first_token, decode, run_decode = [], [], [], [], [], []
            for wall, results in timed[kind]:
                walls.append(wall)
                run_rates = [float(r["meta_info"]["decode_throughput"]) for r in results
                             if r.get("meta_info", {}).get("decode_throughput") is not None]
                if run_rates:  # each timed batch's own median: the spread between repeats
                    run_decode.append(statistics.median(run_rates))
                for r in results:
                    meta = r.get("meta_info", {})
                    latency = meta.get("e2e_latency") or wall
                    per_request.append(len(r["output_ids"]) / latency)
                    if meta.get("spec_accept_length") is not None:
                        accepts.append(float(meta["spec_accept_length"]))
                    if meta.get("first_token_latency") is not None and meta.get("decode_throughput") is not None:
                        first_token.append(float(meta["first_token_latency"]) * 1e3)
                        decode.append(float(meta["decode_throughput"]))
            row = {
                "tok_s_per_request": statistics.median(per_request),
                "tok_s_total": bs * new_tokens * repeats / sum(walls),
                "accept_len": statistics.fmean(accepts) if accepts else 1.0,
                "runs": repeats,
            }
            if keep_outputs:
                row["output_ids"] = [list(r["output_ids"]) for r in timed[kind][0][1]]
            if first_token:  # --latency-split: the request's wait for its first token, then its decode rate
                row.update(first_token_ms=statistics.median(first_token), decode_tok_s=statistics.median(decode),
                           decode_tok_s_runs=run_decode)
            rounds = _rounds(server, start_lines[kind], bs)
            if rounds:
                split = {p: statistics.median(r["ms"][p] for r in rounds) for p in PHASES}
                split["bookkeeping"] = split["tree"] + split["accept_commit"]
                with_steps = [r["steps"] for r in rounds if "steps" in r]
                if with_steps:  # per step, device timeline and host clock (KDTreeWorker's _RoundMarks.detail)
                    row["steps_ms"] = {clock: {n: statistics.median(s[clock][n] for s in with_steps)
                                               for n in with_steps[0][clock]} for clock in ("ms", "host_ms")}
                    split["bookkeeping"] = statistics.median(
                        sum(s["ms"].get(n, 0.0) for n in OWN_STEPS) for s in with_steps)
                    split["sglang_side"] = statistics.median(
                        sum(s["ms"].get(n, 0.0) for n in SGLANG_STEPS) for s in with_steps)
                widths = [r["width"] for r in rounds if r.get("width")]
                if widths:  # the width choice: rounds per width, mean predicted / realised accept length
                    row["widths"] = {str(w): {"rounds": len(m), "predicted": statistics.fmean(x["predicted"] for x in m),
                                              "realised": statistics.fmean(x["realised"] for x in m)}
                                     for w in sorted({x["width"] for x in widths})
                                     for m in [[x for x in widths if x["width"] == w]]}
                row.update(split_ms=split, rounds=len(rounds),
                           graph_rounds=sum(bool(r.get("graph")) for r in rounds),
                           mla_launches=rounds[-1].get("mla_launches"),
                           mla_launches_by_kernel=rounds[-1].get("mla_launches_by_kernel"),
                           marlin_routed=rounds[-1].get("marlin_routed"))
            table.setdefault(str(bs), {})[kind] = row
    return table


def _paths(tokens, parents) -> list[dict]:
    """Per request, ``{token path from the root: node index}`` of one dumped tree (a node's verify logits
    depend only on the prefix and its path, so equal paths have equal logits whatever the node order)."""
    out = []
    for toks, pars in zip(tokens.tolist(), parents.tolist()):
        keys: dict = {}
        path_of: list = []
        for j, (t, p) in enumerate(zip(toks, pars)):
            if j > 0 and p < 0:  # padding past the tree's nodes
                path_of.append(None)
                continue
            path = (t,) if j == 0 else (path_of[p] + (t,) if path_of[p] is not None else None)
            path_of.append(path)
            if path is not None:
                keys.setdefault(path, j)
        out.append(keys)
    return out


def compare_dumps(out: Path) -> list[dict]:
    """The fused MLA kernel's verify logits (``kdtree-log``) against SGLang's MLA path (``kdtree-nomla``) for
    the first rounds both servers dumped (the first warm-up batch, greedy). Nodes are matched by their token
    path from the root: the two servers' trees may order near-tied nodes differently (bf16 MoE reductions
    with atomics are not bit-reproducible across processes). Per round: the largest |difference| over the
    matched rows relative to the largest |logit|, whether every matched row's argmax agrees, how many rows matched
    and how many of them differ by more than ``AB_REL_TOL`` of the largest |logit| (``rows_over``: one row can fail a
    round when its MoE routing flips between the two processes). Rounds whose roots or prefixes differ match no rows
    and are reported, not compared."""
    import torch

    rows = []
    for n in range(8):
        a, b = out / f"dump-fused.{n}.pt", out / f"dump-sglang.{n}.pt"
        if not (a.exists() and b.exists()):
            break
        x, y = torch.load(a), torch.load(b)
        row = {"round": n, "graph": (x["graph"], y["graph"])}
        lx, ly = x["logits"].double(), y["logits"].double()
        if "parents" in x and "parents" in y and x["tokens"].shape[0] == y["tokens"].shape[0]:
            bs, width = lx.shape[0], lx.shape[1]
            pos_x, pos_y = x["positions"].view(bs, width), y["positions"].view(bs, width)
            ia, ib = [], []
            for r, (px, py) in enumerate(zip(_paths(x["tokens"], x["parents"]), _paths(y["tokens"], y["parents"]))):
                if int(pos_x[r, 0]) != int(pos_y[r, 0]):  # different prefix lengths: not the same request state
                    continue
                for path in px.keys() & py.keys():
                    ia.append(r * width + px[path])
                    ib.append(r * width + py[path])
            lx, ly = lx.reshape(bs * width, -1)[ia], ly.reshape(bs * width, -1)[ib]
        elif torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["positions"], y["positions"]):
            lx, ly = lx.reshape(-1, lx.shape[-1]), ly.reshape(-1, ly.shape[-1])
        else:
            lx = ly = lx[:0].reshape(0, lx.shape[-1])
        row["same_inputs"] = lx.shape[0] > 0
        if lx.shape[0]:
            row["max_abs"] = float((lx - ly).abs().max())
            row["rel_to_max_logit"] = row["max_abs"] / float(ly.abs().max())
            row["argmax_agree"] = bool(torch.equal(lx.argmax(-1), ly.argmax(-1)))
            row["rows"] = int(lx.shape[0])
            row["rows_over"] = int(((lx - ly).abs().amax(-1) > AB_REL_TOL * float(ly.abs().max())).sum())
        rows.append(row)
    return rows


def mla_check(server) -> dict | None:
    """The ``kdtree-check`` server's last ``mla_check`` record (its figures cover the whole run), with the number
    of rounds and of those whose verify forward replayed a graph (not compared), or None when that server did not
    run or logged none."""
    if server is None or server.round_log is None or not server.round_log.exists():
        return None
    records = [json.loads(x) for x in server.round_log.read_text().splitlines() if x.strip()]
    checked = [r for r in records if "mla_check" in r]
    if not checked:
        return None
    return dict(checked[-1]["mla_check"], rounds=len(records), graph_rounds=sum(bool(r.get("graph")) for r in records))


def format_check(check: dict) -> str:
    verdict = "PASS" if check["calls"] > 0 and check["max_rel"] <= AB_REL_TOL else "FAIL"
    return (f"MLA check (kdtree-check: both paths on the same calls): {check['calls']} routed layer calls over "
            f"{check['rounds']} rounds ({check['graph_rounds']} replayed a graph: not compared); max |fused - SGLang| "
            f"{check['max_abs']:.4g} = {check['max_rel']:.3g} of max |SGLang output| (tolerance {AB_REL_TOL:g}: "
            f"{verdict})")


def format_table(table: dict, depths: int, vocab: int) -> str:
    lines = ["| bs | server | tok/s per request | tok/s total | accept len | draft ms | tree ms | verify ms | "
             "accept+commit ms | bookkeeping ms | SGLang prep + drafter feed ms | bookkeeping floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for bs, rows in table.items():
        for kind, r in rows.items():
            s = r.get("split_ms")
            cells = ([f"{s[p]:.3f}" for p in (*PHASES, "bookkeeping")] + [
                f"{s['sglang_side']:.3f}" if "sglang_side" in s else ""]) if s else [""] * 6
            floor = f"{bookkeeping_floor_ms(int(bs), depths, vocab):.4f}" if s else ""
            lines.append(f"| {bs} | {kind} | {r['tok_s_per_request']:.1f} | {r['tok_s_total']:.1f} | "
                         f"{r['accept_len']:.2f} | " + " | ".join(cells) + f" | {floor} |")
    for bs, rows in table.items():
        for kind, r in rows.items():
            if r.get("widths"):
                lines.append(f"widths chosen, bs {bs}, {kind}: " + "; ".join(
                    f"{w}: {x['rounds']} rounds, accept predicted {x['predicted']:.2f} realised {x['realised']:.2f}"
                    for w, x in r["widths"].items()))
    split = [(bs, kind, r) for bs, rows in table.items() for kind, r in rows.items() if "first_token_ms" in r]
    if split:
        lines += ["", "per request, median: first-token latency ms / decode tokens/s after it (--latency-split)",
                  "| bs | server | first token ms | decode tok/s |", "|---|---|---|---|"]
        lines += [f"| {bs} | {kind} | {r['first_token_ms']:.1f} | {r['decode_tok_s']:.1f} |" for bs, kind, r in split]
    steps = [(bs, kind, r["steps_ms"]) for bs, rows in table.items() for kind, r in rows.items() if "steps_ms" in r]
    if steps:
        names = list(dict.fromkeys(n for _, _, st in steps for n in st["ms"]))
        lines += ["", "per step, median ms: device timeline / host clock", "| bs | server | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for bs, kind, st in steps:
            lines.append(f"| {bs} | {kind} | " + " | ".join(
                f"{st['ms'].get(n, 0):.3f} / {st['host_ms'].get(n, 0):.3f}" for n in names) + " |")
    return "\n".join(lines)


def write_report(out: Path, report: dict) -> None:
    """``bench.json``: the run's settings and what it has measured so far (``table``, ``host_times``, then
    ``idle`` and ``gc_frozen``)."""
    (out / "bench.json").write_text(json.dumps(report, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="kimi", help="target from tests/e2e/cuda_servers.variants (default kimi)")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the tiny targets (default bfloat16)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    ap.add_argument("--budget", type=int, default=64, help="KDTREE node budget (default 64)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per size and server (default 3)")
    ap.add_argument("--kinds", nargs="+", default=["plain", "dflash", "kdtree", "kdtree-log", "kdtree-nomla"],
                    help="servers to run (default plain dflash kdtree kdtree-log kdtree-nomla; kdtree-nomla = "
                         "SGLANG_KDTREE_MLA=off, for the A/B of tokens/s and verify logits; kdtree-check = "
                         "SGLANG_KDTREE_MLA=check, both MLA paths on the same calls)")
    ap.add_argument("--widths", default=None, help="kdtree-auto*: SGLANG_KDTREE_VERIFY_WIDTHS (default: the plugin's)")
    ap.add_argument("--baselines-no-overlap", action="store_true",
                    help="plain and DFLASH with --disable-overlap-schedule (default: SGLang's default, overlap on)")
    ap.add_argument("--idle-steps", type=int, default=0,
                    help="after the timing, profile this many decode steps per server at each --idle-batches size "
                         "and report the GPU's idle time between rounds (benchmarks/idle_gaps.py; default 0: off)")
    ap.add_argument("--idle-batches", type=int, nargs="+", default=[1, 32], help="batch sizes of the idle trace")
    ap.add_argument("--latency-split", action="store_true",
                    help="start every server with --enable-metrics and report each request's first-token latency "
                         "and decode rate (medians) beside its tokens/s: where a server's time per request goes")
    ap.add_argument("--host-times", action="store_true",
                    help="every server times its decode rounds' host work, step by step of SGLang's scheduler loop "
                         "(KDTREE_HOST_TIMES, sglang_kdtree/server/host_times.py): medians over the timed batches")
    ap.add_argument("--out", type=Path, required=True, help="folder for server logs and bench.json")
    args = ap.parse_args(argv)
    variant = cuda_servers.variants(args.dtype)[args.variant]
    servers = start(variant, args.kinds, args.budget, args.out, args.widths, not args.baselines_no_overlap,
                    args.latency_split, args.host_times)
    depths, vocab = _geometry(variant)
    report = {"variant": args.variant, "budget": args.budget, "widths": args.widths, "new_tokens": args.new_tokens,
              "baselines_overlap": not args.baselines_no_overlap, "latency_split": args.latency_split}
    try:
        failed = cuda_servers.wait_all(servers)
        for name, err in failed.items():
            print(f"{name} failed to start:\n{err}", file=sys.stderr)
            servers.pop(name)
        report["table"] = measure(servers, args.batches, args.new_tokens, args.repeats)
        report["host_times"] = read_host_times(servers, args.out) if args.host_times else {}  # before the traces
        # written and printed now: the profiled traces are the slow part, and a call that runs out of time
        # in them keeps the timed table
        write_report(args.out, report)
        print(format_table(report["table"], depths, vocab), flush=True)
        if report["host_times"]:
            print("Host time per decode round, by step of the scheduler loop (medians, timed batches):\n"
                  + format_host_times(report["host_times"], extra=("period_mean",)), flush=True)
            steps = format_round_steps(report["host_times"])
            if steps:
                print("KDTREE's round by its own steps, host clock (medians, ms):\n" + steps, flush=True)
        report["idle"] = idle_gaps.trace_servers(
            servers, args.idle_batches, args.idle_steps, IDLE_TOKENS_PER_STEP * args.idle_steps, args.out / "traces",
            batch_of) if args.idle_steps else {}
    finally:
        for server in servers.values():
            server.stop()
    gc_frozen = {name: server.gc_frozen for name, server in servers.items()}
    write_report(args.out, dict(report, gc_frozen=gc_frozen))
    if report["idle"]:
        print("GPU idle time between rounds (profiled decode window):\n" + idle_gaps.format_table(report["idle"]))
    unfrozen = sorted(name for name, frozen in gc_frozen.items() if not frozen)
    print("garbage collector frozen after startup (as after SGLang's warm-up): "
          + ("every server" if not unfrozen else "NOT in " + ", ".join(unfrozen)))
    ab = compare_dumps(args.out)
    (args.out / "verify_ab.json").write_text(json.dumps(ab, indent=1))
    for row in ab:
        print(f"verify logits round {row['round']}: " + (
            f"fused MLA vs SGLang MLA max|diff| {row['max_abs']:.4g} = {row['rel_to_max_logit']:.3g} of max|logit|, "
            f"argmax agree {row['argmax_agree']} over {row['rows']} rows, {row['rows_over']} over the tolerance "
            f"({AB_REL_TOL:g} of max|logit|: "
            f"{'PASS' if row['rel_to_max_logit'] <= AB_REL_TOL and row['argmax_agree'] else 'FAIL'}), graph {row['graph']}"
            if row["same_inputs"] else "no node with the same prefix and token path in both dumps, not compared"))
    if not ab:
        print("verify logits: no dumps to compare (kdtree-log / kdtree-nomla did not both dump)")
    check = mla_check(servers.get("kdtree-check"))
    if check is not None:
        (args.out / "mla_check.json").write_text(json.dumps(check, indent=1))
        print(format_check(check))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
