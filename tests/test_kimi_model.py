"""CPU tests of the Kimi-shaped target built by tests/e2e/make_kimi_model.py (a short build: 2 training steps).
Those of the built checkpoint are ``extended``: the build and SGLang's load take about 100 s of CI's 2 cores, for
a test target that changes rarely (run them before a GPU session that serves it: ``-m extended``).

They check the checkpoint against SGLang's own code: its config readers, the compressed-tensors config and
MoE scheme selection, and FusedMoE's weight loader for the packed experts. The INT4 codes are unpacked here
independently (and by compressed-tensors' own decompressor) and compared with the staged training weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
import make_kimi_model as kimi  # noqa: E402
import make_tiny_models as tiny  # noqa: E402

MOE_LAYERS = (1, 2)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi")
    manifest = kimi.build(out, target_steps=2, drafter_steps=2, device="cpu", log=lambda *_: None)
    return SimpleNamespace(out=out, manifest=manifest, target=out / kimi.TARGET_DIR, draft=out / kimi.DRAFT_DIR,
                           stage=out / kimi.STAGE_DIR)


@pytest.fixture(scope="module")
def tensors(built):
    from safetensors.torch import load_file

    return load_file(str(built.target / "model.safetensors"))


@pytest.fixture(scope="module")
def staged(built):
    from safetensors.torch import load_file

    return load_file(str(built.stage / "target" / "model.safetensors"))


def quant_config(built):
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = json.loads((built.target / "config.json").read_text())
    return CompressedTensorsConfig.from_config(config["quantization_config"])


# ---------------------------------------------------------------------------------------------------------
# configs through SGLang's readers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.extended
def test_model_config_is_kimi_mla_geometry(built):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_config

    hf = get_config(str(built.target), trust_remote_code=False)
    assert hf.architectures == ["DeepseekV3ForCausalLM"] and hf.model_type == "deepseek_v3"
    mc = ModelConfig(str(built.target))
    assert mc.attention_arch == AttentionArch.MLA
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim, mc.v_head_dim) == (512, 64, 128, 128)
    assert mc.num_attention_heads == 8
    # SGLang's absorbed MLA: q/k width kv_lora + rope = 576, v width kv_lora = 512 (the fused kernel's geometry)
    assert mc.kv_lora_rank + mc.qk_rope_head_dim == 576
    assert mc.vocab_size == 163_840 and hf.vocab_size == 163_840
    assert mc.quantization == "compressed-tensors" and mc.dtype == torch.bfloat16
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.n_shared_experts) == (16, 4, 1)
    assert (hf.topk_method, hf.scoring_func, hf.n_group, hf.topk_group) == ("noaux_tc", "sigmoid", 1, 1)
    assert hf.first_k_dense_replace == 1 and hf.num_hidden_layers == 3
    assert hf.hidden_size % 128 == 0 and hf.moe_intermediate_size % 128 == 0  # Marlin tiles


@pytest.mark.extended
def test_quantization_config_selects_wna16_marlin_moe_and_ignores_the_rest(built):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsWNA16MoE

    qc = quant_config(built)
    assert qc.quant_format == "pack-quantized"
    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    for i in MOE_LAYERS:
        scheme = qc.get_moe_scheme(layer, f"model.layers.{i}.mlp.experts")
        assert type(scheme) is CompressedTensorsWNA16MoE
        assert (scheme.num_bits, scheme.group_size, scheme.sym, scheme.strategy) == (4, 32, True, "group")
        assert scheme.actorder is None
    # everything else is served unquantized (SGLang's module names, fused ones included)
    unquantized = ["lm_head", "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    for i in range(3):
        unquantized += [f"model.layers.{i}.self_attn.{n}" for n in
                        ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")]
    for i in MOE_LAYERS:
        unquantized += [f"model.layers.{i}.mlp.shared_experts.{n}" for n in ("gate_up_proj", "down_proj")]
    for name in unquantized:
        assert qc.get_scheme_dict(None, name) is None, name


@pytest.mark.extended
def test_checkpoint_names_and_dtypes(built, tensors):
    packed = [n for n in tensors if n.endswith("weight_packed")]
    assert len(packed) == len(MOE_LAYERS) * 16 * 3
    for name, value in tensors.items():
        if ".mlp.experts." in name:
            assert kimi.EXPERT_WEIGHT.match(name.rsplit(".", 1)[0] + ".weight"), name
            suffix = name.rsplit(".", 1)[1]
            assert suffix in ("weight_packed", "weight_scale", "weight_shape"), name
            assert value.dtype == {"weight_packed": torch.int32, "weight_scale": torch.bfloat16,
                                   "weight_shape": torch.int64}[suffix]
        elif name.endswith("e_score_correction_bias"):
            assert value.dtype == torch.float32 and value.abs().max() > 0  # a real correction bias
        else:
            assert value.dtype == torch.bfloat16, name
    assert tensors["model.embed_tokens.weight"].shape == (163_840, 256)
    assert tensors["lm_head.weight"].shape == (163_840, 256)
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight_packed"].shape == (256, 256 // 8)
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].shape == (256, 256 // 32)
    assert tensors["model.layers.2.mlp.experts.15.down_proj.weight_shape"].tolist() == [256, 256]
    # the routed experts are the only quantized tensors; dense MLP, shared experts, attention stay bf16
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in tensors
    assert "model.layers.1.self_attn.kv_b_proj.weight" in tensors


# ---------------------------------------------------------------------------------------------------------
# the packed experts
# ---------------------------------------------------------------------------------------------------------


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Independent unpack: int32 ``[out, in/8]`` -> int ``[out, in]``; nibble j of a word is input column
    8w + j, stored with offset 8 (uint4b8)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = [(words >> (4 * j)) & 0xF for j in range(8)]
    return torch.stack(nibbles, dim=-1).reshape(packed.shape[0], -1) - 8


@pytest.mark.extended
@pytest.mark.parametrize("layer", MOE_LAYERS)
def test_packed_experts_unpack_to_the_trained_weights(tensors, staged, layer):
    for e in range(16):
        for proj in ("gate", "up", "down"):
            base = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj."
            codes = unpack_codes(tensors[base + "weight_packed"])
            scale = tensors[base + "weight_scale"].float()
            assert codes.min() >= -8 and codes.max() <= 7
            grouped = codes.reshape(codes.shape[0], -1, 32)
            # symmetric, scale = max|w| / 7: the largest code of every (non-zero) group is exactly +-7
            assert bool((grouped.abs().amax(-1) == 7).all()), base
            values = (grouped.float() * scale[..., None]).reshape(codes.shape)
            trained = staged[base + "weight"]
            assert tuple(tensors[base + "weight_shape"].tolist()) == tuple(trained.shape)
            torch.testing.assert_close(values, trained, rtol=0, atol=0)


@pytest.mark.extended
def test_compressed_tensors_decompresses_the_same_values(built, tensors, staged):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    cfg = json.loads((built.target / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], weights=cfg["config_groups"]["group_0"]["weights"])
    base = "model.layers.2.mlp.experts.7.down_proj."
    state = {k: tensors[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
    weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert weight.dtype == torch.bfloat16  # it multiplies in the scale's dtype: code * scale rounded to bf16
    torch.testing.assert_close(weight, staged[base + "weight"].to(torch.bfloat16), rtol=0, atol=0)


def sglang_moe_layer(built, tensors, layer_index: int):
    """A ``FusedMoE`` of SGLang's, built only as far as its weight loading needs (``FusedMoE.__init__`` needs a
    parallel state), with ``CompressedTensorsWNA16MoE``'s parameters loaded through FusedMoE's own weight
    loader and the name mapping of deepseek_v2's loader. Returns (layer, names of the tensors it took)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsFusedMoEMethod

    qc = quant_config(built)
    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    prefix = f"model.layers.{layer_index}.mlp."
    layer.scheme = qc.get_moe_scheme(layer, prefix + "experts")
    layer.quant_config, layer.quant_method = qc, CompressedTensorsFusedMoEMethod(qc)
    layer.moe_tp_size, layer.moe_tp_rank, layer.moe_runner_config = 1, 0, SimpleNamespace(is_gated=True)
    layer.use_padded_loading = layer.use_presharded_weights = layer.use_triton_kernels = False
    layer.use_flashinfer_trtllm_moe, layer._has_fused_shared, layer.num_fused_shared_experts = False, False, 0
    layer.scheme.create_weights(layer, num_experts=16, hidden_size=256, intermediate_size_per_partition=256,
                                params_dtype=torch.bfloat16)
    params = dict(layer.named_parameters())
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=16)
    loaded = set()
    for name, value in tensors.items():
        if not name.startswith(prefix + "experts."):
            continue
        param_name, weight_name, expert_id, shard_id = next(m for m in mapping if m[1] in name)
        local = name.replace(weight_name, param_name)[len(prefix + "experts."):]
        assert local in params, local
        FusedMoE._weight_loader_impl(layer, params[local], value, local, shard_id, expert_id)
        loaded.add(name)
    return layer, loaded


