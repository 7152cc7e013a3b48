"""The worker's two backends agree: ``pipeline.GpuBackend`` (the CUDA kernels, as the worker calls them)
against ``pipeline.ReferenceBackend`` (the numpy oracle) over one whole round on the same inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_kdtree.round import pipeline
from sglang_kdtree.state import RoundShape

pytestmark = pytest.mark.gpu

TREE_FIELDS = ("tokens", "depths", "parents", "num_nodes")
VERIFY_FIELDS = ("input_ids", "positions", "full_mask", "ancestor_bits", "retrieve_index", "retrieve_next_token",
                 "retrieve_next_sibling")


def target_following_the_tree(trees, vocab, agree, gen):
    """Target logits [bs, N, V] whose argmax at a node is one of its children's tokens with probability
    `agree` (any child, not only the first), else a random token."""
    bs, width = trees.tokens.shape
    logits = torch.randn((bs, width, vocab), generator=gen)
    for b in range(bs):
        n = int(trees.num_nodes[b])
        children = {}
        for i in range(1, n + 1):
            children.setdefault(int(trees.parents[b, i]), []).append(i)
        for node in range(width):
            kids = children.get(node)
            if kids and float(torch.rand((), generator=gen)) < agree:
                pick = kids[int(torch.randint(len(kids), (), generator=gen))]
                logits[b, node, int(trees.tokens[b, pick])] += 40.0
            else:
                logits[b, node, int(torch.randint(vocab, (), generator=gen))] += 40.0
    return logits


@pytest.mark.parametrize("bs, budget, depths, vocab", [(1, 1, 1, 64), (3, 16, 7, 1000), (8, 64, 15, 5003),
                                                       (4, 255, 15, 30011)])
def test_gpu_backend_round_equals_reference_backend(bs, budget, depths, vocab):
    gen = torch.Generator().manual_seed(bs * 1000 + budget)
    ref = pipeline.ReferenceBackend(torch.device("cpu"))
    gpu = pipeline.select_backend(torch.device("cuda"))
    assert isinstance(gpu, pipeline.GpuBackend)
    cuda = torch.device("cuda")

    # top-K (tie-heavy logits: multiples of 1/4), directly and through the tensor-parallel path of one rank
    logits = torch.round(torch.randn((bs, depths, vocab), generator=gen) * 12) / 4
    k = min(budget, vocab)
    lp_r, id_r = ref.topk(logits, k)
    lp_g, id_g = gpu.topk(logits.to(cuda), k)
    assert torch.equal(id_g.cpu(), id_r)
    torch.testing.assert_close(lp_g.cpu(), lp_r, rtol=0, atol=2e-6)
    lp_tp, id_tp = pipeline.vocab_parallel_topk(logits.to(cuda).view(-1, vocab), k, 0, gpu)
    assert torch.equal(id_tp.cpu().view(bs, depths, -1), id_r)

    # the tree, from the same log-probs, must match bit for bit
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    tr = ref.build(lp_r, id_r, budget, roots)
    tg = gpu.build(lp_r.to(cuda), id_r.to(cuda), budget, roots.to(cuda))
    for field in TREE_FIELDS:
        assert torch.equal(getattr(tg, field).cpu(), getattr(tr, field)), field

    seq_lens = torch.randint(0, 300, (bs,), generator=gen)
    vr = ref.verify_inputs(tr, seq_lens, int(seq_lens.sum()))
    vg = gpu.verify_inputs(tg, seq_lens.to(cuda), seq_lens_sum=int(seq_lens.sum()))
    for field in VERIFY_FIELDS:
        assert torch.equal(getattr(vg, field).cpu().to(getattr(vr, field).dtype), getattr(vr, field)), field

    # accept along target logits that follow the tree through random siblings
    target = target_following_the_tree(tr, vocab, 0.8, gen)
    ar = ref.accept_greedy(tr, target, depths)
    ag = gpu.accept_greedy(tg, target.to(cuda), depths)
    assert torch.equal(ag.accepted.cpu(), ar.accepted)
    assert torch.equal(ag.accept_lens.cpu().to(torch.int64), ar.accept_lens)
    assert torch.equal(ag.bonus.cpu().to(torch.int64), ar.bonus)
    for b in range(bs):
        tau = int(ar.accept_lens[b])
        assert torch.equal(ag.committed[b, :tau].cpu(), ar.committed[b, :tau])

    # commit plan over shuffled KV slots
    width = budget + 1
    slots = torch.randperm(10 * bs * width, generator=gen)[: bs * width].view(bs, width)
    cr = ref.commit_plan(ar.accepted, ar.accept_lens, slots)
    cg = gpu.commit_plan(ag.accepted, ag.accept_lens, slots.to(cuda))
    for field in ("src_slots", "dst_slots", "hidden_rows"):
        assert torch.equal(getattr(cg, field).cpu().to(torch.int64), getattr(cr, field)), field


def _poison_backend(gpu):
    """Every reserved buffer filled with what no step writes: NaN, -3 (the only negative id / link is -1) and,
    for the FULL_MASK, raw bytes 0x5A (a written byte is 0 or 1)."""
    b = gpu._builder
    tensors = [b.logprobs, b.token_ids, gpu._accept_storage, gpu._plan_storage, gpu._hidden_storage]
    tensors += [getattr(b.trees, f.name) for f in dataclasses.fields(b.trees)]
    tensors += [getattr(b.verify, f.name) for f in dataclasses.fields(b.verify)]
    for t in tensors:
        if t.dtype == torch.bool:
            t.view(torch.uint8).fill_(0x5A)
        else:
            t.fill_(float("nan") if t.is_floating_point() else -3)


def _assert_verify_equal(vg, vr):
    """GPU verify inputs equal the reference's; the FULL_MASK compared as bytes (a poisoned byte is not 0 or 1)."""
    for field in VERIFY_FIELDS:
        got, want = getattr(vg, field).cpu(), getattr(vr, field)
        if field == "full_mask":
            got, want = got.view(torch.uint8), want.to(torch.uint8)
        assert torch.equal(got.to(want.dtype), want), field


