"""CPU checks of the round's plumbing that the CUDA server relies on: the commit helpers shared by both backends,
the grow-only buffer rule, the round log's time split, allocation failures and the round's host lengths (the
fault words: ``tests/test_deferred_faults.py``)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_kdtree.round import pipeline
from sglang_kdtree.round.begin import begin_round
from sglang_kdtree.round import faults as round_faults
from sglang_kdtree.round.log import RoundMarks
from sglang_kdtree.state import RoundShape


def test_reference_gather_hidden_takes_the_accepted_rows_not_the_first_tau():
    backend = pipeline.ReferenceBackend("cpu")
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(10, 3)
    plan = types.SimpleNamespace(hidden_rows=torch.tensor([[0, 2, 3, -1], [5, 9, -1, -1]]))
    out = backend.gather_hidden(hidden, plan, width=3)
    assert out.shape == (2, 3, 3)
    assert torch.equal(out[0], hidden[[0, 2, 3]])
    assert torch.equal(out[1, :2], hidden[[5, 9]])


def test_move_kv_with_sglang_is_one_fixed_shape_call():
    """Every plan row in one call, whatever moves: rows that keep their slot copy it onto itself, padding rows
    copy slot 0 onto itself (no host read decides what to pass)."""
    calls = []
    pool = types.SimpleNamespace(move_kv_cache=lambda dst, src: calls.append((dst.tolist(), src.tolist())))
    plan = types.SimpleNamespace(src_slots=torch.tensor([[10, 12, -1], [20, 21, 22]]),
                                 dst_slots=torch.tensor([[10, 11, -1], [20, 21, 22]]))
    pipeline.move_kv_with_sglang(pool, plan)
    assert calls == [([10, 11, 0, 20, 21, 22], [10, 12, 0, 20, 21, 22])]
    calls.clear()
    pipeline.move_kv_with_sglang(pool, types.SimpleNamespace(src_slots=plan.dst_slots, dst_slots=plan.dst_slots))
    assert calls == [([10, 11, 0, 20, 21, 22], [10, 11, 0, 20, 21, 22])]


@pytest.mark.parametrize("seed", range(4))
def test_move_kv_with_sglang_moves_exactly_what_a_move_of_the_changed_rows_moves(seed):
    """SGLang's own row move (``move_kv_cache_native``) on random accepted paths: the KV after the fixed-shape call
    is bit-identical to moving only the rows whose slot changes."""
    from sglang.srt.mem_cache.memory_pool import move_kv_cache_native

    from sglang_kdtree.reference import compact

    gen = torch.Generator().manual_seed(seed)
    bs, width, slots = 5, 6, 64
    verify_slots = 1 + torch.randperm(slots - 1, generator=gen)[: bs * width].view(bs, width)  # slot 0: padding
    accepted = torch.full((bs, width), -1, dtype=torch.int64)
    accept_lens = torch.randint(1, width + 1, (bs,), generator=gen)
    for b in range(bs):
        path = torch.randperm(width - 1, generator=gen)[: int(accept_lens[b]) - 1].sort().values + 1
        accepted[b, : int(accept_lens[b])] = torch.cat([torch.zeros(1, dtype=torch.int64), path])
    plan = compact.commit_plan(accepted.numpy(), accept_lens.numpy(), verify_slots.numpy())
    plan = types.SimpleNamespace(src_slots=torch.from_numpy(plan.src_slots),
                                 dst_slots=torch.from_numpy(plan.dst_slots))
    k, v = torch.randn(slots, 2, 3, generator=gen), torch.randn(slots, 2, 3, generator=gen)
    k_ref, v_ref = k.clone(), v.clone()
    moving = (plan.src_slots >= 0) & (plan.src_slots != plan.dst_slots)
    move_kv_cache_native([k_ref], [v_ref], plan.dst_slots[moving], plan.src_slots[moving])
    pool = types.SimpleNamespace(move_kv_cache=lambda dst, src: move_kv_cache_native([k], [v], dst, src))
    pipeline.move_kv_with_sglang(pool, plan)
    assert bool(moving.any()) and torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("current, needed, expect", [(0, 5, 5), (8, 5, 8), (8, 9, 16), (8, 40, 40)])
def test_buffers_grow_at_least_twofold_and_never_shrink(current, needed, expect):
    from sglang_kdtree.gpu.buffers import grown

    assert grown(current, needed) == expect


def test_round_marks_split_in_order_and_off_by_default():
    marks = RoundMarks("cpu", enabled=True)
    for name in ("draft", "tree", "verify", "accept_commit"):
        marks.mark(name)
    split = marks.split()
    assert list(split) == ["draft", "tree", "verify", "accept_commit"]
    assert all(v >= 0 for v in split.values())
    off = RoundMarks("cpu", enabled=False)
    off.mark("draft")
    assert off.split() == {} and off.detail() == {"ms": {}, "host_ms": {}}


def test_round_marks_sum_steps_into_their_phases():
    import time

    marks = RoundMarks("cpu", enabled=True)
    steps = ("draft", "tree_prep", "draft_head", "topk", "build", "verify_inputs", "prepare", "verify", "accept",
             "commit", "features", "accept_commit")
    for name in steps:
        time.sleep(0.001)
        marks.mark(name)
    split, detail = marks.split(), marks.detail()
    assert list(split) == ["draft", "tree", "verify", "accept_commit"]
    assert list(detail["ms"]) == list(steps) == list(detail["host_ms"])
    ms = detail["ms"]
    assert abs(split["draft"] - (ms["draft"] + ms["draft_head"])) < 1e-3  # the head GEMM is the drafter's
    assert abs(split["tree"] - (ms["tree_prep"] + ms["topk"] + ms["build"] + ms["verify_inputs"]
                                + ms["prepare"])) < 1e-3
    assert abs(split["accept_commit"] - (ms["accept"] + ms["commit"] + ms["features"] + ms["accept_commit"])) < 1e-3
    assert all(v >= 0.9 for v in ms.values())  # each step slept 1 ms on the host clock (CPU marks)


def test_startup_rehearsal_runs_the_rounds_steps_on_either_backend():
    """``rehearse_round`` (the CUDA server's startup rehearsal, two ``pipeline.bookkeeping_round`` calls) runs on
    the reference backend too, so a contract slip in the shared step sequence shows up on CPU."""
    from sglang_kdtree.server.prewarm import rehearse_round

    backend = pipeline.ReferenceBackend("cpu")
    used = rehearse_round(backend, 3, RoundShape(6, 7, 4, 40), device="cpu", hidden_size=16)
    assert used == 3 * 7 * 40 * 4  # the fp32 verify logits it rehearsed with
    assert rehearse_round(backend, 3, RoundShape(6, 3, 4, 40), device="cpu", hidden_size=16) == 3 * 3 * 40 * 4
    assert int(backend.tree_errors) == 0 and int(backend.commit_errors) == 0


def test_bookkeeping_round_cut_verifies_the_smaller_budgets_tree():
    """A cut round (width 3 of a budget-5 tree) verifies, accepts and commits the budget-2 tree."""
    gen = torch.Generator().manual_seed(4)
    bs, budget, depth, vocab, width = 2, 5, 3, 30, 3
    draft = torch.randn((bs, depth, vocab), generator=gen)
    target = torch.randn((bs, width, vocab), generator=gen)
    seq, slots = torch.tensor([4, 9]), torch.arange(bs * width).view(bs, width) + 100
    hidden, roots = torch.randn((bs * width, 8), generator=gen), torch.tensor([1, 2])
    b = pipeline.ReferenceBackend("cpu")
    step, acc, plan, rows = pipeline.bookkeeping_round(b, draft, RoundShape(budget, width, depth, vocab, (width,)),
                                                       roots, seq, 13, target, slots, hidden)
    lp, ids = b.topk(draft, width - 1)
    own = b.build(lp, ids, width - 1, roots)
    for field in ("tokens", "depths", "parents", "num_nodes"):
        assert torch.equal(getattr(step.trees, field), getattr(own, field)), field
    assert torch.equal(acc.committed, b.accept_greedy(own, target, depth).committed)
    assert step.expected.shape == (bs, 1) and bool((step.expected >= 1).all())


def test_bookkeeping_round_equals_the_steps_called_one_by_one():
    gen = torch.Generator().manual_seed(9)
    bs, budget, depth, vocab, width = 2, 5, 3, 30, 6
    draft = torch.randn((bs, depth, vocab), generator=gen)
    target = torch.randn((bs, width, vocab), generator=gen)
    seq = torch.tensor([4, 9])
    slots = torch.arange(bs * width).view(bs, width) + 100
    hidden = torch.randn((bs * width, 8), generator=gen)
    roots = torch.tensor([1, 2])
    b = pipeline.ReferenceBackend("cpu")
    step, acc, plan, rows = pipeline.bookkeeping_round(b, draft, RoundShape(budget, width, depth, vocab), roots, seq,
                                                       13, target, slots, hidden)
    trees, verify = step.trees, step.verify
    lp, ids = b.topk(draft, budget)
    t2 = b.build(lp, ids, budget, roots)
    a2 = b.accept_greedy(t2, target, depth)
    p2 = b.commit_plan(a2.accepted, a2.accept_lens, slots)
    assert torch.equal(trees.tokens, t2.tokens) and torch.equal(acc.committed, a2.committed)
    assert torch.equal(plan.src_slots, p2.src_slots)
    assert torch.equal(verify.full_mask, b.verify_inputs(t2, seq, 13).full_mask)
    assert torch.equal(rows, b.gather_hidden(hidden, p2, width))


# --- allocation failures in a round (round_faults.contained_round) ----------------------------------------------


def test_injected_round_oom_fires_on_the_first_attempt_and_twice_also_on_the_retry():
    assert round_faults.injected_oom({}, 0) is None
    assert round_faults.injected_oom({"draft_nan": [0]}, 0) is None
    assert "round_oom" in round_faults.injected_oom({"round_oom": [1]}, 0)
    assert round_faults.injected_oom({"round_oom": [1]}, 1) is None
    assert round_faults.injected_oom({"round_oom_twice": [0]}, 0) and round_faults.injected_oom({"round_oom_twice": [0]}, 1)


def test_failing_reserve_raises_torch_oom_then_gives_the_backend_its_reserve_back():
    backend = pipeline.ReferenceBackend("cpu")
    with round_faults.failing_reserve(backend, None):
        backend.reserve(2, 4, 3, 10)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        with round_faults.failing_reserve(backend, "injected"):
            backend.reserve(2, 4, 3, 10)
    assert "reserve" not in vars(backend)
    backend.reserve(2, 4, 3, 10)
    assert issubclass(torch.cuda.OutOfMemoryError, round_faults.OOM_ERRORS)


def test_abort_round_outputs_commit_one_placeholder_per_request():
    seq_lens = torch.tensor([5, 9, 1], dtype=torch.int64)
    ids, accept_lens, new_seq_lens = round_faults.abort_round_outputs(seq_lens, [2, 2, 7], width=4)
    assert ids.shape == (12,) and ids.dtype == torch.int64
    assert ids.view(3, 4)[:, 0].tolist() == [2, 2, 7] and not ids.view(3, 4)[:, 1:].any()
    assert accept_lens.dtype == torch.int32 and accept_lens.tolist() == [1, 1, 1]  # 0 breaks SGLang's accounting
    assert new_seq_lens.tolist() == [6, 10, 2]


def test_placeholder_token_is_the_requests_eos_else_the_models():
    reqs = [types.SimpleNamespace(eos_token_ids={9, 4}), types.SimpleNamespace(eos_token_ids=None)]
    assert round_faults.placeholder_tokens(reqs, {3}) == [4, 3]
    assert round_faults.placeholder_tokens(reqs[1:], None) == [0]


def _logprob_batch(top, token_ids, return_logprob=True):
    return types.SimpleNamespace(reqs=[object()] * len(top), return_logprob=return_logprob, top_logprobs_nums=top,
                                 token_ids_logprobs=token_ids)


def test_abort_logits_output_has_the_logprob_layout_the_scheduler_reads():
    out = round_faults.abort_logits_output(_logprob_batch([0, 0], [None, None], return_logprob=False))
    assert out.next_token_logits is None and out.next_token_logprobs is None and out.hidden_states is None
    out = round_faults.abort_logits_output(_logprob_batch([3, 0], [[0, 5], None]))
    assert out.next_token_logprobs.shape == (2, 1)
    # SGLang's _normalize_decode_outputs calls .tolist() on every top-logprob entry, both values and ids
    assert [v.tolist() for v in out.next_token_top_logprobs_val] == [[], []]
    assert [x.tolist() for x in out.next_token_top_logprobs_idx] == [[], []]
    assert [len(v.tolist()) for v in out.next_token_token_ids_logprobs_val] == [2, 0]
    assert out.next_token_token_ids_logprobs_idx == [[0, 5], []]
    plain = round_faults.abort_logits_output(_logprob_batch([0], [None]))
    assert plain.next_token_top_logprobs_val is None and plain.next_token_token_ids_logprobs_val is None


def test_release_round_caches_drops_the_gpu_backends_buffers_and_graphs():
    graphs = types.SimpleNamespace(_graphs={"k": 1}, _builder="old", _logits=torch.zeros(6, 5), _roots=None, _seq=None)
    backend = types.SimpleNamespace(device=torch.device("cpu"), _builder="builder", _tree_graphs=graphs,
                                    _commit_graphs=types.SimpleNamespace(_graphs={}, _builder=None),
                                    _accept_storage=torch.zeros(8, dtype=torch.int64),
                                    _plan_storage=torch.zeros(0, dtype=torch.int64),
                                    _hidden_storage=torch.zeros(4, dtype=torch.bfloat16))
    released = round_faults.release_round_caches(backend)
    assert backend._builder is None and graphs._graphs == {} and graphs._builder is None and graphs._logits is None
    assert backend._accept_storage.numel() == 0 and backend._hidden_storage.dtype == torch.bfloat16
    assert released == ["1 tree_graphs", "tree_graphs inputs", "round buffers", "accept_storage", "hidden_storage"]
    assert round_faults.release_round_caches(pipeline.ReferenceBackend("cpu")) == []


def test_release_round_caches_on_the_real_gpu_backend_class_lets_reserve_start_afresh():
    """The attributes ``release_round_caches`` drops are the ones ``pipeline.GpuBackend`` and its round graphs
    hold (the class builds on CPU; its kernels are not run here)."""
    backend = pipeline.GpuBackend("cpu")
    backend.reserve(4, 4, 3, 10, mask_bytes=100)
    backend._storage("_plan_storage", 12)
    backend._tree_graphs._check_builder()
    assert backend._tree_graphs._builder is backend._builder
    assert round_faults.release_round_caches(backend) == ["round buffers", "plan_storage"]
    assert backend._builder is None and backend._tree_graphs._builder is None
    assert backend._plan_storage.numel() == 0
    backend.reserve(1, 4, 3, 10)  # the retry's reservation: sized for its batch, not the largest seen
    assert backend._builder.max_batch == 1 and backend._builder.error_flag is backend.tree_errors


class _FakeRoundWorker:
    """What ``round_faults.contained_round`` / ``ended_round_result`` read of the worker."""

    def _contained_round(self, batch, on_publish):
        return round_faults.contained_round(self, batch, on_publish)

    def __init__(self, faults_path, fail_times=0):
        self.backend = pipeline.ReferenceBackend("cpu")
        self._test_faults_path = faults_path
        self.verify_width = 4
        self.target_worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(model_config=types.SimpleNamespace(hf_eos_token_id={2})))
        self.fail_times, self.calls = fail_times, []
        self.deferred_faults = round_faults.DeferredFaults()

    def _tree_round(self, batch, on_publish):
        self.calls.append((batch.out_cache_loc, batch.spec_info))
        batch.out_cache_loc, batch.spec_info = "verify slots", "verify input"  # what a round edits on the batch
        self.backend.reserve(len(batch.reqs), 3, 2, 10)
        if len(self.calls) <= self.fail_times:
            raise MemoryError("host allocation failed")
        return "round result"


def _oom_batch(rids):
    reqs = [types.SimpleNamespace(rid=r, to_finish=None, skip_radix_cache_insert=False, eos_token_ids=None)
            for r in rids]
    return types.SimpleNamespace(reqs=reqs, seq_lens=torch.tensor([3 + i for i in range(len(rids))]),
                                 out_cache_loc=None, spec_info="draft input", return_logprob=False)


@pytest.fixture
def single_rank(monkeypatch):
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(tp_size=1, pp_size=1))


@pytest.mark.parametrize("fault,fail_times", [("round_oom", 0), (None, 1)])
def test_a_round_that_fails_once_is_retried_from_the_same_batch_state(tmp_path, single_rank, fault, fail_times):
    path = tmp_path / "faults.json"
    if fault:
        path.write_text('{"oom-": "%s"}' % fault)
    worker, batch = _FakeRoundWorker(str(path), fail_times=fail_times), _oom_batch(["ok-0", "oom-1"])
    assert worker._contained_round(batch, None) == "round result"
    assert len(worker.calls) == 2 and worker.calls[1] == (None, "draft input")  # the batch was put back first
    assert all(r.to_finish is None and not r.skip_radix_cache_insert for r in batch.reqs)


def test_a_round_that_fails_twice_ends_every_request_of_its_batch(tmp_path, single_rank):
    path = tmp_path / "faults.json"
    path.write_text('{"oom-": "round_oom_twice"}')
    worker, batch = _FakeRoundWorker(str(path)), _oom_batch(["ok-0", "oom-1", "ok-2"])
    result = worker._contained_round(batch, None)
    assert len(worker.calls) == 2 and batch.spec_info == "draft input" and batch.out_cache_loc is None
    for req in batch.reqs:
        assert req.skip_radix_cache_insert
        abort = req.to_finish
        assert abort.status_code == 503
        assert "KDTREE round could not allocate memory (OutOfMemoryError: " in abort.message
        assert "the request was ended, the server continues" in abort.message
    assert result.accept_lens.tolist() == [1, 1, 1] and result.new_seq_lens.tolist() == [4, 5, 6]
    assert result.next_token_ids.view(3, 4)[:, 0].tolist() == [2, 2, 2] and result.speculative_num_draft_tokens == 4
    assert result.next_draft_input.bonus_tokens.tolist() == [2, 2, 2]
    assert result.next_draft_input.new_seq_lens.tolist() == [4, 5, 6]
    assert result.logits_output is not None and result.logits_output.next_token_logprobs is None


def test_a_round_oom_under_tensor_parallelism_propagates(tmp_path, monkeypatch):
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(tp_size=2, pp_size=1))
    worker, batch = _FakeRoundWorker(None, fail_times=1), _oom_batch(["a"])
    with pytest.raises(MemoryError):
        worker._contained_round(batch, None)


def test_a_decode_batch_with_a_grammar_is_ended_not_raised(single_rank):
    """The last guard behind admission's grammar refusal: the batch ends (400 for the request with a grammar, 503
    for the others) with the placeholder result, and the worker returns it instead of raising in the scheduler."""
    from sglang_kdtree.round import worker as worker_mod

    worker, batch = _FakeRoundWorker(None), _oom_batch(["plain-0", "grammar-1"])
    for req in batch.reqs:
        req.grammar = object() if req.rid.startswith("grammar") else None
    batch.has_grammar = True
    batch.is_extend_in_batch = False
    batch.forward_mode = types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
    result = worker_mod.KDTreeWorker.forward_batch_generation(worker, batch)
    plain, grammar = (req.to_finish for req in batch.reqs)
    assert grammar.status_code == 400 and grammar.message == round_faults.GRAMMAR_MESSAGE
    assert plain.status_code == 503 and plain.message == round_faults.GRAMMAR_BATCH_MESSAGE
    assert all(req.skip_radix_cache_insert for req in batch.reqs)
    assert result.accept_lens.tolist() == [1, 1] and result.new_seq_lens.tolist() == [4, 5]
    assert worker.calls == []  # no round ran


def _round_start_worker():
    """The part of a ``KDTreeWorker`` that ``round.begin.begin_round`` reads."""
    from sglang_kdtree.state import Geometry
    from sglang_kdtree.round.width_choice import WidthChooser
    from sglang_kdtree.round.worker import KDTreeWorker

    worker = object.__new__(KDTreeWorker)
    worker.geometry = Geometry(budget=7, block_size=4, vocab_size=10)
    worker.budget, worker.depths, worker.vocab_size, worker.verify_width = 7, 3, 10, 8
    worker.backend, worker.device = pipeline.ReferenceBackend("cpu"), "cpu"
    worker.chooser = WidthChooser(worker.geometry.tiers)
    worker._round_log, worker._mark_events, worker._check_host_lens = None, [], False
    worker._tp_width_group = worker._tp_fault_group = None  # one rank
    return worker


def _decode_batch(seq_lens, seq_lens_cpu, seq_lens_sum=None, reserved=None):
    """A decode batch as the round sees it: ``reserved`` is the KV length SGLang reserved per request
    (``DFlashDraftInputV2.nxt_kv_lens_cpu``, set by its ``prepare_for_decode``)."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    draft_input = DFlashDraftInputV2.create_idle_input("cpu")
    draft_input.nxt_kv_lens_cpu = reserved
    return types.SimpleNamespace(spec_info=draft_input, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
                                 seq_lens_sum=seq_lens_sum)


