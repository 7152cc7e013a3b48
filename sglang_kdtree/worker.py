"""``KDTreeWorker``: SGLang's DFlash V2 worker with the chain verify replaced by a DDTree round.

Prefill is DFLASH's (target prefill with aux-hidden capture, draft KV materialised for the prompt). Each
decode round (``KDTreeWorker._tree_round``, one method per step):

1. **Draft**: the DFlash drafter runs once over ``[bonus, MASK x (bs-1)]`` at positions ``P..P+bs-1``
   (``bs`` = the drafter's block size, from ``--speculative-dflash-block-size`` or its config).
2. **Top-K**: per-depth top-K + logsumexp of the target ``lm_head`` applied to draft rows ``1..L`` (``K = B``;
   under TP each rank ranks its vocabulary shard and only the candidates are all-gathered:
   ``pipeline.vocab_parallel_topk``).
3. **Tree**: the exact best-first tree of ``B`` nodes (``B + 1`` = the largest verify width,
   ``--speculative-num-draft-tokens``), cut to this round's width ``N`` (``width_choice.WidthChooser``, from
   earlier rounds; the first ``N - 1`` nodes are exactly the budget-``N - 1`` tree), and its verify input: ``N``
   rows ``[root, nodes]``, positions ``P + depth``, SGLang's FULL_MASK (prefix + ancestor-or-self) as
   ``custom_mask``, bit-packed ``ancestor_bits`` and ``retrieve_*`` links (``contract.tree_verify``). On one rank
   steps 2-3 are one backend call (``tree_step``).
4. **Verify**: one TARGET_VERIFY forward of the N rows into KV slots ``req_to_token[req, P:P+N]``
   (``verify_input.tree_verify_batch``), on the target's attention backend and verify graphs of width ``N``
   (``verify_tiers.VerifyTiers``).
5. **Accept**: the walk along the target's own argmax (T = 0) or per-node samples (T > 0).
6. **Commit**: the accepted path's KV rows move to the slots of positions ``P..P+tau-1`` (a greedy batch:
   steps 5-6 are one backend call, ``accept_commit_greedy``).
7. **Feed the drafter**: the target hidden states of the *accepted* rows (not the first tau) are written
   into the draft KV at those positions.
8. **Result**: ``GenerationBatchResult`` with the V2 fields: ``next_token_ids`` of stride ``B + 1`` (whatever the
   round's width) whose first ``tau`` entries are the committed tokens, ``accept_lens = tau`` (bonus included),
   ``new_seq_lens = P + tau``; the round's per-request fault words and width-choice statistics, copied to the
   host without waiting (read once SGLang has the round's results).

Which implementation runs steps 2-3, 5 and 6 is decided in one place, ``sglang_kdtree.pipeline.select_backend``
(reference on CPU, GPU kernels on CUDA); both follow ``sglang_kdtree.contract``. The round geometry (budget,
block, vocabulary) is ``self.geometry``, published for the patches with ``state.publish``.

Overlap scheduling (``spec.SUPPORTS_OVERLAP``; on unless ``--disable-overlap-schedule``): SGLang issues round k+1
while round k runs, so the round never waits for the device. Its host lengths are SGLang's own, or on Triton and
FA3, which ask SGLang for none, an upper bound from the KV reserved for the round (``verify_input.host_prefix_lens``:
then SGLang does not wait for round k's accept before issuing round k+1), ``on_publish(new_seq_lens)`` hands
the next round its lengths as soon as the accept is issued, its fault words are read where SGLang reads its
results (``on_verify_complete_cpu``) and the width choice times it with device events, settled before the next
choice (``width_choice``); no host sync is left on the round's path (``tests/test_host_syncs.py`` lists the rest).

Faults (``sglang_kdtree.round_faults``): NaN / +inf logits and the GPU kernels' error flags end only the
requests they hit; the flags become per-request fault words on the device (``device_fault_words``), read on the
host where SGLang reads the round's results (``on_verify_complete_cpu``, ``DeferredFaults``). An allocation failure
(``torch.OutOfMemoryError`` / ``MemoryError``) anywhere in the round is retried once after the plugin's round
caches are released, and a second failure ends every request of that batch (``contained_round``).

Sampling at T > 0: temperature, top-k, top-p and min-p as SGLang's sampler applies them (penalties are
refused at admission, ``sglang_kdtree/patches/request_validation.py``), with a per-request seed from ``sampling_seed``
and the request's position, so a seeded request is reproducible (the prefill's token of a seeded request is drawn
by the same sampler, ``sglang_kdtree.seeded``; SGLang itself honours seeds only under
``--enable-deterministic-inference``, which CPU backends do not support).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sglang_kdtree import host_times, round_faults, round_log, seeded, state, sync_debug
from sglang_kdtree.contract import TreeStep, draft_head, tree_verify
from sglang_kdtree.gpu.verify import full_mask_numel
from sglang_kdtree.pipeline import select_backend, vocab_parallel_topk
from sglang_kdtree.prewarm import prewarm_round, rehearse_round  # noqa: F401  (rehearse_round: re-exported)
from sglang_kdtree.round_log import RoundMarks
from sglang_kdtree.spec_logprobs import round_logprobs
from sglang_kdtree.state import RoundShape
from sglang_kdtree.verify_tiers import VerifyTiers, server_tiers
from sglang_kdtree.width_choice import POLICY_ENV, WidthChooser, agreed_width

logger = logging.getLogger(__name__)

try:  # SGLang's worker: absent only on installs without SGLang (the plugin then never registers)
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError(f"sglang_kdtree.worker needs SGLang 0.5.23's DFlashWorkerV2: {exc}") from exc

from sglang_kdtree.verify_input import (  # noqa: E402,F401  (KDTreeVerifyInput, tree_verify_batch: re-exported)
    CHECK_HOST_LENS_ENV, KDTreeVerifyInput, host_prefix_lens, tree_verify_batch)

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


@dataclass
class _Round:
    """One decode round's batch-wide values, shared by its steps."""

    batch: object
    draft_input: object  # SGLang's DFlashDraftInputV2: the bonus tokens (the trees' roots)
    prefix_lens: torch.Tensor  # [bs] int64 committed lengths P
    prefix_cpu: torch.Tensor  # the same on the host, or an upper bound (verify_input.host_prefix_lens)
    prefix_sum: int  # sum(prefix_cpu)
    marks: RoundMarks
    faults: dict | None  # test-only fault injection (round_faults.read_test_faults); None: off
    shape: RoundShape  # the tree's budget and this round's verify width (width_choice.WidthChooser)
    started: object  # the width choice's start mark (WidthChooser.start; None: the round is not timed)
    # the round's forward batches: under overlap SGLang keeps them alive for two more iterations, as EAGLE's
    # verify batch, so nothing they hold is freed while the device may still read it
    keep_alive: list = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.shape.width

    @property
    def bs(self) -> int:
        return len(self.prefix_lens)


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
        self.chooser = WidthChooser(self.geometry.tiers, os.environ.get(POLICY_ENV) or "auto", self.device,
                                    log_stats=self._round_log is not None)
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
        """One decode round: the numbered steps of the module docstring, top to bottom."""
        rnd = self._begin_round(batch)
        draft_hidden = self._draft_block(rnd)  # 1. draft
        rnd.marks.mark("draft")
        step = self._topk_and_tree(rnd, draft_hidden)  # 2-3. top-K, tree, cut
        verify_slots, kv_plan, target_out, logits = self._verify(rnd, step.trees, step.verify)  # 4. verify
        acc, commit, accepted_hidden = self._accept_and_commit(rnd, step.trees, logits, verify_slots,
                                                               target_out)  # 5-6. accept, commit
        accept_lens = acc.accept_lens.to(torch.int64)
        new_seq_lens = rnd.prefix_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._feed_drafter(rnd, accepted_hidden, kv_plan, accept_lens, target_out.logits_output)  # 7. drafter
        return self._round_result(rnd, acc, commit, logits, target_out, step, new_seq_lens)  # 8. result

    def _begin_round(self, batch) -> _Round:
        """The round's batch-wide values; the backend's buffers reserved for this batch and context (grow-only;
        nothing is allocated in steady state)."""
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("KDTREE expected DFlashDraftInputV2 state on the running batch")
        prefix_lens = batch.seq_lens.to(torch.int64)
        prefix_cpu, prefix_sum = host_prefix_lens(batch, self.geometry.kv_reserve, check=self._check_host_lens)
        self.chooser.settle()  # the earlier rounds whose statistics have landed; nothing waits for the others
        width = self.chooser.choose(len(prefix_cpu), prefix_sum)
        if self._tp_width_group is not None:
            width = agreed_width(width, self._tp_width_group)
        shape = self.geometry.shape(width)
        started = self.chooser.start()
        rnd = _Round(batch, draft_input, prefix_lens, prefix_cpu, prefix_sum,
                     RoundMarks(self.device, enabled=self._round_log is not None or host_times.enabled(),
                                events=self._mark_events, device_clock=self._round_log is not None),
                     faults=None, shape=shape, started=started)
        self.backend.reserve(rnd.bs, self.budget, self.depths, self.vocab_size,
                             mask_bytes=full_mask_numel(rnd.prefix_sum, self.verify_width, rnd.bs))
        return rnd

    def _gather_slots(self, batch, prefix_lens, width: int) -> torch.Tensor:
        """``[bs, width]`` KV slots ``req_to_token[req, P : P + width]`` (reserved by prepare_for_decode)."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        cols = prefix_lens.to(torch.int64)[:, None] + torch.arange(width, device=prefix_lens.device)[None, :]
        return req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)

    def _draft_block(self, rnd: _Round):
        """Run the DFlash drafter over ``[bonus, MASK...]``; returns the draft hidden states [bs, block, H]."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_utils import draft_tp_context
        from sglang.srt.lora.layers import unwrap_lora_layer

        batch, draft_input, prefix_lens = rnd.batch, rnd.draft_input, rnd.prefix_lens
        bs, block = rnd.bs, int(self.block_size)
        block_ids = torch.full((bs, block), int(self._mask_token_id), dtype=torch.int64, device=self.device)
        block_ids[:, 0] = draft_input.bonus_tokens.to(torch.int64)
        positions = prefix_lens.to(torch.int64)[:, None] + torch.arange(block, device=self.device)[None, :]
        cache_loc = self._gather_slots(batch, prefix_lens, block)
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model,
                                                                   self.target_worker.model_runner.model))
        if self._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            embeds = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            embeds = embeds * self._noise_embed_scale
        embeds = embeds.to(self._draft_dtype)
        seq_lens_cpu = rnd.prefix_cpu + block
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=seq_lens_cpu,
            write_virtual=cache_loc.reshape(-1), read_extent=block,
        )
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc.reshape(-1),
            seq_lens_sum=rnd.prefix_sum + bs * block, seq_lens_cpu=seq_lens_cpu, positions=positions.reshape(-1),
            input_embeds=embeds.reshape(-1, embeds.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL,
            global_num_token_non_padded_cpu=bs * block, can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        rnd.keep_alive.append(forward_batch)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            out = self.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("KDTREE: the DFlash draft model returned no hidden states")
        return hidden.view(bs, block, -1)

    def _topk_and_tree(self, rnd: _Round, draft_hidden) -> TreeStep:
        """Steps 2-3: per-depth top-K of the target head on the draft rows, the tree at the full budget, cut to
        the round's width, its verify inputs (``contract.tree_verify``)."""
        from sglang.srt.lora.layers import unwrap_lora_layer
        from sglang.srt.runtime_context import get_parallel

        if self._test_faults_path is not None:  # with the file, the steps run one by one (and read it)
            rnd.faults = round_faults.read_test_faults(self._test_faults_path, rnd.batch)
        roots = rnd.draft_input.bonus_tokens
        if roots.dtype != torch.int64:
            roots = roots.to(torch.int64)
        marks = rnd.marks
        # The round log's "tree_prep": this step's host work before the drafter's head GEMM, "draft_head" (and its
        # static inputs' copy when that goes first); in a host-paced round the GPU waits for it. It also holds the
        # head rows' view (and their cast, when the draft's hidden dtype is not the head's): counted as bookkeeping,
        # not as the drafter's.
        if rnd.faults is None and get_parallel().tp_size == 1:
            # one call: head GEMM (the draft's last step), then top-K -> tree -> verify inputs (on the GPU
            # one CUDA graph replay after the eager GEMM; gpu/round_graphs.py orders the GEMM and the step's host
            # work by the stream's state)
            lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
            rows = draft_hidden[:, 1:, :].reshape(-1, draft_hidden.shape[-1]).to(lm_head.weight.dtype)
            step = self.backend.tree_step(rows, lm_head.weight, rnd.shape, roots, rnd.prefix_lens, rnd.prefix_sum,
                                          graph=self._round_graphs, mark=lambda: marks.mark("draft_head"),
                                          prep_mark=lambda: marks.mark("tree_prep"))
            marks.mark("tree_step")
            return step
        marks.mark("tree_prep")
        # tensor parallel (vocab-parallel top-K) or test fault injection: step by step
        logprobs, ids, draft_logits = self._draft_topk(draft_hidden, rnd.faults, marks)
        marks.mark("topk")
        step = tree_verify(self.backend, logprobs, ids, rnd.shape, roots, rnd.prefix_lens, rnd.prefix_sum)
        step.draft_logits = draft_logits
        marks.mark("build")
        return step

    def _verify(self, rnd: _Round, trees, verify):
        """Step 4: the target's TARGET_VERIFY forward of the N tree rows per request. Returns ``(verify slots
        [bs, N], the KV plan, SGLang's forward output, verify logits [bs, N, V])``."""
        width = rnd.width
        verify_slots = self._gather_slots(rnd.batch, rnd.prefix_lens, width)
        with self.verify_tiers.use(width):  # the target's attention backend and verify graphs of this width
            verify_fb, kv_plan = tree_verify_batch(self.target_worker, rnd.batch, verify, verify_slots,
                                                   rnd.prefix_lens, rnd.prefix_cpu, rnd.prefix_sum, width)
            rnd.keep_alive.append(verify_fb)
            rnd.marks.mark("prepare")
            target_out = self.target_worker.forward_batch_generation(batch=None, forward_batch=verify_fb,
                                                                     is_verify=True, skip_attn_backend_init=True)
        self.verify_tiers.count(width, target_out.can_run_cuda_graph)
        logits = target_out.logits_output.next_token_logits[:, : self.vocab_size].reshape(rnd.bs, width, -1)
        for b in (rnd.faults or {}).get("target_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
            logits[b, 0, 0] = float("nan")
        rnd.marks.mark("verify")
        if self._dump_prefix is not None and self._dumped < round_log.DUMP_ROUNDS:
            round_log.dump_verify(self._dump_prefix, self._dumped, verify, trees, logits, target_out.can_run_cuda_graph)
            self._dumped += 1
        return verify_slots, kv_plan, target_out, logits

    def _accept_and_commit(self, rnd: _Round, trees, logits, verify_slots, target_out):
        """Steps 5-6: accept, then the KV commit (the accepted path to the slots of positions P..P+tau-1, read
        all then write) and the accepted rows' hidden states ``[bs, C, D]`` for the drafter. Returns ``(accept
        result, commit plan, accepted hidden rows)``."""
        sampling = rnd.batch.sampling_info
        pool = self.target_worker.model_runner.token_to_kv_pool
        hidden = target_out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("KDTREE verify requires target hidden states, but got None")
        width = rnd.width
        if sampling is None or sampling.is_all_greedy:
            # one call; a CUDA graph replay when the verify forward replayed SGLang's (fixed output addresses)
            out = self.backend.accept_commit_greedy(trees, logits, self.depths, verify_slots, pool, hidden, width,
                                                    graph=self._round_graphs and bool(target_out.can_run_cuda_graph))
            rnd.marks.mark("accept_commit_kv")
            return out
        seeds, _ = seeded.request_seeds(rnd.batch, self.device)
        min_ps = seeded.per_request(sampling.min_ps if sampling.need_min_p_sampling else None)
        acc = self.backend.accept_sampled(trees, logits, sampling.temperatures.view(-1), seeds.view(-1),
                                          rnd.prefix_lens, self.depths, top_ks=seeded.per_request(sampling.top_ks),
                                          top_ps=seeded.per_request(sampling.top_ps), min_ps=min_ps)
        rnd.marks.mark("accept")
        commit = self.backend.commit_plan(acc.accepted, acc.accept_lens.to(torch.int64), verify_slots)
        self.backend.commit_kv(pool, commit)
        rnd.marks.mark("commit")
        return acc, commit, self.backend.gather_hidden(hidden, commit, width)

    def _feed_drafter(self, rnd: _Round, accepted_hidden, kv_plan, accept_lens, logits_output) -> None:
        """Step 7: the drafter's features, the accepted rows' target hidden states, written into the draft KV at
        chain positions P..P+tau-1."""
        commit_width = accepted_hidden.shape[1]
        chain_positions = rnd.prefix_lens[:, None] + torch.arange(commit_width, device=self.device)[None, :]
        draft_slots = self._draft_write_ids(kv_plan).view(rnd.bs, rnd.width)[:, :commit_width]
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=accepted_hidden.reshape(-1, accepted_hidden.shape[-1]),
            cache_loc=draft_slots.reshape(-1).contiguous(), cache_loc_2d=draft_slots.contiguous(),
            positions=chain_positions.reshape(-1), commit_lens=accept_lens.to(torch.int32),
        )
        logits_output.hidden_states = None
        rnd.marks.mark("features")

    def _round_result(self, rnd: _Round, acc, commit, logits, target_out, step: TreeStep, new_seq_lens):
        """Step 8: the V2 result (token rows of the server's stride N, whatever width this round verified, whose
        first tau entries are committed), the logprobs of the committed tokens (``return_logprob`` batches), the
        round's faults, the width choice's statistics and the round log's record."""
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        logits_output = target_out.logits_output
        out_tokens = torch.nn.functional.pad(acc.committed.clamp_min(0), (0, self.verify_width - rnd.width))
        if rnd.batch.return_logprob:
            # from the verify rows of the accepted nodes, over the C = min(width, L + 1) columns a round can commit
            cols = min(rnd.width, self.geometry.block_size)
            round_logprobs(rnd.batch, logits_output, logits, acc.accepted[:, :cols], acc.committed[:, :cols])
        rnd.marks.mark("accept_commit")
        self.chooser.record(rnd.width, rnd.bs, rnd.prefix_sum, rnd.started, step.expected, acc.accepted)
        fault_words = round_faults.device_fault_words(self.backend, acc, commit, step.draft_logits)
        if self._tp_fault_group is not None:
            fault_words = round_faults.union_over_ranks(fault_words, self._tp_fault_group)
        if self._round_log is not None:
            self.chooser.settle(wait=True)  # the record names this round's width: diagnostics may wait
            round_log.write_round_record(self._round_log, self.backend, self.device, acc, step.verify, step.trees,
                                         rnd.marks, target_out.can_run_cuda_graph, width=self.chooser.last,
                                         tiers=self.verify_tiers.stats())
        host_times.round_steps(rnd.marks)
        next_draft_input = make_draft_input_v2(bonus_tokens=acc.bonus.to(torch.int64), new_seq_lens=new_seq_lens)
        self.deferred_faults.push(rnd.batch.reqs, fault_words)  # last: a retried round must not push twice
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=acc.accept_lens.to(torch.int32),
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=self.verify_width,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
            extra_keep_alive_refs=rnd.keep_alive,
        )

    def _draft_topk(self, draft_hidden, faults=None, marks=None):
        """Per-depth top-K log-probs of the target head on draft rows 1..L; vocab-parallel under TP. ``marks``
        (a ``round_log.RoundMarks``) gets ``draft_head`` after the head GEMM."""
        from sglang.srt.lora.layers import unwrap_lora_layer
        from sglang.srt.runtime_context import get_parallel

        lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        bs, _, hidden_size = draft_hidden.shape
        rows = draft_hidden[:, 1:, :].reshape(-1, hidden_size).to(lm_head.weight.dtype)
        # the head's own dtype (bf16 in serving): both backends read it as it is, no fp32 copy
        local = draft_head(rows, lm_head.weight, lm_head.weight.shape[0])
        if marks is not None:
            marks.mark("draft_head")
        for b in (faults or {}).get("draft_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
            local[b * self.depths, 0] = float("nan")
        shard = getattr(lm_head, "shard_indices", None)
        tp = get_parallel().tp_size
        k = self.geometry.shape().k
        if tp == 1:
            logprobs, ids = self.backend.topk(local[:, : self.vocab_size].unflatten(0, (bs, self.depths)), k)
        else:
            # Columns past the shard's real vocabulary are padding: never candidates.
            start = int(shard.org_vocab_start_index) if shard is not None else 0
            real = int(shard.num_org_elements) if shard is not None else local.shape[1]
            local = local.clone()
            local[:, real:] = float("-inf")
            logprobs, ids = vocab_parallel_topk(local, k, start, self.backend,
                                                group=get_parallel().tp_group.device_group)
        return logprobs.view(bs, self.depths, -1), ids.view(bs, self.depths, -1), local
