"""``KDTreeWorker``: SGLang's DFlash V2 worker with the chain verify replaced by a DDTree round.

Prefill is DFLASH's (target prefill with aux-hidden capture, draft KV materialised for the prompt). Each
decode round is ``KDTreeWorker._tree_round``: ``begin.py`` starts it, then one module of ``sglang_kdtree/round/``
per step:

1. **Draft** (``draft.py``): the DFlash drafter runs once over ``[bonus, MASK x (bs-1)]`` at positions
   ``P..P+bs-1`` (``bs`` = the drafter's block size, from ``--speculative-dflash-block-size`` or its config).
2. **Top-K** (``tree_step.py``): per-depth top-K + logsumexp of the target ``lm_head`` applied to draft rows
   ``1..L`` (``K = B``; under TP each rank ranks its vocabulary shard and only the candidates are all-gathered:
   ``pipeline.vocab_parallel_topk``).
3. **Tree** (``tree_step.py``): the exact best-first tree of ``B`` nodes (``B + 1`` = the largest verify width,
   ``--speculative-num-draft-tokens``), cut to this round's width ``N`` (``width_choice.WidthChooser``, from
   earlier rounds; the first ``N - 1`` nodes are exactly the budget-``N - 1`` tree), and its verify input: ``N``
   rows ``[root, nodes]``, positions ``P + depth``, SGLang's FULL_MASK (prefix + ancestor-or-self) as
   ``custom_mask``, bit-packed ``ancestor_bits`` and ``retrieve_*`` links (``contract.tree_verify``). On one rank
   steps 2-3 are one backend call (``tree_step``).
4. **Verify** (``verify.py``): one TARGET_VERIFY forward of the N rows into KV slots ``req_to_token[req, P:P+N]``
   (``verify_input.tree_verify_batch``), on the target's attention backend and verify graphs of width ``N``
   (``verify_tiers.VerifyTiers``).
5. **Accept** (``accept.py``): the walk along the target's own argmax (T = 0) or per-node samples (T > 0).
6. **Commit** (``accept.py``): the accepted path's KV rows move to the slots of positions ``P..P+tau-1`` (a
   greedy batch: steps 5-6 are one backend call, ``accept_commit_greedy``).
7. **Feed the drafter** (``draft.py``): the target hidden states of the *accepted* rows (not the first tau) are
   written into the draft KV at those positions.
8. **Result** (``result.py``): ``GenerationBatchResult`` with the V2 fields: ``next_token_ids`` of stride
   ``B + 1`` (whatever the round's width) whose first ``tau`` entries are the committed tokens, ``accept_lens =
   tau`` (bonus included), ``new_seq_lens = P + tau``; the round's per-request fault words and width-choice
   statistics, copied to the host without waiting (read once SGLang has the round's results).

Which implementation runs steps 2-3, 5 and 6 is decided in one place, ``sglang_kdtree.round.pipeline.select_backend``
(reference on CPU, GPU kernels on CUDA); both follow ``sglang_kdtree.contract``. The round geometry (budget,
block, vocabulary) is ``self.geometry``, published for the patches with ``state.publish``.

Overlap scheduling (``spec.SUPPORTS_OVERLAP``; on unless ``--disable-overlap-schedule``): SGLang issues round k+1
while round k runs, so the round never waits for the device. Its host lengths are SGLang's own, or on Triton and
FA3, which ask SGLang for none, an upper bound from the KV reserved for the round (``verify_input.host_prefix_lens``:
then SGLang does not wait for round k's accept before issuing round k+1), ``on_publish(new_seq_lens)`` hands
the next round its lengths as soon as the accept is issued, its fault words are read where SGLang reads its
results (``on_verify_complete_cpu``) and the width choice times it with device events, settled before the next
choice (``width_choice``); no host sync is left on the round's path (``tests/test_host_syncs.py`` lists the rest).

Faults (``sglang_kdtree.round.faults``): NaN / +inf logits and the GPU kernels' error flags end only the
requests they hit; the flags become per-request fault words on the device (``device_fault_words``), read on the
host where SGLang reads the round's results (``on_verify_complete_cpu``, ``DeferredFaults``). An allocation failure
(``torch.OutOfMemoryError`` / ``MemoryError``) anywhere in the round is retried once after the plugin's round
caches are released, and a second failure ends every request of that batch (``contained_round``).

Sampling at T > 0: temperature, top-k, top-p and min-p as SGLang's sampler applies them (penalties are
refused at admission, ``sglang_kdtree/patches/request_validation.py``), with a per-request seed from ``sampling_seed``
and the request's position, so a seeded request is reproducible (the prefill's token of a seeded request is drawn
by the same sampler, ``sglang_kdtree.round.seeded``; SGLang itself honours seeds only under
``--enable-deterministic-inference``, which CPU backends do not support).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager

import torch

from sglang_kdtree import state
from sglang_kdtree.round import faults as round_faults
from sglang_kdtree.round import log as round_log
from sglang_kdtree.round import seeded
from sglang_kdtree.round.accept import accept_and_commit
from sglang_kdtree.round.begin import begin_round
from sglang_kdtree.round.draft import draft_block, feed_drafter
from sglang_kdtree.round.pipeline import select_backend
from sglang_kdtree.round.result import round_result
from sglang_kdtree.round.tree_step import topk_and_tree
from sglang_kdtree.round.verify import verify
from sglang_kdtree.round.verify_tiers import VerifyTiers, server_tiers
from sglang_kdtree.round.width_choice import POLICY_ENV, STATED_TAU_ENV, WidthChooser, parse_stated_tau
from sglang_kdtree.server import host_times, sync_debug
from sglang_kdtree.server.prewarm import prewarm_round, rehearse_round  # noqa: F401  (rehearse_round: re-exported)

logger = logging.getLogger(__name__)

try:  # SGLang's worker: absent only on installs without SGLang (the plugin then never registers)
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError(f"sglang_kdtree.round.worker needs SGLang 0.5.23's DFlashWorkerV2: {exc}") from exc

from sglang_kdtree.round.verify_input import (  # noqa: E402,F401  (KDTreeVerifyInput, tree_verify_batch: re-exported)
    CHECK_HOST_LENS_ENV, KDTreeVerifyInput, tree_verify_batch)

#: ``off`` keeps the GPU round's bookkeeping out of CUDA graphs (``gpu/round_graphs.py``)
TREE_GRAPH_ENV = "SGLANG_KDTREE_TREE_GRAPH"


def _read_draft_block_size(server_args) -> int:
    """The drafter's block size from the server args or its config.json, before any model is built."""
    if getattr(server_args, "speculative_dflash_block_size", None):
        return int(server_args.speculative_dflash_block_size)
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    path = os.path.join(server_args.speculative_draft_model_path, "config.json")
    with open(path) as f:
        config = json.load(f)
    block = parse_dflash_draft_config(draft_hf_config=config).block_size
    if block is None:
        raise ValueError(
            f"KDTREE: {path} has no block_size (top level or dflash_config); pass --speculative-dflash-block-size"
        )
    return int(block)


