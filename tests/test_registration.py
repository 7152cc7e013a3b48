"""Registration with the real installed SGLang: plugin loading, algorithm lookup, server-args resolution."""

from __future__ import annotations

import json

import pytest

sglang = pytest.importorskip("sglang")

from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from sglang_kdtree import plugin, state  # noqa: E402
from sglang_kdtree.server import spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A config-only Llama checkpoint directory: argument resolution reads the config, never the weights."""
    d = tmp_path_factory.mktemp("tiny_llama")
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6,
                "torch_dtype": "float32",
            }
        )
    )
    return str(d)


@pytest.fixture(scope="module")
def mla_model_dir(tmp_path_factory):
    """A config-only DeepSeek-V3-style (MLA + MoE) checkpoint directory."""
    d = tmp_path_factory.mktemp("tiny_deepseek")
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
                "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4,
                "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "kv_lora_rank": 32, "q_lora_rank": None,
                "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
                "rope_theta": 10000.0,
            }
        )
    )
    return str(d)


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    load_plugins()


def resolve(model_dir, *extra, overlap_off=True, device="cpu"):
    argv = [
        "--model-path", model_dir,
        "--speculative-algorithm", "kdtree",
        "--speculative-draft-model-path", model_dir,
        "--device", device,
    ]
    if overlap_off:
        argv.append("--disable-overlap-schedule")
    sa = prepare_server_args(argv + list(extra))
    sa.resolve_once()
    return resolving_view(sa)


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kdtree") == "sglang_kdtree.plugin:register"


def test_from_string_returns_our_algorithm_after_load_plugins():
    algo = SpeculativeAlgorithm.from_string("kdtree")
    assert isinstance(algo, spec.KDTreeSpec)
    assert algo.is_dflash() and algo.is_dflash_family() and algo.supports_target_verify_for_draft()
    assert algo.need_topk() is False and algo.carries_draft_hidden_states() is False
    assert algo.get_platform_worker_cls() is None
    assert algo.supports_overlap is spec.SUPPORTS_OVERLAP
    plugin.register()  # idempotent: a second call must not raise "already registered"


def test_spec_class_defines_every_method_the_scheduler_calls():
    # SGLang 0.5.23's CustomSpecAlgo lacks these; the scheduler and FutureMap call them unconditionally.
    enum_methods = {"create_future_map", "carries_draft_hidden_states", "need_topk", "get_platform_worker_cls"}
    for name in enum_methods:
        assert hasattr(SpeculativeAlgorithm.EAGLE, name), f"SGLang no longer has {name}: re-check the spec class"
        assert name in vars(spec.KDTreeSpec), f"KDTreeSpec must define {name}"


def test_valid_configuration_resolves(model_dir):
    cfg = resolve(model_dir)
    assert cfg.speculative_algorithm == "KDTREE"
    assert cfg.speculative_num_draft_tokens == state.DEFAULT_VERIFY_WIDTH
    assert cfg.speculative_num_steps == 1 and cfg.speculative_eagle_topk == 2
    assert cfg.page_size == 1
    cfg = resolve(model_dir, "--speculative-num-draft-tokens", "257", "--speculative-dflash-block-size", "16")
    assert cfg.speculative_num_draft_tokens == 257
    cfg = resolve(model_dir, "--speculative-num-draft-tokens", "1025")
    assert cfg.speculative_num_draft_tokens == state.MAX_WIDTH == state.MAX_BUDGET + 1
    # EAGLE's knobs at the values the plugin sets anyway are accepted (a command line that spells them out)
    cfg = resolve(model_dir, "--speculative-num-steps", "1", "--speculative-eagle-topk", "2")
    assert cfg.speculative_num_steps == 1 and cfg.speculative_eagle_topk == 2


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--speculative-num-draft-tokens", "1"], r"--speculative-num-draft-tokens 1 is out of range.*\[2, 1025\]"),
        (["--speculative-num-draft-tokens", "1026"], r"--speculative-num-draft-tokens 1026 is out of range"),
        (["--speculative-dflash-block-size", "64"], r"--speculative-dflash-block-size 64 is out of range"),
        (["--attention-backend", "flashmla"], r"--attention-backend flashmla plans causal.*use --attention-backend"),
        (["--attention-backend", "triton"], r"--attention-backend triton is not known.*supported on cpu"),
        (["--page-size", "16"], r"--page-size 16 is not supported.*use --page-size 1"),
        (["--speculative-num-steps", "5"], r"--speculative-num-steps 5 does not apply.*drop it"),
        (["--speculative-eagle-topk", "8"], r"--speculative-eagle-topk 8 does not apply.*drop it"),
        (["--speculative-eagle-topk", "1"], r"--speculative-eagle-topk 1 does not apply.*drop it"),
        (["--speculative-accept-threshold-single", "0.5"],
         r"--speculative-accept-threshold-single 0.5 is not supported.*drop --speculative-accept-threshold-single"),
        (["--speculative-accept-threshold-acc", "0.9"], r"--speculative-accept-threshold-acc 0.9 is not supported"),
        (["--speculative-use-rejection-sampling"], r"--speculative-use-rejection-sampling True is not supported"),
        (["--speculative-token-map", "/tmp/map.pt"], r"--speculative-token-map /tmp/map.pt is not supported"),
        (["--speculative-draft-window-size", "512"], r"--speculative-draft-window-size 512 is not supported.*window"),
        (["--enable-return-hidden-states"], r"hidden states is not supported \(--enable-return-hidden-states.*drop the flag"),
        (["--return-hidden-states-mode", "last"], r"--return-hidden-states-mode last\).*drop the flag"),
        (["--return-hidden-states-mode", "full"], r"--return-hidden-states-mode full\).*drop the flag"),
        (["--enable-return-routed-experts"], r"--enable-return-routed-experts True is not supported.*KV slot"),
        (["--enable-return-indexer-topk"], r"--enable-return-indexer-topk True is not supported.*KV slot"),
        (["--enable-mixed-chunk"], r"--enable-mixed-chunk True is not supported.*drop --enable-mixed-chunk"),
        (["--enable-watermark"], r"--enable-watermark True is not supported.*no watermark.*drop --enable-watermark"),
        (["--enable-strict-thinking"], r"--enable-strict-thinking True is not supported.*token filter"),
    ],
)
def test_invalid_configurations_fail_with_our_message(model_dir, extra, match):
    with pytest.raises(ValueError, match=match):
        resolve(model_dir, *extra)


def test_overlap_scheduling_is_the_default_and_can_be_turned_off(model_dir):
    assert spec.SUPPORTS_OVERLAP
    overlapped = resolve(model_dir, overlap_off=False)
    assert overlapped.speculative_algorithm == "KDTREE" and not overlapped.disable_overlap_schedule
    assert resolve(model_dir).disable_overlap_schedule


def test_missing_drafter_is_refused(model_dir):
    sa = prepare_server_args(
        ["--model-path", model_dir, "--speculative-algorithm", "kdtree", "--device", "cpu",
         "--disable-overlap-schedule"]
    )
    with pytest.raises(ValueError, match="--speculative-draft-model-path is required"):
        sa.resolve_once()


def test_worker_factory_never_falls_back(monkeypatch, model_dir):
    """The factory returns our worker, or raises naming the problem: never another algorithm's worker."""
    algo = SpeculativeAlgorithm.from_string("kdtree")
    try:
        cls = algo.factory(None)
    except plugin.WorkerUnavailableError as exc:
        assert "refusing to fall back" in str(exc)
    else:
        assert cls.__module__ == "sglang_kdtree.round.worker"
    import builtins

    real_import = builtins.__import__

    def no_worker(name, *a, **kw):
        if name == "sglang_kdtree.round.worker":
            raise ImportError("simulated missing worker")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_worker)
    with pytest.raises(plugin.WorkerUnavailableError, match="refusing to fall back"):
        algo.factory(None)


