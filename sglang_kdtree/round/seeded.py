"""Seeded sampling at T > 0 for KDTREE: per-request seeds, and the prefill's token drawn with them.

The tree rounds draw every token with a uniform keyed by the request's seed and the position it generates
(``reference.position_uniform``), so a seeded request is reproducible. SGLang honours ``sampling_seed`` only
under ``--enable-deterministic-inference`` (which CPU backends do not support); outside it, the prefill's token
of a seeded T > 0 request is drawn again here with the same seeded sampler (``prefill_with_seeded_tokens``).
"""

from __future__ import annotations

import torch
from sglang.srt.utils.common import async_h2d

from sglang_kdtree.round.spec_logprobs import reseed_prefill_logprobs


def per_request(values):
    """SGLang's per-request sampling tensor (``SamplingBatchInfo.top_ks`` / ``top_ps``) as ``[bs]``, or None."""
    return None if values is None else values.reshape(-1)


def request_seeds(batch, device) -> tuple[torch.Tensor, list[bool]]:
    """Per-request sampling seeds: SGLang's (deterministic-inference mode), else each request's own
    ``sampling_seed`` (which SGLang ignores outside that mode), else a fresh random one. Also returns, per
    request, whether the seed is the request's own."""
    sampling = batch.sampling_info
    if sampling is not None and sampling.sampling_seed is not None:
        return sampling.sampling_seed.view(-1).to(torch.int64), [False] * len(batch.reqs)
    seeds, own = [], []
    for req in batch.reqs:
        seed = req.sampling_params.sampling_seed
        own.append(seed is not None)
        seeds.append(int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
    # pinned and non-blocking: a pageable upload would make the host wait for the device every T > 0 round
    return async_h2d(seeds, dtype=torch.int64, device=device), own


def has_seeded_sampling(batch) -> bool:
    """A batch with a seeded T > 0 request whose seed SGLang will not apply (no deterministic mode)."""
    sampling = batch.sampling_info
    if batch.forward_mode.is_idle() or sampling is None or sampling.is_all_greedy:
        return False
    if sampling.sampling_seed is not None:
        return False
    return any(r.sampling_params.sampling_seed is not None and r.sampling_params.temperature > 0
               for r in batch.reqs)


def prefill_with_seeded_tokens(worker, batch, forward):
    """``forward()`` (DFLASH's prefill of ``batch``) with SGLang's sampler wrapped to keep the raw logits
    (it scales them in place), then the seeded requests' tokens drawn again from them."""
    runner = worker.target_worker.model_runner
    original_sample = runner.sample
    kept = {}

    def sample_keeping_logits(logits_output, forward_batch, *args, **kwargs):
        kept["logits"] = logits_output.next_token_logits.clone()
        return original_sample(logits_output, forward_batch, *args, **kwargs)

    runner.sample = sample_keeping_logits
    try:
        result = forward()
    finally:
        del runner.sample
    if "logits" in kept:
        reseed_prefill_samples(worker.backend, worker.vocab_size, worker.device, batch, result, kept["logits"])
    return result


def reseed_prefill_samples(backend, vocab_size: int, device, batch, result, logits) -> None:
    """Outside deterministic-inference mode SGLang samples the prefill's token without the request's
    seed; for seeded requests at T > 0 draw it again (from the raw logits) with the same seeded sampler
    as the tree rounds, so a seeded request is reproducible end to end."""
    sampling = batch.sampling_info
    seeds, own = request_seeds(batch, device)
    temps = sampling.temperatures.view(-1)
    # the host's own temperatures (``temps`` is their device copy): reading ``temps`` would wait for the device
    rows = [b for b, (req, mine) in enumerate(zip(batch.reqs, own)) if mine and req.sampling_params.temperature > 0]
    if not rows:
        return
    index = async_h2d(rows, dtype=torch.int64, device=device)
    top_ks, top_ps = per_request(sampling.top_ks), per_request(sampling.top_ps)
    min_ps = per_request(sampling.min_ps) if sampling.need_min_p_sampling else None
    drawn = backend.sample_tokens(logits[index, :vocab_size], temps[index], seeds[index],
                                  batch.seq_lens[index], None if top_ks is None else top_ks[index],
                                  None if top_ps is None else top_ps[index],
                                  None if min_ps is None else min_ps[index])
    result.next_token_ids[index] = drawn.to(result.next_token_ids.dtype)
    reseed_prefill_logprobs(batch, result.logits_output, logits[index, :vocab_size], index, drawn)
    # the next round's root is the draft input's own (int64) copy of the token: it must be the same one
    draft_input = result.next_draft_input
    if draft_input is not None and draft_input.bonus_tokens.data_ptr() != result.next_token_ids.data_ptr():
        draft_input.bonus_tokens[index] = drawn.to(draft_input.bonus_tokens.dtype)
