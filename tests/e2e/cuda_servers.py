"""Real SGLang servers on a CUDA GPU, plain vs ``--speculative-algorithm kdtree``, for the GPU tests and
``device/device_server.sh``.

What is real and what is not: SGLang's launcher, scheduler, model runner, CUDA-graph runners, memory pool,
Triton attention and fused-MoE kernels, its JIT kernels (``sglang.kernels.ops``), and all of sglang-kdtree,
run as shipped. What the GPU machine cannot have (the ``sglang-kernel`` binary wheel, built for SGLang's
pinned torch; ``soundfile``; the CUTLASS DSL) is replaced by the test-only stand-in in
``tests/e2e/sgl_kernel_cuda`` (see its ``sgl_kernel/__init__.py`` and ``sitecustomize.py``), put first on
every server's ``PYTHONPATH``.

Every server of one comparison set starts at once, on distinct ports, then ``NUM_PROMPTS`` greedy prompts
of mixed lengths go to each, concurrently, by ``input_ids``. Memory: SGLang sizes a server's KV budget as
the free memory when it profiles minus ``(1 - mem_fraction_static)`` x the free memory when it started, so
``--mem-fraction-static 0.3`` (~42 GB of an H200) is headroom for what the neighbours allocate meanwhile;
the pool itself is capped by ``--max-total-tokens`` (a few hundred MB for these models).

CLI (``device/device_server.sh``'s PROBE; the test is ``tests/gpu/test_server_cuda.py``)::

    python tests/e2e/cuda_servers.py --models llama,dsv3 --modes graph --dtypes float32 --out DIR

writes ``DIR/summary.json`` and one log per server, and prints one line per comparison. ``--overlap``: every server
on SGLang's overlap scheduler; ``--sync-debug``: KDTREE servers list each host sync of a decode round, in place of
the round log.

Environment: ``KDTREE_TINY_MODELS`` (the tiny models, built with ``make_tiny_models.py`` if missing),
``KDTREE_KIMI_MODELS`` (the Kimi-shaped target as ``DIR/kimi`` with its drafter ``DIR/kimi-dflash``;
variants ``kimi`` and ``kimi-marlin`` exist only when it is set), ``KDTREE_CUDA_STARTUP_TIMEOUT``
(default 420 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN_DIR = HERE / "sgl_kernel_cuda"
REPO = HERE.parent.parent

sys.path[:0] = [str(HERE), str(REPO)]  # cuda_compare imports testbed
import make_tiny_models as tiny  # noqa: E402
from cuda_compare import first_mismatch, host_syncs, logprob_pair  # noqa: E402,F401  (cs.first_mismatch etc.)
from server_limits import launch_limits, profile_holds  # noqa: E402

STARTUP_TIMEOUT_S = float(os.environ.get("KDTREE_CUDA_STARTUP_TIMEOUT", "420"))
NUM_PROMPTS = 40
NEW_TOKENS = 32
VERIFY_WIDTH = 17  # --speculative-num-draft-tokens: 16 tree nodes + the root
#: verify-width tiers (``--widths``): KDTREE servers then choose per round (no --speculative-num-draft-tokens)
WIDTHS: str | None = None
#: ``--overlap``: every server on SGLang's overlap scheduler (its default); else all pass --disable-overlap-schedule
OVERLAP = False
#: ``--sync-debug``: KDTREE servers write each host sync of a decode round (``sglang_kdtree/server/sync_debug.py``) instead
#: of a round log (whose reads are such syncs, by design)
SYNC_DEBUG = False
MAX_RUNNING = 48  # >= NUM_PROMPTS, so every prompt is in flight at once
DECODE_GRAPH_BS = [1, 2, 4, 8, 16, 24, 32, 40, 48]
PREFILL_GRAPH_TOKENS = [64, 256, 1024]

@dataclass(frozen=True)
class Variant:
    """One target (and its DFlash drafter) served plain and with KDTREE under the same settings."""

    name: str
    target: Path
    drafter: Path
    dtype: str
    env: dict = field(default_factory=dict)
    tp: int = 1  # --tp-size (the Kimi-shaped target at TP 2 splits its 8 heads and its vocabulary in two)


def tiny_models_dir() -> Path:
    root = Path(os.environ.get("KDTREE_TINY_MODELS", REPO / ".tiny_models"))
    tiny.ensure_built(root)
    return root


def variants(dtype: str = "float32") -> dict[str, Variant]:
    """The comparison targets: the tiny Llama and DeepSeek-V3 (fp32 checkpoints, served in ``dtype``),
    and the Kimi-shaped W4A16 target when ``KDTREE_KIMI_MODELS`` is set (bf16: Marlin needs it), with
    SGLang's own MoE path and with ``SGLANG_KDTREE_MOE=marlin``."""
    root = tiny_models_dir()
    out = {name: Variant(name, root / name, root / f"{name}-dflash", dtype) for name in ("llama", "dsv3")}
    kimi = os.environ.get("KDTREE_KIMI_MODELS")
    if kimi:
        k = Path(kimi)
        out["kimi"] = Variant("kimi", k / "kimi", k / "kimi-dflash", "bfloat16")
        out["kimi-marlin"] = Variant("kimi-marlin", k / "kimi", k / "kimi-dflash", "bfloat16",
                                     {"SGLANG_KDTREE_MOE": "marlin"})
    return out


