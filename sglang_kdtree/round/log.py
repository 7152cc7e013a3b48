"""The decode round's opt-in diagnostics: per-step timing marks, the one-JSON-line-per-round log, the verify dump.

* ``$KDTREE_ROUND_LOG`` (``ROUND_LOG_ENV``): a file that receives one JSON line per decode round
  (``write_round_record``; tests and offline analysis). It costs a host sync per round, so it is off unless
  the variable names a file.
* ``$KDTREE_DUMP_VERIFY`` (``DUMP_ENV``): a file prefix; the worker saves ``PREFIX.<round>.pt`` with the verify
  input ids, positions and the first ``DUMP_COLUMNS`` columns of the target's verify logits for its first
  ``DUMP_ROUNDS`` decode rounds (``dump_verify``; the CUDA server test compares the fused MLA kernel's logits
  against SGLang's attention path with it).
"""

from __future__ import annotations

import json
import time

import torch

ROUND_LOG_ENV = "KDTREE_ROUND_LOG"
DUMP_ENV = "KDTREE_DUMP_VERIFY"
DUMP_ROUNDS = 4
DUMP_COLUMNS = 2048


class RoundMarks:
    """Phase boundaries of one round for the round log: CUDA events on a GPU (read after the round's end),
    the host clock on CPU; does nothing unless the round log is on.

    ``mark(name)`` closes the step ``name``; steps listed in ``PHASE_OF`` add up to their phase (the drafter's
    head GEMM ``draft_head`` belongs to ``draft``; ``tree_prep`` (the tree step's work before the head GEMM: its
    host preparation, and its static inputs' copy when that goes first), ``tree_step``, or ``topk``, ``build``,
    ``verify_inputs`` one by one, and SGLang's verify ``prepare`` make ``tree``; ``accept_commit_kv``, or
    ``accept`` and ``commit``, then ``features`` and the result's own mark make ``accept_commit``). ``split()``
    gives the four phases; ``detail()`` every step on the device timeline (``ms``) and on the host clock
    (``host_ms``: how long the Python side took to issue it; a step whose host time is close to its device time is
    bound by the host)."""

    PHASE_OF = {"draft_head": "draft", "tree_prep": "tree", "tree_step": "tree", "topk": "tree", "build": "tree",
                "verify_inputs": "tree", "prepare": "tree", "accept_commit_kv": "accept_commit",
                "accept": "accept_commit", "commit": "accept_commit", "features": "accept_commit"}

    def __init__(self, device, enabled: bool, events: list | None = None, device_clock: bool = True):
        # device_clock=False: the host clock only, on a GPU too (no event, no sync: ``KDTREE_HOST_TIMES``'s
        # per-step figures, which must not change the round they time)
        self._cuda = enabled and device_clock and torch.device(device).type == "cuda"
        self._enabled = enabled
        self._clock = time.perf_counter
        # the worker's pool of timing events, reused round after round (each round's are read at its end, before
        # the next round records them again): no event is created inside the round's host-paced steps
        self._events = events if events is not None else []
        self._marks = []
        if enabled:
            self._marks.append(("start", self._now(), self._clock()))

    def _now(self):
        if self._cuda:
            i = len(self._marks)
            if i == len(self._events):
                self._events.append(torch.cuda.Event(enable_timing=True))
            event = self._events[i]
            event.record()
            return event
        return self._clock()

    def mark(self, name: str) -> None:
        if self._enabled:
            self._marks.append((name, self._now(), self._clock()))

    def _steps(self) -> list[tuple[str, float, float]]:
        if len(self._marks) < 2:
            return []
        if self._cuda:
            self._marks[-1][1].synchronize()
            elapsed = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            elapsed = lambda a, b: (b - a) * 1e3  # noqa: E731
        return [(name, elapsed(prev, cur), (h1 - h0) * 1e3)
                for (_, prev, h0), (name, cur, h1) in zip(self._marks, self._marks[1:])]

    def host_ms(self) -> dict:
        """Every step on the host clock only (ms): reads no event, so it never waits for the device."""
        return {name: (h1 - h0) * 1e3 for (_, _, h0), (name, _, h1) in zip(self._marks, self._marks[1:])}

    def split(self) -> dict:
        phases: dict = {}
        for name, ms, _ in self._steps():
            phase = self.PHASE_OF.get(name, name)
            phases[phase] = phases.get(phase, 0.0) + ms
        return {k: round(v, 4) for k, v in phases.items()}

    def detail(self) -> dict:
        steps = self._steps()
        return {"ms": {n: round(ms, 4) for n, ms, _ in steps}, "host_ms": {n: round(h, 4) for n, _, h in steps}}


def _sibling_accepts(acc, verify) -> tuple[list, list]:
    """``(accept_lens, sibling_accepts)``: per request, accepted nodes that are not their parent's first child."""
    accepted = acc.accepted.to("cpu")
    first_child = verify.retrieve_next_token.to("cpu")
    lens = acc.accept_lens.to("cpu").tolist()
    siblings = []
    for b, tau in enumerate(lens):
        path = accepted[b, :tau].tolist()
        siblings.append(sum(int(first_child[b, p]) != c for p, c in zip(path, path[1:])))
    return lens, siblings


