"""The startup rehearsal of KDTREE's round bookkeeping (``KDTreeWorker.prewarm_sampling``).

SGLang rehearses its sampler at startup so the KV pool is sized from the memory left after it. KDTREE never
runs DFLASH's chain sampling verify; on CUDA it rehearses its own round instead: one greedy and one sampled
round of the GPU backend (``pipeline.bookkeeping_round``) at the largest batch the verify CUDA graph takes, so
every kernel is compiled and the backend's buffers exist before SGLang sizes the pool; the measured peak is
reported like DFLASH's rehearsal. On CPU SGLang's own rehearsal runs.
"""

from __future__ import annotations

import logging

import torch

from sglang_kdtree.round.pipeline import bookkeeping_round
from sglang_kdtree.round.spec_logprobs import round_logprobs_bytes

logger = logging.getLogger(__name__)

#: Largest batch the startup rehearsal sizes the round's buffers for (SGLang's default largest CUDA-graph
#: batch); a larger batch grows them on first sight.
PREWARM_MAX_BATCH = 256


def rehearse_round(backend, bs: int, shape, device, hidden_size: int = 8, hidden_dtype=torch.bfloat16) -> int:
    """One greedy and one sampled round of ``backend`` on synthetic inputs at batch ``bs`` and round shape
    ``shape`` (startup pre-warm: compiles every kernel and sizes the backend's buffers); returns the bytes of the
    verify logits it used."""
    width = shape.width
    gen = torch.Generator(device=device).manual_seed(0)
    draft = torch.randn((bs, shape.depths, shape.vocab), generator=gen, device=device,
                        dtype=torch.float32).to(torch.bfloat16)
    prefix = torch.full((bs,), 8, dtype=torch.int64, device=device)
    logits = torch.randn((bs, width, shape.vocab), generator=gen, device=device, dtype=torch.float32)
    round_inputs = (draft, shape, torch.zeros(bs, dtype=torch.int64, device=device), prefix, 8 * bs, logits,
                    torch.arange(bs * width, dtype=torch.int64, device=device).view(bs, width),
                    torch.zeros((bs * width, hidden_size), dtype=hidden_dtype, device=device))
    bookkeeping_round(backend, *round_inputs)
    bookkeeping_round(backend, *round_inputs, temperatures=torch.ones(bs, dtype=torch.float32, device=device),
                      seeds=torch.arange(bs, dtype=torch.int64, device=device))
    for flag in (getattr(backend, "tree_errors", None), getattr(backend, "commit_errors", None)):
        if flag is not None:
            flag.zero_()
    return logits.numel() * logits.element_size()


def _prepare_mla_verify(runner, device) -> None:
    """An MLA target's fused tree verify: launch the kernel this GPU runs once, whole and split (the merge), on a small
    tree (the first launch compiles it and checks it against the device's limits), so a kernel that cannot launch
    here refuses the start, naming it, before any round, graphs on or off. Its block and shared memory do not depend
    on the batch, the width or the context (only its grid does). With ``SGLANG_KDTREE_MLA=off`` SGLang's own path
    runs and there is nothing to rehearse."""
    from sglang_kdtree.patches import mla_tree_verify

    if getattr(runner, "use_mla_backend", False) and mla_tree_verify.option() != "off":
        from sglang_kdtree.gpu import mla_attention
        from sglang_kdtree.gpu.mla_reference import synthetic_inputs

        case = synthetic_inputs(1, 3, 1, [40], device=device)
        for splits in (1, 2):
            mla_attention.mla_tree_verify(case["q"], case["kv_buffer"], case["kv_indptr"], case["kv_indices"],
                                          case["tree_slots"], case["ancestor_bits"], case["sm_scale"],
                                          num_splits=splits)


def log_launch_limits(worker) -> None:
    """On CUDA, the server log's line of what this GPU allows, the variant each step launched and the largest shared
    memory any launch asked for (``gpu.limits.summary``)."""
    if worker.backend.name == "gpu":
        from sglang_kdtree.gpu import limits

        logger.info("KDTREE launch limits: %s", limits.summary(limits.current(torch.device(worker.device).index)))


def prewarm_round(worker):
    """``worker.prewarm_sampling`` on CUDA: rehearse the round at the largest verify batch (bounded like
    SGLang's graph batch sizes: larger batches grow the buffers) and report the peak as SGLang's
    ``SamplingPrewarmResult``, plus the transient memory of a ``return_logprob`` batch's gather."""
    from sglang.srt.model_executor.model_runner import SamplingPrewarmResult

    runner = worker.target_worker.model_runner
    geometry = worker.geometry
    bs = min(worker._prewarm_batch_size(geometry.verify_width), PREWARM_MAX_BATCH)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["allocated_bytes.all.current"]
    # the largest width sizes every buffer; the smallest tier also runs the cut's steps once
    logits = 0
    for width in sorted({geometry.tiers[0], geometry.verify_width}):
        logits = rehearse_round(worker.backend, bs, geometry.shape(width), worker.device,
                                hidden_size=int(runner.model_config.hidden_size), hidden_dtype=worker._draft_dtype)
    _prepare_mla_verify(runner, worker.device)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["allocated_bytes.all.peak"] - base
    # a return_logprob batch gathers and log-softmaxes the accepted rows on top (spec_logprobs)
    logprob_bytes = round_logprobs_bytes(bs, geometry.commit_width, geometry.vocab_size)
    result = SamplingPrewarmResult(sampling_input_bytes=logits,
                                   sampling_headroom_bytes=max(peak, 0) + logits + logprob_bytes)
    runner.sampling_prewarm_result = result
    logger.info("KDTREE round pre-warm: bs=%d peak=%d B (buffers kept for serving), logprob headroom %d B",
                bs, peak, logprob_bytes)
    log_launch_limits(worker)  # SGLang captured its graphs before this rehearsal: every configuration has launched
    return result