def prompts(count: int = NUM_PROMPTS, seed: int = 11) -> list[list[int]]:
    """Mixed lengths 1..48 (a few fixed short/long ones, the rest random) over the tiny vocabulary's words
    (the Kimi-shaped target's vocabulary contains them too)."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 48] + [rng.randint(1, 48) for _ in range(count - 9)]
    return [[rng.randrange(tiny.NUM_WORDS) for _ in range(n)] for n in lengths]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(
        [str(STANDIN_DIR), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


def server_args(variant: Variant, port: int, *, kdtree: bool, cuda_graph: bool) -> list[str]:
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(variant.target),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", variant.dtype,
        "--attention-backend", "triton",
        "--sampling-backend", "pytorch",
        "--page-size", "1",
        *([] if OVERLAP else ["--disable-overlap-schedule"]),
        "--disable-radix-cache",
        "--mem-fraction-static", "0.3",
        "--max-total-tokens", "32768",
        "--max-running-requests", str(MAX_RUNNING),
        "--chunked-prefill-size", "1024",
        "--skip-server-warmup",
        # an idle SGLang scheduler otherwise polls at 100 % of a core: servers started side by side (the probe,
        # the bench's plain / DFLASH / KDTREE servers) would take CPU from the one being measured
        "--sleep-on-idle",
        "--log-level", "info",
    ]
    if variant.tp > 1:
        args += ["--tp-size", str(variant.tp)]
    if cuda_graph:
        args += ["--cuda-graph-max-bs-decode", str(max(DECODE_GRAPH_BS)),
                 "--cuda-graph-bs-decode", *map(str, DECODE_GRAPH_BS),
                 "--cuda-graph-bs-prefill", *map(str, PREFILL_GRAPH_TOKENS)]
    else:
        args += ["--disable-cuda-graph"]
    if kdtree:
        args += ["--speculative-algorithm", "kdtree",
                 "--speculative-draft-model-path", str(variant.drafter)]
        if WIDTHS is None:
            args += ["--speculative-num-draft-tokens", str(VERIFY_WIDTH)]
    return args


class CudaServer:
    """A ``sglang.launch_server`` subprocess on 127.0.0.1; ``stop()`` ends its whole process group."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict | None = None):
        self.name = name
        self.args = args
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.round_log: Path | None = (Path(env["KDTREE_ROUND_LOG"]) if env and "KDTREE_ROUND_LOG" in env
                                       else None)
        self.sync_log: Path | None = (Path(env["KDTREE_SYNC_DEBUG"]) if env and "KDTREE_SYNC_DEBUG" in env
                                      else None)
        self.ready_s: float | None = None
        self.gc_frozen: bool | None = None  # /freeze_gc's outcome once healthy (see poll_ready)
        self._log = open(log_path, "wb")
        self._started = time.time()
        self.proc = subprocess.Popen(args, env=server_env(env), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(REPO))

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def poll_ready(self) -> bool | None:
        """True once healthy, None while starting; raises if the process died. Once healthy, freezes the
        server's garbage collector (``freeze_gc``)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name}: server exited with {self.proc.returncode} during startup:\n"
                               f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status == 200:
                    self.ready_s = time.time() - self._started
                    self.freeze_gc()
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        return None

    def freeze_gc(self) -> None:
        """POST ``/freeze_gc``, which SGLang runs after its warm-up so the startup heap leaves the collected
        generations; with ``--skip-server-warmup`` its own call comes too early and fails. ``gc_frozen``: whether
        this one succeeded."""
        try:
            req = urllib.request.Request(self.url + "/freeze_gc", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                self.gc_frozen = r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            self.gc_frozen = False

    def generate(self, payload: dict, timeout: float = 600) -> dict:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        try:  # scheduler / detokenizer share the group: none may outlive the run
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not self._log.closed:
            self._log.close()


def server_name(variant: Variant, kdtree: bool, cuda_graph: bool) -> str:
    return (f"{variant.name}-{variant.dtype}-{'kdtree' if kdtree else 'plain'}-{'graph' if cuda_graph else 'eager'}"
            + ("-overlap" if OVERLAP else ""))


def start_servers(plan: list[tuple[Variant, bool, bool]], log_dir: Path) -> dict[str, CudaServer]:
    """Start every (variant, kdtree, cuda_graph) of ``plan`` at once; KDTREE servers write a round log (or, with
    ``SYNC_DEBUG``, their host syncs)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {}
    for variant, kdtree, cuda_graph in plan:
        name = server_name(variant, kdtree, cuda_graph)
        env = dict(variant.env)
        env["KDTREE_STANDIN_TRACE"] = str(log_dir / f"standin-ops-{name}.txt")
        Path(env["KDTREE_STANDIN_TRACE"]).unlink(missing_ok=True)
        if kdtree:
            log = log_dir / f"{'syncs' if SYNC_DEBUG else 'rounds'}-{name}.jsonl"
            log.unlink(missing_ok=True)
            env["KDTREE_SYNC_DEBUG" if SYNC_DEBUG else "KDTREE_ROUND_LOG"] = str(log)
            if WIDTHS is not None:
                env["SGLANG_KDTREE_VERIFY_WIDTHS"] = WIDTHS
        args = server_args(variant, free_port(), kdtree=kdtree, cuda_graph=cuda_graph)
        servers[name] = CudaServer(name, args, log_dir / f"{name}.log", env)
    return servers