def test_reserved_gpu_backend_reuses_its_buffers_and_equals_the_reference():
    """The worker's path: ``reserve`` then bf16 draft logits as they are, rounds of growing batch and context
    into the same (poisoned) buffers; every step equals the reference, and a round that fits allocates
    nothing new (same storage addresses)."""
    cuda = torch.device("cuda")
    ref = pipeline.ReferenceBackend(torch.device("cpu"))
    gpu = pipeline.select_backend(cuda)
    budget, depths, vocab = 24, 7, 3001
    width = budget + 1
    addresses = None
    for round_no, (bs, max_len) in enumerate([(2, 50), (5, 400), (3, 100), (5, 400)]):
        gen = torch.Generator().manual_seed(100 * bs + max_len)  # rounds 1 and 3: the same inputs
        seq_lens = torch.randint(1, max_len, (bs,), generator=gen)
        gpu.reserve(bs, budget, depths, vocab, mask_bytes=int(seq_lens.sum()) * width + width * width * bs)
        _poison_backend(gpu)
        logits = (torch.randn((bs, depths, vocab), generator=gen) * 3).to(torch.bfloat16)
        lp_r, id_r = ref.topk(logits, budget)
        lp_g, id_g = gpu.topk(logits.to(cuda), budget)
        assert torch.equal(id_g.cpu(), id_r)
        torch.testing.assert_close(lp_g.cpu(), lp_r, rtol=0, atol=2e-6)
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        tr = ref.build(lp_r, id_r, budget, roots)
        tg = gpu.build(lp_g, id_g, budget, roots.to(cuda))
        for field in TREE_FIELDS:
            assert torch.equal(getattr(tg, field).cpu(), getattr(tr, field)), field
        vr = ref.verify_inputs(tr, seq_lens, int(seq_lens.sum()))
        vg = gpu.verify_inputs(tg, seq_lens.to(cuda), seq_lens_sum=int(seq_lens.sum()))
        _assert_verify_equal(vg, vr)
        target = target_following_the_tree(tr, vocab, 0.8, gen)
        ar = ref.accept_greedy(tr, target, depths)
        ag = gpu.accept_greedy(tg, target.to(cuda), depths)
        assert torch.equal(ag.accept_lens.cpu(), ar.accept_lens)
        assert torch.equal(ag.accepted.cpu(), ar.accepted)
        slots = torch.randperm(10 * bs * width, generator=gen)[: bs * width].view(bs, width)
        cr = ref.commit_plan(ar.accepted, ar.accept_lens, slots)
        cg = gpu.commit_plan(ag.accepted, ag.accept_lens, slots.to(cuda))
        for field in ("src_slots", "dst_slots", "hidden_rows"):
            assert torch.equal(getattr(cg, field).cpu(), getattr(cr, field)), field
        hidden = torch.randn((bs * width, 64), generator=gen).to(torch.bfloat16)
        hr = ref.gather_hidden(hidden, cr, width)
        hg = gpu.gather_hidden(hidden.to(cuda), cg, width).cpu()
        for b in range(bs):
            tau = int(ar.accept_lens[b])
            assert torch.equal(hg[b, :tau], hr[b, :tau])
        assert int(gpu.tree_errors.item()) == 0 and int(gpu.commit_errors.item()) == 0
        now = (lp_g.data_ptr(), tg.tokens.data_ptr(), vg.full_mask.data_ptr(), ag.accepted.data_ptr(),
               cg.src_slots.data_ptr(), hg.shape)
        if round_no == 3:
            assert now[:5] == addresses[:5], "a round that fits the reserved buffers must not reallocate"
        addresses = now


