"""``--attention-backend fa3`` judged against the GPU before SGLang's own assertion: SGLang 0.5.23's fa3
backend asserts ``(major == 8 and not MLA) or major == 9`` only once the weights are loaded, so the plugin's
startup checks (``spec.launch_problems``, given the ``DeviceLimits`` that ``spec.device_limits`` picks) and
``doctor --arch`` refuse it first, naming ``triton``. Everything runs on the CPU: the GPU is a ``gpu.limits`` table
entry, or a faked device under the test-only ``KDTREE_DEVICE_PROFILE``."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang_kdtree.cli import doctor  # noqa: E402
from sglang_kdtree.server import spec
from sglang_kdtree.cli.doctor_launch import check_launch_command, launch_args_problem, server_argv  # noqa: E402
from sglang_kdtree.gpu import limits, runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REFUSED = "--attention-backend fa3 is not supported on compute capability 12.0 with an MLA target"

#: a config-only Kimi-K2-shaped (DeepSeek-V3 architecture: MLA + MoE) target; the checks read config.json only
KIMI_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "rope_theta": 10000.0,
}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
}


def _checkpoint(root: Path, name: str, config: dict) -> str:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("models"), "Kimi-K2.6", KIMI_CONFIG)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("models"), "llama", LLAMA_CONFIG)


def _readme_launches() -> list[str]:
    """The README's Kimi launches (the box's, then Hopper's), each as one line."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Launch: Kimi K2.6 on one 8-GPU box"):text.index("## How a round runs")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [block.replace("\\\n", " ") for block in blocks]


def _with_target(command: str, model_path: str) -> str:
    return command.replace("--model-path /models/Kimi-K2.6 ", f"--model-path {model_path} ")


def _argv(kimi: str, backend: str, *extra: str) -> list[str]:
    return ["--model-path", kimi, "--speculative-algorithm", "kdtree", "--speculative-draft-model-path", kimi,
            "--attention-backend", backend, "--page-size", "1", *extra]


@pytest.mark.parametrize("arch", ["12.0", "10.0"])
def test_fa3_with_an_mla_target_is_refused_off_hopper_naming_triton(kimi, arch):
    problem = launch_args_problem(_argv(kimi, "fa3"), limits.for_arch(arch))
    assert problem is not None
    assert f"--attention-backend fa3 is not supported on compute capability {arch} with an MLA target" in problem
    assert problem.rstrip().endswith("use --attention-backend triton")
    assert limits.for_arch(arch).source in problem  # where the capability comes from
    assert launch_args_problem(_argv(kimi, "triton"), limits.for_arch(arch)) is None


def test_fa3_passes_on_hopper_and_every_fa3_flag_is_named(kimi):
    assert launch_args_problem(_argv(kimi, "fa3"), limits.for_arch("9.0")) is None
    problem = launch_args_problem(_argv(kimi, "triton", "--decode-attention-backend", "fa3",
                                        "--prefill-attention-backend", "fa3"), limits.for_arch("12.0"))
    assert "2 problems" in problem
    for flag in ("--decode-attention-backend", "--prefill-attention-backend"):
        assert f"{flag} fa3 is not supported on compute capability 12.0 with an MLA target" in problem
        assert f"use {flag} triton" in problem


def test_sglangs_mha_rule_is_kept(llama):
    """An MHA target may use fa3 on 8.x and 9.x (SGLang's own rule), not on 12.0."""
    ampere = dataclasses.replace(limits.for_arch("9.0"), arch=(8, 0), source="an 8.0 stand-in")
    assert launch_args_problem(_argv(llama, "fa3"), ampere) is None
    assert launch_args_problem(_argv(llama, "fa3"), limits.for_arch("9.0")) is None
    problem = launch_args_problem(_argv(llama, "fa3"), limits.for_arch("12.0"))
    assert "--attention-backend fa3 is not supported on compute capability 12.0 (" in problem
    assert "MLA target" not in problem and "use --attention-backend triton" in problem


def test_an_mla_target_on_8x_is_refused(kimi):
    ampere = dataclasses.replace(limits.for_arch("9.0"), arch=(8, 6), source="an 8.6 stand-in")
    assert "compute capability 8.6 with an MLA target" in launch_args_problem(_argv(kimi, "fa3"), ampere)


def test_without_a_gpu_or_a_readable_config_the_check_is_skipped(kimi, monkeypatch):
    monkeypatch.setattr(runtime, "gpu_available", lambda: False)
    assert spec.device_limits() is None  # a CPU machine judges no GPU ...
    assert spec.device_limits("12.0") == limits.for_arch("12.0")  # ... unless told which (doctor --arch)
    assert launch_args_problem(_argv(kimi, "fa3")) is None
    # a config that cannot be read here (a remote id): on 12.0 fa3 is refused whatever the target (SGLang asserts for
    # MHA and MLA alike there); on 8.x only an MLA target is, so SGLang judges it when it loads the model
    problem = launch_args_problem(_argv("/no/such/Kimi", "fa3"), limits.for_arch("12.0"))
    assert "--attention-backend fa3 is not supported on compute capability 12.0 (" in problem
    ampere = dataclasses.replace(limits.for_arch("9.0"), arch=(8, 0), source="an 8.0 stand-in")
    assert launch_args_problem(_argv("/no/such/Kimi", "fa3"), ampere) is None