@pytest.mark.extended
def test_sglang_fused_moe_loader_takes_the_checkpoint(built, tensors, staged):
    """SGLang's CompressedTensorsWNA16MoE.create_weights + FusedMoE's weight loader load every expert tensor;
    the loaded layout dequantizes to the trained weights."""
    from sglang_kdtree.moe.weights import PackedMoEWeights, dequantize

    layer, loaded = sglang_moe_layer(built, tensors, 1)
    assert len(loaded) == 16 * 3 * 3
    assert bool((layer.w13_weight_shape == 256).all()) and bool((layer.w2_weight_shape == 256).all())
    # [E, in/8, out] after the loader's transpose: gate columns [0, N), up [N, 2N)
    weights = PackedMoEWeights(layer.w13_weight_packed.data, layer.w13_weight_scale.data,
                               layer.w2_weight_packed.data, layer.w2_weight_scale.data)
    weights.validate()
    w13 = dequantize(weights.w13_packed, weights.w13_scale)
    w2 = dequantize(weights.w2_packed, weights.w2_scale)
    prefix = "model.layers.1.mlp."
    for e in (0, 9, 15):
        gate, up = staged[f"{prefix}experts.{e}.gate_proj.weight"], staged[f"{prefix}experts.{e}.up_proj.weight"]
        torch.testing.assert_close(w13[e], torch.cat([gate, up]).T, rtol=0, atol=0)
        torch.testing.assert_close(w2[e], staged[f"{prefix}experts.{e}.down_proj.weight"].T, rtol=0, atol=0)