def _tree_step_graph_check():
    """The worker's GPU tree step: head GEMM -> top-K -> tree -> verify inputs captured in a CUDA graph per batch
    size and replayed on fresh inputs (batch sizes and contexts that shrink, grow past the reservation and come
    back), into poisoned buffers; every replay equals the reference backend's eager steps on the same bf16 head
    logits."""
    cuda = torch.device("cuda")
    ref = pipeline.ReferenceBackend(torch.device("cpu"))
    gpu = pipeline.select_backend(cuda)
    budget, depths, vocab, padded, hidden = 32, 7, 5003, 5120, 64
    width = budget + 1
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn((padded, hidden), generator=gen) / 4).to(torch.bfloat16)
    weight[vocab:] = 50.0  # the padded head rows must never become candidates
    weight_g = weight.to(cuda)
    query = torch.cuda.Stream.query
    for round_no, (bs, max_len) in enumerate([(4, 30), (2, 30), (4, 20), (9, 300), (2, 10), (9, 300), (9, 250)]):
        seq_lens = torch.randint(1, max_len, (bs,), generator=gen)
        total = int(seq_lens.sum())
        # one FULL_MASK capacity for every round, so only the batch size and the builder make new graph keys
        gpu.reserve(bs, budget, depths, vocab, mask_bytes=pipeline.full_mask_numel(9 * 300, width, 9))
        _poison_backend(gpu)
        rows = torch.randn((bs * depths, hidden), generator=gen).to(torch.bfloat16)
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        # both issue orders of TreeStepGraphs.step, whichever the stream's state: the head GEMM first (as on an
        # idle stream) in odd rounds, the host work first (a busy stream) in even ones
        torch.cuda.Stream.query = (lambda self: True) if round_no % 2 else (lambda self: False)
        calls = []
        step = gpu.tree_step(rows.to(cuda), weight_g, RoundShape(budget, width, depths, vocab), roots.to(cuda),
                             seq_lens.to(cuda), total, mark=lambda: calls.append("mark"),
                             prep_mark=lambda: calls.append("prep"))
        tg, vg, lg = step.trees, step.verify, step.draft_logits
        assert calls == ["prep", "mark"], calls  # once each: the round log's tree_prep / draft_head ends
        graphs = gpu._tree_graphs
        assert graphs.disabled_reason is None, graphs.disabled_reason
        logits = lg.cpu()  # the GPU GEMM's bf16 logits: the reference runs the remaining steps on them
        assert logits.shape == (bs * depths, vocab)
        torch.testing.assert_close(logits.double(), (rows.double() @ weight.double().T)[:, :vocab], rtol=0.02,
                                   atol=0.05)
        lp_r, id_r = ref.topk(logits.view(bs, depths, vocab), min(budget, vocab))
        tr = ref.build(lp_r, id_r, budget, roots)
        for field in TREE_FIELDS:
            assert torch.equal(getattr(tg, field).cpu(), getattr(tr, field)), (round_no, field)
        vr = ref.verify_inputs(tr, seq_lens, total)
        for field in VERIFY_FIELDS:
            assert torch.equal(getattr(vg, field).cpu().to(getattr(vr, field).dtype), getattr(vr, field)), (
                round_no, field)
    # captures: rounds 0 (bs 4), 1 (bs 2), 3 (bs 9: a new builder drops the graphs), 4 (bs 2 again); replays:
    # rounds 2, 5, 6
    assert (graphs.replays, graphs.captures) == (3, 4), (graphs.replays, graphs.captures)
    assert graphs.head_first == 3, graphs.head_first  # rounds 1, 3, 5
    torch.cuda.Stream.query = query
    assert int(gpu.tree_errors.item()) == 0
    te = gpu.tree_step(rows.to(cuda), weight_g, RoundShape(budget, width, depths, vocab), roots.to(cuda),
                       seq_lens.to(cuda), total, graph=False).trees
    for field in TREE_FIELDS:
        assert torch.equal(getattr(te, field).cpu(), getattr(tr, field)), field
    print("TREE-STEP-GRAPH-OK", graphs.replays, graphs.captures)


