"""The target's verify at several widths in one server: one attention backend and one set of verify CUDA graphs
per verify width, as SGLang's adaptive speculation keeps one runtime state per step count for EAGLE.

SGLang builds the target's attention backend and its TARGET_VERIFY CUDA graphs for
``--speculative-num-draft-tokens`` rows per request, the largest tier. For every smaller tier ``VerifyTiers``
builds the same pair with that width (``ModelRunner._get_attention_backend(init_new_workspace=True)`` and a
``DecodeCudaGraphRunner`` with ``speculative_num_draft_tokens=w``, under a runtime-context override of the width,
as ``EAGLEWorkerV2.build_adaptive_runtime_state`` does), logs what each cost in memory and time, and ``use(w)``
swaps them into the target's model runner around one verify forward (``EAGLEWorkerV2.apply_runtime_state``), with
the width overridden for code that reads it from the runtime context. The largest tier is SGLang's own pair.

Why a backend per width and not only graphs: fa3 caches the verify width at init and uses it for eager verifies
too; triton fixes its graph metadata at capture. A graph runner only replays a batch of its own width
(``DecodeCudaGraphRunner.can_run_graph`` compares ``captured_req_width``), so a mismatch runs eagerly, never
wrong. On CPU no verify graph exists and torch_native reads the width per forward; the per-width backends there
are the same cheap objects.

* ``server_tiers(width)``: the tiers this process serves, from ``SGLANG_KDTREE_VERIFY_WIDTHS`` as
  ``spec.resolve_widths`` wrote it at startup.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

from sglang_kdtree.round.widths import WIDTHS_ENV, parse_widths

logger = logging.getLogger(__name__)


def server_tiers(width: int) -> tuple:
    """The verify widths of a server whose largest is ``width`` (``--speculative-num-draft-tokens``): the tiers of
    ``SGLANG_KDTREE_VERIFY_WIDTHS``, or ``(width,)`` when it is unset (a worker built without the plugin's startup
    check). RuntimeError when the variable's largest width is not ``width``."""
    text = os.environ.get(WIDTHS_ENV)
    if text is None or not text.strip():
        return (int(width),)
    tiers = parse_widths(text)
    if max(tiers) != int(width):
        raise RuntimeError(f"KDTREE: {WIDTHS_ENV}={text!r} does not end at the server's verify width {width} "
                           "(--speculative-num-draft-tokens); restart the server so the startup check resolves both")
    return tiers


def _memory_bytes(device) -> int | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def out_of_memory(width: int, tiers, free_bytes: int | None) -> str:
    """The startup error of an extra tier whose backend or graphs ran out of GPU memory: what to lower."""
    free = "" if free_bytes is None else f" ({free_bytes / 2**20:,.0f} MiB were free before it)"
    return (f"KDTREE: building the extra verify tier of width {width} ran out of GPU memory{free}. Each extra tier "
            "captures its own verify graphs, sized by request slots x width (docs/sm120.md, 'The verify tiers' own "
            f"memory'): serve fewer or narrower tiers ({WIDTHS_ENV}, now {','.join(map(str, tiers))}; e.g. 16,32), "
            "capture verify graphs for fewer requests (--cuda-graph-max-bs-decode), or lower --mem-fraction-static")


class VerifyTiers:
    """The target model runner's attention backend and verify graph runner per verify width (module docstring)."""

    def __init__(self, model_runner, tiers):
        self.runner = model_runner
        self.tiers = tuple(sorted(int(w) for w in tiers))
        self.full = self.tiers[-1]
        self._states: dict = {}
        self.costs: dict = {}  # width -> {"seconds", "bytes"} of building its backend and graphs
        self.verifies = {w: 0 for w in self.tiers}
        self.replays = {w: 0 for w in self.tiers}
        for width in self.tiers[:-1]:
            self._states[width] = self._build(width)

    def _build(self, width: int) -> tuple:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.runtime_context import get_spec

        runner = self.runner
        device = getattr(runner, "device", "cpu")
        before, started = _memory_bytes(device), time.perf_counter()
        # _get_attention_backend sets init_new_workspace for good: put it back with the other two
        saved = (runner.attn_backend, getattr(runner, "decode_cuda_graph_runner", None),
                 getattr(runner, "init_new_workspace", False))
        try:
            with get_spec().override(speculative_num_draft_tokens=width):
                backend = runner._get_attention_backend(init_new_workspace=True)
                graphs = None
                if isinstance(saved[1], DecodeCudaGraphRunner):  # SGLang captured the largest width's verify
                    runner.attn_backend = backend  # graphs: capture this width's the same way
                    graphs = type(saved[1])(runner, attn_backend=backend, speculative_num_steps=1,
                                            speculative_num_draft_tokens=width)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one: say which setting sized what ran out
            if "out of memory" not in str(exc).lower():
                raise
            raise RuntimeError(out_of_memory(width, self.tiers, before)) from exc
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner, runner.init_new_workspace = saved
        after = _memory_bytes(device)
        self.costs[width] = {"seconds": round(time.perf_counter() - started, 3),
                             "bytes": None if before is None else before - after}
        return backend, graphs

    def describe(self) -> str:
        """One line for the worker's startup log: each extra tier's build time and memory."""
        if not self._states:
            return "one verify width"
        parts = []
        for width, cost in self.costs.items():
            mem = "" if cost["bytes"] is None else f", {cost['bytes'] / 2**20:.0f} MiB"
            graphs = "graphs" if self._states[width][1] is not None else "no graphs"
            parts.append(f"width {width}: {graphs}, {cost['seconds']:.1f} s{mem}")
        return "extra verify tiers built (" + "; ".join(parts) + ")"

    @contextmanager
    def use(self, width: int):
        """The target's attention backend and verify graphs of ``width`` rows for the forward inside."""
        if width not in self.verifies:
            raise ValueError(f"KDTREE: verify width {width} is not one of this server's tiers {self.tiers}")
        if width == self.full:
            yield
            return
        from sglang.srt.runtime_context import get_spec

        runner = self.runner
        backend, graphs = self._states[width]
        saved = runner.attn_backend, getattr(runner, "decode_cuda_graph_runner", None)
        runner.attn_backend, runner.decode_cuda_graph_runner = backend, graphs
        try:
            with get_spec().override(speculative_num_draft_tokens=width):
                yield
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def count(self, width: int, replayed: bool) -> None:
        self.verifies[width] += 1
        self.replays[width] += int(bool(replayed))

    def stats(self) -> dict:
        """Per width (as a string key): verify forwards so far and how many replayed a CUDA graph."""
        return {str(w): {"verifies": self.verifies[w], "graph_replays": self.replays[w]} for w in self.tiers}