_SGLANG_MODEL_LOAD = """
import json, socket, sys, torch
from safetensors.torch import load_file
from sglang.test.layer_ut_utils import init_single_process_dist
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import _get_quantization_config
from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

path = sys.argv[1]
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
args = ServerArgs(model_path=path, device="cpu", dtype="bfloat16", tp_size=1)
set_global_server_args_for_scheduler(args)
init_single_process_dist(master_port=port)
config = ModelConfig.from_server_args(args)
quant = _get_quantization_config(config, LoadConfig())
model = DeepseekV3ForCausalLM(config.hf_config, quant_config=quant)
SENTINEL = -1234567
with torch.no_grad():
    for p in model.parameters():
        p.fill_(float("nan") if p.is_floating_point() else SENTINEL)
tensors = load_file(path + "/model.safetensors")
model.load_weights(iter(tensors.items()))
unfilled = sorted(n for n, p in model.named_parameters()
                  if bool((torch.isnan(p) if p.is_floating_point() else p == SENTINEL).any()))
params = dict(model.named_parameters())
same = {
    "lm_head": torch.equal(params["lm_head.weight"], tensors["lm_head.weight"]),
    "embed": torch.equal(params["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"]),
    "o_proj": torch.equal(params["model.layers.2.self_attn.o_proj.weight"],
                          tensors["model.layers.2.self_attn.o_proj.weight"]),
    "fused_qkv_a": torch.equal(params["model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"],
                               torch.cat([tensors["model.layers.1.self_attn.q_a_proj.weight"],
                                          tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]])),
    "bias": torch.equal(params["model.layers.1.mlp.gate.e_score_correction_bias"].float(),
                        tensors["model.layers.1.mlp.gate.e_score_correction_bias"]),
}
print("RESULT " + json.dumps({"quant": type(quant).__name__, "unfilled": unfilled, "same": same,
                              "moe_scheme": type(model.model.layers[1].mlp.experts.scheme).__name__,
                              "num_params": len(params)}))
"""