@pytest.mark.parametrize("width", [2, 8, 16, 33])
def test_tree_step_graph_cut_is_the_references_cut(width):
    """A round verifying ``width`` rows of the budget-32 tree, replayed from its graph: the trees, verify inputs and
    expected accepts equal the reference's cut (the budget-``width - 1`` tree) exactly / within float32."""
    cuda = torch.device("cuda")
    ref = pipeline.ReferenceBackend(torch.device("cpu"))
    gpu = pipeline.select_backend(cuda)
    budget, depths, vocab, hidden, bs = 32, 7, 3001, 64, 5
    tiers = (2, 8, 16, 33)
    gen = torch.Generator().manual_seed(width)
    weight = (torch.randn((vocab, hidden), generator=gen) / 4).to(torch.bfloat16)
    seq_lens = torch.randint(1, 60, (bs,), generator=gen)
    total = int(seq_lens.sum())
    gpu.reserve(bs, budget, depths, vocab, mask_bytes=pipeline.full_mask_numel(total, budget + 1, bs))
    shape = RoundShape(budget, width, depths, vocab, tiers)
    for _ in range(3):  # eager + capture, then replays
        rows = torch.randn((bs * depths, hidden), generator=gen).to(torch.bfloat16)
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        step = gpu.tree_step(rows.to(cuda), weight.to(cuda), shape, roots.to(cuda), seq_lens.to(cuda), total)
        want = ref.tree_step(step.draft_logits.cpu(), torch.eye(vocab, dtype=torch.bfloat16), shape, roots, seq_lens,
                             total)
        for field in TREE_FIELDS:
            assert torch.equal(getattr(step.trees, field).cpu(), getattr(want.trees, field)), field
        for field in VERIFY_FIELDS:
            assert torch.equal(getattr(step.verify, field).cpu().to(getattr(want.verify, field).dtype),
                               getattr(want.verify, field)), field
        torch.testing.assert_close(step.expected.cpu(), want.expected, rtol=1e-5, atol=1e-5)
    assert gpu._tree_graphs.replays >= 2 and gpu._tree_graphs.disabled_reason is None