def test_the_round_takes_its_host_lengths_from_sglang_without_reading_the_device():
    """``seq_lens`` on the meta device: any host read of it raises, so the round's start reads none."""
    worker = _round_start_worker()
    batch = _decode_batch(torch.tensor([5, 9, 1], device="meta"), torch.tensor([5, 9, 1]))
    rnd = begin_round(worker, batch)
    assert rnd.prefix_cpu.tolist() == [5, 9, 1] and rnd.prefix_sum == 15 and rnd.bs == 3
    worker._check_host_lens = True  # the e2e servers' check does read the device
    with pytest.raises(NotImplementedError):
        begin_round(worker, batch)


def test_without_published_host_lengths_the_round_plans_with_the_reserved_kv_less_its_window():
    """Overlap on Triton / FA3: SGLang sets no ``seq_lens_cpu``; the round's host lengths are the reserved KV less
    ``kv_reserve`` (8 here: max(N = 8, block = 4)), still without reading the device."""
    worker = _round_start_worker()
    assert worker.geometry.kv_reserve == 8
    batch = _decode_batch(torch.tensor([5, 9, 1], device="meta"), None, reserved=torch.tensor([21, 25, 17]))
    rnd = begin_round(worker, batch)
    assert rnd.prefix_cpu.tolist() == [13, 17, 9] and rnd.prefix_sum == 39


