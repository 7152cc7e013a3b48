"""CUDA graphs of the round's bookkeeping on the GPU backend, so the host issues one replay per step instead of
a GEMM, several kernel launches and their argument checks (in a server the GPU otherwise waits for Python).

* ``TreeStepGraphs``: top-K -> tree -> verify inputs (``GpuBackend.tree_step``), after the draft head GEMM,
  which runs eagerly (one cuBLAS call) into a static logits buffer, so the round log can time the drafter's
  head apart from the bookkeeping. Static inputs: those logits, the roots and the committed lengths, copied
  into buffers before each replay.
* ``AcceptCommitGraphs``: greedy accept -> commit plan -> KV compaction and, as a concurrent branch of the graph
  (a forked stream), the accepted hidden rows (``GpuBackend.accept_commit_greedy``), used only when the target's
  verify replayed SGLang's own graph, whose logits and hidden states then sit at the same addresses in every round
  of that batch size. Static input: the verify slots.

One graph per key (batch size, widths, and the addresses of every buffer the steps read or write). The first
round with a new key runs the steps eagerly (that round's real work), then captures them (capture executes
nothing); later rounds replay. A key's buffers are the backend's grow-only reservations, so a grown buffer
makes a new key. Nothing here syncs the host, not even a capture (``_Graphs._capture``). A capture
that fails is logged once and turns that graph kind off for the process (the eager steps are exact too).
"""

from __future__ import annotations

import gc
import logging

import torch

from sglang_kdtree.contract import TreeStep, VerifyInputs, draft_head, topk_tree_verify
from sglang_kdtree.gpu.buffers import grown
from sglang_kdtree.gpu.verify import full_mask_numel, verify_views

logger = logging.getLogger(__name__)

#: at most this many graphs of one kind per process
MAX_GRAPHS = 256
#: a kind whose keys missed this many rounds in a row stops capturing (its inputs do not sit still)
MAX_CONSECUTIVE_MISSES = 64