def _mla_pool(rows: int, layers: int, gen):
    """An SGLang ``MLATokenToKVPool`` holding only what ``compact_kv``'s table reads (``kv_buffer``, page size 1),
    built without its constructor (test-only: the constructor wants a model runner's memory settings)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool.__new__(MLATokenToKVPool)
    pool.page_size, pool.layer_num, pool.k_scale_buffer = 1, layers, None
    pool.kv_buffer = [torch.randn((rows, 1, 576), generator=gen).to(torch.bfloat16).cuda() for _ in range(layers)]
    return pool


def _accept_commit_graph_check():
    """The worker's greedy accept -> commit plan -> KV move -> hidden gather, replayed from a CUDA graph per key
    while the target logits and hidden states sit at fixed addresses (as SGLang's replayed verify graph leaves
    them): every round's KV rows and hidden rows equal an independent walk over the reference's accept result."""
    cuda = torch.device("cuda")
    ref = pipeline.ReferenceBackend(torch.device("cpu"))
    gpu = pipeline.select_backend(cuda)
    budget, depths, vocab, d = 24, 7, 3001, 32
    width = budget + 1
    gen = torch.Generator().manual_seed(11)
    pool = _mla_pool(4096, 2, gen)
    static = {}
    for round_no, bs in enumerate([3, 3, 3, 5, 3, 5]):
        gpu.reserve(bs, budget, depths, vocab, mask_bytes=1)
        lp_r, id_r = ref.topk(torch.randn((bs, depths, vocab), generator=gen) * 3, budget)
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        tr = ref.build(lp_r, id_r, budget, roots)
        tg = gpu.build(lp_r.cuda(), id_r.cuda(), budget, roots.cuda())
        target = target_following_the_tree(tr, vocab, 0.8, gen)
        hidden = torch.randn((bs * width, d), generator=gen).to(torch.bfloat16)
        if bs not in static:  # one fixed logits / hidden buffer per batch size, like a graph runner's outputs
            static[bs] = (torch.empty((bs, width, vocab), device=cuda), torch.empty((bs * width, d), device=cuda,
                                                                                   dtype=torch.bfloat16))
        logits_g, hidden_g = static[bs]
        logits_g.copy_(target)
        hidden_g.copy_(hidden)
        slots = torch.randperm(4096, generator=gen)[: bs * width].view(bs, width)
        before = [layer.cpu().clone() for layer in pool.kv_buffer]
        acc, plan, rows = gpu.accept_commit_greedy(tg, logits_g, depths, slots.cuda(), pool, hidden_g, width,
                                                   graph=True)
        ar = ref.accept_greedy(tr, target, depths)
        assert torch.equal(acc.accepted.cpu(), ar.accepted), round_no
        rows = rows.cpu()
        for b in range(bs):
            tau = int(ar.accept_lens[b])
            for i, node in enumerate(ar.accepted[b, :tau].tolist()):
                for layer, old in zip(pool.kv_buffer, before):
                    assert torch.equal(layer[int(slots[b, i])].cpu(), old[int(slots[b, node])]), (round_no, b, i)
                assert torch.equal(rows[b, i], hidden[b * width + node]), (round_no, b, i)
    graphs = gpu._commit_graphs
    assert graphs.disabled_reason is None, graphs.disabled_reason
    # captures: rounds 0 (bs 3), 3 (bs 5: a new builder drops the graphs), 4 (bs 3 again); replays: 1, 2, 5
    assert (graphs.replays, graphs.captures) == (3, 3), (graphs.replays, graphs.captures)
    assert int(gpu.commit_errors.item()) == 0
    print("ACCEPT-COMMIT-GRAPH-OK", graphs.replays, graphs.captures)


def _in_fresh_interpreter(check: str, expect: str):
    """Run ``check`` of this file in its own interpreter: a CUDA-graph capture that fails inside torch can leave
    the process's CUDA generator in capture state and break every later test."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    code = f"import runpy; runpy.run_path({str(here)!r})[{check!r}]()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(here.parents[2]), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and expect in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_tree_step_graph_replays_equal_the_reference():
    _in_fresh_interpreter("_tree_step_graph_check", "TREE-STEP-GRAPH-OK")


def test_accept_commit_graph_replays_move_the_accepted_rows():
    _in_fresh_interpreter("_accept_commit_graph_check", "ACCEPT-COMMIT-GRAPH-OK")