def _reserve_as_sglang_does(committed: int, kv_reserve: int) -> int:
    """The KV length SGLang reserves for a request whose host knows ``committed`` tokens: its own
    ``page_aligned_decode_alloc_lens`` with the reserve ``patches/decode_reserve.py`` makes it use (page size 1)."""
    from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens

    req = types.SimpleNamespace(kv=types.SimpleNamespace(kv_allocated_len=committed, kv_committed_len=committed))
    return page_aligned_decode_alloc_lens([req], reserve=2 * kv_reserve, page_size=1)[1][0]


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_covers_every_length_one_unprocessed_round_can_reach(seed):
    """Under overlap the host has processed the rounds up to k-1 when it reserves for round k+1; round k then
    commits 1..C tokens. The bound from SGLang's own reservation is at least P whatever round k accepted, and the
    round's window P..P+kv_reserve lies inside the reservation."""
    from sglang_kdtree.state import Geometry
    from sglang_kdtree.round.verify_input import host_prefix_lens

    gen = torch.Generator().manual_seed(seed)
    for budget, block in ((7, 16), (15, 16), (63, 16), (3, 4)):
        geometry = Geometry(budget=budget, block_size=block, vocab_size=10)
        committed = torch.randint(1, 4000, (16,), generator=gen)
        accepted = torch.randint(1, geometry.commit_width + 1, (16,), generator=gen)
        accepted[0] = geometry.commit_width  # the longest accept, every time
        reserved = torch.tensor([_reserve_as_sglang_does(int(c), geometry.kv_reserve) for c in committed])
        true_lens = committed + accepted
        batch = _decode_batch(true_lens, None, reserved=reserved)
        bound, total = host_prefix_lens(batch, geometry.kv_reserve, check=True)
        assert bool((bound >= true_lens).all()) and total == int(bound.sum())
        assert bool((true_lens + geometry.kv_reserve <= reserved).all())