def wait_all(servers: dict[str, CudaServer], timeout: float = STARTUP_TIMEOUT_S) -> dict[str, str]:
    """Wait until every server is healthy or failed; returns ``{name: error}`` for the failed ones (those
    are stopped). Never raises for one server, so one failure does not hide the others' results."""
    deadline = time.time() + timeout
    pending, failed = dict(servers), {}
    while pending and time.time() < deadline:
        for name, server in list(pending.items()):
            try:
                if server.poll_ready():
                    del pending[name]
            except RuntimeError as exc:
                failed[name] = str(exc)
                del pending[name]
        time.sleep(1.0)
    for name, server in pending.items():
        failed[name] = f"{name}: not healthy after {timeout:.0f}s:\n{server.log_tail()}"
        server.stop()
    return failed


def greedy_payload(prompt: list[int], logprobs: bool = False) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
            **({"return_logprob": True} if logprobs else {})}


def run_prompts(server: CudaServer, batch: list[list[int]], logprobs: bool = False) -> list[dict]:
    def one(prompt):
        return server.generate(greedy_payload(prompt, logprobs))

    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        return list(pool.map(one, batch))


#: prompts also served greedily with ``return_logprob`` by both servers of a pair (KDTREE's logprobs come from
#: the verify forward's rows of the accepted path: ``spec_logprobs.py``)
LOGPROB_PROMPTS = 8