@pytest.mark.extended
def test_sglang_deepseek_model_loads_every_parameter(built, tmp_path):
    """SGLang's own DeepseekV3ForCausalLM (CPU engine, in a subprocess: it needs a process group, the CPU
    ``sgl_kernel`` stand-in and ``SGLANG_USE_CPU_ENGINE`` set before import) built with the checkpoint's
    compressed-tensors config takes every parameter from the checkpoint through ``load_weights``; the
    only ones left are the act-order ``g_idx`` tensors, which ``process_weights_after_loading`` replaces by
    empty ones for a checkpoint without act order (that step needs CUDA)."""
    import os
    import subprocess

    script = tmp_path / "load.py"
    script.write_text(_SGLANG_MODEL_LOAD)
    stub = Path(__file__).resolve().parent / "e2e" / "sgl_kernel_stub"
    path = [str(stub)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, str(script), str(built.target)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["quant"] == "CompressedTensorsConfig"
    assert result["moe_scheme"] == "CompressedTensorsWNA16MoE"
    assert result["same"] == {k: True for k in result["same"]}
    expected_unfilled = sorted(f"model.layers.{i}.mlp.experts.{n}" for i in MOE_LAYERS for n in
                               ("w13_weight_g_idx", "w2_weight_g_idx", "w13_g_idx_sort_indices",
                                "w2_g_idx_sort_indices"))
    assert result["unfilled"] == expected_unfilled


@pytest.mark.extended
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_sglang_plain_marlin_moe_serves_the_checkpoint(built, tensors, staged, tokens):
    """On CUDA: SGLang's own W4A16 path on the checkpoint (``process_weights_after_loading``: JIT Marlin repack;
    ``apply_weights`` -> ``fused_marlin_moe``: the two JIT Marlin GEMM specializations tests/e2e/prebuild_jit.py
    pre-builds, the JIT align / SiLU kernels, ``sgl_kernel.moe_sum_reduce`` and ``scalar_type`` from the test
    stand-in) against a float32 loop over the trained (INT4-valued) expert weights."""
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    layer, _ = sglang_moe_layer(built, tensors, 2)
    layer.to("cuda")
    scheme = layer.scheme
    scheme.process_weights_after_loading(layer)
    scheme.moe_runner_config = SimpleNamespace(activation="silu", routed_scaling_factor=kimi.ROUTED_SCALING_FACTOR,
                                               swiglu_limit=None)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)]).to(torch.int32)
    topk_weights = torch.rand(tokens, 4, generator=gen) + 0.1
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    router_logits = torch.randn(tokens, 16, generator=gen)
    dispatch = SimpleNamespace(hidden_states=x.cuda(), topk_output=(topk_weights.cuda(), topk_ids.cuda(),
                                                                    router_logits.cuda()))
    out = scheme.apply_weights(layer, dispatch)
    assert isinstance(out, StandardCombineInput)
    got = out.hidden_states.float().cpu()
    prefix = "model.layers.2.mlp.experts."
    want = torch.zeros(tokens, 256)
    xf = x.float()
    for t in range(tokens):
        for k in range(4):
            e = int(topk_ids[t, k])
            gate = xf[t] @ staged[f"{prefix}{e}.gate_proj.weight"].T
            up = xf[t] @ staged[f"{prefix}{e}.up_proj.weight"].T
            down = staged[f"{prefix}{e}.down_proj.weight"]
            want[t] += topk_weights[t, k] * ((torch.nn.functional.silu(gate) * up) @ down.T)
    want *= kimi.ROUTED_SCALING_FACTOR
    error = float((got - want).norm() / want.norm())
    assert error < 2e-2, f"relative error {error:.4f} at {tokens} tokens"


# ---------------------------------------------------------------------------------------------------------
# vocabulary, tokenizer, drafter
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.extended
def test_filler_rows_never_beat_the_prototypes(tensors, staged):
    """Every filler row of the LM head is a convex combination of the trained prototype rows, so for any
    hidden state its logit is at most the largest prototype logit (bf16 rounding aside)."""
    head = tensors["lm_head.weight"].float()
    trained = staged["lm_head.weight"]
    torch.testing.assert_close(head[: kimi.TRAIN_VOCAB], trained.to(torch.bfloat16).float(), rtol=0, atol=0)
    h = torch.randn(64, head.shape[1], generator=torch.Generator().manual_seed(0))
    logits = h @ head.T
    proto = logits[:, kimi.PROTOTYPES.start:kimi.PROTOTYPES.stop]
    filler = logits[:, kimi.TRAIN_VOCAB:]
    slack = 0.02 * h.norm(dim=1) * trained.norm(dim=1).max()
    assert bool((filler.amax(1) <= proto.amax(1) + slack).all())
    assert bool((filler.amin(1) >= proto.amin(1) - slack).all())
    assert filler.std(1).min() > 0  # a real ranking among fillers, not one repeated row


