"""CPU tests of sglang_kdtree.moe: the INT4 format against compressed-tensors' own packer, the glue
references against plain Python loops, the float reference against a dense float64 loop, and the repack
arguments against what SGLang's CompressedTensorsWNA16MoE.process_weights_after_loading hands the same
SGLang functions. The CUDA kernels themselves are compiled with NVRTC here (no GPU needed) so a syntax
error fails on CPU; their numerics are checked in tests/gpu/test_marlin_moe_gpu.py."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang_kdtree.moe import forward as fwd
from sglang_kdtree.moe import launch, routing
from sglang_kdtree.moe import reference as twin
from sglang_kdtree.moe import weights as mw

ROOT = Path(__file__).resolve().parents[1]


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ------------------------------------------------------------------------------------------------------
# INT4 format
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 32), (3, 64, 48), (2, 256, 128)])
def test_pack_int4_matches_compressed_tensors(shape):
    """Our packer on SGLang's transposed layout equals compressed-tensors' pack_to_int32 on the checkpoint
    layout ([out, in], packed along in), transposed; unpack inverts it."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = _gen(sum(shape))
    values = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)  # [..., K, N]
    values.view(-1)[:3] = torch.tensor([-8, 7, 0], dtype=torch.int8)  # both extremes present
    ours = mw.pack_int4(values)
    checkpoint = values.transpose(-2, -1).contiguous()  # [..., N, K]: how the checkpoint stores it
    theirs = pack_to_int32(checkpoint, 4, packed_dim=1).transpose(-2, -1)
    assert ours.dtype == torch.int32
    assert torch.equal(ours, theirs)
    assert torch.equal(mw.unpack_int4(ours), values)


def test_pack_int4_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        mw.pack_int4(torch.full((8, 4), 8, dtype=torch.int8))


