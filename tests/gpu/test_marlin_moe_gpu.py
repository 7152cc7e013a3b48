"""GPU tests of sglang_kdtree.moe (H200): the CuPy glue kernels against their torch twins (exact
tables, exact top-k sum, SiLU within one bf16 ulp), and the whole Marlin W4A16 path against the fp32 float
reference (relative error <= 1e-2 over the output, <= 2e-2 per token; both reduce modes) for small shapes
and Kimi K2.6 at TP 8 and TP 1, token counts 1..1024, routing with repeated, unused and dropped (-1)
experts; also int64 ids, caller-owned output, an id >= num_experts (flagged, route dropped), CUDA-graph
replay and run-to-run determinism of the default reduce. Outputs start from a poisoned allocator. Tests
named *glue* need no Marlin compile; the others build (or load) the Marlin JIT module first (~6 min of nvcc
when SGLang's cache is cold)."""

from __future__ import annotations

import pytest

import cuda_poison
from sglang_kdtree.moe import forward as fwd
from sglang_kdtree.moe import jit, launch
from sglang_kdtree.moe import reference as twin
from sglang_kdtree.moe import routing as moe_routing
from sglang_kdtree.moe import weights as mw

pytestmark = pytest.mark.gpu

#: The accuracy bar: ||ours - ref|| / ||ref|| over the whole output vs the fp32 reference, for the default
#: (fp32) reduce.
REL_TOL = 1e-2
#: Per-token bound, to catch a single broken token: our path (like SGLang's) rounds the gate/up output, the
#: SiLU*up intermediate and each route's output to bf16 while the reference stays fp32; the H200 accuracy
#: sweep (benchmarks/RESULTS.md) saw per-token errors up to 8.8e-3 with the fp32 reduce, so per token the
#: bound is twice the global one.
TOKEN_REL_TOL = 2e-2
#: The opt-in "atomic" reduce adds one bf16 rounding per K-slice: measured up to 1.21e-2 (above REL_TOL,
#: which is why it is not the default); checked against twice the bar so a broken kernel still fails.
ATOMIC_REL_TOL = 2e-2


def _torch():
    import torch

    return torch


def poison_allocator():
    """Fill freed cache blocks (both of the allocator's pools) with garbage so torch.empty buffers (and our
    outputs) start poisoned: bf16 0x7F7F is a huge value."""
    cuda_poison.poison_allocator(0x7F, large_bytes=256 << 20)


def routing(M, top_k, E, kind, seed):
    """topk_ids [M, top_k] int32 and topk_weights [M, top_k] float32 (positive, rows sum to 1).

    kinds: random (distinct experts per token, DeepSeek-like), hot (every token picks the same top_k
    experts: one tall block per expert), skewed (expert 0 in every token), padded (random, a third of the
    tokens have -1 everywhere like SGLang's padded rows, and one route of token 0 is dropped), repeat
    (a token lists the same expert twice).
    """
    torch = _torch()
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    scores = torch.rand((M, E), device="cuda", generator=g)
    if kind == "hot":
        scores = scores * 0 + torch.arange(E, 0, -1, device="cuda", dtype=torch.float32)
    if kind == "skewed":
        scores[:, 0] = 2.0
    ids = torch.topk(scores, top_k, dim=1).indices.to(torch.int32)
    if kind == "padded":
        ids[::3] = -1
        ids[0, -1] = -1
    if kind == "repeat" and top_k >= 2:
        ids[:, 1] = ids[:, 0]
    weights = torch.rand((M, top_k), device="cuda", generator=g) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids, weights


def rel_errors(ours, ref):
    """Per-token ||ours - ref|| / ||ref||; tokens whose reference is exactly zero must be exactly zero."""
    torch = _torch()
    diff = (ours.float() - ref).norm(dim=1)
    norm = ref.norm(dim=1)
    zero = norm == 0
    assert torch.all(diff[zero] == 0), "a token with no live route is not zero"
    return diff[~zero] / norm[~zero]


# ------------------------------------------------------------------------------------------------------
# Glue kernels (no Marlin)
# ------------------------------------------------------------------------------------------------------