def round_records(server: CudaServer) -> list[dict]:
    if server.round_log is None or not server.round_log.exists():
        return []
    return [json.loads(line) for line in server.round_log.read_text().splitlines() if line.strip()]


def compare(variants_: list[Variant], modes: list[bool], log_dir: Path, batch=None) -> dict:
    """Serve every variant plain and KDTREE in every CUDA-graph mode at once; return a JSON-able summary
    (per server: ready time or error, outputs; per pair: identical or the first mismatch)."""
    batch = batch or prompts()
    plan = [(v, kd, g) for v in variants_ for g in modes for kd in (False, True)]
    servers = start_servers(plan, log_dir)
    summary: dict = {"servers": {}, "pairs": {}, "logprob_pairs": {}, "num_prompts": len(batch),
                     "new_tokens": NEW_TOKENS}
    try:
        failed = wait_all(servers)
        outputs, logprob_outputs, logprob_errors = {}, {}, {}
        live = [n for n in servers if n not in failed]
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            futures = {n: pool.submit(run_prompts, servers[n], batch) for n in live}
            for name, fut in futures.items():
                try:
                    outputs[name] = fut.result()
                except Exception as exc:  # noqa: BLE001  (recorded, reported, asserted by the caller)
                    failed[name] = f"{name}: generate failed: {exc!r}\n{servers[name].log_tail()}"
            live = [n for n in live if n in outputs]
            futures = {n: pool.submit(run_prompts, servers[n], batch[:LOGPROB_PROMPTS], True) for n in live}
            for name, fut in futures.items():
                try:
                    logprob_outputs[name] = fut.result()
                except Exception as exc:  # noqa: BLE001
                    logprob_errors[name] = f"{name}: generate with logprobs failed: {exc!r}"
        for name, server in servers.items():
            log = server.log_text()
            trace = log_dir / f"standin-ops-{name}.txt"
            rec = {"ready_s": server.ready_s, "gc_frozen": server.gc_frozen, "error": failed.get(name),
                   "log": str(server.log_path),
                   "gpu_backend": "gpu backend" in log,
                   "standin_ops_called": sorted({line.split()[0] for line in trace.read_text().splitlines()
                                                 if line.strip()}) if trace.exists() else []}
            if name in outputs:
                rec["output_ids"] = [r["output_ids"] for r in outputs[name]]
                rec["completion_tokens"] = sum(r["meta_info"]["completion_tokens"] for r in outputs[name])
                verify = sum(r["meta_info"].get("spec_verify_ct", 0) for r in outputs[name])
                rec["spec_verify_ct"] = verify
                rec["accept_length"] = rec["completion_tokens"] / verify if verify else None
            records = round_records(server)
            rec.update(host_syncs(server.sync_log) if server.sync_log else {})
            rec["round_log_exists"] = bool(server.round_log and server.round_log.exists())
            rec["rounds"] = len(records)
            rec["max_batch_in_round"] = max((len(r.get("accept_lens", [])) for r in records), default=0)
            rec["backends"] = sorted({str(r.get("backend")) for r in records})
            rec["graph_rounds"] = sum(bool(r.get("graph")) for r in records)
            graph_mla = [r["mla_launches"] for r in records if r.get("graph") and "mla_launches" in r]
            rec["mla_launches"] = max((r.get("mla_launches", 0) for r in records), default=0)
            rec["mla_launches_during_graph_rounds"] = graph_mla[-1] - graph_mla[0] if len(graph_mla) > 1 else 0
            last_by_kernel = next((r["mla_launches_by_kernel"] for r in reversed(records)
                                   if "mla_launches_by_kernel" in r), {})
            rec["mla_kernels"] = sorted(k for k, n in last_by_kernel.items() if n > 0)
            rec["launch_limits"] = launch_limits(log)
            rec["marlin_routed"] = max((r.get("marlin_routed", 0) for r in records), default=0)
            rec["tree_graph_replays"] = max((r.get("tree_graph_replays", 0) for r in records), default=0)
            rec["commit_graph_replays"] = max((r.get("commit_graph_replays", 0) for r in records), default=0)
            # per verify width: rounds, graph replays and the mean predicted / realised accept length
            widths = [r["width"] for r in records if r.get("width")]
            rec["tiers"] = next((r["tiers"] for r in reversed(records) if r.get("tiers")), {})
            rec["width_rounds"] = {}
            for w in sorted({x["width"] for x in widths}):
                mine = [x for x in widths if x["width"] == w]
                rec["width_rounds"][str(w)] = {
                    "rounds": len(mine), "predicted": round(sum(x["predicted"] for x in mine) / len(mine), 3),
                    "predicted_raw": round(sum(x["predicted_raw"] for x in mine) / len(mine), 3),
                    "realised": round(sum(x["realised"] for x in mine) / len(mine), 3)}
            summary["servers"][name] = rec
        for v in variants_:
            for g in modes:
                plain, spec = server_name(v, False, g), server_name(v, True, g)
                key = f"{v.name}-{v.dtype}-{'graph' if g else 'eager'}"
                if plain in outputs and spec in outputs:
                    mismatch = first_mismatch(outputs[plain], outputs[spec])
                    summary["pairs"][key] = {"identical": mismatch is None, "mismatch": mismatch}
                else:
                    summary["pairs"][key] = {"identical": None, "mismatch": "a server failed"}
                if plain in logprob_outputs and spec in logprob_outputs:
                    summary["logprob_pairs"][key] = logprob_pair(logprob_outputs[plain], logprob_outputs[spec])
                else:
                    summary["logprob_pairs"][key] = {"ids_identical": None, "max_abs_diff": None,
                                                     "error": logprob_errors.get(spec) or logprob_errors.get(plain)
                                                     or "a server failed"}
    finally:
        for server in servers.values():
            server.stop()
    return summary


