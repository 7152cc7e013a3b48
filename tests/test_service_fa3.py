"""service/launch.sh judges ``KDTREE_ATTENTION_BACKEND=fa3`` by the GPUs' compute capability: SGLang's
fa3 backend asserts ``(major == 8 and not MLA) or major == 9`` only after the weight load, so the env-file check
(and with it install.sh's preflight) refuses fa3 where nvidia-smi, or ``GPU_COMPUTE_CAP_CMD`` in its place, reports
another capability, naming ``triton``. Where neither can be read the backend is not judged by the GPU. The env
example is the RTX PRO 6000 box's launch: triton, and ``SGLANG_KDTREE_MOE=marlin``. Runs on the CPU with the fakes
of tests/service_harness.py."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from service_harness import SERVICE, make_site, run_script, write_env, write_executable

REFUSAL = "KDTREE_ATTENTION_BACKEND=fa3 (--attention-backend fa3) is not supported on compute capability"


def _print(tmp_path: Path, caps: str | None, **overrides):
    site = make_site(tmp_path, **overrides)
    env = {} if caps is None else {"GPU_COMPUTE_CAP_CMD": caps}
    return run_script("launch.sh", "--env-file", write_env(tmp_path / "s.env", site), "--print", **env)


def _mha(tmp_path: Path) -> None:
    model = tmp_path / "models" / "Kimi-K2.6-INT4"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"model_type": "llama", "num_key_value_heads": 8}')


@pytest.mark.parametrize("caps", ["printf '12.0\\n'", "printf '12.0\\n12.0\\n'", "printf '9.0\\n12.0\\n'",
                                  "printf '10.0\\n'", "printf '8.6\\n'"])
def test_fa3_with_an_mla_target_is_refused_off_hopper_naming_triton(tmp_path, caps):
    result = _print(tmp_path, caps)  # make_site: an MLA target (kv_lora_rank) with fa3
    assert result.returncode != 0 and result.stdout == ""
    cap = [c for c in ("12.0", "10.0", "8.6") if c in caps][0]
    assert f"{REFUSAL} {cap} with an MLA target" in result.stderr, result.stderr
    assert "has kv_lora_rank" in result.stderr
    assert result.stderr.rstrip().endswith("use KDTREE_ATTENTION_BACKEND=triton")


@pytest.mark.parametrize("caps", ["printf '9.0\\n'", "printf '9.0\\n9.0\\n'"])
def test_fa3_passes_on_hopper(tmp_path, caps):
    result = _print(tmp_path, caps)
    assert result.returncode == 0, result.stderr
    assert "--attention-backend fa3" in result.stdout


def test_triton_passes_on_the_box(tmp_path):
    result = _print(tmp_path, "printf '12.0\\n'", KDTREE_ATTENTION_BACKEND="triton")
    assert result.returncode == 0, result.stderr
    assert "--attention-backend triton" in result.stdout


def test_sglangs_mha_rule_is_kept(tmp_path):
    site = make_site(tmp_path)
    _mha(tmp_path)  # the target becomes an MHA model
    env_file = write_env(tmp_path / "s.env", site)
    for cap in ("8.6", "9.0"):
        result = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COMPUTE_CAP_CMD=f"echo {cap}")
        assert result.returncode == 0, result.stderr
    result = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COMPUTE_CAP_CMD="echo 12.0")
    assert result.returncode != 0
    assert f"{REFUSAL} 12.0 (SGLang's fa3 backend runs on compute capability 9.x" in result.stderr, result.stderr
    assert "MLA" not in result.stderr and "use KDTREE_ATTENTION_BACKEND=triton" in result.stderr


def test_a_failing_capability_command_is_named(tmp_path):
    result = _print(tmp_path, "exit 3")
    assert result.returncode != 0 and "GPU_COMPUTE_CAP_CMD 'exit 3' failed" in result.stderr


def test_nvidia_smi_is_asked_and_without_it_the_gpu_does_not_judge(tmp_path):
    """Without GPU_COMPUTE_CAP_CMD the capability comes from ``nvidia-smi --query-gpu=compute_cap``; where
    nvidia-smi is not on PATH (as on this test machine, with GPU_COUNT_CMD standing in for the count), fa3 passes
    this check (the server's own startup check still judges it on the GPU)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    write_executable(fake_bin / "nvidia-smi", '#!/bin/sh\ncase "$*" in\n  *--query-gpu=compute_cap*'
                     '--format=csv,noheader*) printf "12.0\\n12.0\\n" ;;\n  *) exit 9 ;;\nesac\n')
    site = make_site(tmp_path)
    env_file = write_env(tmp_path / "s.env", site)
    result = run_script("launch.sh", "--env-file", env_file, "--print", PATH=f"{fake_bin}:{os.environ['PATH']}")
    assert result.returncode != 0 and f"{REFUSAL} 12.0 with an MLA target" in result.stderr, result.stderr
    no_smi = [d for d in os.environ["PATH"].split(":") if d and not (Path(d) / "nvidia-smi").exists()]
    result = run_script("launch.sh", "--env-file", env_file, "--print", PATH=":".join(no_smi))
    assert result.returncode == 0, result.stderr


def test_the_env_example_is_the_boxs_launch(tmp_path):
    site = make_site(tmp_path)
    example = (SERVICE / "sglang-k26-ddtree.env.example").read_text()
    lines = example.splitlines()
    assert "KDTREE_ATTENTION_BACKEND=triton" in lines and "SGLANG_KDTREE_MOE=marlin" in lines
    env_file = tmp_path / "example.env"
    env_file.write_text(example.replace("/opt/sglang-kdtree/venv/bin/python", site["KDTREE_PYTHON"])
                        .replace("/models/Kimi-K2.6-INT4", site["KDTREE_MODEL_PATH"])
                        .replace("/models/Kimi-K2.6-DFlash", site["KDTREE_DRAFT_MODEL_PATH"]))
    result = run_script("launch.sh", "--env-file", env_file, "--print", GPU_COMPUTE_CAP_CMD="echo 12.0")
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[argv.index("--attention-backend") + 1] == "triton" and "--page-size" in argv
