"""Logprobs of a KDTREE round's committed tokens, in SGLang's speculative response format.

The target's verify forward yields one logits row per tree node (``[bs, N, V]``). The token committed at
chain position ``j`` of request ``b`` was chosen from the row of the accepted node ``accepted[b, j]`` (the
root for ``j = 0``), so those rows, gathered in chain order, are exactly the distributions a plain
autoregressive decode would have produced at those positions. ``round_logprobs`` gathers them into a
``[bs * C, V]`` chain (``C`` = the columns a round can commit,
``min(N, L + 1)``: ``state.Geometry.commit_width``) and hands it to SGLang's own
``compute_spec_logprobs`` (the helper DFLASH / EAGLE / n-gram use), which fills ``next_token_logprobs``
(``[bs, C]``), the top-logprobs and the ``token_ids_logprob`` values exactly as for DFLASH's chain. The
scheduler reads the first ``accept_len`` of each request's ``C`` entries.

Which distribution: SGLang's rule, as in its plain sampler: ``log_softmax(logits)`` for an all-greedy batch
or under ``SGLANG_RETURN_ORIGINAL_LOGPROB``, else ``log_softmax(logits / T)`` per request (greedy requests
carry ``T = 1``). Top-k / top-p do not change the reported values (the plain server reports the
temperature-scaled, unfiltered distribution too).

The gather costs ``bs * C * V`` floats, so the worker calls this only for batches with ``return_logprob``.

``reseed_prefill_logprobs``: the worker redraws the prefill's token of a seeded request at T > 0
(``seeded.reseed_prefill_samples``); SGLang's sampler has already reported the logprob of the token
it drew, so the redrawn rows get the logprob of the new token, under the same rule.
"""

from __future__ import annotations

import types

import torch

#: The ``LogitsProcessorOutput`` fields ``compute_spec_logprobs`` writes.
OUTPUT_FIELDS = ("next_token_logprobs", "next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                 "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx")


def accepted_rows(logits: torch.Tensor, accepted: torch.Tensor, columns: int) -> torch.Tensor:
    """The verify logits at the accepted nodes, in chain order.

    Args:
        logits: ``[bs, N, V]`` verify logits (one row per tree node, node 0 = root).
        accepted: ``[bs, >= columns]`` node indices of the accepted path, -1 padded.
        columns: chain columns ``C`` to gather.

    Returns:
        ``[bs * C, V]``: row ``b * C + j`` is ``logits[b, accepted[b, j]]``; padding (-1) takes the root's row
        (never read: the scheduler stops at ``accept_len``).
    """
    bs = logits.shape[0]
    nodes = accepted[:, :columns].to(device=logits.device, dtype=torch.int64).clamp_min(0)
    rows = torch.arange(bs, device=logits.device, dtype=torch.int64)[:, None]
    return logits[rows, nodes].reshape(bs * columns, logits.shape[-1])


def round_logprobs_bytes(bs: int, columns: int, vocab: int) -> int:
    """The most transient memory ``round_logprobs`` takes for ``bs`` requests of ``columns`` accepted rows over
    ``vocab``: the gathered rows, SGLang's temperature-scaled copy and its log-softmax, float32 each (the
    worker's startup rehearsal reserves it, so a logprob batch cannot run the KV pool's neighbours out)."""
    return 3 * int(bs) * int(columns) * int(vocab) * 4


def round_logprobs(batch, logits_output, logits: torch.Tensor, accepted: torch.Tensor,
                   committed: torch.Tensor) -> None:
    """Fill ``logits_output``'s next-token logprob fields for a KDTREE round (a no-op without
    ``batch.return_logprob``).

    Args:
        batch: SGLang's ``ScheduleBatch`` (``return_logprob``, ``sampling_info``, ``top_logprobs_nums``,
            ``token_ids_logprobs``, ``seq_lens``).
        logits_output: the round's ``LogitsProcessorOutput``; its ``next_token_logits`` (all nodes) is left
            as it is.
        logits: ``[bs, N, V]`` verify logits over the target's vocabulary.
        accepted: ``[bs, C]`` accepted node indices (-1 padded).
        committed: ``[bs, C]`` committed token ids (-1 padded), the tokens the result reports.
    """
    if not batch.return_logprob:
        return
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    columns = committed.shape[1]
    chain = types.SimpleNamespace(next_token_logits=accepted_rows(logits, accepted, columns))
    tokens = committed.to(device=logits.device, dtype=torch.int64).clamp_min(0).reshape(-1)
    compute_spec_logprobs(batch, chain, tokens, chain_stride=columns)
    for field in OUTPUT_FIELDS:
        if hasattr(chain, field):
            setattr(logits_output, field, getattr(chain, field))


def reseed_prefill_logprobs(batch, logits_output, raw_logits: torch.Tensor, rows: torch.Tensor,
                            tokens: torch.Tensor) -> None:
    """After the worker replaced the prefill's sampled token of ``rows`` by ``tokens``, report their
    logprobs (``next_token_logprobs[rows]``) under SGLang's rule, from the raw logits ``raw_logits[rows]``
    (``[len(rows), V]``, before temperature). The top-logprobs do not depend on the token and stay.
    No-op without ``batch.return_logprob``."""
    if not batch.return_logprob or getattr(logits_output, "next_token_logprobs", None) is None:
        return
    from sglang.srt.environ import envs

    x = raw_logits.float()
    if not (batch.sampling_info.is_all_greedy or envs.SGLANG_RETURN_ORIGINAL_LOGPROB.get()):
        x = x / batch.sampling_info.temperatures.view(-1, 1)[rows].float()
    logprobs = torch.log_softmax(x, dim=-1).clamp_(min=torch.finfo(torch.float32).min)
    picked = logprobs.gather(1, tokens.to(torch.int64).view(-1, 1)).view(-1)
    out = logits_output.next_token_logprobs
    out[rows] = picked.to(out.dtype)
