"""GPU timing of the pieces of one Kimi K2.6 decode round at TP 8 (per GPU), for ``kimi_model``'s arithmetic.
``measure`` times every piece the rows need (the verify pieces at T = batch x every verify width: 1, the drafter
block, every budget + 1), in priority order within a deadline; ``kimi_round.py`` is its CLI.

Pieces (one GPU, bf16 unless said; each the median of CUDA-event-timed replays of a CUDA graph, eager where a
capture fails, marked in the output). Weights rotate over enough distinct copies (up to one per layer) that they
come from HBM, not the 50 MB L2, as in the real 61-layer forward:

* MLA projections per layer: fused q_a + kv_a (7168 -> 1536 + 576, replicated), q_b (1536 -> 8 x 192), the
  absorbed kv_b halves as batched matmuls over the 8 local heads (128 -> latent 512; latent 512 -> v 128), o_proj
  (8 x 128 -> 7168); RMSNorms over 7168 (two), 1536 and 512 with ``torch.nn.functional.rms_norm``.
* tree-verify attention: ``sglang_kdtree.gpu.mla_attention.mla_tree_verify`` on ``mla_reference.synthetic_inputs``,
  8 heads, every request at the given context (AR: the same kernel at width 1, a stand-in for SGLang's decode
  attention).
* routed MoE: ``sglang_kdtree.moe.forward.fused_moe_marlin`` at bench_marlin_moe's ``tp8`` shape (384 experts,
  hidden 7168, intermediate 256, top 8), uniform random routings rotated over ``ROTATE`` draws; where Marlin's JIT
  modules are not ready within ``--marlin-prep-s`` (seeded from ``.dev-carry/jit`` or ``.jitcache/sm90a`` if
  carried; a cold compile takes ~6 min), the bf16 grouped path of bench_marlin_moe instead, and the output says so.
* router (7168 -> 384, sigmoid, biased top 8), shared expert (7168 -> 2 x 256 -> 7168), the dense first layer's MLP
  (7168 -> 2 x 2304 -> 7168), the lm_head slice (7168 -> 163,840 / 8).
* the drafter (ASSUMPTION: Kimi K2.6's DFlash drafter is not public): ``--draft-layers`` (default 5) dense layers
  at hidden 7168, GQA with 64 query / 8 KV heads of 128 (8 / 1 per GPU, the query heads folded into rows for torch
  SDPA), SwiGLU 18432 (the dense layer's piece), a block of 16 positions attending, unmasked, to the whole context
  plus the block; its head: the lm_head slice over batch x 15 rows (part of the draft). Not modelled: its
  projection of the target's hidden states for the accepted tokens and its KV commit.
* our bookkeeping: ``benchmarks/round_parts.py``'s ``parts()`` at each batch and the largest budget (depth 15,
  vocab 163,840, KV compaction over 61 MLA layers): tree = ``tree graph replay`` (top-K -> tree -> verify inputs),
  accept+commit = ``accept_commit graph replay`` (device time of the two captured step graphs).
"""

from __future__ import annotations

import math
import signal
import sys
import time

from benchmarks.kimi_model import DRAFT_PIECES, KIMI, VERIFY_PIECES, RoundConfig, key
from sglang_kdtree.cli.bench_timing import cuda_time_us


class DeadlineExceeded(BaseException):
    """The deadline (or a piece's shorter budget) passed. A BaseException, like KeyboardInterrupt, so library
    code's ``except Exception`` (e.g. ``moe.jit.seed_prebuilt`` falling back to a compile) cannot swallow it."""

    def __init__(self, label: str = "deadline"):
        super().__init__(label)
        self.label = label