def format_table(summary: dict) -> str:
    lines = [f"{'server':44s} {'ready_s':>8s} {'tokens':>7s} {'accept':>7s} {'rounds':>6s} {'maxbs':>5s} "
             f"{'gpu':>4s} {'graph':>5s} {'tree_g':>6s} {'acc_g':>5s} {'mla':>6s} {'marlin':>6s}  error"]
    for name, rec in summary["servers"].items():
        ready = f"{rec['ready_s']:.0f}" if rec.get("ready_s") else "-"
        acc = f"{rec['accept_length']:.2f}" if rec.get("accept_length") else "-"
        err = (rec.get("error") or "").strip().splitlines()
        # the exception line if the log tail has one (the last lines are usually the launcher's shutdown)
        err_line = next((e for e in reversed(err) if "Error" in e or "Exception" in e),
                        next((e for e in reversed(err) if e.strip()), ""))[:110] if err else ""
        lines.append(f"{name:44s} {ready:>8s} {rec.get('completion_tokens', '-')!s:>7s} {acc:>7s} "
                     f"{rec.get('rounds', 0):>6d} {rec.get('max_batch_in_round', 0):>5d} "
                     f"{'yes' if rec.get('gpu_backend') else 'no':>4s} {rec.get('graph_rounds', 0):>5d} "
                     f"{rec.get('tree_graph_replays', 0):>6d} {rec.get('commit_graph_replays', 0):>5d} "
                     f"{rec.get('mla_launches', 0):>6d} {rec.get('marlin_routed', 0):>6d}  {err_line}")
    for name, rec in summary["servers"].items():
        if rec.get("width_rounds"):
            lines.append(f"widths {name}: " + "; ".join(
                f"{w}: {x['rounds']} rounds, pred {x['predicted']} (raw {x['predicted_raw']}) real {x['realised']}, "
                f"graph {rec['tiers'].get(w, {}).get('graph_replays', '?')}/{rec['tiers'].get(w, {}).get('verifies', '?')}"
                for w, x in rec["width_rounds"].items()))
    ops = sorted({op for rec in summary["servers"].values() for op in rec.get("standin_ops_called", [])})
    for name, rec in summary["servers"].items():
        if "host_syncs" in rec:
            lines.append(f"host syncs in decode rounds {name}: {rec['host_syncs']}  "
                         + ", ".join(f"{k} x{n}" for k, n in rec["host_sync_sites"].items()))
    lines.append(f"sgl_kernel stand-in ops called (any server): {', '.join(ops) or '-'}")
    kernels = {name: rec["mla_kernels"] for name, rec in summary["servers"].items() if rec.get("mla_kernels")}
    lines.append("fused MLA kernels that ran: "
                 + (", ".join(f"{name}: {'+'.join(k)}" for name, k in kernels.items()) or "-"))
    for key, pair in summary["pairs"].items():
        verdict = {True: "IDENTICAL", False: "DIFFER", None: "NOT RUN"}[pair["identical"]]
        lines.append(f"kdtree vs plain {key:30s} {verdict}  {pair['mismatch'] or ''}"[:200])
    for key, pair in summary.get("logprob_pairs", {}).items():
        diff = pair["max_abs_diff"]
        lines.append(f"logprobs, {LOGPROB_PROMPTS} prompts {key:27s} ids {'same' if pair['ids_identical'] else 'DIFFER'}"
                     f"  max |dlogprob| {'-' if diff is None else f'{diff:.2e}'}  {pair['error'] or ''}"[:200])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,dsv3")
    parser.add_argument("--modes", default="graph", help="comma list of graph, eager")
    parser.add_argument("--dtypes", default="float32", help="comma list; the Kimi variants are always bf16")
    parser.add_argument("--tp", type=int, default=1, help="--tp-size of every server (variant names get -tpN)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--widths", default=None,
                        help="verify-width tiers, e.g. 8,16,32: KDTREE servers choose per round (default: pinned 17)")
    parser.add_argument("--overlap", action="store_true", help="every server on the overlap scheduler")
    parser.add_argument("--sync-debug", action="store_true", help="KDTREE servers record each host sync of a round")
    args = parser.parse_args(argv)
    global WIDTHS, OVERLAP, SYNC_DEBUG
    WIDTHS, OVERLAP, SYNC_DEBUG = args.widths, args.overlap, args.sync_debug
    chosen = []
    for dtype in args.dtypes.split(","):
        table = variants(dtype)
        chosen += [table[m] for m in args.models.split(",") if m in table]
    if args.tp > 1:
        chosen = [dataclasses.replace(v, name=f"{v.name}-tp{args.tp}", tp=args.tp) for v in chosen]
    # the bf16 Kimi variants appear once whatever --dtypes says
    chosen = list({(v.name, v.dtype): v for v in chosen}.values())
    modes = [{"graph": True, "eager": False}[m] for m in args.modes.split(",")]
    summary = compare(chosen, modes, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "table.txt").write_text(format_table(summary) + "\n")
    print(format_table(summary))
    for name, rec in summary["servers"].items():
        if rec.get("launch_limits"):
            print(f"{name}: MLA {rec.get('mla_kernels')}; {rec['launch_limits']['line']}")
    ok = all(p["identical"] for p in summary["pairs"].values()) and all(
        p["error"] is None and p["ids_identical"] for p in summary["logprob_pairs"].values())
    profile = os.environ.get("KDTREE_DEVICE_PROFILE")
    if profile:
        problems = profile_holds(summary, profile)
        print(f"{profile} profile: " + ("every KDTREE server within it" if not problems else "; ".join(problems)))
        ok = ok and not problems
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