def test_quantize_dequantize_round_trip():
    """Independent pack/quantize: codes from our quantizer, packed by compressed-tensors in the checkpoint
    layout, loaded through from_checkpoint, dequantize to exactly code * scale; and the codes reproduce
    the float weights within half a scale step."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    E, K, N, group = 3, 128, 64, 32
    w13 = torch.randn((E, K, 2 * N), generator=_gen(1)) * 0.05
    w2 = torch.randn((E, N, K), generator=_gen(2)) * 0.05
    p13, s13 = mw.quantize_symmetric(w13, group)
    p2, s2 = mw.quantize_symmetric(w2, group)
    for w, p, s in ((w13, p13, s13), (w2, p2, s2)):
        step = s.float().repeat_interleave(group, dim=-2)
        deq = mw.dequantize(p, s, group)
        assert torch.all((deq - w).abs() <= step * 0.5 + 1e-7)
        codes = mw.unpack_int4(p)
        assert torch.equal(deq, codes.float() * step)
    # the checkpoint: per projection [E, out, in/8] packed along in, scales [E, out, in/g]
    codes13, codes2 = mw.unpack_int4(p13), mw.unpack_int4(p2)
    gate_q = pack_to_int32(codes13[:, :, :N].transpose(1, 2).contiguous(), 4, packed_dim=1)
    up_q = pack_to_int32(codes13[:, :, N:].transpose(1, 2).contiguous(), 4, packed_dim=1)
    down_q = pack_to_int32(codes2.transpose(1, 2).contiguous(), 4, packed_dim=1)
    loaded = mw.from_checkpoint(gate_q, up_q, down_q, s13[:, :, :N].transpose(1, 2), s13[:, :, N:].transpose(1, 2),
                                s2.transpose(1, 2), group)
    assert (loaded.num_experts, loaded.hidden_size, loaded.intermediate_size) == (E, K, N)
    assert torch.equal(loaded.w13_packed, p13) and torch.equal(loaded.w2_packed, p2)
    assert torch.equal(loaded.w13_scale, s13) and torch.equal(loaded.w2_scale, s2)
    gate = mw.dequantize(loaded.w13_packed, loaded.w13_scale, group)[:, :, :N]
    assert torch.equal(gate, codes13[:, :, :N].float() * s13[:, :, :N].float().repeat_interleave(group, dim=1))


def test_packed_weights_validate_names_the_problem():
    w = mw.random_packed_weights(2, 64, 64, seed=3)
    w.w2_scale = w.w2_scale[:, :1]
    with pytest.raises(ValueError, match="w2_scale"):
        w.validate()


def test_uint4b8_id_matches_sgl_kernel_scalar_type():
    """The b_q_type shim's id is sgl_kernel's uint4b8 (its scalar_type.py is pure Python; loaded by path so
    the sgl_kernel package, which needs libcuda, is not imported)."""
    spec = importlib.util.find_spec("sgl_kernel")
    path = Path(spec.submodule_search_locations[0]) / "scalar_type.py" if spec else None
    if path is None or not path.is_file():
        pytest.skip("sgl_kernel/scalar_type.py is not installed")
    mod_spec = importlib.util.spec_from_file_location("_sgl_scalar_type_probe", path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = module  # dataclasses resolve their module by name
    try:
        mod_spec.loader.exec_module(module)
    finally:
        sys.modules.pop(mod_spec.name, None)
    assert mw.UINT4B8.id == module.scalar_types.uint4b8.id


# ------------------------------------------------------------------------------------------------------
# Glue references vs plain Python loops
# ------------------------------------------------------------------------------------------------------


def _align_loop(ids, num_experts, block):
    flat = ids.reshape(-1).tolist()
    numel = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        routes = [i for i, x in enumerate(flat) if x == e]
        if not routes:
            continue
        padded = -(-len(routes) // block) * block
        sorted_ids += routes + [numel] * (padded - len(routes))
        expert_ids += [e] * (padded // block)
    return sorted_ids, expert_ids, any(x >= num_experts for x in flat)


def _routing_cases():
    """(topk_ids, num_experts) pairs: DeepSeek-like distinct experts per token at several sizes, a hot
    expert (every route, repeats inside a token), padded tokens (-1), nothing routed, an id >= E."""
    g = _gen(7)
    cases = []
    for M, top_k, E in ((1, 8, 384), (5, 8, 16), (33, 6, 64), (130, 8, 384), (64, 2, 4), (1, 1, 1)):
        ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(M)])
        cases.append((ids.to(torch.int32), E))
    cases.append((torch.zeros((40, 8), dtype=torch.int64), 3))
    mixed = torch.randint(0, 12, (17, 4), generator=g)
    mixed[3] = -1
    mixed[5, 1] = -1
    cases.append((mixed.to(torch.int32), 12))
    cases.append((torch.full((4, 8), -1, dtype=torch.int32), 5))
    bad = torch.randint(0, 9, (9, 4), generator=g)
    cases.append((bad.to(torch.int32), 8))  # some ids == 8 >= E
    return cases


@pytest.mark.parametrize("block", routing.BLOCK_SIZES_M)
@pytest.mark.parametrize("case", range(len(_routing_cases())))
def test_moe_align_reference_matches_loop(case, block):
    ids, E = _routing_cases()[case]
    align = twin.moe_align_reference(ids, E, block)
    want_sorted, want_experts, bad = _align_loop(ids, E, block)
    total = int(align.num_tokens_post_padded[0])
    assert total == len(want_sorted) and int(align.num_tokens_post_padded[1]) == 0
    assert align.sorted_token_ids[:total].tolist() == want_sorted
    assert align.expert_ids[: total // block].tolist() == want_experts
    assert total <= align.sorted_token_ids.numel() == routing.align_capacity(ids.numel(), E, block)
    assert align.sorted_token_ids.numel() % block == 0
    assert int(align.errors[0]) == (routing.ERR_EXPERT_ID if bad else 0)


def test_moe_align_reference_flags_out_of_range_ids():
    ids = torch.tensor([[0, 9], [2, 1]], dtype=torch.int32)
    align = twin.moe_align_reference(ids, 4, 8)
    assert int(align.errors[0]) == routing.ERR_EXPERT_ID
    assert align.sorted_token_ids[: int(align.num_tokens_post_padded[0])].tolist() == (
        [0] + [4] * 7 + [3] + [4] * 7 + [2] + [4] * 7)
    assert align.expert_ids[:3].tolist() == [0, 1, 2]


def test_choose_block_size_m_is_sglang_rule():
    """The literal loop of SGLang's fused_marlin_moe (0.5.23) over a grid of shapes."""

    def sglang_rule(M, topk, E):
        for block_size_m in [8, 16, 32, 48, 64]:
            if M * topk / E / block_size_m < 0.9:
                break
        return block_size_m

    for M in (1, 2, 8, 32, 65, 130, 260, 520, 1024, 4096, 16384):
        for topk, E in ((8, 384), (8, 48), (6, 64), (2, 8)):
            assert routing.choose_block_size_m(M, topk, E) == sglang_rule(M, topk, E), (M, topk, E)


