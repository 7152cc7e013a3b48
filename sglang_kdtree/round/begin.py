"""The round's start: its batch-wide values (``Round``), the verify width chosen for it, and the KV slots its
steps write."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kdtree.gpu.verify import full_mask_numel
from sglang_kdtree.round.log import RoundMarks
from sglang_kdtree.round.verify_input import host_prefix_lens
from sglang_kdtree.round.width_choice import agreed_width
from sglang_kdtree.server import host_times
from sglang_kdtree.state import RoundShape


@dataclass
class Round:
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

def begin_round(worker, batch) -> Round:
    """The round's batch-wide values; the backend's buffers reserved for this batch and context (grow-only;
    nothing is allocated in steady state)."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    draft_input = batch.spec_info
    if not isinstance(draft_input, DFlashDraftInputV2):
        raise RuntimeError("KDTREE expected DFlashDraftInputV2 state on the running batch")
    prefix_lens = batch.seq_lens.to(torch.int64)
    prefix_cpu, prefix_sum = host_prefix_lens(batch, worker.geometry.kv_reserve, check=worker._check_host_lens)
    worker.chooser.settle()  # the earlier rounds whose statistics have landed; nothing waits for the others
    width = worker.chooser.choose(len(prefix_cpu), prefix_sum)
    if worker._tp_width_group is not None:
        width = agreed_width(width, worker._tp_width_group)
    shape = worker.geometry.shape(width)
    started = worker.chooser.start()
    rnd = Round(batch, draft_input, prefix_lens, prefix_cpu, prefix_sum,
                 RoundMarks(worker.device, enabled=worker._round_log is not None or host_times.enabled(),
                            events=worker._mark_events, device_clock=worker._round_log is not None),
                 faults=None, shape=shape, started=started)
    worker.backend.reserve(rnd.bs, worker.budget, worker.depths, worker.vocab_size,
                         mask_bytes=full_mask_numel(rnd.prefix_sum, worker.verify_width, rnd.bs))
    return rnd

def gather_slots(worker, batch, prefix_lens, width: int) -> torch.Tensor:
    """``[bs, width]`` KV slots ``req_to_token[req, P : P + width]`` (reserved by prepare_for_decode)."""
    req_to_token = worker.model_runner.req_to_token_pool.req_to_token
    cols = prefix_lens.to(torch.int64)[:, None] + torch.arange(width, device=prefix_lens.device)[None, :]
    return req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)