@pytest.mark.parametrize("backend", ["fa3", "triton"])
def test_cuda_mla_target_accepts_tree_mask_backends(mla_model_dir, backend):
    # argument resolution only reads config.json, so a CUDA configuration can be checked on a CPU machine
    cfg = resolve(mla_model_dir, "--attention-backend", backend, device="cuda")
    assert cfg.attention_backend == backend and cfg.speculative_eagle_topk == 2


def test_flashinfer_is_refused_for_mla_but_allowed_for_mha(model_dir, mla_model_dir):
    with pytest.raises(ValueError, match=r"flashinfer on an MLA model .* use --attention-backend fa3"):
        resolve(mla_model_dir, "--attention-backend", "flashinfer", device="cuda")
    assert resolve(model_dir, "--attention-backend", "flashinfer", device="cuda").attention_backend == "flashinfer"


def test_lora_is_refused_at_startup_by_sglang(model_dir):
    """KDTREE does not serve LoRA adapters; SGLang's own startup check refuses the combination (the README's flag
    table relies on it): if a later SGLang lets it through, this fails and the plugin must refuse it itself."""
    sa = prepare_server_args(
        ["--model-path", model_dir, "--speculative-algorithm", "kdtree", "--speculative-draft-model-path", model_dir,
         "--device", "cpu", "--disable-overlap-schedule", "--enable-lora", "--max-lora-rank", "8",
         "--lora-target-modules", "q_proj", "--speculative-num-draft-tokens", "17"]  # one width: the plugin's own
    )                                                                              # refusal is for several
    sa.resolve_once()
    with pytest.raises(ValueError, match="LoRA is only compatible with .* not KDTREE"):
        sa.check_server_args()


def test_a_launch_with_three_mistakes_names_all_three_in_one_block(model_dir, capsys):
    """Every problem of a launch at once, one ``kdtree:`` line each under a count (and the same block is printed
    again at exit, after SGLang's traceback)."""
    from sglang_kdtree import plugin

    with pytest.raises(Exception) as err:
        resolve(model_dir, "--attention-backend", "torch_native", "--page-size", "16", "--speculative-num-steps", "5",
                "--speculative-eagle-topk", "8")
    text = str(err.value)
    for words in ("--page-size 16 is not supported", "--speculative-num-steps 5 does not apply",
                  "--speculative-eagle-topk 8 does not apply"):
        assert words in text
    block = plugin.refusal_block(text)
    lines = block.splitlines()
    assert lines[0] == "kdtree: 3 problems with this launch:" and len(lines) == 4
    assert all(line.startswith("kdtree:   ") for line in lines[1:])
    assert block in capsys.readouterr().err
    assert block in plugin._last_words  # printed once more at exit
    assert plugin.refusal_block("KDTREE: --page-size 16 is not supported") == "kdtree: --page-size 16 is not supported"