class _Graphs:
    """Graph cache of one step kind: ``run(key, body)`` returns the body's outputs (views of static buffers).

    ``backend`` is the ``GpuBackend`` whose steps are captured, used through its public surface (the
    ``contract.RoundBackend`` steps, ``device``, ``builder``, ``size_accept_commit``, ``storage_addresses``): this
    module does not import the backend, which imports it."""

    kind = "graph"

    def __init__(self, backend):
        self._backend = backend
        self._builder = None  # held, so a replaced TreeBuilder's address cannot come back under an old key
        self._graphs: dict = {}
        self.disabled_reason: str | None = None
        self.replays = 0
        self.captures = 0
        self._misses = 0
        self._stream = None

    def _check_builder(self) -> None:
        """Drop every graph when ``reserve`` replaced the builder (the graphs point into its buffers)."""
        if self._backend.builder is not self._builder:
            self._graphs.clear()
            self._builder = self._backend.builder

    def run(self, key, body, hit=None):
        """``hit``: ``self._graphs.get(key)`` when the caller looked the key up already (before work it wanted
        issued in between)."""
        if hit is None:
            hit = self._graphs.get(key)
        if hit is not None:
            graph, outputs = hit
            graph.replay()
            self.replays += 1
            self._misses = 0
            return outputs
        outputs = body()  # this round's work, eagerly (also loads every kernel before the capture)
        self._misses += 1
        if self._misses >= MAX_CONSECUTIVE_MISSES and self.disabled_reason is None:
            self.disabled_reason = f"no key repeated in {self._misses} rounds"
            self._graphs.clear()
            logger.warning("KDTREE: %s CUDA graphs off: %s", self.kind, self.disabled_reason)
        if self.disabled_reason is None and len(self._graphs) < MAX_GRAPHS:
            try:
                self._graphs[key] = self._capture(body)
                self.captures += 1
            except Exception as exc:  # noqa: BLE001  (the eager steps stay exact; say so once)
                self.disabled_reason = f"{type(exc).__name__}: {exc}"
                self._graphs.clear()
                logger.warning("KDTREE: %s CUDA graph capture failed (%s); these steps run eagerly from now on",
                               self.kind, self.disabled_reason)
        return outputs

    def _capture(self, body):
        """``(graph, outputs)`` of ``body`` captured on a side stream. Unlike ``torch.cuda.graph``, no device
        sync, ``gc.collect`` or ``empty_cache`` (a server captures one graph per new batch size while serving):
        the side stream waits for the current one, and the current one for the side stream after."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._backend.device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        # no cyclic garbage collection inside the capture: it may destroy an unreachable CUDA graph (or free a
        # CuPy allocation), which CUDA refuses while a stream captures, and the capture would be invalidated
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outputs = body()
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        current.wait_stream(self._stream)
        return graph, outputs


class TreeStepGraphs(_Graphs):
    """``GpuBackend.tree_step``: the head GEMM into a static logits buffer, then top-K and tree into the reserved
    ``TreeBuilder`` and verify inputs into its verify buffers, replayed."""

    kind = "tree-step"

    def __init__(self, backend):
        super().__init__(backend)
        self._logits = self._roots = self._seq = None
        self.head_first = 0  # steps that issued the head GEMM before their host work (step's docstring)

    def _inputs(self, max_batch: int, depth: int, weight):
        cap = max_batch * depth
        dev = self._backend.device
        if (self._logits is None or self._logits.shape[0] < cap or self._logits.dtype != weight.dtype
                or self._logits.shape[1] != weight.shape[0] or self._roots.shape[0] < max_batch):
            self._logits = torch.empty((cap, weight.shape[0]), dtype=weight.dtype, device=dev)
            self._roots = torch.empty(max_batch, dtype=torch.int64, device=dev)
            self._seq = torch.empty(max_batch, dtype=torch.int64, device=dev)

    def step(self, rows, weight, shape, roots, seq_lens, seq_lens_sum: int, mark=None, prep_mark=None):
        """The round's ``contract.TreeStep`` (the verify inputs' FULL_MASK cut to this round's length) or None when
        graphs are off; ``prep_mark()`` (optional) is called just before the head GEMM is issued, ``mark()`` once
        it is.

        The order follows the GPU. In a server this step's host work (the key, the graph lookup, the static inputs'
        copy) is tens of microseconds of Python, and the GPU waits for whatever is issued after it:
        - the stream idle (a host-paced round: the drafter's kernels are done): the GEMM first, so the host
          work runs while the GEMM does;
        - the stream busy (the drafter still running): the host work first, while the drafter finishes, then
          the GEMM and at once the replay, which follows the GEMM with no gap.
        Either order computes the same thing; ``head_first`` counts the rounds that took the first."""
        if self.disabled_reason is not None:
            return None
        self._check_builder()
        backend, builder = self._backend, self._backend.builder
        bs = roots.shape[0]
        mask_numel = full_mask_numel(int(seq_lens_sum), shape.width, bs)
        if shape.budget > builder.max_budget or builder.verify.full_mask.numel() < mask_numel:
            return None  # not within the reservation: the caller runs the steps eagerly
        self._inputs(builder.max_batch, shape.depths, weight)
        logits, roots_in, seq_in = self._logits[: bs * shape.depths], self._roots[:bs], self._seq[:bs]

        def head():  # the drafter's head, eagerly (cuBLAS); the round log's tree_prep ends before it
            if prep_mark is not None:
                prep_mark()
            draft_head(rows, weight, shape.vocab, out=logits)
            if mark is not None:
                mark()

        head_first = torch.cuda.current_stream(self._backend.device).query()  # True: nothing left to run
        if head_first:
            head()
            self.head_first += 1
        verify_buf = builder.verify
        key = (bs, shape, verify_buf.full_mask.data_ptr(), verify_buf.full_mask.numel(), logits.data_ptr(),
               logits.shape[1])
        hit = self._graphs.get(key)
        torch._foreach_copy_((roots_in, seq_in), (roots, seq_lens))  # both static inputs in one launch
        if not head_first:
            head()

        def body():
            # the FULL_MASK offsets come from seq_in on the device, the host size only cuts the view
            step = topk_tree_verify(backend, logits[:, :shape.vocab], shape, roots_in, seq_in, int(seq_lens_sum))
            # the result's views, kept with the graph (a round then cuts only the FULL_MASK, whose length follows
            # the committed lengths): eleven tensor views less of host work per round on a host-bound step
            step.verify = verify_views(verify_buf, bs, shape.width, 0)
            return step

        step = self.run(key, body, hit)
        v = step.verify
        # the round's verify inputs: the graph's views, with the FULL_MASK cut to this round's length
        verify = VerifyInputs(v.input_ids, v.positions, verify_buf.full_mask[:mask_numel], v.ancestor_bits,
                              v.retrieve_index, v.retrieve_next_token, v.retrieve_next_sibling)
        return TreeStep(step.trees, verify, step.expected, step.draft_logits)


class AcceptCommitGraphs(_Graphs):
    """``GpuBackend.accept_commit_greedy`` replayed (greedy batches whose verify forward replayed a graph)."""

    kind = "accept-commit"

    def __init__(self, backend):
        super().__init__(backend)
        self._slots = None
        self._fork = None  # the hidden-row gather's stream: a branch of the graph beside the KV moves

    def step(self, trees, logits, depth: int, verify_slots, pool, hidden, width: int):
        """``(accept result, commit plan, accepted hidden rows)`` or None when graphs are off."""
        if self.disabled_reason is not None:
            return None
        self._check_builder()
        backend = self._backend
        bs = trees.tokens.shape[0]
        n = bs * verify_slots.shape[1]
        held = self._slots.numel() if self._slots is not None else 0
        if held < n:
            self._slots = torch.empty(grown(held, n), dtype=torch.int64, device=backend.device)
        slots_in = self._slots[:n].view(bs, -1)
        slots_in.copy_(verify_slots)
        # the storages the steps carve their outputs from must not grow inside a capture: size them first
        backend.size_accept_commit(trees, depth, hidden, width)
        # every tree field's address: a cut round's trees are copies whose fields need not move together
        key = (bs, trees.tokens.shape[1], depth, width, *(t.data_ptr() for t in (trees.tokens, trees.depths,
                                                                                 trees.parents, trees.num_nodes)),
               logits.data_ptr(),
               tuple(logits.stride()), logits.dtype, hidden.data_ptr(), tuple(hidden.stride()), id(pool),
               backend.storage_addresses(), slots_in.data_ptr())

        def body():
            acc = backend.accept_greedy(trees, logits, depth)
            plan = backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), slots_in)
            if not plan.hidden_rows[:, :width].is_contiguous():
                # width < depth + 1: gather_hidden copies the rows it reads, an allocation that is not to happen
                # on a side stream inside a capture; the two steps stay in order
                backend.commit_kv(pool, plan)
                return acc, plan, backend.gather_hidden(hidden, plan, width)
            # The KV moves and the hidden-row gather read only the plan: the gather runs on a forked stream,
            # joined before the step ends, so the graph holds them as two concurrent branches (both kernels are
            # a few microseconds of latency; they write different buffers and OR their error bits atomically).
            if self._fork is None:
                self._fork = torch.cuda.Stream(device=backend.device)
            here = torch.cuda.current_stream()
            self._fork.wait_stream(here)
            with torch.cuda.stream(self._fork):
                rows = backend.gather_hidden(hidden, plan, width)
            backend.commit_kv(pool, plan)
            here.wait_stream(self._fork)
            return acc, plan, rows

        return self.run(key, body)