class _Alarm:
    """Raise ``DeadlineExceeded`` in the main thread when the global deadline (or a shorter budget) passes
    (SIGALRM; where that is unavailable, only the checks between pieces apply)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.label = "deadline"
        self.enabled = hasattr(signal, "setitimer")
        self._old = None
        if self.enabled:
            try:
                self._old = signal.signal(signal.SIGALRM, self._fire)
            except ValueError:  # not the main thread
                self.enabled = False

    def _fire(self, signum, frame):
        raise DeadlineExceeded(self.label)

    def left(self) -> float:
        return self.end - time.monotonic()

    def arm(self, seconds: float | None = None, label: str = "deadline") -> None:
        left = self.left()
        t = left if seconds is None else min(seconds, left)
        self.label = "deadline" if t >= left else label
        if t <= 0:
            raise DeadlineExceeded(self.label)
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, t)

    def disarm(self) -> None:
        if self.enabled:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if self._old is not None:
                signal.signal(signal.SIGALRM, self._old)
                self._old = None
            self.enabled = False


def _oneline(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:limit]


def _import_bench(name: str):
    """A sibling benchmark module (``bench_marlin_moe``, ``round_parts``), imported when its piece is timed (it
    pulls torch and SGLang)."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


L2_FLUSH_BYTES = 256 << 20  # weights a piece rotates over: well past the H200's 50 MB L2
MIN_CALLS = 16  # calls per timed replay


def cuda_graph_us(fns, trials: int = 5) -> tuple[float, str]:
    """Median device microseconds per call of ``fns`` (each run once per pass, passes repeated to at least
    MIN_CALLS calls) from CUDA-event-timed replays of one CUDA graph; eager passes where the capture fails."""
    import torch

    repeat = max(1, math.ceil(MIN_CALLS / len(fns)))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, autotunes) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                for f in fns:
                    f()
        run = graph.replay
    except DeadlineExceeded:
        raise
    except Exception:
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for _ in range(repeat):
                for f in fns:
                    f()
    # one warm-up pass, then the median of `trials` CUDA-event-timed passes (the benchmarks' one timer)
    return cuda_time_us(run, calls=repeat * len(fns), trials=trials), mode