def test_the_sm_120_profile_on_a_hopper_gpu_refuses_fa3(kimi, monkeypatch):
    """With a GPU, the server's own check judges the device ``gpu.limits.current()`` reports: an H200 under
    ``KDTREE_DEVICE_PROFILE=sm_120`` is judged as an sm_120 card, and without the profile as itself."""
    import torch

    h200 = dataclasses.replace(limits.for_arch("9.0"), source="device 0 (NVIDIA H200)")
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(limits, "from_device", lambda index: h200)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    limits._profiled.cache_clear()
    try:
        monkeypatch.setenv(limits.PROFILE_ENV, "sm_120")
        judged = spec.device_limits("9.0")  # the GPU decides, not the no-GPU fallback
        assert judged.arch == (12, 0) and judged.source == "profile sm_120 on device 0 (NVIDIA H200)"
        problem = launch_args_problem(_argv(kimi, "fa3"))
        assert REFUSED in problem and "profile sm_120 on device 0 (NVIDIA H200)" in problem
        monkeypatch.delenv(limits.PROFILE_ENV)
        assert spec.device_limits() is h200
        assert launch_args_problem(_argv(kimi, "fa3")) is None
    finally:
        limits._profiled.cache_clear()


def test_a_profile_the_gpu_cannot_honour_is_a_launch_problem(kimi, monkeypatch):
    import torch

    small = dataclasses.replace(limits.for_arch("12.0"), source="device 0 (a small GPU)")
    monkeypatch.setattr(runtime, "gpu_available", lambda: True)
    monkeypatch.setattr(limits, "from_device", lambda index: small)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv(limits.PROFILE_ENV, "sm_90")
    limits._profiled.cache_clear()
    try:
        problem = launch_args_problem(_argv(kimi, "triton"))
        assert f"{limits.PROFILE_ENV}=sm_90 asks for more than" in problem and "unset" in problem
    finally:
        limits._profiled.cache_clear()


def test_readme_launches_pass_for_their_gpus_and_fa3_is_refused_on_the_box(kimi):
    box, hopper = _readme_launches()
    assert "--attention-backend triton" in box and "--tp 8" in box and "--page-size 1" in box
    assert box.startswith("SGLANG_KDTREE_MOE=marlin ") and "--attention-backend fa3" in hopper
    for flag in ("--mem-fraction-static", "--max-running-requests", "--cuda-graph-max-bs-decode"):
        assert flag in box
    sm_120, sm_90 = limits.for_arch("12.0"), limits.for_arch("9.0")
    assert launch_args_problem(server_argv(_with_target(box, kimi)), sm_120) is None
    assert launch_args_problem(server_argv(_with_target(hopper, kimi)), sm_90) is None
    assert REFUSED in launch_args_problem(server_argv(_with_target(hopper, kimi)), sm_120)
    report = doctor.Report(out=io.StringIO())
    judged = doctor.judged_limits(report, "12.0") if not runtime.gpu_available() else sm_120
    assert judged == sm_120
    assert check_launch_command(report, _with_target(box, kimi), judged)
    assert not check_launch_command(report, _with_target(box.replace("triton", "fa3"), kimi), judged)
    assert REFUSED in report.out.getvalue()


def test_doctor_arch_option():
    p = doctor.argparse.ArgumentParser()
    doctor.add_arguments(p)
    assert p.parse_args([]).arch == "12.0"  # the box
    assert p.parse_args(["--arch", "sm_90"]).arch == "sm_90"
    with pytest.raises(SystemExit):
        p.parse_args(["--arch", "7.5"])  # no limits are known for it


@pytest.mark.skipif(runtime.gpu_available(), reason="--arch applies only where there is no GPU")
def test_doctor_arch_12_refuses_the_readme_launch_with_fa3_and_names_triton(kimi):
    box, _ = _readme_launches()
    command = _with_target(box, kimi).replace("--attention-backend triton", "--attention-backend fa3")
    script = ("import sys\nfrom sglang_kdtree.__main__ import main\n"
              f"sys.exit(main(['doctor', '--arch', '12.0', '--launch-command', {command!r}]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    # the refusal, and the README's drafter folder, which does not exist here (doctor checks the command's paths)
    assert len(fails) == 2 and "launch command would not start" in fails[0], result.stdout
    assert REFUSED in fails[0] and "use --attention-backend triton" in fails[0]
    assert fails[1] == "FAIL  --speculative-draft-model-path /models/Kimi-K2.6-DFlash: the path does not exist"
    assert any(line.startswith("ok") and "GPU judged for" in line and "sm_120" in line
               for line in result.stdout.splitlines()), result.stdout


def test_a_budget_that_cannot_fit_is_refused_naming_the_limit(kimi):
    """The tree's shared memory at the largest width and the drafter's depths, judged before the weight load: on
    sm_120 budget 1,024 at 31 draft depths needs 161,440 B of a 101,376 B block (the largest that fits is 539); the
    same launch passes for sm_90, and 540 rows pass on sm_120."""
    argv = _argv(kimi, "triton", "--speculative-dflash-block-size", "32", "--speculative-num-draft-tokens", "1025")
    problem = launch_args_problem(argv, limits.for_arch("12.0"))
    assert problem is not None and "verify width 1025 (budget 1024) at 31 draft depths" in problem
    assert "101,376 B" in problem and "largest budget that fits at 31 draft depths is 539" in problem
    assert launch_args_problem(argv, limits.for_arch("9.0")) is None
    assert launch_args_problem(argv[:-1] + ["540"], limits.for_arch("12.0")) is None