def _bf16_ulp(x):
    return torch.where(x == 0, torch.full_like(x, 2.0**-133), 2.0 ** (torch.floor(torch.log2(x.abs())) - 7))


def test_silu_and_mul_reference_matches_loop():
    g = _gen(11)
    x = (torch.randn((6, 2 * 24), generator=g) * 4).to(torch.bfloat16)
    x[0, 0] = -100.0  # silu underflows to -0
    got = twin.silu_and_mul_reference(x)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 24)
    for r in range(6):
        for c in range(24):
            gate, up = float(x[r, c]), float(x[r, 24 + c])
            want = gate / (1.0 + math.exp(-gate)) * up
            assert abs(float(got[r, c]) - want) <= float(_bf16_ulp(torch.tensor(want))) * 0.5 + 1e-30


def test_moe_topk_sum_reference_matches_loop():
    g = _gen(12)
    M, top_k, K, E = 5, 3, 16, 6
    ids = torch.randint(-1, E + 1, (M, top_k), generator=g)  # includes dropped (-1) and invalid (E) routes
    routed = torch.randn((M * top_k, K), generator=g).to(torch.bfloat16)
    got = twin.moe_topk_sum_reference(routed, ids, E, 2.5)
    # Exact: the loop sums in fp32 in ascending k and rounds once to bf16, as the kernel's contract says.
    for m in range(M):
        for c in range(K):
            acc = np.float32(0.0)
            for k in range(top_k):
                if 0 <= int(ids[m, k]) < E:
                    acc = np.float32(acc + np.float32(float(routed[m * top_k + k, c])))
            want = torch.tensor(float(np.float32(acc * np.float32(2.5))), dtype=torch.float32).to(torch.bfloat16)
            assert float(got[m, c]) == float(want), (m, c)


def test_fused_moe_reference_matches_dense_loop():
    """float64 per-token loop over dense dequantized experts vs the reference's grouped computation."""
    g = _gen(13)
    E, K, N, top_k, M = 6, 64, 32, 3, 7
    w = mw.random_packed_weights(E, K, N, seed=5)
    x = torch.randn((M, K), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(M)]).to(torch.int32)
    ids[2, 1] = -1  # a dropped route
    ids[4] = torch.tensor([5, 5, 1])  # a repeated expert inside one token
    weights = torch.rand((M, top_k), generator=g)
    got = twin.fused_moe_reference(x, w, weights, ids, routed_scaling_factor=2.0)
    w13 = mw.dequantize(w.w13_packed, w.w13_scale).double()
    w2 = mw.dequantize(w.w2_packed, w.w2_scale).double()
    for m in range(M):
        want = torch.zeros(K, dtype=torch.float64)
        for k in range(top_k):
            e = int(ids[m, k])
            if e < 0:
                continue
            h = x[m].double() @ w13[e]
            act = torch.nn.functional.silu(h[:N]) * h[N:]
            want += float(weights[m, k]) * (act @ w2[e])
        assert torch.allclose(got[m].double(), 2.0 * want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# Repack arguments vs SGLang's own process_weights_after_loading
# ------------------------------------------------------------------------------------------------------


def _sglang_marlin_scheme(group_size):
    from types import SimpleNamespace

    from compressed_tensors import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe import (
        CompressedTensorsWNA16MoE,
    )

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, group_size=group_size, strategy="group")
    config = SimpleNamespace(quant_format=CompressionFormat.pack_quantized.value)
    return CompressedTensorsWNA16MoE(config, args)