def test_the_host_lengths_check_catches_a_stale_host_copy():
    from sglang_kdtree.round.verify_input import host_prefix_lens

    exact = _decode_batch(torch.tensor([5, 9]), torch.tensor([5, 9]), seq_lens_sum=14)
    assert host_prefix_lens(exact, 8, check=True)[1] == 14
    for stale in (_decode_batch(torch.tensor([5, 9]), torch.tensor([4, 9])),
                  _decode_batch(torch.tensor([5, 9]), torch.tensor([5, 9]), seq_lens_sum=12),
                  _decode_batch(torch.tensor([5, 9]), None, reserved=torch.tensor([13, 16]))):
        with pytest.raises(AssertionError, match="host lengths"):
            host_prefix_lens(stale, 8, check=True)
    for missing in (_decode_batch(torch.tensor([5]), None), _decode_batch(torch.tensor([5]), None,
                                                                          reserved=torch.tensor([20, 20]))):
        with pytest.raises(RuntimeError, match="seq_lens_cpu"):
            host_prefix_lens(missing, 8)


def test_the_overlap_scheduler_does_not_wait_for_host_lengths_when_every_attention_backend_opts_out():
    """Triton and FA3 declare ``needs_cpu_seq_lens = False``: by SGLang's own decision over the worker's backends
    the overlap scheduler then publishes no ``seq_lens_cpu`` and so does not wait for the previous round's accept
    (the round plans with its bound); torch_native asks for them."""
    from sglang.srt.managers import overlap_utils

    from sglang_kdtree.round.worker import KDTreeWorker

    worker = object.__new__(KDTreeWorker)
    opted_out = types.SimpleNamespace(needs_cpu_seq_lens=False)
    worker._target_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=opted_out))
    worker.draft_model_runner = types.SimpleNamespace(attn_backend=opted_out)
    spec = types.SimpleNamespace(speculative_algorithm="DFLASH")  # any but ngram, which always publishes
    exec_ = types.SimpleNamespace(overlap=types.SimpleNamespace(enable_two_batch_overlap=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(overlap_utils, "get_spec", lambda: spec)
        mp.setattr(overlap_utils, "get_exec", lambda: exec_)
        assert not overlap_utils.decide_needs_cpu_seq_lens(worker.spec_v2_attn_backends)
        asks = types.SimpleNamespace(needs_cpu_seq_lens=True)
        worker.draft_model_runner = types.SimpleNamespace(attn_backend=asks)
        assert overlap_utils.decide_needs_cpu_seq_lens(worker.spec_v2_attn_backends)
