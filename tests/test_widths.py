"""Verify-width tiers: the cut is the smaller budget's tree, the expected and realised accept lengths per tier
against independent computations, the tier set's startup checks, and the width choice (its calibration
converges on a synthetic drafter of known calibration; it explores, then picks the best rate)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_kdtree import contract, reference
from sglang_kdtree.server import spec
from sglang_kdtree.round import widths
from sglang_kdtree.reference.backend import ReferenceBackend
from sglang_kdtree.state import Geometry, RoundShape
from sglang_kdtree.round.width_choice import STATED_TAU_ENV, WidthChooser, parse_stated_tau


def _draft(rng, bs, depth, vocab, ties=False):
    x = rng.normal(size=(bs, depth, vocab)) * 3
    if ties:
        x = np.round(x)  # many exact ties: lower token id first, at every K
    return x.astype(np.float32)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget, depth, vocab", [(24, 5, 30), (40, 3, 8), (7, 15, 50), (63, 15, 12)])
def test_the_cut_is_the_smaller_budgets_tree(seed, budget, depth, vocab):
    """The first w rows of the budget-B tree equal the budget-(w-1) tree built with its own K = min(w-1, V),
    for every w (ties, a vocabulary smaller than the budget, trees that run out of reachable nodes)."""
    rng = np.random.default_rng(seed)
    x = _draft(rng, 3, depth, vocab, ties=seed % 2 == 0)
    roots = rng.integers(0, vocab, size=3)
    lp, ids = reference.topk_logprobs(x, min(budget, vocab))
    full = reference.build_trees(lp, ids, budget, roots)
    for width in range(2, budget + 2):
        own_lp, own_ids = reference.topk_logprobs(x, min(width - 1, vocab))
        own = reference.build_trees(own_lp, own_ids, width - 1, roots)
        cut = reference.cut_trees(full, width)
        for field in ("tokens", "depths", "parents", "num_nodes", "scores"):
            assert np.array_equal(getattr(cut, field), getattr(own, field)), (width, field)


def test_contract_cut_is_the_references_twin():
    rng = np.random.default_rng(1)
    lp, ids = reference.topk_logprobs(_draft(rng, 4, 6, 40), 20)
    full = reference.build_trees(lp, ids, 20, rng.integers(0, 40, size=4))
    t = contract.Trees(*(torch.from_numpy(getattr(full, f)) for f in ("tokens", "depths", "parents", "num_nodes",
                                                                      "scores")))
    for width in (2, 9, 21):
        cut, ref = contract.cut_trees(t, width), reference.cut_trees(full, width)
        for field in ("tokens", "depths", "parents", "num_nodes", "scores"):
            assert np.array_equal(getattr(cut, field).numpy(), getattr(ref, field)), (width, field)
            assert getattr(cut, field).is_contiguous()


@pytest.mark.parametrize("width", [2, 5, 16, 25])
def test_tree_verify_cut_gives_the_smaller_trees_verify_inputs(width):
    rng = np.random.default_rng(width)
    bs, depth, vocab, budget = 3, 6, 40, 24
    x = _draft(rng, bs, depth, vocab)
    roots = torch.from_numpy(rng.integers(0, vocab, size=bs))
    seq = torch.tensor([3, 0, 17])
    backend = ReferenceBackend("cpu")
    lp, ids = backend.topk(torch.from_numpy(x), budget)
    step = contract.tree_verify(backend, lp, ids, RoundShape(budget, width, depth, vocab, (2, width, budget + 1)),
                                roots, seq, int(seq.sum()))
    own_lp, own_ids = reference.topk_logprobs(x, width - 1)
    own = reference.build_trees(own_lp, own_ids, width - 1, roots.numpy())
    ref = reference.verify_inputs(own, seq.numpy())
    assert step.trees.width == width and step.verify.input_ids.numel() == bs * width
    for field in ("input_ids", "positions", "full_mask", "retrieve_index", "retrieve_next_token",
                  "retrieve_next_sibling"):
        assert np.array_equal(getattr(step.verify, field).numpy(), getattr(ref, field)), field
    assert np.array_equal(step.verify.ancestor_bits.numpy().view(np.uint32), ref.ancestor_bits)


def _path_probability(lp, ids, tokens, depths, parents, i):
    """exp(sum of the path's log-probs), walking parents and looking each token up in its depth's top-K."""
    logp = 0.0
    while i > 0:
        d = int(depths[i])
        logp += float(lp[d - 1][list(ids[d - 1]).index(int(tokens[i]))])
        i = int(parents[i])
    return math.exp(logp)


def test_expected_accepts_against_path_probabilities():
    rng = np.random.default_rng(7)
    bs, depth, vocab, budget = 3, 5, 12, 30
    x = _draft(rng, bs, depth, vocab) / 2
    lp, ids = reference.topk_logprobs(x, min(budget, vocab))
    trees = reference.build_trees(lp, ids, budget, rng.integers(0, vocab, size=bs))
    tiers = (2, 8, 16, 31, 40)  # 40: past the tree, counts the whole tree
    got = widths.expected_accepts(torch.from_numpy(trees.scores), torch.from_numpy(trees.num_nodes), tiers)
    assert got.shape == (bs, len(tiers)) and got.dtype == torch.float32
    for b in range(bs):
        n = int(trees.num_nodes[b])
        probs = [_path_probability(lp[b], ids[b], trees.tokens[b], trees.depths[b], trees.parents[b], i)
                 for i in range(1, n + 1)]
        for j, w in enumerate(tiers):
            want = 1.0 + sum(probs[: w - 1])
            assert abs(float(got[b, j]) - want) <= 1e-5 * want, (b, w)


@pytest.mark.parametrize("seed", range(4))
def test_realised_accepts_equal_the_walk_on_each_cut(seed):
    """The accept length of a cut, read off the whole tree's walk, equals the greedy walk run on the cut tree with
    the cut's own verify logits (an independent walk)."""
    rng = np.random.default_rng(seed)
    bs, depth, vocab, budget = 5, 6, 4, 20  # a 4-token vocabulary: long accepted paths
    lp, ids = reference.topk_logprobs(_draft(rng, bs, depth, vocab), min(budget, vocab))
    full = reference.build_trees(lp, ids, budget, rng.integers(0, vocab, size=bs))
    logits = rng.normal(size=(bs, budget + 1, vocab)).astype(np.float32)
    for b in range(bs):  # let the target agree with the tree often: its argmax at a node = a child's token
        for i in range(budget + 1):
            kids = [c for c in range(1, budget + 1) if full.parents[b, c] == i]
            if kids and rng.random() < 0.8:
                logits[b, i, full.tokens[b, kids[rng.integers(len(kids))]]] += 20
    acc = reference.accept_greedy(full, logits, depth)
    tiers = tuple(range(2, budget + 2))
    got = widths.realised_accepts(torch.from_numpy(acc.accepted), tiers)
    for j, w in enumerate(tiers):
        own = reference.accept_greedy(reference.cut_trees(full, w), logits[:, :w], depth)
        assert np.array_equal(got[:, j].numpy(), own.accept_lens), w


def test_parse_widths():
    assert widths.parse_widths(None) == widths.DEFAULT_WIDTHS == (16, 32, 48, 64)
    assert widths.parse_widths(" 48,16 ") == (16, 48)
    for bad, words in (("16,x", "integers"), ("1,16", "outside"), ("16,16", "repeats"),
                       (",".join(str(w) for w in range(2, 12)), "tiers")):
        with pytest.raises(ValueError, match=words) as err:
            widths.parse_widths(bad)
        assert widths.WIDTHS_ENV in str(err.value)


def test_best_width_takes_the_best_rate_and_the_smaller_on_ties():
    assert widths.best_width({16: 4.0, 32: 6.0}, {16: 1.0, 32: 1.2}) == 32
    assert widths.best_width({16: 4.0, 32: 8.0}, {16: 1.0, 32: 2.0}) == 16
    assert widths.best_width({16: 4.0, 32: 9.0}, {32: 2.0}) == 32  # 16 has no time yet
    with pytest.raises(ValueError):
        widths.best_width({16: 1.0}, {16: 0.0})


@pytest.mark.parametrize("flag, env, width, written", [
    (None, None, 64, "16,32,48,64"), (None, "8,24", 24, "8,24"), (65, None, 65, "65"), (32, "16,32", 32, "16,32")])
def test_resolve_widths(monkeypatch, flag, env, width, written):
    if env is None:
        monkeypatch.delenv(widths.WIDTHS_ENV, raising=False)
    else:
        monkeypatch.setenv(widths.WIDTHS_ENV, env)
    assert spec.resolve_widths(flag) == width
    import os

    assert os.environ[widths.WIDTHS_ENV] == written
    assert spec.resolve_widths(width) == width  # resolving again (another process) agrees


def test_resolve_widths_refuses_a_flag_that_disagrees_with_the_tiers(monkeypatch):
    monkeypatch.setenv(widths.WIDTHS_ENV, "16,32")
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 65 pins one verify width"):
        spec.resolve_widths(65)
    monkeypatch.setenv("SGLANG_KDTREE_WIDTH_POLICY", "fastest")
    with pytest.raises(ValueError, match="SGLANG_KDTREE_WIDTH_POLICY='fastest'"):
        spec.resolve_widths(None)


def test_geometry_shapes():
    g = Geometry(budget=63, block_size=16, vocab_size=100, widths=(16, 32, 64))
    assert g.tiers == (16, 32, 64) and g.verify_width == 64
    s = g.shape(16)
    assert (s.budget, s.width, s.k, s.depths, s.tiers, s.is_cut) == (63, 16, 63, 15, (16, 32, 64), True)
    assert Geometry(budget=4, block_size=8, vocab_size=3).shape().k == 3
    with pytest.raises(ValueError, match="include"):
        Geometry(budget=63, block_size=16, widths=(16, 32))
    with pytest.raises(ValueError, match="verify width 65"):
        g.shape(65)


# -- the width choice -----------------------------------------------------------------------------------------


class _Clock:
    """A width-choice timer whose rounds take ``seconds`` each and land on the device only when the test says
    (``hold``: rounds recorded from now on stay in flight until ``land()``)."""

    def __init__(self):
        self.seconds, self.hold, self._in_flight = 1.0, False, []

    def start(self):
        return "start"

    def stop(self, started, stats):
        ticket = {"stats": stats.clone(), "seconds": self.seconds, "landed": not self.hold}
        self._in_flight.append(ticket)
        return ticket

    def ready(self, ticket):
        return ticket["landed"]

    def wait(self, ticket):
        ticket["landed"] = True

    def read(self, ticket):
        return ticket["stats"].tolist(), ticket["seconds"]

    def land(self):
        for ticket in self._in_flight:
            ticket["landed"] = True


def _run_round(chooser, clock, width, rng, bs=8, q=0.7, p=0.7, depth=15):
    expected, accepted = _chain_round(rng, bs, depth, q, p)
    chooser.record(width, bs, 800, chooser.start(), expected, accepted)


def _chain_round(rng, bs, depth, q, p):
    """A chain drafter claiming per-depth acceptance q; the target accepts each next depth with probability p."""
    scores = np.zeros((bs, depth + 1))
    scores[:, 1:] = np.arange(1, depth + 1) * math.log(q)
    expected = widths.expected_accepts(torch.from_numpy(scores), torch.full((bs,), depth), (4, 8, depth + 1))
    accepted = np.full((bs, depth + 1), -1)
    for b in range(bs):
        k = 0
        while k < depth and rng.random() < p:
            k += 1
        accepted[b, : k + 1] = np.arange(k + 1)
    return expected, torch.from_numpy(accepted)


@pytest.mark.parametrize("q, p", [(0.9, 0.6), (0.5, 0.8)])  # over- and under-confident
def test_calibration_converges_to_the_true_ratio(q, p):
    depth, tiers = 15, (4, 8, 16)
    clock = _Clock()
    chooser = WidthChooser(tiers, policy="cycle", timer=clock)
    rng = np.random.default_rng(0)
    for r in range(1500):
        _run_round(chooser, clock, tiers[r % 3], rng, q=q, p=p, depth=depth)
        chooser.settle()
    for w, ratio in zip(tiers, chooser.calibration()):
        want = sum(p ** d for d in range(1, w)) / sum(q ** d for d in range(1, w))
        assert abs(ratio - want) <= 0.1 * want, (w, ratio, want)
    assert abs(ratio - 1.0) > 0.2  # the test distinguishes a miscalibrated drafter


def _choose_rounds(chooser, clock, seconds, rounds, rng):
    """The worker's order per round: settle, choose, start, (the round), record. Returns the widths chosen."""
    chosen = []
    for _ in range(rounds):
        chooser.settle()
        w = chooser.choose(8, 800)
        chosen.append(w)
        clock.seconds = seconds[w]
        _run_round(chooser, clock, w, rng)
    return chosen


def test_the_choice_explores_every_tier_then_takes_the_best_rate():
    tiers = (4, 8, 16)
    clock = _Clock()
    chooser = WidthChooser(tiers, timer=clock)
    seconds = {4: 1.0, 8: 1.1, 16: 2.5}  # the widest tier is slow: at p = 0.7, width 8 commits the most per second
    chosen = _choose_rounds(chooser, clock, seconds, 60, np.random.default_rng(1))
    assert chosen[:6] == [4, 4, 8, 8, 16, 16]  # each tier: a warm-up round, then a timed one
    rate = {w: (1 + sum(0.7 ** d for d in range(1, w))) / seconds[w] for w in tiers}
    assert max(rate, key=rate.get) == 8
    assert set(chosen[10:]) == {8}
    assert chooser.last["width"] == 8 and chooser.last["realised"] >= 1.0 and chooser.last["round_ms"] == 1100.0


@pytest.mark.parametrize("stated, seconds, want", [
    ({4: 2.0, 8: 3.0, 16: 3.5}, {4: 1.0, 8: 1.4, 16: 2.0}, 8),  # rates 2.0 / 2.14 / 1.75
    ({4: 2.0, 8: 3.0, 16: 5.0}, {4: 1.0, 8: 1.4, 16: 2.0}, 16),  # rates 2.0 / 2.14 / 2.5
    ({4: 2.0, 8: 2.0, 16: 2.0}, {4: 1.0, 8: 1.0, 16: 1.0}, 4),  # ties: the smaller
])
def test_a_stated_curve_replaces_the_drafters_expectation(stated, seconds, want):
    """The bench hook: the choice follows the stated accept lengths under the measured times, whatever the
    drafter claims (p = q = 0.7 here would pick 8 under the first times) and whatever is realised."""
    clock = _Clock()
    chooser = WidthChooser((4, 8, 16), timer=clock, stated_tau=stated)
    chosen = _choose_rounds(chooser, clock, seconds, 40, np.random.default_rng(3))
    assert chosen[:6] == [4, 4, 8, 8, 16, 16] and set(chosen[10:]) == {want}
    assert chooser.expected_tokens() == stated


def test_parse_stated_tau_refuses_what_it_cannot_use():
    assert parse_stated_tau(None, (16, 32)) is None and parse_stated_tau(" ", (16, 32)) is None
    assert parse_stated_tau("32=6.5,16=6.03", (16, 32)) == {16: 6.03, 32: 6.5}
    for bad, says in (("16=6,32", "is not WIDTH=TAU"), ("16=0.5,32=2", "needs a tau"), ("16=x,32=2", "is not WIDTH=TAU"),
                      ("16=6", "server's verify widths are [16, 32]"), ("16=6,32=7,64=8", "states widths")):
        with pytest.raises(ValueError, match=STATED_TAU_ENV) as err:
            parse_stated_tau(bad, (16, 32))
        assert says in str(err.value)


def test_a_choice_sees_only_the_rounds_that_have_landed():
    """Under overlap the round before is still on the device when the next width is chosen: nothing waits for
    it. Rounds in flight are not folded in (a cell keeps exploring the same untimed tier), and once they land
    they are folded in oldest first, each with its own width and time."""
    tiers = (4, 8, 16)
    clock = _Clock()
    chooser = WidthChooser(tiers, timer=clock)
    rng = np.random.default_rng(2)
    clock.hold = True
    chosen = _choose_rounds(chooser, clock, {4: 1.0, 8: 2.0, 16: 3.0}, 5, rng)
    assert chosen == [4] * 5 and chooser.pending == 5 and chooser.last == {}  # nothing landed: still exploring 4
    clock.land()
    clock.hold = False
    chooser.settle()
    assert chooser.pending == 0 and chooser.last["width"] == 4 and chooser.last["round_ms"] == 1000.0
    # the first landed round of the tier was the warm-up, the next four timed it
    assert _choose_rounds(chooser, clock, {4: 1.0, 8: 2.0, 16: 3.0}, 4, rng) == [8, 8, 16, 16]


def test_settle_folds_in_launch_order_and_stops_at_the_first_round_in_flight():
    clock = _Clock()
    chooser = WidthChooser((4, 8, 16), policy="cycle", timer=clock)
    rng = np.random.default_rng(3)
    _run_round(chooser, clock, 4, rng)  # landed
    clock.hold = True
    _run_round(chooser, clock, 8, rng)  # in flight
    clock.hold = False
    _run_round(chooser, clock, 16, rng)  # landed, but after one in flight
    chooser.settle()
    assert chooser.pending == 2 and chooser.last["width"] == 4
    chooser.settle(wait=True)  # the round log's wait: everything, in order
    assert chooser.pending == 0 and chooser.last["width"] == 16


def test_one_tier_and_cycle():
    assert {WidthChooser((65,)).choose(b, 10 * b) for b in (1, 7, 64)} == {65}
    expected, accepted = torch.full((2, 1), 3.0), torch.tensor([[0, 1, -1], [0, -1, -1]])
    pinned, logged = WidthChooser((65,)), WidthChooser((65,), log_stats=True)
    for chooser in (pinned, logged):
        chooser.record(65, 2, 20, chooser.start(), expected, accepted)
        chooser.settle()
    assert pinned.start() is None and pinned.last == {}
    assert logged.last["realised"] == 1.5 and logged.last["predicted_raw"] == 3.0 and logged.last["round_ms"] >= 0
    cyc = WidthChooser((16, 32, 48), policy="cycle")
    got = []
    for _ in range(5):
        got.append(cyc.choose(4, 100))
        cyc.record(got[-1], 4, 100, cyc.start(), None, None)
    assert got == [16, 32, 48, 16, 32]
    with pytest.raises(ValueError, match="SGLANG_KDTREE_WIDTH_POLICY"):
        WidthChooser((16,), policy="fastest")


def test_the_device_timer_reuses_its_ring_and_a_retried_rounds_slot():
    """The CUDA timer's bookkeeping, on stand-in events: a round that starts and never stops (it raised and was
    retried) leaves its slot to the next start; a ring with every slot in flight measures nothing; a slot is
    read once its end event has completed, and its time is the events' own."""
    from sglang_kdtree.round.width_choice import DeviceTimer

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at, self.done = None, False

        def record(self):
            self.at, self.done = len(recorded), False
            recorded.append(self)

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return 1000.0 * (end.at - self.at)

    recorded = []
    timer = DeviceTimer("cpu", 3, event=Event)
    first = timer.start()
    assert timer.start() == first  # the retry takes the same slot
    tickets = [timer.stop(first, torch.ones(2, 3))] + [timer.stop(timer.start(), torch.ones(2, 3))
                                                       for _ in range(DeviceTimer.RING - 1)]
    assert sorted(tickets) == list(range(DeviceTimer.RING)) and timer.start() is None
    assert not timer.ready(tickets[0])
    for event in recorded:
        event.done = True
    assert timer.ready(tickets[0])
    stats, seconds = timer.read(tickets[0])
    assert stats == [[1.0] * 3] * 2 and seconds == 1.0  # from the retry's start (event 1) to its end (event 2)
    assert timer.start() == tickets[0]


class _SpecStandIn:
    """Stands in for SGLang's runtime-context spec bag (``sglang.srt.runtime_context.get_spec()``), which a server
    publishes at startup: only ``override(speculative_num_draft_tokens=...)``; anything else raises by name."""

    def override(self, **kw):
        import contextlib

        if set(kw) != {"speculative_num_draft_tokens"}:
            raise AttributeError(f"spec stand-in: override({', '.join(kw)}) is not stood in for")
        return contextlib.nullcontext()

    def __getattr__(self, name):
        raise AttributeError(f"spec stand-in: {name} is not stood in for")


@pytest.mark.parametrize("message, ours", [("CUDA out of memory. Tried to allocate 2.00 GiB", True),
                                           ("CUDA error: an illegal memory access", False)])
def test_a_tier_that_runs_out_of_memory_fails_naming_what_to_lower(monkeypatch, message, ours):
    """An extra tier whose backend or graphs cannot be allocated stops the startup with the settings that size it
    (the tiers' variable, the decode graphs' batch, the static memory fraction), the runner's state put back; any
    other error passes through as it was."""
    import sglang.srt.runtime_context as rc

    from sglang_kdtree.round import verify_tiers

    monkeypatch.setattr(rc, "get_spec", lambda: _SpecStandIn())

    class Runner:  # a model runner whose attention backend for the width cannot be allocated
        device, attn_backend, decode_cuda_graph_runner, init_new_workspace = "cpu", "sglang's", None, False

        def _get_attention_backend(self, init_new_workspace):
            self.attn_backend, self.init_new_workspace = "half built", init_new_workspace
            raise (torch.OutOfMemoryError if ours else RuntimeError)(message)

    runner = Runner()
    with pytest.raises(RuntimeError) as info:
        verify_tiers.VerifyTiers(runner, (16, 32, 64))
    if ours:
        text = str(info.value)
        assert text.startswith("KDTREE: building the extra verify tier of width 16 ran out of GPU memory")
        assert "SGLANG_KDTREE_VERIFY_WIDTHS, now 16,32,64" in text and "--cuda-graph-max-bs-decode" in text
        assert "--mem-fraction-static" in text and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    else:
        assert str(info.value) == message
    assert (runner.attn_backend, runner.init_new_workspace) == ("sglang's", False)
    assert "MiB were free before it" in verify_tiers.out_of_memory(16, (16, 32), 3 * 2**30)
    assert "were free" not in verify_tiers.out_of_memory(16, (16, 32), None)