def test_repack_args_match_sglang_process_weights_after_loading(monkeypatch):
    """Create SGLang's compressed-tensors MoE parameters on CPU, load our PackedMoEWeights into them, run
    process_weights_after_loading with the JIT repack replaced by a recorder, and compare: the recorded
    gptq_marlin_moe_repack calls equal marlin_repack_args' (shapes, dtypes, values, sizes, bits), and the
    scales SGLang permuted equal marlin_moe_permute_scales on our arguments."""
    import sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe as scheme_mod
    from sglang.srt.layers.quantization.marlin_utils import marlin_moe_permute_scales

    E, K, N, group = 4, 256, 128, 32
    packed = mw.random_packed_weights(E, K, N, seed=21)
    scheme = _sglang_marlin_scheme(group)
    layer = torch.nn.Module()
    layer.moe_tp_size = 1
    scheme.create_weights(layer, num_experts=E, hidden_size=K, intermediate_size_per_partition=N,
                          params_dtype=torch.bfloat16)
    # the loaded (transposed) checkpoint: exactly PackedMoEWeights' layout
    for name, value in (("w13_weight_packed", packed.w13_packed), ("w2_weight_packed", packed.w2_packed),
                        ("w13_weight_scale", packed.w13_scale), ("w2_weight_scale", packed.w2_scale)):
        param = getattr(layer, name)
        assert tuple(param.shape) == tuple(value.shape) and param.dtype == value.dtype, name
        param.data.copy_(value)

    calls = []

    def recording_repack(b_q_weight, perm, size_k, size_n, num_bits):
        calls.append((b_q_weight.clone(), perm.clone(), size_k, size_n, num_bits))
        # the shape the JIT repack returns, filled with something traceable
        return torch.full((b_q_weight.shape[0], size_k // 16, size_n * (num_bits // 2)), len(calls),
                          dtype=b_q_weight.dtype)

    monkeypatch.setattr(scheme_mod, "gptq_marlin_moe_repack", recording_repack)
    monkeypatch.setattr(scheme_mod, "marlin_make_workspace", lambda device, n=1: torch.zeros(4, dtype=torch.int32))
    scheme.process_weights_after_loading(layer)
    assert layer.is_marlin_converted

    ours = mw.marlin_repack_args(packed)
    assert len(calls) == 2
    for (b_q, perm, size_k, size_n, bits), key in zip(calls, ("w13", "w2")):
        o_q, o_perm, o_k, o_n, o_bits = ours[key]
        assert torch.equal(b_q, o_q) and b_q.dtype == o_q.dtype
        assert tuple(perm.shape) == tuple(o_perm.shape) and perm.dtype == o_perm.dtype
        assert (size_k, size_n, bits) == (o_k, o_n, o_bits)
    assert torch.equal(layer.w13_weight_scale, marlin_moe_permute_scales(*ours["w13_scale"]))
    assert torch.equal(layer.w2_weight_scale, marlin_moe_permute_scales(*ours["w2_scale"]))
    # the scale permutation is not the identity (the test would pass vacuously otherwise)
    assert not torch.equal(layer.w13_weight_scale, packed.w13_scale)

    # SGLang's Marlin-converted layer, viewed as MarlinMoEWeights, has the geometry of the packed weights
    view = mw.MarlinMoEWeights(layer.w13_weight_packed, layer.w13_weight_scale, layer.w2_weight_packed,
                               layer.w2_weight_scale, layer.workspace, group)
    assert (view.num_experts, view.hidden_size, view.intermediate_size) == (E, K, N)
    assert tuple(view.w13.shape) == (E, K // 16, 4 * N) and tuple(view.w2.shape) == (E, N // 16, 2 * K)


def test_marlin_shape_check_names_the_gemm():
    with pytest.raises(ValueError, match="down GEMM"):
        mw.check_marlin_shape(7168 + 64, 256)
    with pytest.raises(ValueError, match="gate_up GEMM"):
        mw.check_marlin_shape(7168, 32)
    mw.check_marlin_shape(7168, 256)  # Kimi K2.6 at TP 8
    mw.check_marlin_shape(7168, 2048)  # TP 1


# ------------------------------------------------------------------------------------------------------
# GPU launchers: boundary validation on CPU, and the .cu files compile
# ------------------------------------------------------------------------------------------------------


def test_launchers_reject_cpu_tensors():
    ids = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        launch.moe_align_block_size(ids, 16, 8)
    with pytest.raises(ValueError, match="CUDA"):
        launch.silu_and_mul(torch.zeros((2, 32), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        launch.silu_and_mul(torch.zeros((2, 32), dtype=torch.float32))
    with pytest.raises(ValueError, match="CUDA"):
        launch.moe_topk_sum(torch.zeros((16, 8), dtype=torch.bfloat16), ids, 16)


# ------------------------------------------------------------------------------------------------------
# The forward's call sequence, on CPU, with Marlin replaced by an emulation of its documented semantics
# ------------------------------------------------------------------------------------------------------


class _MarlinEmulator:
    """Stands in for SGLang's moe_wna16_marlin_gemm: performs the argument checks its C++ entry point makes
    (moe_wna16_marlin.cuh) and computes what the kernel computes, from the *packed* weights the fake Marlin
    tensors stand for: for each live block b, expert e = expert_ids[b], every route id < size_m * top_k in
    the block gets c[id] = a[id // top_k] @ W_e (times topk_weights[id] when mul_topk_weights), rounded to
    the activation dtype; other rows of c are not written."""

    def __init__(self, marlin, packed, workspace_min):
        self.dense = {id(marlin.w13): mw.dequantize(packed.w13_packed, packed.w13_scale),
                      id(marlin.w2): mw.dequantize(packed.w2_packed, packed.w2_scale)}
        self.workspace_min = workspace_min
        self.calls = []

    def __call__(self, a, c_or_none, b_q_weight, b_bias_or_none, b_scales, global_scale_or_none, b_zeros_or_none,
                 g_idx_or_none, perm_or_none, workspace,
                 sorted_token_ids, expert_ids, num_tokens_post_padded, topk_weights, *, moe_block_size, top_k,
                 mul_topk_weights, is_ep, b_q_type, size_m, size_n, size_k, is_k_full=True, use_atomic_add=False,
                 use_fp32_reduce=False, is_zp_float=False, expert_ids_are_sorted=False,
                 zero_inactive_output=False, has_inactive_prefix_count=False):
        self.calls.append(dict(top_k=top_k, mul=mul_topk_weights, size_m=size_m, size_n=size_n, size_k=size_k,
                               block=moe_block_size, atomic=use_atomic_add, fp32_reduce=use_fp32_reduce))
        c = c_or_none
        assert b_q_type.id == mw.UINT4B8.id and not is_ep and b_bias_or_none is None and b_zeros_or_none is None
        assert g_idx_or_none is None and perm_or_none is None and global_scale_or_none is None
        assert not (expert_ids_are_sorted or zero_inactive_output or has_inactive_prefix_count)
        assert moe_block_size == 8 or (moe_block_size % 16 == 0 and 16 <= moe_block_size <= 64)
        assert tuple(a.shape) == (size_m, size_k) and a.is_contiguous()
        assert size_k % 16 == 0 and b_q_weight.shape[1] == size_k // 16
        assert b_q_weight.shape[2] % 16 == 0 and size_n == b_q_weight.shape[2] // 16 * 8
        assert c is not None and tuple(c.shape) == (size_m * top_k, size_n) and c.is_contiguous()
        assert b_scales.dim() == 3 and b_scales.shape[2] == size_n and size_k % b_scales.shape[1] == 0
        assert b_scales.dtype == a.dtype and b_scales.is_contiguous() and b_q_weight.is_contiguous()
        assert size_n % 64 == 0 and workspace.numel() >= self.workspace_min
        assert num_tokens_post_padded.dtype == torch.int32 and num_tokens_post_padded.numel() == 2
        assert sorted_token_ids.dtype == torch.int32 and sorted_token_ids.numel() % moe_block_size == 0
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        dense = self.dense[id(b_q_weight)]
        total = int(num_tokens_post_padded[0])
        for b in range(total // moe_block_size):
            e = int(expert_ids[b])
            for route in sorted_token_ids[b * moe_block_size:(b + 1) * moe_block_size].tolist():
                if route >= size_m * top_k:
                    continue
                row = a[route // top_k].float() @ dense[e]
                if mul_topk_weights:
                    row = row * topk_weights.reshape(-1)[route].to(a.dtype).float()
                c[route] = row.to(c.dtype)
        return c


def test_fused_moe_marlin_call_sequence_on_cpu(monkeypatch):
    """fused_moe_marlin's orchestration (tables, top_k/size arguments of both GEMMs, SiLU, top-k weights,
    sum, routed scaling) with the glue twins and a Marlin emulator on CPU, against the float reference;
    the garbage-filled intermediate buffers stay unread wherever a route is dropped."""
    import sglang.kernels.ops.moe.moe_wna16_marlin as sgl_marlin

    import inspect

    # the emulator takes exactly the installed SGLang's parameters (fused_moe_marlin passes keywords)
    assert list(inspect.signature(inspect.unwrap(sgl_marlin.moe_wna16_marlin_gemm)).parameters) == list(
        inspect.signature(_MarlinEmulator.__call__).parameters)[1:]
    E, K, N, top_k, M = 8, 256, 128, 4, 9
    packed = mw.random_packed_weights(E, K, N, seed=31)
    marlin = mw.MarlinMoEWeights(
        w13=torch.zeros((E, K // 16, 4 * N), dtype=torch.int32), w13_scale=packed.w13_scale.clone(),
        w2=torch.zeros((E, N // 16, 2 * K), dtype=torch.int32), w2_scale=packed.w2_scale.clone(),
        workspace=torch.zeros(528, dtype=torch.int32))
    emulator = _MarlinEmulator(marlin, packed, workspace_min=min(528, 2 * N // 64 * 16))
    real_empty = torch.empty

    def garbage_empty(*shape, **kw):  # every intermediate starts as NaN/garbage
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(sgl_marlin, "moe_wna16_marlin_gemm", emulator)
    monkeypatch.setattr(fwd, "ensure_marlin_kernels", lambda *a: 0.0)
    monkeypatch.setattr(fwd, "_require_cuda", lambda name, t, dtypes=None: None)
    monkeypatch.setattr(fwd, "moe_align_block_size",
                        lambda ids, e, block, errors=None: twin.moe_align_reference(ids, e, block))
    monkeypatch.setattr(fwd, "silu_and_mul", lambda x, out=None: twin.silu_and_mul_reference(x))
    monkeypatch.setattr(fwd, "moe_topk_sum", lambda r, ids, e, f=1.0, out=None: out.copy_(
        twin.moe_topk_sum_reference(r, ids, e, f)))
    monkeypatch.setattr(torch, "empty", garbage_empty)

    g = _gen(32)
    x = torch.randn((M, K), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(M)]).to(torch.int32)
    ids[3] = -1  # a padded token
    ids[5, 2] = -1  # a dropped route
    weights = torch.rand((M, top_k), generator=g)
    ours = fwd.fused_moe_marlin(x, marlin, weights, ids, 2.5)
    ref = twin.fused_moe_reference(x, packed, weights, ids, 2.5)
    assert [(c["top_k"], c["mul"], c["size_m"], c["size_n"], c["size_k"]) for c in emulator.calls] == [
        (top_k, False, M, 2 * N, K), (1, True, M * top_k, K, N)]
    assert emulator.calls[0]["block"] == routing.choose_block_size_m(M, top_k, E)
    assert torch.all(ours[3] == 0) and torch.isfinite(ours).all()
    rel = (ours.float() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
    assert float(rel.max()) <= 1e-2
    assert fwd.DEFAULT_REDUCE == "fp32"  # deterministic and within 1e-2 on the H200 (see moe.forward.DEFAULT_REDUCE)
    assert [(c["atomic"], c["fp32_reduce"]) for c in emulator.calls] == [(False, True)] * 2
    # the reduce mode reaches both GEMMs; an unknown one is refused before any launch
    for reduce, atomic in (("fp32", False), ("atomic", True)):
        emulator.calls.clear()
        assert torch.equal(fwd.fused_moe_marlin(x, marlin, weights, ids, 2.5, reduce=reduce), ours)
        assert [c["atomic"] for c in emulator.calls] == [atomic] * 2
    emulator.calls.clear()
    with pytest.raises(ValueError, match="reduce = 'bf16'"):
        fwd.fused_moe_marlin(x, marlin, weights, ids, 2.5, reduce="bf16")
    assert emulator.calls == []
    # a strided caller buffer (e.g. a column slice) receives the same result through the final copy
    wide = torch.full((M, 2 * K), 5.0, dtype=torch.bfloat16)
    strided = wide[:, :K]
    assert fwd.fused_moe_marlin(x, marlin, weights, ids, 2.5, out=strided) is strided
    assert torch.equal(strided, ours) and torch.all(wide[:, K:] == 5.0)


def test_repack_functions_import_in_a_fresh_process():
    """In a process that has imported nothing of SGLang's quantization stack, the repack functions import
    (importing gptq_kernels first is a circular import in SGLang 0.5.23), and where gptq_kernels cannot
    import, the per-expert fallback over the JIT repack produces SGLang's output shape."""
    import subprocess

    code = r'''
import sys, torch
from sglang_kdtree.moe import weights as mw
repack, permute = mw._sglang_repack_functions()
assert repack.__module__.endswith("gptq_kernels"), repack.__module__
assert permute.__module__.endswith("marlin_utils"), permute.__module__
sys.modules["sglang.srt.hardware_backend.gpu.quantization.gptq_kernels"] = None  # now it "cannot import"
import sglang.kernels.ops.quantization.gptq_marlin_repack as jit
calls = []
def fake(b, perm, k, n, bits):
    calls.append((tuple(b.shape), tuple(perm.shape), k, n, bits))
    return torch.full((k // 16, n * bits // 2), len(calls), dtype=b.dtype)
jit.gptq_marlin_repack = fake
repack, _ = mw._sglang_repack_functions()
w = mw.random_packed_weights(3, 256, 128, seed=1)
args = mw.marlin_repack_args(w)
out = repack(*args["w13"])
assert tuple(out.shape) == (3, 256 // 16, 2 * 128 * 2), out.shape
assert calls == [((32, 256), (0,), 256, 256, 4)] * 3, calls
assert [int(out[e, 0, 0]) for e in range(3)] == [1, 2, 3]
print("ok")
'''
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