class KDTreeWorker(DFlashWorkerV2):
    """DDTree on the DFlash drafter; see the module docstring for the round."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        from sglang.srt.runtime_context import get_spec

        block_size = _read_draft_block_size(server_args)
        # the round geometry, published for the patches (KV reservation, request admission) before SGLang
        # builds the drafter; the tree is built at the largest verify width, which SGLang's own buffers and
        # verify graphs are sized for
        width = int(get_spec().speculative_num_draft_tokens)
        tiers = server_tiers(width)
        self.geometry = state.Geometry(budget=width - 1, block_size=block_size,
                                       vocab_size=int(target_worker.model_runner.model_config.vocab_size),
                                       widths=tiers if len(tiers) > 1 else ())
        state.publish(self.geometry)
        self.verify_width, self.budget = self.geometry.verify_width, self.geometry.budget
        # DFlashWorkerV2 sizes its draft block (buffers, draft CUDA graph, conv layout) from
        # speculative_num_draft_tokens; for DDTree that flag is the verify width, so the drafter is built
        # with its own block size and a chain (topk 1) draft backend.
        with self._draft_geometry(block_size):
            super().__init__(server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port,
                             target_worker=target_worker)
        if int(self.block_size) != block_size:
            raise RuntimeError(f"KDTREE: drafter block size {self.block_size} != expected {block_size}")
        self.depths, self.vocab_size = self.geometry.depths, self.geometry.vocab_size
        self._draft_dtype = next(self.draft_model.parameters()).dtype
        self.backend = select_backend(self.device)
        # opt-in diagnostics (round_log) and test-only fault injection (round_faults), off unless set
        self._round_log = os.environ.get(round_log.ROUND_LOG_ENV) or None
        stated = parse_stated_tau(os.environ.get(STATED_TAU_ENV), self.geometry.tiers)
        if stated is not None:
            logger.warning("KDTREE: %s is set: the width choice takes these stated accept lengths, not the drafter's "
                           "(benches and tests only): %s", STATED_TAU_ENV, stated)
        self.chooser = WidthChooser(self.geometry.tiers, os.environ.get(POLICY_ENV) or "auto", self.device,
                                    log_stats=self._round_log is not None, stated_tau=stated)
        # under TP every rank ends the same faulty requests and verifies the same width (rank 0's when the choice
        # depends on timings); None: one rank, or a choice every rank makes alike
        from sglang.srt.runtime_context import get_parallel

        tp_group = get_parallel().tp_group if get_parallel().tp_size > 1 else None
        self._tp_fault_group = tp_group.device_group if tp_group is not None else None
        self._tp_width_group = tp_group.cpu_group if tp_group is not None and self.chooser.per_rank else None
        self.verify_tiers = None  # built once the target's own verify backend and graphs exist (init_cuda_graphs)
        self._mark_events: list = []  # RoundMarks' CUDA events, reused every round
        self._dump_prefix = os.environ.get(round_log.DUMP_ENV) or None
        self._test_faults_path = os.environ.get(round_faults.TEST_FAULTS_ENV) or None
        self.deferred_faults = round_faults.DeferredFaults()  # read in on_verify_complete_cpu
        self._check_host_lens = os.environ.get(CHECK_HOST_LENS_ENV) == "1"
        self._dumped = 0
        # the GPU round's bookkeeping (tree step; greedy accept + commit) replays CUDA graphs
        # (gpu/round_graphs.py) unless CUDA graphs are off for the server or SGLANG_KDTREE_TREE_GRAPH=off
        self._round_graphs = (not getattr(server_args, "disable_cuda_graph", False)
                              and os.environ.get(TREE_GRAPH_ENV, "on") != "off")
        gpu, launches = self.backend.name == "gpu", "off (CPU backend)"
        if gpu:  # the tree step's top-K select and tree kernel (gpu.runtime.launch)
            from sglang_kdtree.gpu.runtime import pdl_status

            launches = pdl_status()
        logger.info("KDTREE worker: budget %d, verify widths %s (%s), draft block %d, %s backend, round graphs %s, "
                    "dependent launches %s", self.budget, ",".join(map(str, self.geometry.tiers)),
                    "pinned" if len(self.geometry.tiers) == 1 else f"chosen per round, policy {self.chooser.policy}",
                    block_size, self.backend.name, "on" if self._round_graphs and gpu else "off", launches)

    @staticmethod
    @contextmanager
    def _draft_geometry(block_size: int):
        from sglang.srt.runtime_context import get_spec

        with get_spec().override(speculative_num_draft_tokens=int(block_size), speculative_eagle_topk=1):
            yield

    def init_attention_backends(self):
        with self._draft_geometry(self.block_size):
            super().init_attention_backends()

    def init_cuda_graphs(self):
        with self._draft_geometry(self.block_size):
            super().init_cuda_graphs()
        # SGLang's scheduler has built the target's attention backend and captured its verify graphs (at the
        # largest width) by now: the smaller tiers get theirs, as EAGLE's adaptive states are built here
        self.verify_tiers = VerifyTiers(self.target_worker.model_runner, self.geometry.tiers)
        logger.info("KDTREE verify widths: %s", self.verify_tiers.describe())

    def prewarm_sampling(self):
        """Rehearse KDTREE's own round bookkeeping at startup (not DFLASH's chain sampling verify, which
        KDTREE never runs): on CUDA ``prewarm.prewarm_round``; elsewhere SGLang's own rehearsal."""
        if self.backend.name != "gpu":  # CUDA (select_backend); self.device may be a str
            return self.target_worker.model_runner.prewarm_sampling()
        return prewarm_round(self)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            prefill = lambda: super(KDTreeWorker, self).forward_batch_generation(  # noqa: E731
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors)
            if not seeded.has_seeded_sampling(batch):
                return prefill()
            return seeded.prefill_with_seeded_tokens(self, batch, prefill)
        if batch.has_grammar:  # refused at admission and startup; if one gets here, end its batch, not the server
            return round_faults.ended_grammar_batch(self, batch, on_publish)
        return host_times.timed(sync_debug.watch, round_faults.contained_round, self, batch, on_publish)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req, batch_size: int = 0) -> None:
        """SGLang's call once per decode result, in launch order, once the result is on the host (both scheduler
        modes): the round's fault words have landed too, and its faulty requests end before its tokens are
        appended (``round_faults.DeferredFaults``)."""
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        self.deferred_faults.land(batch_size)

    # ------------------------------------------------------------------------------------------------
    # the decode round
    # ------------------------------------------------------------------------------------------------

    def _tree_round(self, batch, on_publish):
        """One decode round: the numbered steps of the module docstring, top to bottom, one module each."""
        rnd = begin_round(self, batch)
        draft_hidden = draft_block(self, rnd)  # 1. draft
        rnd.marks.mark("draft")
        step = topk_and_tree(self, rnd, draft_hidden)  # 2-3. top-K, tree, cut
        verify_slots, kv_plan, target_out, logits = verify(self, rnd, step.trees, step.verify)  # 4. verify
        acc, commit, accepted_hidden = accept_and_commit(self, rnd, step.trees, logits, verify_slots,
                                                         target_out)  # 5-6. accept, commit
        accept_lens = acc.accept_lens.to(torch.int64)
        new_seq_lens = rnd.prefix_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        feed_drafter(self, rnd, accepted_hidden, kv_plan, accept_lens, target_out.logits_output)  # 7. drafter
        return round_result(self, rnd, acc, commit, logits, target_out, step, new_seq_lens)  # 8. result