@pytest.mark.extended
def test_tokenizer_covers_every_id(built):
    from transformers import AutoTokenizer

    for folder in (built.target, built.draft):
        tok = AutoTokenizer.from_pretrained(str(folder))
        assert len(tok) == 163_840
        assert tok.encode("w05 w63 w00", add_special_tokens=False) == [5, 63, 0]
        assert tok.eos_token_id == tiny.EOS_ID
        assert tok.convert_tokens_to_ids(tiny.MASK_TOKEN) == tiny.MASK_ID
        assert tok.decode([163_839, 100_000, 66]) == "x163839 x100000 x66"


@pytest.mark.extended
def test_drafter_config_parses_and_weights_fit(built, tensors):
    from safetensors.torch import load_file
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    cfg = json.loads((built.draft / "config.json").read_text())
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert parsed.block_size == tiny.BLOCK_SIZE and parsed.target_layer_ids == tiny.CAPTURE_LAYER_IDS
    assert parsed.mask_token_id == tiny.MASK_ID and parsed.mask_token == tiny.MASK_TOKEN
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["hidden_size"] == 256 and cfg["vocab_size"] == 163_840
    weights = load_file(str(built.draft / "model.safetensors"))
    expected = tiny.TinyDFlashDrafter(len(tiny.CAPTURE_LAYER_IDS), hidden=256).state_dict_for_checkpoint()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert weights["fc.weight"].shape == (256, 2 * 256)


@pytest.mark.extended
def test_manifest_and_rebuild_is_deterministic(built, tmp_path):
    manifest = json.loads((built.out / kimi.MANIFEST).read_text())
    assert manifest["source_hash"] == kimi.source_hash() and manifest["vocab_size"] == 163_840
    assert manifest["train"]["target_steps"] == 2 and manifest["train"]["device"] == "cpu"
    # the export stage alone, from the same stage, writes byte-identical checkpoints
    again = kimi.export(built.stage, tmp_path, log=lambda *_: None)
    assert again["sha256"] == manifest["sha256"]


def test_marlin_ops_scalar_types_match_sgl_kernel():
    """The CUDA stand-in's ``sgl_kernel.scalar_type`` (tests/e2e/sgl_kernel_cuda/sgl_kernel/_marlin_ops.py)
    gives the Marlin kernels the same type ids as the real pure-Python module (installed in the CPU venv)."""
    import importlib.util

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    # the real module is pure Python; load it by path (sgl_kernel/__init__ needs its CUDA library)
    installed = importlib.util.find_spec("sgl_kernel")
    if installed is None or not Path(installed.origin).with_name("scalar_type.py").exists():
        pytest.skip("sgl_kernel (the real wheel) is not installed here")
    real = load("real_sgl_kernel_scalar_type", Path(installed.origin).with_name("scalar_type.py"))
    ops = load("kdtree_marlin_ops_under_test",
               Path(__file__).resolve().parent / "e2e" / "sgl_kernel_cuda" / "sgl_kernel" / "_marlin_ops.py")
    names = ("uint4b8", "uint8b128", "uint4", "uint8", "float4_e2m1f", "float8_e4m3fn")
    for name in names:
        ours, theirs = getattr(ops.scalar_type.scalar_types, name), getattr(real.scalar_types, name)
        assert ours.id == theirs.id, name
        assert ours.size_bits == theirs.size_bits and ours.has_bias() == theirs.has_bias(), name
    assert ops.scalar_type.scalar_types.uint4b8 in [ops.scalar_type.scalar_types.uint4b8]
    with pytest.raises(AttributeError, match="float6_e3m2f"):
        ops.scalar_type.scalar_types.float6_e3m2f
    assert ops.__all__ == []


def test_prebuild_jit_seed_resolves_the_kdtree_builder_without_recursing(monkeypatch, tmp_path):
    """``prebuild_jit.seed`` hands ``moe.jit.seed_prebuilt`` its own builder list; asking for the kdtree
    specialization (whose builder comes from ``moe.jit.marlin_module_builders``) must resolve once, not recurse
    (it did when the list was swapped in by patching the module)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
    import prebuild_jit

    from sglang_kdtree.moe import jit

    original = jit.marlin_module_builders
    seen = {}

    def fake_seed(source, *, builders):
        seen["builders"] = list(builders)
        return []

    monkeypatch.setattr(jit, "seed_prebuilt", fake_seed)
    assert prebuild_jit.seed(tmp_path, {"kdtree"}) == []
    assert len(seen["builders"]) == 2 and all(callable(b) for b in seen["builders"])  # repack + ours
    assert jit.marlin_module_builders is original
