"""``KDTreeWorker``: SGLang's DFlash V2 worker with the chain verify replaced by a DDTree round.

Prefill is DFLASH's (target prefill with aux-hidden capture, draft KV materialised for the prompt). Each
decode round:

1. **Draft block**: the DFlash drafter runs once over ``[bonus, MASK x (bs-1)]`` at positions ``P..P+bs-1``
   (``bs`` = the drafter's block size, from ``--speculative-dflash-block-size`` or its config).
2. **Per-depth top-K + logsumexp** of the target ``lm_head`` applied to draft rows ``1..L`` (``K = B``;
   under TP each rank ranks its vocabulary shard and only the candidates are all-gathered:
   ``pipeline.vocab_parallel_topk``).
3. **Tree**: the exact best-first tree of ``B`` nodes (``B = --speculative-num-draft-tokens - 1``).
4. **Verify input**: ``N = B + 1`` rows ``[root, nodes]``, positions ``P + depth``, SGLang's FULL_MASK
   (prefix + ancestor-or-self) as ``custom_mask``, bit-packed ``ancestor_bits`` and ``retrieve_*`` links.
5. **Target verify**: one TARGET_VERIFY forward of the N rows into KV slots ``req_to_token[req, P:P+N]``.
6. **Accept**: the walk along the target's own argmax (T = 0) or per-node samples (T > 0).
7. **KV commit**: the accepted path's KV rows move to the slots of positions ``P..P+tau-1``.
8. **Drafter features**: the target hidden states of the *accepted* rows (not the first tau) are written
   into the draft KV at those positions.
9. ``GenerationBatchResult`` with the V2 fields: ``next_token_ids`` of stride N whose first ``tau`` entries
   are the committed tokens, ``accept_lens = tau`` (bonus included), ``new_seq_lens = P + tau``.

Which implementation runs steps 2-4, 6 and the commit plan is decided in one place,
``sglang_kdtree.pipeline.select_backend`` (reference on CPU, GPU kernels on CUDA).

Overlap scheduling: not supported (``spec.SUPPORTS_OVERLAP = False``, a server without
``--disable-overlap-schedule`` is refused at startup). The round still reads lengths on the host (tree
widths of the FULL_MASK, the reference path's numpy round trip), so it cannot run ahead of the scheduler.

Faults: NaN / +inf logits and the GPU kernels' error flags end only the requests they hit (``_round_faults``);
an allocation failure (``torch.OutOfMemoryError`` / ``MemoryError``) anywhere in the round is retried once after
the plugin's round caches are released, and a second failure ends every request of that batch
(``_contained_round``; the policy is in ``sglang_kdtree.round_faults``).

Sampling at T > 0: temperature, top-k, top-p and min-p as SGLang's sampler applies them (penalties are
refused at admission, ``patches/request_validation.py``), with a per-request generator seeded from ``sampling_seed`` and the request's position, so a seeded request is reproducible
(the prefill's token of a seeded request is drawn by the same sampler; SGLang itself honours seeds only
under ``--enable-deterministic-inference``, which CPU backends do not support).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager

import torch

from sglang_kdtree import state
from sglang_kdtree.gpu.verify import full_mask_numel
from sglang_kdtree.pipeline import bookkeeping_round, select_backend, vocab_parallel_topk
from sglang_kdtree.spec_logprobs import reseed_prefill_logprobs, round_logprobs, round_logprobs_bytes

logger = logging.getLogger(__name__)

try:  # SGLang's worker: absent only on installs without SGLang (the plugin then never registers)
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError(f"sglang_kdtree.worker needs SGLang 0.5.23's DFlashWorkerV2: {exc}") from exc

from sglang.srt.speculative.dflash_info import DFlashVerifyInput

#: Environment variable naming a file that receives one JSON line per decode round (tests, analysis).
ROUND_LOG_ENV = "KDTREE_ROUND_LOG"

#: Diagnostic: a file prefix; the worker saves ``PREFIX.<round>.pt`` with the verify input ids, positions and the
#: first ``DUMP_COLUMNS`` columns of the target's verify logits for its first ``DUMP_ROUNDS`` decode rounds (the
#: CUDA server test compares the fused MLA kernel's logits against SGLang's attention path with it).
DUMP_ENV = "KDTREE_DUMP_VERIFY"
TREE_GRAPH_ENV = "SGLANG_KDTREE_TREE_GRAPH"
DUMP_ROUNDS = 4
DUMP_COLUMNS = 2048

#: Test-only fault injection: a path; while that file exists it holds ``{"<rid prefix>": "draft_nan" |
#: "target_nan" | "round_oom" | "round_oom_twice"}`` and the round writes a NaN into the draft (or target verify)
#: logits of every request whose rid starts with a prefix, so the end-to-end tests can force a fault in one
#: request of a live batch; the ``round_oom`` kinds make the round's buffer reservation raise
#: ``torch.OutOfMemoryError`` for a batch holding such a request (``round_faults``: once, or on the retry too).
TEST_FAULTS_ENV = "KDTREE_TEST_FAULTS"

#: Largest batch the startup rehearsal sizes the round's buffers for (SGLang's default largest CUDA-graph
#: batch); a larger batch grows them on first sight.
_PREWARM_MAX_BATCH = 256


class KDTreeVerifyInput(DFlashVerifyInput):
    """DFLASH's verify input carrying the tree: ``custom_mask`` (FULL_MASK) plus the DDTree extras that
    tree-aware kernels read (``patches/mla_tree_verify.py`` reads ``ancestor_bits``)."""

    ancestor_bits: torch.Tensor | None = None
    retrieve_index: torch.Tensor | None = None
    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None


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
        # builds the drafter
        self.geometry = state.Geometry(budget=int(get_spec().speculative_num_draft_tokens) - 1,
                                       block_size=block_size,
                                       vocab_size=int(target_worker.model_runner.model_config.vocab_size))
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
        # Opt-in per-round record (one JSON line per round) for tests and offline analysis; costs a host
        # sync per round, so it is off unless the variable names a file.
        self._round_log = os.environ.get(ROUND_LOG_ENV) or None
        self._dump_prefix = os.environ.get(DUMP_ENV) or None
        self._test_faults_path = os.environ.get(TEST_FAULTS_ENV) or None
        self._dumped = 0
        # the GPU round's bookkeeping (tree step; greedy accept + commit) replays CUDA graphs
        # (gpu/round_graphs.py) unless CUDA graphs are off for the server or SGLANG_KDTREE_TREE_GRAPH=off
        self._round_graphs = (not getattr(server_args, "disable_cuda_graph", False)
                              and os.environ.get(TREE_GRAPH_ENV, "on") != "off")
        logger.info("KDTREE worker: budget %d (verify width %d), draft block %d, %s backend, round graphs %s",
                    self.budget, self.verify_width, block_size, self.backend.name,
                    "on" if self._round_graphs and self.backend.name == "gpu" else "off")

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

    def prewarm_sampling(self):
        """Rehearse KDTREE's own round bookkeeping at startup (not DFLASH's chain sampling verify, which
        KDTREE never runs): on CUDA, one greedy and one sampled round of the GPU backend at the largest batch
        the verify CUDA graph takes, so every kernel is compiled and the backend's buffers exist before SGLang
        sizes the KV pool from the free memory; the measured peak is reported like DFLASH's rehearsal."""
        from sglang.srt.model_executor.model_runner import SamplingPrewarmResult

        runner = self.target_worker.model_runner
        if self.backend.name != "gpu":  # CUDA (select_backend); self.device may be a str
            return runner.prewarm_sampling()
        # the largest verify batch, bounded like SGLang's graph batch sizes: larger batches grow the buffers
        bs = min(self._prewarm_batch_size(self.verify_width), _PREWARM_MAX_BATCH)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        config = runner.model_config
        logits = rehearse_round(self.backend, bs, self.budget, self.depths, self.vocab_size, self.device,
                                hidden_size=int(config.hidden_size), hidden_dtype=self._draft_dtype)
        torch.cuda.synchronize()
        peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"] - base
        # a return_logprob batch gathers and log-softmaxes the accepted rows on top (spec_logprobs)
        logprob_bytes = round_logprobs_bytes(bs, min(self.verify_width, self.depths + 1), self.vocab_size)
        result = SamplingPrewarmResult(sampling_input_bytes=logits,
                                       sampling_headroom_bytes=max(peak, 0) + logits + logprob_bytes)
        runner.sampling_prewarm_result = result
        logger.info("KDTREE round pre-warm: bs=%d peak=%d B (buffers kept for serving), logprob headroom %d B",
                    bs, peak, logprob_bytes)
        return result

    # ------------------------------------------------------------------------------------------------
    # the decode round
    # ------------------------------------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            if not self._has_seeded_sampling(batch):
                return super().forward_batch_generation(batch, on_publish=on_publish,
                                                        grammar_barrier=grammar_barrier,
                                                        pp_proxy_tensors=pp_proxy_tensors)
            # SGLang's sampler scales the logits in place; keep the raw ones for the seeded redraw.
            runner = self.target_worker.model_runner
            original_sample = runner.sample
            kept = {}

            def sample_keeping_logits(logits_output, forward_batch, *args, **kwargs):
                kept["logits"] = logits_output.next_token_logits.clone()
                return original_sample(logits_output, forward_batch, *args, **kwargs)

            runner.sample = sample_keeping_logits
            try:
                result = super().forward_batch_generation(batch, on_publish=on_publish,
                                                          grammar_barrier=grammar_barrier,
                                                          pp_proxy_tensors=pp_proxy_tensors)
            finally:
                del runner.sample
            if "logits" in kept:
                self._reseed_prefill_samples(batch, result, kept["logits"])
            return result
        if batch.has_grammar:
            raise ValueError("KDTREE does not support grammar-constrained decoding yet; drop the grammar")
        return self._contained_round(batch, on_publish)

    def _request_seeds(self, batch) -> tuple[torch.Tensor, list[bool]]:
        """Per-request sampling seeds: SGLang's (deterministic-inference mode), else each request's own
        ``sampling_seed`` (which SGLang ignores outside that mode), else a fresh random one."""
        sampling = batch.sampling_info
        if sampling is not None and sampling.sampling_seed is not None:
            return sampling.sampling_seed.view(-1).to(torch.int64), [False] * len(batch.reqs)
        seeds, own = [], []
        for req in batch.reqs:
            seed = req.sampling_params.sampling_seed
            own.append(seed is not None)
            seeds.append(int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
        return torch.tensor(seeds, dtype=torch.int64, device=self.device), own

    @staticmethod
    def _has_seeded_sampling(batch) -> bool:
        """A batch with a seeded T > 0 request whose seed SGLang will not apply (no deterministic mode)."""
        sampling = batch.sampling_info
        if batch.forward_mode.is_idle() or sampling is None or sampling.is_all_greedy:
            return False
        if sampling.sampling_seed is not None:
            return False
        return any(r.sampling_params.sampling_seed is not None and r.sampling_params.temperature > 0
                   for r in batch.reqs)

    def _reseed_prefill_samples(self, batch, result, logits) -> None:
        """Outside deterministic-inference mode SGLang samples the prefill's token without the request's
        seed; for seeded requests at T > 0 draw it again (from the raw logits) with the same seeded sampler
        as the tree rounds, so a seeded request is reproducible end to end."""
        sampling = batch.sampling_info
        seeds, own = self._request_seeds(batch)
        temps = sampling.temperatures.view(-1)
        rows = [b for b, mine in enumerate(own) if mine and float(temps[b]) > 0]
        if not rows:
            return
        index = torch.tensor(rows, device=self.device)
        top_ks, top_ps = _per_request(sampling.top_ks), _per_request(sampling.top_ps)
        min_ps = _per_request(sampling.min_ps) if sampling.need_min_p_sampling else None
        drawn = self.backend.sample_tokens(logits[index, : self.vocab_size], temps[index], seeds[index],
                                           batch.seq_lens[index], None if top_ks is None else top_ks[index],
                                           None if top_ps is None else top_ps[index],
                                           None if min_ps is None else min_ps[index])
        result.next_token_ids[index] = drawn.to(result.next_token_ids.dtype)
        reseed_prefill_logprobs(batch, result.logits_output, logits[index, : self.vocab_size], index, drawn)
        # the next round's root is the draft input's own (int64) copy of the token: it must be the same one
        draft_input = result.next_draft_input
        if draft_input is not None and draft_input.bonus_tokens.data_ptr() != result.next_token_ids.data_ptr():
            draft_input.bonus_tokens[index] = drawn.to(draft_input.bonus_tokens.dtype)

    def _gather_slots(self, batch, prefix_lens, width: int) -> torch.Tensor:
        """``[bs, width]`` KV slots ``req_to_token[req, P : P + width]`` (reserved by prepare_for_decode)."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        cols = prefix_lens.to(torch.int64)[:, None] + torch.arange(width, device=prefix_lens.device)[None, :]
        return req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)

    def _draft_block(self, batch, draft_input, prefix_lens):
        """Run the DFlash drafter over ``[bonus, MASK...]``; returns the draft hidden states [bs, block, H]."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_utils import draft_tp_context
        from sglang.srt.lora.layers import unwrap_lora_layer

        bs, block = len(prefix_lens), int(self.block_size)
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
        seq_lens_cpu = prefix_lens.to("cpu", torch.int64) + block
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=seq_lens_cpu,
            write_virtual=cache_loc.reshape(-1), read_extent=block,
        )
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc.reshape(-1),
            seq_lens_sum=int(seq_lens_cpu.sum()), seq_lens_cpu=seq_lens_cpu, positions=positions.reshape(-1),
            input_embeds=embeds.reshape(-1, embeds.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL,
            global_num_token_non_padded_cpu=bs * block, can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            out = self.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("KDTREE: the DFlash draft model returned no hidden states")
        return hidden.view(bs, block, -1)

    def _draft_topk(self, draft_hidden, faults=None, marks=None):
        """Per-depth top-K log-probs of the target head on draft rows 1..L; vocab-parallel under TP. ``marks``
        (a ``_RoundMarks``) gets ``draft_head`` after the head GEMM."""
        from sglang.srt.lora.layers import unwrap_lora_layer
        from sglang.srt.runtime_context import get_parallel

        lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        bs, _, hidden_size = draft_hidden.shape
        rows = draft_hidden[:, 1:, :].reshape(-1, hidden_size).to(lm_head.weight.dtype)
        # the head's own dtype (bf16 in serving): both backends read it as it is, no fp32 copy
        local = torch.nn.functional.linear(rows, lm_head.weight)
        if marks is not None:
            marks.mark("draft_head")
        for b in (faults or {}).get("draft_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
            local[b * self.depths, 0] = float("nan")
        shard = getattr(lm_head, "shard_indices", None)
        tp = get_parallel().tp_size
        k = min(self.budget, self.vocab_size)
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

    def _log_round(self, acc, verify, trees, marks, graph: bool) -> None:
        """Append this round's record to ``$KDTREE_ROUND_LOG`` (one JSON line):

        * ``accept_lens``, ``num_nodes``; ``sibling_accepts[b]`` counts accepted nodes that are not their
          parent's first child (rank > 0 at their depth): acceptance a chain drafter (DFLASH) could not have;
        * ``backend`` (``gpu`` / ``reference``) and ``graph`` (the target verify replayed a CUDA graph);
        * ``mla_launches``: launches of the fused MLA tree-verify kernel in this process so far (a device
          counter, so launches inside graph replays count); ``marlin_routed``: routed Marlin MoE calls (eager
          calls plus captures);
        * ``ms``: the round's time split (CUDA events, or host clock on CPU): ``draft``, ``tree`` (top-K, tree,
          verify inputs, SGLang's verify preparation), ``verify`` (target forward), ``accept_commit`` (accept,
          KV commit, drafter features); ``steps``: the same per step, on the device and on the host clock.
        """
        accepted = acc.accepted.to("cpu")
        first_child = verify.retrieve_next_token.to("cpu")
        lens = acc.accept_lens.to("cpu").tolist()
        siblings = []
        for b, tau in enumerate(lens):
            path = accepted[b, :tau].tolist()
            siblings.append(sum(int(first_child[b, p]) != c for p, c in zip(path, path[1:])))
        record = {"accept_lens": lens, "sibling_accepts": siblings, "num_nodes": trees.num_nodes.to("cpu").tolist(),
                  "backend": self.backend.name, "graph": bool(graph), "ms": marks.split(), "steps": marks.detail()}
        if self.backend.name == "gpu":
            from sglang_kdtree.gpu import mla_attention

            record["mla_launches"] = mla_attention.launch_count(self.device)
            record["tree_graph_replays"] = self.backend._tree_graphs.replays
            record["commit_graph_replays"] = self.backend._commit_graphs.replays
        try:
            from sglang_kdtree.patches import marlin_moe
        except ImportError:  # pragma: no cover - patches ship with the package
            marlin_moe = None
        record["marlin_routed"] = getattr(marlin_moe, "routed_calls", 0)
        with open(self._round_log, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _test_faults(self, batch) -> dict:
        """``{"draft_nan": [b...], "target_nan": [b...], "round_oom": [b...], ...}`` (fault kind -> batch rows) for
        this batch from the ``KDTREE_TEST_FAULTS`` file."""
        try:
            with open(self._test_faults_path) as f:
                wanted = json.load(f)
        except (OSError, ValueError):
            return {}
        out: dict = {}
        for b, req in enumerate(batch.reqs):
            for prefix, fault in wanted.items():
                if str(req.rid).startswith(prefix):
                    out.setdefault(fault, []).append(b)
        return out

    def _round_faults(self, batch, acc, plan, draft_logits) -> None:
        """Read every device error flag of the round once (the round's one host read at its end; the scheduler
        reads the results right after) and end each flagged request with ``FINISH_ABORT`` naming the fault,
        so the rest of the batch goes on. Flags the kernels keep per batch, not per request (draft
        log-probs / tree, KV commit), are traced back to the requests whose draft logits hold NaN / +inf or
        whose commit plan is invalid; failing that, the whole batch is ended."""
        per_request = getattr(acc, "errors", None)
        tree_flag = getattr(self.backend, "tree_errors", None)
        commit_flag = getattr(self.backend, "commit_errors", None)
        if per_request is None or tree_flag is None or commit_flag is None:
            return  # a backend without fault flags raises at the faulty step instead
        words = torch.cat([tree_flag.to(torch.int64), commit_flag.to(torch.int64), per_request.to(torch.int64)])
        host = words.tolist()
        tree_bits, commit_bits, req_bits = host[0], host[1], host[2:]
        if not (tree_bits or commit_bits or any(req_bits)):
            return
        from sglang_kdtree.gpu.errors import describe_device_error
        from sglang_kdtree.gpu.topk import TOPK_ERRORS

        bs = len(req_bits)
        faults = {b: describe_device_error(bits) for b, bits in enumerate(req_bits) if bits}
        if tree_bits:
            what = [m for bit, m in TOPK_ERRORS.items() if tree_bits & bit]
            rows = draft_logits.reshape(bs, -1)
            bad = (torch.isnan(rows) | torch.isposinf(rows)).any(dim=1).tolist()
            for b in [b for b in range(bs) if bad[b]] or range(bs):
                faults.setdefault(b, []).extend(f"draft: {m}" for m in what)
            tree_flag.zero_()
        if commit_bits:
            invalid = (plan.src_slots[:, 0] < 0).tolist()
            for b in [b for b in range(bs) if invalid[b]] or range(bs):
                faults.setdefault(b, []).extend(f"commit: {m}" for m in describe_device_error(commit_bits))
            commit_flag.zero_()
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        for b, problems in sorted(faults.items()):
            req = batch.reqs[b]
            message = f"KDTREE round failed for this request: {'; '.join(problems)}"
            logger.error("%s (rid=%s)", message, req.rid)
            req.to_finish = FINISH_ABORT(message, status_code=500, err_type="InternalServerError")

    def _contained_round(self, batch, on_publish):
        """``_tree_round`` with its allocation failures contained (``sglang_kdtree.round_faults``).

        A round raising ``torch.OutOfMemoryError`` or ``MemoryError`` runs once more, after the batch's fields
        are put back and the plugin's round caches are released (on CUDA: the GPU backend's round buffers and
        round graphs, then ``torch.cuda.empty_cache()``; on CPU nothing). If the retry fails too, every request
        of the batch (the round's memory is per batch) is ended with ``FINISH_ABORT`` (HTTP 503) and kept out
        of the radix cache, and the scheduler gets a result committing one placeholder token per request
        (``_ended_round_result``); other batches and later rounds go on. At tensor parallelism > 1 the error
        propagates as before (the other ranks are inside the round's collectives)."""
        from sglang.srt.runtime_context import get_parallel

        from sglang_kdtree import round_faults

        faults = self._test_faults(batch) if self._test_faults_path is not None else {}
        snapshot = round_faults.snapshot_batch(batch)
        error = None
        for attempt in (0, 1):
            if attempt:
                round_faults.restore_batch(batch, snapshot)
                released = round_faults.release_round_caches(self.backend)
                logger.warning("KDTREE round: retrying once after releasing %s", ", ".join(released) or "nothing")
            try:
                with round_faults.failing_reserve(self.backend, round_faults.injected_oom(faults, attempt)):
                    return self._tree_round(batch, on_publish)
            except round_faults.OOM_ERRORS as exc:
                parallel = get_parallel()
                if parallel.tp_size != 1 or getattr(parallel, "pp_size", 1) != 1:
                    raise
                error = round_faults.describe_error(exc)
                logger.warning("KDTREE round (batch of %d, attempt %d) could not allocate memory: %s",
                               len(batch.reqs), attempt + 1, error, exc_info=True)
            # the exception and its traceback (the failed attempt's tensors) are dropped here, before the retry
        round_faults.restore_batch(batch, snapshot)
        return self._ended_round_result(batch, error, on_publish)

    def _ended_round_result(self, batch, error: str, on_publish=None):
        """End every request of ``batch`` after its round failed twice to allocate memory; the result commits
        one placeholder token per request (see ``round_faults``)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        from sglang_kdtree import round_faults

        message = round_faults.abort_message(error)
        for req in batch.reqs:
            if req.to_finish is None:
                req.to_finish = FINISH_ABORT(message, status_code=round_faults.ABORT_STATUS,
                                             err_type=round_faults.ABORT_ERR_TYPE)
            # the scheduler counts position P (the bonus token) as committed after this round, but its KV was never
            # computed: the request must not be checkpointed into the radix cache for later requests to reuse
            req.skip_radix_cache_insert = True
        logger.error("%s (batch of %d: rids %s)", message, len(batch.reqs), [req.rid for req in batch.reqs])
        model_eos = getattr(self.target_worker.model_runner.model_config, "hf_eos_token_id", None)
        tokens = round_faults.placeholder_tokens(batch.reqs, model_eos)
        next_token_ids, accept_lens, new_seq_lens = round_faults.abort_round_outputs(
            batch.seq_lens, tokens, self.verify_width)
        bonus = next_token_ids.view(-1, self.verify_width)[:, 0]
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=round_faults.abort_logits_output(batch),
            next_token_ids=next_token_ids,
            accept_lens=accept_lens,
            can_run_cuda_graph=False,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=self.verify_width,
            new_seq_lens=new_seq_lens,
        )

    def _tree_round(self, batch, on_publish):
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("KDTREE expected DFlashDraftInputV2 state on the running batch")
        bs, width, device = len(batch.seq_lens), self.verify_width, self.device
        prefix_lens = batch.seq_lens.to(torch.int64)
        prefix_cpu = prefix_lens.to("cpu")
        marks = _RoundMarks(device, enabled=self._round_log is not None)
        # the round's buffers for this batch and context (grow-only; nothing is allocated in steady state)
        self.backend.reserve(bs, self.budget, self.depths, self.vocab_size,
                             mask_bytes=full_mask_numel(int(prefix_cpu.sum()), width, bs))

        # 1: draft block (then 2-4: per-depth top-K -> tree -> verify inputs)
        draft_hidden = self._draft_block(batch, draft_input, prefix_lens)
        marks.mark("draft")
        faults = self._test_faults(batch) if self._test_faults_path is not None else None
        from sglang.srt.lora.layers import unwrap_lora_layer
        from sglang.srt.runtime_context import get_parallel

        roots = draft_input.bonus_tokens.to(torch.int64)
        seq_lens_sum = int(prefix_cpu.sum())
        if faults is None and get_parallel().tp_size == 1:
            # 2-4 in one call: head GEMM (the draft's last step), then top-K -> tree -> verify inputs (on the GPU
            # one CUDA graph replay after the eager GEMM)
            lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
            rows = draft_hidden[:, 1:, :].reshape(-1, draft_hidden.shape[-1]).to(lm_head.weight.dtype)
            trees, verify, draft_logits = self.backend.tree_step(
                rows, lm_head.weight, self.vocab_size, self.depths, self.budget, roots, prefix_lens, seq_lens_sum,
                graph=self._round_graphs, mark=lambda: marks.mark("draft_head"))
            marks.mark("tree_step")
        else:  # tensor parallel (vocab-parallel top-K) or test fault injection: step by step
            logprobs, ids, draft_logits = self._draft_topk(draft_hidden, faults, marks)
            marks.mark("topk")
            trees = self.backend.build(logprobs, ids, self.budget, roots)
            marks.mark("build")
            # 4: verify input into the N reserved slots after the committed prefix
            verify = self.backend.verify_inputs(trees, prefix_lens, seq_lens_sum=seq_lens_sum)
            marks.mark("verify_inputs")
        verify_slots = self._gather_slots(batch, prefix_lens, width)
        seq_lens_cpu_verify = prefix_cpu + width
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, seq_lens_cpu=seq_lens_cpu_verify,
            write_virtual=verify_slots.reshape(-1), read_extent=width,
        )
        verify_input = KDTreeVerifyInput(
            draft_token=verify.input_ids, positions=verify.positions, draft_token_num=width, topk=2,
            custom_mask=verify.full_mask, capture_hidden_mode=CaptureHiddenMode.FULL, kv_loc_plan=plan,
        )
        verify_input.ancestor_bits = verify.ancestor_bits
        verify_input.retrieve_index = verify.retrieve_index
        verify_input.retrieve_next_token = verify.retrieve_next_token
        verify_input.retrieve_next_sibling = verify.retrieve_next_sibling
        batch.out_cache_loc = verify_slots.reshape(-1)
        saved_cpu, saved_sum = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu = seq_lens_cpu_verify
        batch.seq_lens_sum = int(seq_lens_cpu_verify.sum())
        verify_fb, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved_cpu, saved_sum
        marks.mark("prepare")

        # 5: target verify
        target_out = self.target_worker.forward_batch_generation(batch=None, forward_batch=verify_fb,
                                                                 is_verify=True, skip_attn_backend_init=True)
        logits_output = target_out.logits_output
        logits = logits_output.next_token_logits[:, : self.vocab_size].reshape(bs, width, -1)
        for b in (faults or {}).get("target_nan", ()):  # test-only fault injection (KDTREE_TEST_FAULTS)
            logits[b, 0, 0] = float("nan")
        marks.mark("verify")
        if self._dump_prefix is not None and self._dumped < DUMP_ROUNDS:
            torch.save({"input_ids": verify.input_ids.cpu(), "positions": verify.positions.cpu(),
                        "tokens": trees.tokens.cpu(), "parents": trees.parents.cpu(),
                        "logits": logits[:, :, :DUMP_COLUMNS].float().cpu(), "graph": target_out.can_run_cuda_graph},
                       f"{self._dump_prefix}.{self._dumped}.pt")
            self._dumped += 1

        # 6-7: accept, then the KV commit (the accepted path to the slots of positions P..P+tau-1, read all then
        # write) and the accepted rows' hidden states for the drafter
        sampling = batch.sampling_info
        pool = self.target_worker.model_runner.token_to_kv_pool
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("KDTREE verify requires target hidden states, but got None")
        if sampling is None or sampling.is_all_greedy:
            # one call; a CUDA graph replay when the verify forward replayed SGLang's (fixed output addresses)
            acc, commit, accepted_hidden = self.backend.accept_commit_greedy(
                trees, logits, self.depths, verify_slots, pool, hidden, width,
                graph=self._round_graphs and bool(target_out.can_run_cuda_graph))
            accept_lens = acc.accept_lens.to(torch.int64)
            marks.mark("accept_commit_kv")
        else:
            seeds, _ = self._request_seeds(batch)
            acc = self.backend.accept_sampled(trees, logits, sampling.temperatures.view(-1), seeds.view(-1),
                                              prefix_lens, self.depths, top_ks=_per_request(sampling.top_ks),
                                              top_ps=_per_request(sampling.top_ps),
                                              min_ps=_per_request(sampling.min_ps if sampling.need_min_p_sampling
                                                                  else None))
            accept_lens = acc.accept_lens.to(torch.int64)
            marks.mark("accept")
            commit = self.backend.commit_plan(acc.accepted, accept_lens, verify_slots)
            self.backend.commit_kv(pool, commit)
            marks.mark("commit")
            accepted_hidden = self.backend.gather_hidden(hidden, commit, width)  # [bs, min(L+1, N), D]
        new_seq_lens = prefix_lens + accept_lens
        if on_publish is not None:
            on_publish(new_seq_lens)

        # 8: drafter features from the accepted rows, written at chain positions P..P+tau-1
        commit_width = accepted_hidden.shape[1]
        chain_positions = prefix_lens[:, None] + torch.arange(commit_width, device=device)[None, :]
        draft_slots = self._draft_write_ids(plan).view(bs, width)[:, :commit_width]
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=accepted_hidden.reshape(-1, hidden.shape[-1]),
            cache_loc=draft_slots.reshape(-1).contiguous(), cache_loc_2d=draft_slots.contiguous(),
            positions=chain_positions.reshape(-1), commit_lens=accept_lens.to(torch.int32),
        )
        logits_output.hidden_states = None
        marks.mark("features")

        # 9: the V2 result: stride-N token rows whose first tau entries are committed
        out_tokens = torch.zeros((bs, width), dtype=torch.int64, device=device)
        committed = acc.committed[:, : min(width, acc.committed.shape[1])]
        out_tokens[:, : committed.shape[1]] = committed.clamp_min(0)
        # logprobs of the committed tokens from the verify rows of the accepted nodes (return_logprob only)
        round_logprobs(batch, logits_output, logits, acc.accepted, committed)
        marks.mark("accept_commit")
        self._round_faults(batch, acc, commit, draft_logits)
        if self._round_log is not None:
            self._log_round(acc, verify, trees, marks, target_out.can_run_cuda_graph)
        next_draft_input = make_draft_input_v2(bonus_tokens=acc.bonus.to(torch.int64), new_seq_lens=new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=accept_lens.to(torch.int32),
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=width,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )


def _per_request(values):
    """SGLang's per-request sampling tensor (``SamplingBatchInfo.top_ks`` / ``top_ps``) as ``[bs]``, or None."""
    return None if values is None else values.reshape(-1)


class _RoundMarks:
    """Phase boundaries of one round for the round log: CUDA events on a GPU (read after the round's end),
    the host clock on CPU; does nothing unless the round log is on.

    ``mark(name)`` closes the step ``name``; steps listed in ``PHASE_OF`` add up to their phase (the drafter's
    head GEMM ``draft_head`` belongs to ``draft``; ``tree_step``, or ``topk``, ``build``, ``verify_inputs``
    one by one, and SGLang's verify ``prepare`` make ``tree``;
    ``accept_commit_kv``, or ``accept`` and ``commit``, then ``features`` and the result's own mark make
    ``accept_commit``). ``split()`` gives the four phases; ``detail()`` every step on the device timeline (``ms``)
    and on the host clock (``host_ms``: how long the Python side took to issue it; a step whose host time is
    close to its device time is bound by the host)."""

    PHASE_OF = {"draft_head": "draft", "tree_step": "tree", "topk": "tree", "build": "tree", "verify_inputs": "tree", "prepare": "tree",
                "accept_commit_kv": "accept_commit", "accept": "accept_commit", "commit": "accept_commit",
                "features": "accept_commit"}

    def __init__(self, device, enabled: bool):
        import time

        self._cuda = enabled and torch.device(device).type == "cuda"
        self._enabled = enabled
        self._clock = time.perf_counter
        self._marks = [("start", self._now(), self._clock())] if enabled else []

    def _now(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
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

    def split(self) -> dict:
        phases: dict = {}
        for name, ms, _ in self._steps():
            phase = self.PHASE_OF.get(name, name)
            phases[phase] = phases.get(phase, 0.0) + ms
        return {k: round(v, 4) for k, v in phases.items()}

    def detail(self) -> dict:
        steps = self._steps()
        return {"ms": {n: round(ms, 4) for n, ms, _ in steps}, "host_ms": {n: round(h, 4) for n, _, h in steps}}


def rehearse_round(backend, bs: int, budget: int, depth: int, vocab: int, device, hidden_size: int = 8,
                   hidden_dtype=torch.bfloat16) -> int:
    """One greedy and one sampled round of ``backend`` on synthetic inputs at batch ``bs`` (startup pre-warm:
    compiles every kernel and sizes the backend's buffers); returns the bytes of the verify logits it used."""
    width = budget + 1
    gen = torch.Generator(device=device).manual_seed(0)
    draft = torch.randn((bs, depth, vocab), generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    prefix = torch.full((bs,), 8, dtype=torch.int64, device=device)
    logits = torch.randn((bs, width, vocab), generator=gen, device=device, dtype=torch.float32)
    round_inputs = (draft, budget, depth, torch.zeros(bs, dtype=torch.int64, device=device), prefix, 8 * bs, logits,
                    torch.arange(bs * width, dtype=torch.int64, device=device).view(bs, width),
                    torch.zeros((bs * width, hidden_size), dtype=hidden_dtype, device=device))
    bookkeeping_round(backend, *round_inputs)
    bookkeeping_round(backend, *round_inputs, temperatures=torch.ones(bs, dtype=torch.float32, device=device),
                      seeds=torch.arange(bs, dtype=torch.int64, device=device))
    for flag in (getattr(backend, "tree_errors", None), getattr(backend, "commit_errors", None)):
        if flag is not None:
            flag.zero_()
    return logits.numel() * logits.element_size()