def _check_alignment(got, want, numel):
    torch = _torch()
    total = int(want.num_tokens_post_padded[0])
    assert got.num_tokens_post_padded.tolist() == [total, 0]
    block = want.block_size
    assert torch.equal(got.expert_ids[: total // block], want.expert_ids[: total // block])
    # inside an expert's segment the kernel's route order is free: compare (expert, route) multisets, which
    # also pins the sentinel padding count per expert
    expert_of_slot = want.expert_ids[: total // block].to(torch.int64).repeat_interleave(block)

    def keys(align):
        return (expert_of_slot * (numel + 1) + align.sorted_token_ids[:total].to(torch.int64)).sort().values

    assert torch.equal(keys(got), keys(want))
    assert int(got.errors[0]) == int(want.errors[0])
    assert total <= got.sorted_token_ids.numel()
    # Marlin needs each block's live routes first: the sentinel only trails inside a block
    blocks = got.sorted_token_ids[:total].view(-1, block)
    live = blocks < numel
    assert torch.all(live[:, :-1] | ~live[:, 1:]), "a live route follows padding inside a block"


@pytest.mark.parametrize("block", moe_routing.BLOCK_SIZES_M)
@pytest.mark.parametrize(
    "M, top_k, E, kind",
    [(1, 8, 384, "random"), (7, 8, 384, "random"), (65, 8, 384, "skewed"), (130, 8, 48, "hot"),
     (1024, 8, 384, "random"), (520, 8, 384, "padded"), (33, 4, 16, "repeat"), (16384, 8, 384, "random"),
     (3, 1, 1, "random"), (9, 8, 4096, "random")],
)
def test_glue_moe_align_matches_reference(M, top_k, E, kind, block):
    torch = _torch()
    poison_allocator()
    ids, _ = routing(M, top_k, E, kind, seed=M * 31 + E)
    want = twin.moe_align_reference(ids, E, block)
    got = launch.moe_align_block_size(ids, E, block)
    _check_alignment(got, want, ids.numel())
    got64 = launch.moe_align_block_size(ids.to(torch.int64), E, block)
    _check_alignment(got64, want, ids.numel())


def test_glue_moe_align_all_dropped_and_bad_ids():
    torch = _torch()
    ids = torch.full((5, 8), -1, dtype=torch.int32, device="cuda")
    got = launch.moe_align_block_size(ids, 16, 16)
    assert got.num_tokens_post_padded.tolist() == [0, 0] and int(got.errors[0]) == 0
    ids[1, 3] = 16  # == num_experts
    ids[2, 0] = 3
    got = launch.moe_align_block_size(ids, 16, 16)
    assert int(got.errors[0]) == moe_routing.ERR_EXPERT_ID
    assert got.num_tokens_post_padded.tolist() == [16, 0]
    assert got.sorted_token_ids[:16].tolist() == [16] + [40] * 15
    with pytest.raises(ValueError, match="dropped"):
        moe_routing.raise_on_route_error(got.errors)


@pytest.mark.parametrize("rows, n", [(1, 8), (8, 256), (1000, 2048), (4096, 256), (3, 1024)])
def test_glue_silu_and_mul_within_one_ulp(rows, n):
    torch = _torch()
    poison_allocator()
    g = torch.Generator(device="cuda")
    g.manual_seed(rows + n)
    x = (torch.randn((rows, 2 * n), device="cuda", generator=g) * 6).to(torch.bfloat16)
    x[0, :2] = torch.tensor([-120.0, 90.0])  # saturating exp in both directions
    got = launch.silu_and_mul(x)
    want = twin.silu_and_mul_reference(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # |got - want| <= one bf16 ulp of want (expf vs torch's silu may round the last fp32 bit differently)
    ulp = torch.where(want == 0, torch.full_like(want.float(), 2.0**-133),
                      2.0 ** (torch.floor(torch.log2(want.float().abs())) - 7))
    assert torch.all((got.float() - want.float()).abs() <= ulp)
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("M, top_k, K", [(1, 8, 7168), (65, 8, 7168), (1024, 8, 7168), (5, 3, 64)])
def test_glue_moe_topk_sum_is_exact(M, top_k, K):
    torch = _torch()
    poison_allocator()
    E = 384
    ids, _ = routing(M, top_k, E, "padded", seed=M + K)
    if M > 2:
        ids[2, 1] = E + 5  # invalid: skipped like a dropped route
    g = torch.Generator(device="cuda")
    g.manual_seed(K)
    routed = torch.randn((M * top_k, K), device="cuda", generator=g).to(torch.bfloat16)
    # Marlin never writes the rows of dropped or invalid routes: garbage there must not reach the sum.
    dead = (ids < 0) | (ids >= E)
    routed.view(M, top_k, K)[dead] = float("nan")
    for factor in (1.0, 2.827):
        got = launch.moe_topk_sum(routed, ids, E, factor)
        want = twin.moe_topk_sum_reference(routed, ids, E, factor)
        assert not want.isnan().any()
        assert torch.equal(got, want)
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
    assert launch.moe_topk_sum(routed, ids.to(torch.int64), E, 1.5, out=out) is out
    assert torch.equal(out, twin.moe_topk_sum_reference(routed, ids, E, 1.5))


# ------------------------------------------------------------------------------------------------------
# The Marlin path vs the float reference
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marlin_ready():
    seconds = jit.ensure_marlin_kernels("bfloat16")
    print(f"Marlin MoE kernels ready in {seconds:.1f} s")
    return seconds


_WEIGHTS = {}


def weights_for(E, K, N):
    """(PackedMoEWeights, MarlinMoEWeights) per shape, built once per session (TP 1 holds ~17 GB)."""
    if (E, K, N) not in _WEIGHTS:
        if E * K * N > 10**9 or any(e * k * n > 10**9 for e, k, n in _WEIGHTS):
            _WEIGHTS.clear()  # the TP 1 experts (~17 GB with their Marlin copy) are kept alone
            _torch().cuda.empty_cache()
        packed = mw.random_packed_weights(E, K, N, device="cuda", seed=E + K + N)
        _WEIGHTS[(E, K, N)] = (packed, mw.repack_for_marlin(packed))
    return _WEIGHTS[(E, K, N)]


def run_case(E, K, N, M, top_k, kind, factor=2.827, ids_dtype=None, reduce=None):
    torch = _torch()
    packed, marlin = weights_for(E, K, N)
    ids, weights = routing(M, top_k, E, kind, seed=M * 7 + N)
    if ids_dtype is not None:
        ids = ids.to(ids_dtype)
    g = torch.Generator(device="cuda")
    g.manual_seed(M + K)
    x = torch.randn((M, K), device="cuda", generator=g).to(torch.bfloat16)
    poison_allocator()
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    ours = fwd.fused_moe_marlin(x, marlin, weights, ids, factor, errors=errors, reduce=reduce)
    ref = twin.fused_moe_reference(x, packed, weights, ids, factor)
    assert int(errors[0]) == 0
    assert ours.shape == (M, K) and ours.dtype == torch.bfloat16
    assert torch.isfinite(ours).all()
    rel = rel_errors(ours, ref)
    assert rel.numel() == 0 or float(rel.max()) <= TOKEN_REL_TOL, f"max per-token rel error {float(rel.max()):.3e}"
    total = float((ours.float() - ref).norm() / ref.norm()) if float(ref.norm()) > 0 else 0.0
    bar = ATOMIC_REL_TOL if reduce == "atomic" else REL_TOL
    assert total <= bar, f"rel error {total:.3e} ({reduce or fwd.DEFAULT_REDUCE} reduce)"
    return ours, ref


@pytest.mark.parametrize("M", [1, 2, 8, 33, 65, 130, 520, 1024])
@pytest.mark.parametrize("kind", ["random", "hot", "padded", "repeat"])
@pytest.mark.parametrize("E, K, N, top_k", [(8, 256, 128, 2), (16, 512, 128, 4), (64, 1024, 256, 8)])
@pytest.mark.parametrize("reduce", fwd.REDUCE_MODES)
def test_marlin_small_shapes(marlin_ready, E, K, N, top_k, M, kind, reduce):
    run_case(E, K, N, M, top_k, kind, reduce=reduce)


@pytest.mark.parametrize("M, kind", [(1, "random"), (8, "random"), (32, "skewed"), (65, "random"),
                                     (130, "padded"), (260, "random"), (520, "hot"), (1024, "random")])
@pytest.mark.parametrize("reduce", fwd.REDUCE_MODES)
def test_marlin_kimi_k26_tp8(marlin_ready, M, kind, reduce):
    run_case(384, 7168, 256, M, 8, kind, reduce=reduce)


@pytest.mark.parametrize("M, kind", [(1, "random"), (65, "skewed"), (1024, "random")])
def test_marlin_kimi_k26_tp1(marlin_ready, M, kind):
    run_case(384, 7168, 2048, M, 8, kind)


def test_marlin_int64_ids_out_buffer_and_empty(marlin_ready):
    torch = _torch()
    ours, ref = run_case(64, 1024, 256, 17, 8, "random", ids_dtype=torch.int64)
    packed, marlin = weights_for(64, 1024, 256)
    ids, weights = routing(5, 8, 64, "random", seed=3)
    x = torch.randn((5, 1024), device="cuda").to(torch.bfloat16)
    out = torch.full((5, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert fwd.fused_moe_marlin(x, marlin, weights, ids, 1.0, out=out) is out
    assert float(rel_errors(out, twin.fused_moe_reference(x, packed, weights, ids)).max()) <= REL_TOL
    empty = fwd.fused_moe_marlin(x[:0], marlin, weights[:0], ids[:0])
    assert empty.shape == (0, 1024)


def test_marlin_out_of_range_id_is_flagged_and_dropped(marlin_ready):
    torch = _torch()
    packed, marlin = weights_for(64, 1024, 256)
    ids, weights = routing(6, 8, 64, "random", seed=4)
    x = torch.randn((6, 1024), device="cuda").to(torch.bfloat16)
    bad = ids.clone()
    bad[1, 2] = 64
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    ours = fwd.fused_moe_marlin(x, marlin, weights, bad, 1.0, errors=errors)
    assert int(errors[0]) == moe_routing.ERR_EXPERT_ID
    dropped = ids.clone()
    dropped[1, 2] = -1
    assert float(rel_errors(ours, twin.fused_moe_reference(x, packed, weights, dropped)).max()) <= REL_TOL


def test_marlin_cuda_graph_replay(marlin_ready):
    """SGLang replays verify/decode forwards from CUDA graphs: capture once, replay on new routing."""
    torch = _torch()
    packed, marlin = weights_for(384, 7168, 256)
    M = 65
    ids, weights = routing(M, 8, 384, "random", seed=10)
    x = torch.randn((M, 7168), device="cuda").to(torch.bfloat16)
    fwd.fused_moe_marlin(x, marlin, weights, ids, 2.827)  # warm: NVRTC and JIT loads happen outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fwd.fused_moe_marlin(x, marlin, weights, ids, 2.827)
        with torch.cuda.graph(graph, stream=stream):
            out = fwd.fused_moe_marlin(x, marlin, weights, ids, 2.827)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (11, 12):
        new_ids, new_weights = routing(M, 8, 384, "padded" if seed == 12 else "random", seed=seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn((M, 7168), device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = twin.fused_moe_reference(x, packed, weights, ids, 2.827)
        assert float(rel_errors(out, ref).max()) <= REL_TOL


@pytest.mark.parametrize("M", [1, 8, 65])
def test_marlin_default_reduce_is_deterministic(marlin_ready, M):
    """The default (fp32) reduce adds K-slices in a fixed order: repeated calls are bit-identical, so greedy
    verify sees the same logits every time (the "atomic" mode does not promise this)."""
    torch = _torch()
    assert fwd.DEFAULT_REDUCE == "fp32"
    packed, marlin = weights_for(384, 7168, 256)
    ids, weights = routing(M, 8, 384, "random", seed=M + 99)
    x = torch.randn((M, 7168), device="cuda").to(torch.bfloat16)
    first = fwd.fused_moe_marlin(x, marlin, weights, ids, 2.827)
    for _ in range(20):
        assert torch.equal(fwd.fused_moe_marlin(x, marlin, weights, ids, 2.827), first)