def _depth_reach(trees) -> list | None:
    """Summed over the batch, per draft depth d = 1, 2, ... up to the deepest verified node: the drafter's own
    probability that the walk reaches depth d, the sum of ``exp(path score)`` over the tree's depth-d nodes (their
    paths are disjoint events). Beside ``accept_lens`` it is the drafter's calibration per depth, which the verify
    width choice leans on; None where the trees carry no scores."""
    if trees.scores is None:
        return None
    node = torch.arange(trees.scores.shape[1], device=trees.scores.device)
    live = (node[None, :] >= 1) & (node[None, :] <= trees.num_nodes[:, None])  # padding rows hold garbage
    zero = torch.zeros((), dtype=torch.float64, device=trees.scores.device)
    rows_cpu = torch.stack([torch.where(live, trees.scores.exp(), zero),
                            torch.where(live, trees.depths.to(torch.float64), zero)]).to("cpu")
    reach_cpu, depths_cpu = rows_cpu[0].flatten(), rows_cpu[1].flatten().long()
    by_depth_cpu = torch.zeros(int(depths_cpu.max()) + 1, dtype=torch.float64).index_add_(0, depths_cpu, reach_cpu)
    return [round(x, 5) for x in by_depth_cpu[1:].tolist()]


def _tp_rank() -> int:
    """This process's tensor-parallel rank; 0 where no server has published one (a round run outside a server)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().tp_rank)
    except RuntimeError:  # SGLang's context refuses to read a name no one has written
        return 0


def write_round_record(path: str, backend, device, acc, verify, trees, marks: RoundMarks, graph: bool,
                       width: dict | None = None, tiers: dict | None = None) -> None:
    """Append this round's record to ``path`` (one JSON line):

    * ``width``: the verify width this round used and its accept lengths per request, from the width choice
      (``width_choice.WidthChooser.last``): ``predicted`` (calibrated, as the choice saw it), ``predicted_raw``
      (the drafter's own), ``realised``, and ``round_ms`` (the round's host wall time);
      ``tiers``: per verify width, the target verify forwards run and how many replayed a CUDA graph
      (``verify_tiers.VerifyTiers.stats``);

    * ``depth_reach``: per draft depth, the drafter's probability of reaching it, summed over the batch
      (``_depth_reach``);
    * ``accept_lens``, ``num_nodes`` (under SGLang's overlap scheduler a request whose in-flight round finishes it
      can run one more round: its row is here, though SGLang drops its tokens and counts no verify);
      ``sibling_accepts[b]`` counts accepted nodes that are not their parent's first child (rank > 0 at their
      depth): acceptance a chain drafter (DFLASH) could not have;
    * ``backend`` (``gpu`` / ``reference``) and ``graph`` (the target verify replayed a CUDA graph);
    * ``mla_launches``: launches of the fused MLA tree-verify kernel in this process so far (a device
      counter, so launches inside graph replays count), and ``mla_launches_by_kernel`` the same per kernel
      (``{"wgmma": n}`` / ``{"mma": n}``: which one ran); ``marlin_routed``: routed Marlin MoE calls (eager
      calls plus captures); ``tree_graph_replays`` / ``commit_graph_replays``: the GPU round graphs' replays;
      ``tree_head_first``: tree steps that found the stream idle and issued the head GEMM before their host work
      (``TreeStepGraphs.step``); ``mla_check`` (under ``SGLANG_KDTREE_MLA=check`` only): the fused MLA kernel
      against SGLang's MLA path on the same routed calls so far (``sglang_kdtree/patches/mla_tree_verify.check_stats``);
    * ``ms``: the round's time split (CUDA events, or host clock on CPU): ``draft``, ``tree`` (top-K, tree,
      verify inputs, SGLang's verify preparation), ``verify`` (target forward), ``accept_commit`` (accept,
      KV commit, drafter features); ``steps``: the same per step, on the device and on the host clock;
    * ``tp_rank``: the tensor-parallel rank that wrote the record (every rank runs the round and appends its own
      record to the same file).
    """
    lens, siblings = _sibling_accepts(acc, verify)
    record = {"accept_lens": lens, "sibling_accepts": siblings, "num_nodes": trees.num_nodes.to("cpu").tolist(),
              "backend": backend.name, "graph": bool(graph), "ms": marks.split(), "steps": marks.detail(),
              "width": width or {}, "tiers": tiers or {}, "depth_reach": _depth_reach(trees)}
    if backend.name == "gpu":
        from sglang_kdtree.gpu import mla_attention

        by_kernel = mla_attention.launch_counts(device)
        record["mla_launches"] = sum(by_kernel.values())
        record["mla_launches_by_kernel"] = by_kernel
        record["tree_graph_replays"] = backend._tree_graphs.replays
        record["commit_graph_replays"] = backend._commit_graphs.replays
        record["tree_head_first"] = backend._tree_graphs.head_first
        from sglang_kdtree.patches import mla_tree_verify as mla_hook

        check = mla_hook.check_stats(device)
        if check is not None:
            record["mla_check"] = check
    try:
        from sglang_kdtree.patches import marlin_moe
    except ImportError:  # pragma: no cover - patches ship with the package
        marlin_moe = None
    record["marlin_routed"] = getattr(marlin_moe, "routed_calls", 0)
    record["tp_rank"] = _tp_rank()
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def dump_verify(prefix: str, index: int, verify, trees, logits, graph) -> None:
    """Save round ``index``'s verify inputs, trees and the first ``DUMP_COLUMNS`` logit columns to
    ``PREFIX.<index>.pt``."""
    torch.save({"input_ids": verify.input_ids.cpu(), "positions": verify.positions.cpu(),
                "tokens": trees.tokens.cpu(), "parents": trees.parents.cpu(),
                "logits": logits[:, :, :DUMP_COLUMNS].float().cpu(), "graph": graph}, f"{prefix}.{index}.pt")
