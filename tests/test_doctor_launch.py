"""``doctor --launch-command``: the checkpoints a launch command names are checked (check 7) as doctor's own
``--model-path`` / ``--speculative-draft-model-path`` would check them, in-process on config-only folders."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from test_doctor import LLAMA, checkpoint, drafter, quiet  # noqa: E402,F401  (checkpoint: a fixture)

from sglang_kdtree.cli import doctor  # noqa: E402

def test_launch_command_checkpoints_are_checked(checkpoint, tmp_path):
    """``--launch-command`` alone: the checkpoints the command names are checked as ``--model-path`` would be
    (a folder that is not there fails, as ``service/launch.sh`` and the server's weight load would; a Hub id
    warns); with doctor's own checkpoint flags the command's are not checked a second time."""
    from sglang_kdtree.gpu import limits

    target, draft = checkpoint("llama", LLAMA), checkpoint("draft", drafter())
    line = ("python -m sglang.launch_server --model-path {} --speculative-algorithm kdtree "
            "--speculative-draft-model-path {} --attention-backend triton --page-size 1")
    sm_120 = limits.for_arch("12.0")
    report = quiet()
    assert doctor.check_launch_command(report, line.format(target, draft), sm_120)
    assert report.counts[doctor.FAIL] == 0 and report.counts[doctor.WARN] == 0
    assert "drafter " in report.out.getvalue() and "LlamaForCausalLM" in report.out.getvalue()

    report = quiet()
    doctor.check_launch_command(report, line.format(tmp_path / "no-target", tmp_path / "no-draft"), sm_120)
    out = report.out.getvalue()
    assert report.counts[doctor.FAIL] == 2, out
    assert f"--model-path {tmp_path / 'no-target'}: the path does not exist" in out
    assert f"--speculative-draft-model-path {tmp_path / 'no-draft'}: the path does not exist" in out

    report = quiet()
    doctor.check_launch_command(report, line.format("moonshotai/Kimi-K2.6", draft), sm_120)
    assert report.counts[doctor.FAIL] == 0 and report.counts[doctor.WARN] == 1
    assert "not a local path: SGLang will fetch it from the Hugging Face Hub" in report.out.getvalue()

    report = quiet()
    doctor.check_launch_command(report, line.format(tmp_path / "no-target", draft), sm_120, checkpoints=False)
    assert report.counts[doctor.FAIL] == 0