class _Bench:
    """State of one measurement run: shapes, device, timer, weight caches, results."""

    def __init__(self, cfg: RoundConfig, device: str, timer, alarm: _Alarm, log):
        self.cfg, self.device, self.timer, self.alarm, self.log = cfg, device, timer, alarm, log
        self.times, self.errors, self.modes, self.notes, self.skipped = {}, {}, {}, [], []
        self.extra: dict = {}
        self.weights: dict = {}
        self.moe = None

    def record(self, k: str, fns) -> None:
        us, mode = self.timer(fns)
        self.times[k] = float(us)
        self.modes[k] = mode

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def free(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

    # --- linear pieces -------------------------------------------------------------------------------

    def _copies(self, nbytes: int) -> int:
        return max(2, min(self.cfg.model.layers, math.ceil(L2_FLUSH_BYTES / max(1, nbytes))))

    def _weights(self, name: str, shapes, scale: float = 0.02):
        """Distinct weight sets for ``name`` (each a tuple of bf16 tensors of ``shapes``), cached."""
        import torch

        if name not in self.weights:
            count = self._copies(sum(math.prod(s) * 2 for s in shapes))
            self.weights[name] = [tuple(torch.randn(s, device=self.device, dtype=torch.bfloat16) * scale
                                        for s in shapes) for _ in range(count)]
        return self.weights[name]

    def linear_fns(self, name: str, T: int):
        """Callables of one linear piece at ``T`` tokens, one per distinct weight set."""
        import torch
        import torch.nn.functional as F

        m, d, dev = self.cfg.model, self.cfg.drafter, self.device
        H, h = m.hidden, m.heads_gpu

        def x_of(k):
            return (torch.randn((T, k), device=dev)).to(torch.bfloat16)

        def mm(k, n):
            x = x_of(k)
            return [lambda w=w: torch.matmul(x, w[0].t()) for w in self._weights(name, [(n, k)])]

        def mlp(inter):
            x = x_of(H)

            def run(w13, w2):
                g = torch.matmul(x, w13.t())
                return torch.matmul(F.silu(g[:, :inter]) * g[:, inter:], w2.t())
            return [lambda w=w: run(*w) for w in self._weights(name, [(2 * inter, H), (H, inter)])]

        def bmm(a, b):
            x = torch.randn((h, T, a), device=dev).to(torch.bfloat16)
            return [lambda w=w: torch.bmm(x, w[0]) for w in self._weights(name, [(h, a, b)])]

        def rms(dim):
            x = x_of(dim)
            w = torch.ones(dim, device=dev, dtype=torch.bfloat16)
            if hasattr(F, "rms_norm"):
                return [lambda: F.rms_norm(x, (dim,), w, 1e-6)]
            return [lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w]

        def router():
            x, bias = x_of(H), torch.zeros(m.experts, device=dev)

            def route(wg):
                scores = torch.sigmoid(torch.matmul(x, wg.t()).float())
                ids = torch.topk(scores + bias, m.top_k, dim=1).indices
                w = scores.gather(1, ids)
                return ids, w / w.sum(dim=1, keepdim=True)
            return [lambda w=w: route(w[0]) for w in self._weights(name, [(m.experts, H)])]

        build = {
            "qkv_a": lambda: mm(H, m.q_lora + m.kv_lora + m.qk_rope),
            "q_b": lambda: mm(m.q_lora, h * (m.qk_nope + m.qk_rope)),
            "kv_absorb": lambda: bmm(m.qk_nope, m.kv_lora), "o_absorb": lambda: bmm(m.kv_lora, m.v_head),
            "o_proj": lambda: mm(h * m.v_head, H), "lm_head": lambda: mm(H, m.vocab_gpu),
            "shared": lambda: mlp(m.shared_inter_gpu), "dense_mlp": lambda: mlp(m.dense_inter_gpu),
            "rms_hidden": lambda: rms(H), "rms_q": lambda: rms(m.q_lora), "rms_kv": lambda: rms(m.kv_lora),
            "draft_qkv": lambda: mm(H, (d.heads + 2 * d.kv_heads) // m.tp * d.head_dim),
            "draft_o": lambda: mm(d.heads // m.tp * d.head_dim, H), "router": router,
        }
        return build[name]()

    # --- routed MoE --------------------------------------------------------------------------------------

    def moe_prepare(self, allow_compile: bool, seed_dir, prep_s: float) -> None:
        """Marlin INT4 experts at the tp8 shape, or the bf16 grouped fallback (the reason goes in the notes)."""
        import torch

        bmm = _import_bench("bench_marlin_moe")
        m = self.cfg.model
        E, K, N = m.experts, m.hidden, m.moe_inter_gpu
        if m == KIMI and (E, K, N) != tuple(bmm.SHAPES["tp8"]):
            self.notes.append(f"bench_marlin_moe.SHAPES['tp8'] is {bmm.SHAPES['tp8']}, not {(E, K, N)}")
        reason = None
        try:
            if self.device != "cuda":
                raise RuntimeError("no CUDA device")
            from sglang_kdtree.moe import forward as fwd
            from sglang_kdtree.moe import jit
            from sglang_kdtree.moe import weights as mw

            self.alarm.arm(prep_s, "marlin")
            try:
                if not jit.marlin_kernels_cached():
                    if seed_dir is not None:
                        seeded = jit.seed_prebuilt(seed_dir)
                        self.notes.append(f"Marlin JIT modules seeded from {seed_dir}: {seeded or 'none matched'}")
                    if not jit.marlin_kernels_cached() and not allow_compile:
                        raise RuntimeError("Marlin JIT modules are neither cached nor seeded (a compile takes ~6 "
                                           "min; --allow-marlin-compile permits it)")
                took = jit.ensure_marlin_kernels("bfloat16")
                packed = mw.random_packed_weights(E, K, N, device="cuda", seed=1)
                marlin = mw.repack_for_marlin(packed)
                del packed
            finally:
                self.alarm.arm()  # back to the global deadline (raises if it has passed)
            self.moe = ("marlin", marlin, fwd)
            self.extra["moe_path"] = f"Marlin INT4 W4A16 (sglang_kdtree.moe, {fwd.DEFAULT_REDUCE} reduce; " \
                                     f"kernels ready in {took:.1f} s)"
            return
        except DeadlineExceeded as exc:
            if exc.label != "marlin":
                raise
            reason = f"Marlin preparation passed its {prep_s:g} s budget (--marlin-prep-s)"
        except Exception as exc:
            reason = _oneline(exc, 200)
        w13 = torch.randn((E, 2 * N, K), device=self.device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn((E, K, N), device=self.device, dtype=torch.bfloat16) * 0.02
        self.moe = ("bf16", (w13, w2), bmm)
        self.extra["moe_path"] = f"bf16 FALLBACK (Marlin unavailable: {reason}); benchmarks/bench_marlin_moe " \
                                 "bf16 grouped path"
        self.notes.append(f"routed MoE timed on the bf16 fallback, NOT Marlin INT4: {reason}")

    def moe_fns(self, T: int):
        import torch

        bmm = _import_bench("bench_marlin_moe")
        m = self.cfg.model
        gen = torch.Generator(device=self.device)
        gen.manual_seed(7 + T)
        cases = []
        for _ in range(bmm.ROTATE):
            ids = torch.topk(torch.rand((T, m.experts), device=self.device, generator=gen), m.top_k,
                             dim=1).indices.to(torch.int32)
            w = torch.rand((T, m.top_k), device=self.device, generator=gen) + 0.1
            w = w / w.sum(dim=1, keepdim=True)
            x = torch.randn((T, m.hidden), device=self.device, generator=gen).to(torch.bfloat16)
            cases.append((x, ids, w))
        if self.moe is None:
            raise RuntimeError("the routed-MoE weights were not prepared (see 'moe preparation')")
        kind, weights, mod = self.moe
        if kind == "marlin":
            return [lambda c=c: mod.fused_moe_marlin(c[0], weights, c[2], c[1], bmm.FACTOR) for c in cases]
        w13, w2 = weights
        try:
            bmm.bf16_moe_grouped(cases[0][0], cases[0][1], cases[0][2], w13, w2, bmm.FACTOR)
            return [lambda c=c: bmm.bf16_moe_grouped(c[0], c[1], c[2], w13, w2, bmm.FACTOR) for c in cases]
        except DeadlineExceeded:
            raise
        except Exception as exc:
            note = f"torch._grouped_mm unavailable ({type(exc).__name__}); bf16 per-expert loop"
            if note not in self.notes:
                self.notes.append(note)
            plans = [bmm.bf16_moe_loop_plan(c[1]) for c in cases]
            return [lambda c=c, p=p: bmm.bf16_moe_loop(c[0], c[1], c[2], w13, w2, bmm.FACTOR, p)
                    for c, p in zip(cases, plans)]

    # --- attention -----------------------------------------------------------------------------------

    def attention_fns(self, bs: int, width: int, ctx: int):
        import torch

        from sglang_kdtree.gpu import mla_attention as mla
        from sglang_kdtree.gpu.mla_reference import synthetic_inputs

        if self.device == "cuda":
            mla.prepare("cuda")
        m = self.cfg.model
        case_bytes = bs * (ctx + width) * (mla.QK_HEAD_DIM * 2)
        copies = max(1, min(16, math.ceil((128 << 20) / case_bytes)))  # small cases: more than the L2 in all
        fns = []
        for i in range(copies):
            c = synthetic_inputs(bs, width, m.heads_gpu, [ctx] * bs, seed=i, device=self.device, spare_slots=0)
            out = torch.empty((bs * width, m.heads_gpu, mla.KV_LORA_RANK), dtype=torch.bfloat16, device=self.device)
            lse = torch.empty((bs * width, m.heads_gpu), dtype=torch.float32, device=self.device)
            args = (c["q"], c["kv_buffer"], c["kv_indptr"], c["kv_indices"], c["tree_slots"], c["ancestor_bits"],
                    c["sm_scale"])
            fns.append(lambda a=args, o=out, s=lse: mla.mla_tree_verify(*a, out=o, lse=s))
        return fns

    def draft_attention_fns(self, bs: int, ctx: int):
        """The drafter block's attention: ``block`` queries x local heads over ``ctx + block`` keys, unmasked.
        The query heads sharing a KV head are folded into query rows (exact without a mask), so the standard
        SDPA kernels run it with ``kv_heads / tp`` heads."""
        import torch
        import torch.nn.functional as F

        m, d = self.cfg.model, self.cfg.drafter
        hq, hkv = max(1, d.heads // m.tp), max(1, d.kv_heads // m.tp)
        group = max(1, hq // hkv)
        keys = ctx + d.block
        nbytes = 2 * bs * hkv * keys * d.head_dim * 2
        copies = max(1, min(64, math.ceil((128 << 20) / nbytes)))
        fns = []
        for _ in range(copies):
            q = torch.randn((bs, hkv, group * d.block, d.head_dim), device=self.device).to(torch.bfloat16)
            k = torch.randn((bs, hkv, keys, d.head_dim), device=self.device).to(torch.bfloat16)
            v = torch.randn((bs, hkv, keys, d.head_dim), device=self.device).to(torch.bfloat16)
            fns.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
        return fns

    # --- bookkeeping ---------------------------------------------------------------------------------

    def bookkeeping(self, bs: int) -> None:
        rp = _import_bench("round_parts")
        m, d = self.cfg.model, self.cfg.drafter
        # one tree at the largest budget per batch serves every KDTREE row (kimi_model's bookkeeping ASSUMPTION)
        out = rp.parts(bs, self.cfg.bookkeeping_budget, d.block - 1, m.vocab, 256, m.layers, 0.75)
        # the captured step graphs replayed alone (device time, as in a server whose host runs ahead); the tree
        # graph holds top-K -> tree -> verify inputs (the drafter's head GEMM runs before it, in the draft)
        self.times[key("tree", bs=bs)] = float(out["tree graph replay"])
        self.times[key("accept_commit", bs=bs)] = float(out["accept_commit graph replay"])
        self.extra.setdefault("round_parts", {})[str(bs)] = {k: (float(v) if isinstance(v, (int, float)) else v)
                                                            for k, v in out.items()}
        if out.get("errors"):
            self.notes.append(f"round_parts at batch {bs} reported error bits {out['errors']}")


#: the target checks' batches: measured first, so a deadline cuts the others
PRIORITY_BATCHES = (1, 32)


def batch_order(batches) -> list:
    """``batches`` in measuring order: ``PRIORITY_BATCHES`` first, then the rest smallest (cheapest) first."""
    rest = sorted(set(batches) - set(PRIORITY_BATCHES))
    return [bs for bs in PRIORITY_BATCHES if bs in batches] + rest


def _jobs(b: _Bench, batches, contexts, skip_bookkeeping, marlin):
    """(name, callable) in priority order: the linear pieces (cheap), then the routed MoE, each at every T the
    batches need (``batch_order``, widths largest first; a T two batches share is timed once), then per batch its
    attention at every width and context, its bookkeeping and the drafter's attention. Each phase frees its
    weights before the next."""
    cfg, order = b.cfg, batch_order(batches)
    widths = sorted(cfg.verify_widths, reverse=True)
    jobs, names = [], set()

    def add(name, job):
        if name not in names:
            names.add(name)
            jobs.append((name, job))

    def linear(name, T):
        add(key(name, T=T), lambda: b.record(key(name, T=T), b.linear_fns(name, T)))

    for bs in order:
        for T in (bs * w for w in widths):
            for name in VERIFY_PIECES:
                linear(name, T)
        for name in DRAFT_PIECES:
            linear(name, bs * cfg.drafter.block)
        linear("lm_head", bs * (cfg.drafter.block - 1))  # the drafter's head
    add("release linear weights", lambda: (b.weights.clear(), b.free()))
    add("moe preparation", lambda: b.moe_prepare(*marlin))
    for bs in order:
        for T in (bs * w for w in widths):
            add(key("moe", T=T), lambda T=T: b.record(key("moe", T=T), b.moe_fns(T)))
    add("release MoE weights", lambda: (setattr(b, "moe", None), b.free()))
    for bs in order:
        for ctx in contexts:
            for width in widths:
                k = key("attention", bs=bs, width=width, ctx=ctx)
                add(k, lambda k=k, bs=bs, w=width, c=ctx: (b.record(k, b.attention_fns(bs, w, c)), b.free()))
        if bs not in skip_bookkeeping:
            add(f"bookkeeping[bs={bs}]", lambda bs=bs: (b.bookkeeping(bs), b.free()))
        for ctx in contexts:
            k = key("draft_attention", bs=bs, ctx=ctx)
            add(k, lambda k=k, bs=bs, c=ctx: (b.record(k, b.draft_attention_fns(bs, c)), b.free()))
    return jobs


def measure(cfg: RoundConfig, batches, contexts, deadline_s: float, *, skip_bookkeeping=(), allow_marlin_compile=False,
            marlin_seed=None, marlin_prep_s: float = 45.0, device: str = "cuda", timer=None, log=None) -> dict:
    """Time every piece the rows need, in priority order, each in its own try/except; stop at ``deadline_s``
    (the pieces not reached are listed as skipped). Returns plain data: ``times`` (us by ``key``), ``errors``,
    ``skipped``, ``notes``, ``modes`` (graph / eager), ``device``, ``moe_path``, ``elapsed_s``, ``extra``."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.monotonic()
    alarm = _Alarm(deadline_s)
    b = _Bench(cfg, device, timer or cuda_graph_us, alarm, log)
    name_dev = device
    jobs, finished = [], set()
    try:
        alarm.arm()
        if device == "cuda":
            import torch

            torch.cuda.init()
            name_dev = torch.cuda.get_device_name()
        jobs = _jobs(b, batches, contexts, set(skip_bookkeeping),
                     (allow_marlin_compile, marlin_seed, marlin_prep_s))
        for i, (name, job) in enumerate(jobs):
            if alarm.left() <= 0:
                b.skipped.extend(n for n, _ in jobs[i:])
                break
            start = time.monotonic()
            try:
                job()
                finished.add(name)
                if time.monotonic() - start > 2:  # only the slow pieces, to keep the log short
                    log(f"[{time.monotonic() - t0:6.1f} s] {name}: {time.monotonic() - start:.1f} s")
            except DeadlineExceeded as exc:
                b.skipped.extend(n for n, _ in jobs[i:])
                log(f"[{time.monotonic() - t0:6.1f} s] {exc.label} reached during {name}; {len(jobs) - i} "
                    "pieces skipped")
                break
            except Exception as exc:  # record and go on
                b.errors[name] = _oneline(exc)
                log(f"[{time.monotonic() - t0:6.1f} s] {name}: FAILED {b.errors[name][:160]}")
                try:
                    b.sync()
                except Exception:
                    pass
    except DeadlineExceeded:  # between pieces (e.g. while logging)
        b.skipped.extend(n for n, _ in jobs if n not in finished and n not in b.errors and n not in b.skipped)
    except Exception as exc:
        b.errors["setup"] = _oneline(exc)
    finally:
        alarm.disarm()
    log(f"[{time.monotonic() - t0:6.1f} s] measured {len(b.times)} pieces, {len(b.errors)} failed, "
        f"{len(b.skipped)} skipped")
    b.skipped = [n for n in b.skipped if not n.startswith("release ")]
    return {"times": b.times, "errors": b.errors, "skipped": b.skipped, "notes": b.notes, "modes": b.modes,
            "device": name_dev, "moe_path": b.extra.get("moe_path"), "elapsed_s": time.monotonic() - t0,
            "deadline_s": deadline_s, "extra": {k: v for k, v in b.extra.items() if k != "moe_path"}}

