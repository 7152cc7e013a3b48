"""``python -m sglang_kdtree doctor`` and the plugin's startup refusals.

Doctor runs in a subprocess (it calls SGLang's ``load_plugins()``, which runs once per process); a failure is
provoked there the way an SGLang upgrade would cause it: the patched symbol is deleted from the imported
SGLang before doctor runs. Which copy doctor checks is tested in-process on fake site folders and once for real:
a venv that sees every package of this one except sglang-kdtree, run from a checkout with a stale egg-info.
The checkpoint checks and the refusals run in-process on config-only folders.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang_kdtree import plugin  # noqa: E402
from sglang_kdtree.cli import doctor, doctor_install  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HOOKED = "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode"
NAMED = "sglang.srt.managers.scheduler.validate_dflash_request"


def run_doctor(before: str = "", *args: str) -> subprocess.CompletedProcess:
    script = f"import sys\n{before}\nfrom sglang_kdtree.__main__ import main\nsys.exit(main(['doctor', *{list(args)!r}]))"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900)


def fail_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL")]


#: a launch line for --launch-command (check 8; the box's triton: doctor judges for --arch 12.0 without a GPU,
#: where fa3 is refused) naming the committed tiny checkpoints, whose folders doctor checks too (check 7);
#: ``+ " --speculative-num-steps 3"`` is refused
TINY = ROOT / "tests" / "e2e" / "tiny_models"
LAUNCH = (f"python -m sglang.launch_server --model-path {TINY / 'llama'} --speculative-algorithm kdtree "
          f"--speculative-draft-model-path {TINY / 'llama-dflash'} --attention-backend triton --page-size 1 "
          "--disable-overlap-schedule")


#: SGLang's plugin loader, made to warn and log the way SGLang's imports do on a machine without a GPU
NOISY_LOAD = (
    "import logging, warnings, sglang.srt.plugins as p\n"
    "_load = p.load_plugins\n"
    "def load_plugins():\n"
    "    warnings.warn('Only CUDA NOISE-WARNING support AWQ currently.', UserWarning)\n"
    "    logging.getLogger('sglang.srt.noise').warning('NOISE-LOG Cannot detect CUDA architecture.')\n"
    "    _load()\n"
    "p.load_plugins = load_plugins\n"
)


def test_doctor_passes_on_this_installation():
    result = run_doctor(NOISY_LOAD, "--launch-command", LAUNCH)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert not fail_lines(out)
    assert out.rstrip().splitlines()[-1].startswith("status: OK")
    for check in ("install: sglang-kdtree 0.1.0", "sglang 0.5.23", "plugin: entry point kdtree loaded",
                  "hooks applied by SGLang's HookRegistry", "kernel compile:",
                  "launch command: passes SGLang's argument parser and KDTREE's startup checks"):
        assert any(line.startswith("ok") and check in line for line in out.splitlines()), check
    # SGLang's import warnings stay out of the report, and it says how many it kept out
    assert "NOISE" not in out + result.stderr, out + result.stderr
    assert "import warnings from SGLang and its libraries not shown" in out


def test_doctor_fails_naming_the_fix_when_patch_targets_are_missing():
    # One symbol the plugin hooks (HookRegistry cannot apply the hook) and one a patch only names.
    before = (
        "import sglang.srt.speculative.dflash_info_v2 as m; del m.DFlashDraftInputV2.prepare_for_decode\n"
        "import sglang.srt.managers.scheduler as s; del s.validate_dflash_request"
    )
    # (the same run, since each doctor run compiles every kernel: a refused --launch-command line fails too)
    result = run_doctor(before, "--launch-command", LAUNCH + " --speculative-num-steps 3")
    assert result.returncode == 1, result.stdout
    out = result.stdout
    failures = fail_lines(out)
    assert any(HOOKED in line and "not patched by SGLang's HookRegistry" in line for line in failures), out
    assert any(NAMED in line and "does not exist in the installed SGLang" in line for line in failures), out
    assert any("launch command would not start: kdtree: --speculative-num-steps 3 does not apply" in line
               for line in failures), out
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("FAIL"):
            assert lines[i + 1].strip().startswith("fix: "), f"no fix after {line!r}"
    assert "pip install --force-reinstall sglang==0.5.23" in out
    assert lines[-1].startswith("status: FAILED") and "status: OK" not in out


def test_doctor_fails_when_the_plugin_cannot_import_its_patches():
    """The failure the issue saw: SGLang logs it, and doctor used to print OK after the traceback."""
    result = run_doctor("sys.modules['sglang_kdtree.patches'] = None")
    assert result.returncode == 1, result.stdout
    failures = fail_lines(result.stdout)
    assert any("sglang_kdtree.patches does not import" in line for line in failures), result.stdout
    assert any("load_plugins() could not run the kdtree plugin" in line for line in failures), result.stdout
    assert "git checkout -- sglang_kdtree" in result.stdout
    assert "status: OK" not in result.stdout


# ---------------------------------------------------------------------------------------------------
# which copy doctor checks: installed, shadowed by a checkout, or only a stale egg-info
# ---------------------------------------------------------------------------------------------------

ENTRY_POINTS = "[sglang.srt.plugins]\nkdtree = sglang_kdtree.plugin:register\n"


def fake_dist_info(site: Path, editable_checkout: Path | None = None) -> Path:
    """An installed sglang-kdtree in ``site`` (a wheel's dist-info, or an editable one pointing at a checkout)."""
    info = site / "sglang_kdtree-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-kdtree\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    if editable_checkout is not None:
        url = editable_checkout.as_uri()
        (info / "direct_url.json").write_text(json.dumps({"dir_info": {"editable": True}, "url": url}))
    else:
        (site / "sglang_kdtree").mkdir()
    return info


def fake_checkout(root: Path) -> Path:
    """A checkout after ``pip install .`` and ``pip uninstall``: its package and the egg-info pip left there."""
    (root / "sglang_kdtree").mkdir(parents=True)
    egg = root / "sglang_kdtree.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: sglang-kdtree\nVersion: 0.1.0\n")
    (egg / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


def test_install_state_stale_egg_info_fails(tmp_path):
    checkout, site = fake_checkout(tmp_path / "checkout"), tmp_path / "site"
    site.mkdir()
    report = quiet()
    found = doctor_install.check_install(report, [str(checkout), str(site)], [str(site)], checkout / "sglang_kdtree")
    assert found.state == doctor_install.STALE and found.metadata == checkout / "sglang_kdtree.egg-info"
    assert report.counts == {doctor.OK: 0, doctor.WARN: 0, doctor.FAIL: 1}
    text = report.out.getvalue()
    assert f"install: sglang-kdtree is not installed in {sys.prefix}" in text
    assert f"comes only from {checkout / 'sglang_kdtree.egg-info'}" in text
    assert f"fix: {sys.executable} -m pip install {checkout} (or a wheel built from it)" in text


def test_install_state_installed_passes_and_a_checkout_in_front_is_named(tmp_path):
    checkout, site = fake_checkout(tmp_path / "checkout"), tmp_path / "site"
    info = fake_dist_info(site)
    report = quiet()
    found = doctor_install.check_install(report, [str(site)], [str(site)], site / "sglang_kdtree")
    assert (found.state, found.version, found.metadata, found.editable) == (doctor_install.INSTALLED, "0.1.0", info,
                                                                             False)
    assert report.counts[doctor.OK] == 1 and report.counts[doctor.FAIL] == 0
    expected = f"install: sglang-kdtree 0.1.0, installed (metadata in {site}); doctor checks that copy"
    assert expected in report.out.getvalue()

    # from the checkout: its package shadows the installed one, which is what the server loads
    report = quiet()
    found = doctor_install.check_install(report, [str(checkout), str(site)], [str(site)], checkout / "sglang_kdtree")
    assert found.state == doctor_install.SHADOWED and found.code == site / "sglang_kdtree"
    assert report.counts == {doctor.OK: 0, doctor.WARN: 1, doctor.FAIL: 0}
    assert (f"doctor checks {checkout / 'sglang_kdtree'}, a checkout on sys.path (the current directory), not the "
            f"installed sglang-kdtree 0.1.0 in {site / 'sglang_kdtree'}") in report.out.getvalue()


def test_install_state_editable_and_missing(tmp_path):
    checkout, site = fake_checkout(tmp_path / "checkout"), tmp_path / "site"
    fake_dist_info(site, editable_checkout=checkout)
    report = quiet()
    found = doctor_install.check_install(report, [str(checkout), str(site)], [str(site)], checkout / "sglang_kdtree")
    assert (found.state, found.editable) == (doctor_install.INSTALLED, True)
    assert f"an editable install of the checkout {checkout} (metadata in {site})" in report.out.getvalue()

    empty = tmp_path / "empty"
    empty.mkdir()
    report = quiet()
    found = doctor_install.check_install(report, [str(empty)], [str(empty)], checkout / "sglang_kdtree")
    assert found.state == doctor_install.MISSING and report.out.getvalue() == ""  # check_plugin names it


def test_server_sys_path_drops_the_current_directory(monkeypatch):
    monkeypatch.setattr(sys, "path", ["", "/venv/site-packages", "/extra"])
    assert doctor_install.server_sys_path() == ["/venv/site-packages", "/extra"]


def test_quiet_imports_keeps_warnings_out_and_errors_visible(capfd):
    capfd.readouterr()
    with doctor_install.quiet_imports() as noise:
        warnings.warn("Only CUDA support AWQ currently.", UserWarning)
        logging.getLogger("sglang.srt.layers").warning("Cannot detect CUDA architecture.")
        logging.getLogger("sglang.srt.layers").error("a real failure")
    err = capfd.readouterr().err
    assert "a real failure" in err
    assert "AWQ" not in err and "Cannot detect" not in err
    lines = noise.lines()
    assert len(lines) == 2 and lines[0].startswith("UserWarning: Only CUDA support AWQ currently.")
    assert lines[1] == "WARNING sglang.srt.layers: Cannot detect CUDA architecture."
    assert logging.getLogger("sglang").propagate and not logging.getLogger("sglang").handlers


@pytest.mark.extended
def test_doctor_fails_from_a_checkout_after_pip_uninstall(tmp_path):
    """sglang-kdtree uninstalled, doctor run from a checkout holding the egg-info ``pip install .`` left. This
    process sees the entry point (SGLang's loader, run here, loads the plugin), a server started elsewhere would
    not. The venv sees every package of this one except sglang-kdtree. ``extended``: a venv and a doctor run,
    about 50 s of CI's 2 cores, for a case the in-process tests above cover in part."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    packages = tmp_path / "packages"
    packages.mkdir()
    for entry in purelib.iterdir():
        if "sglang_kdtree" not in entry.name:  # its dist-info and editable-install finder, i.e. pip uninstall
            (packages / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "packages.pth").write_text(f"{packages}\n")
    checkout = tmp_path / "checkout"
    fake_checkout(checkout)
    (checkout / "sglang_kdtree").rmdir()
    for name in ("sglang_kdtree", "pyproject.toml"):
        (checkout / name).symlink_to(ROOT / name)
    result = subprocess.run([str(python), "-m", "sglang_kdtree", "doctor"], cwd=checkout, capture_output=True,
                            text=True, timeout=900)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-3000:]
    assert fail_lines(out) == [
        f"FAIL  install: sglang-kdtree is not installed in {venv}; the kdtree entry point seen here comes only from "
        f"{checkout / 'sglang_kdtree.egg-info'}, stale metadata in the current directory (what `pip install .` "
        "leaves in a checkout). SGLang's server, which finds plugins through installed entry points, will not load "
        "the plugin"], out
    assert "ok    plugin: entry point kdtree loaded by SGLang's load_plugins()" in out  # fooled without the check
    assert out.rstrip().splitlines()[-1] == "status: FAILED (1 problem; each names its fix above)"
    for noise in ("Warning:", "warnings.warn", "Cannot detect CUDA architecture"):
        assert noise not in out + result.stderr, out + result.stderr


# ---------------------------------------------------------------------------------------------------
# checkpoints (--model-path / --speculative-draft-model-path), in-process on config-only folders
# ---------------------------------------------------------------------------------------------------

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
}
QWEN3_NEXT = {  # hybrid: gated delta-net linear attention in 3 of every 4 layers
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "vocab_size": 256, "max_position_embeddings": 512, "head_dim": 16, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
}


def drafter(block_size=8, target_layer_ids=(0, 1)) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128,
        "vocab_size": 256, "num_target_layers": 2,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": 255},
    }
    if block_size is not None:
        cfg["dflash_config"]["block_size"] = block_size
    return cfg


@pytest.fixture
def checkpoint(tmp_path):
    def make(name: str, config: dict) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    return make


def quiet() -> doctor.Report:
    return doctor.Report(out=io.StringIO())


def test_target_checks(checkpoint, tmp_path):
    report = quiet()
    assert doctor.check_target(report, checkpoint("llama", LLAMA), False) == 2
    assert report.counts[doctor.FAIL] == 0

    report = quiet()
    assert doctor.check_target(report, checkpoint("qwen3next", QWEN3_NEXT), False) is False
    assert "linear-attention / Mamba layers" in report.out.getvalue()

    report = quiet()
    assert doctor.check_target(report, str(tmp_path / "nowhere"), False) is False
    assert f"--model-path {tmp_path / 'nowhere'}: the path does not exist" in report.out.getvalue()

    report = quiet()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert doctor.check_target(report, str(empty), False) is False
    assert "has no config.json" in report.out.getvalue()


def test_drafter_checks(checkpoint, tmp_path):
    report = quiet()
    assert doctor.check_drafter(report, checkpoint("d8", drafter(8)), None, 2) is True
    assert "block size 8 (from the drafter's config), 7 draft depths" in report.out.getvalue()

    cases = [
        (drafter(64), None, "drafter block size 64 (from the drafter's config) is outside [2, 32]"),
        (drafter(8), 33, "drafter block size 33 (from --speculative-dflash-block-size) is outside [2, 32]"),
        (drafter(None), None, "has no block_size"),
        (drafter(8, (0, 5)), None, "drafter reads target layers [0, 5], the target has 2 layers"),
    ]
    for n, (cfg, flag, expected) in enumerate(cases):
        report = quiet()
        assert doctor.check_drafter(report, checkpoint(f"bad{n}", cfg), flag, 2) is False, expected
        assert expected in report.out.getvalue()
        assert "fix: " in report.out.getvalue()
    report = quiet()
    assert doctor.check_drafter(report, checkpoint("d_noblock", drafter(None)), 16, 2) is True

    report = quiet()
    assert doctor.check_drafter(report, str(tmp_path / "no-drafter"), None, None) is False
    assert "the path does not exist" in report.out.getvalue()


def test_missing_path_problem(tmp_path):
    assert plugin.missing_path_problem("--model-path", str(tmp_path)) is None
    assert plugin.missing_path_problem("--model-path", "s3://bucket/model") is None
    assert plugin.missing_path_problem("--model-path", "moonshotai/Kimi-K2") is None  # a Hub repo id
    for path in (str(tmp_path / "missing"), "./missing", "~/missing-model-dir", "a/b/c", "bad name"):
        assert plugin.missing_path_problem("--model-path", path) == f"--model-path {path}: the path does not exist"


# ---------------------------------------------------------------------------------------------------
# startup refusals: one `kdtree: <message>` line on stderr, then SGLang's exception
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plugins_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()


def resolve(argv):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(argv)
    sa.resolve_once()


def test_refusal_prints_one_clean_line(plugins_loaded, checkpoint, capfd):
    model = checkpoint("llama", LLAMA)
    capfd.readouterr()
    with pytest.raises(ValueError, match="--page-size 16 is not supported"):
        resolve(["--model-path", model, "--speculative-algorithm", "kdtree", "--speculative-draft-model-path", model,
                 "--device", "cpu", "--disable-overlap-schedule", "--page-size", "16"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("kdtree:")]
    assert lines == ["kdtree: --page-size 16 is not supported (tree KV rows are compacted slot by slot); "
                     "use --page-size 1"]


def test_missing_checkpoint_paths_are_refused_before_sglang_reads_them(plugins_loaded, checkpoint, tmp_path, capfd):
    model = checkpoint("llama", LLAMA)
    missing = tmp_path / "no-such-drafter"
    capfd.readouterr()
    with pytest.raises(ValueError, match="the path does not exist"):
        resolve(["--model-path", model, "--speculative-algorithm", "kdtree", "--speculative-draft-model-path",
                 str(missing), "--device", "cpu", "--disable-overlap-schedule"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("kdtree:")]
    assert lines == [f"kdtree: --speculative-draft-model-path {missing}: the path does not exist"]
    # a server without kdtree is SGLang's business: no refusal from us
    with pytest.raises(Exception) as info:
        resolve(["--model-path", str(tmp_path / "no-such-target"), "--device", "cpu"])
    assert "kdtree" not in str(info.value).lower()
    assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("kdtree:")]


def test_launch_args_problem_runs_sglangs_parser_then_kdtrees_checks():
    """Check 8 (``doctor_launch``): what the server would refuse before it loads anything, with its message."""
    from sglang_kdtree.cli.doctor_launch import launch_args_problem, server_argv

    base = ["--model-path", "/m", "--speculative-algorithm", "kdtree", "--speculative-draft-model-path", "/d",
            "--attention-backend", "fa3", "--page-size", "1"]
    assert launch_args_problem(base) is None  # overlap scheduling, SGLang's default
    assert launch_args_problem(base + ["--disable-overlap-schedule"]) is None
    assert "--speculative-eagle-topk 8 does not apply" in launch_args_problem(
        base + ["--disable-overlap-schedule", "--speculative-eagle-topk", "8"])
    assert launch_args_problem(base + ["--no-such-flag"]) == (
        "SGLang's argument parser refuses it: sglang serve: error: unrecognized arguments: --no-such-flag")
    # another algorithm is not ours to judge; the parser still is
    assert launch_args_problem(["--model-path", "/m", "--speculative-algorithm", "dflash"]) is None
    cmd = "/opt/venv/bin/python -m sglang.launch_server --model-path '/models/Kimi K2.6' --tp 8"
    assert server_argv(cmd) == ["--model-path", "/models/Kimi K2.6", "--tp", "8"]
    assert server_argv("sglang serve --model-path /m") == ["--model-path", "/m"]
    assert server_argv("--model-path /m") == ["--model-path", "/m"]


@pytest.mark.parametrize("hopper", [True, False])
def test_doctor_loads_an_arch_specific_kernel_only_for_its_gpu(monkeypatch, hopper):
    """With a GPU, the wgmma MLA kernel is built for sm_90a (``load_module_arch``), never through ``load_module``
    (CuPy's sm_90 build cannot assemble wgmma), and on another GPU it is named as not loaded, not failed."""
    import io

    from sglang_kdtree.gpu import runtime

    plain, special = [], []

    class _Module:
        def compile(self):
            return None

    def load_module(name, options=()):
        plain.append(name)
        return _Module()

    def load_module_arch(name, arch, options=()):
        special.append((name, arch))
        return _Module()

    monkeypatch.setattr(runtime, "load_module", load_module)
    monkeypatch.setattr(runtime, "load_module_arch", load_module_arch)
    monkeypatch.setattr(runtime, "arch_runs_here", lambda arch, device_index=None: hopper)
    report = doctor.Report(out=io.StringIO())
    assert doctor.check_kernels(report, None, "90")
    text = report.out.getvalue()
    assert report.counts[doctor.FAIL] == 0 and "kernel compile:" in text
    assert set(runtime.ARCH_SPECIFIC).isdisjoint(plain) and len(plain) >= 11
    if hopper:
        assert special == list(runtime.ARCH_SPECIFIC.items()) and "not for this GPU" not in text
    else:
        assert special == [] and "not for this GPU, not loaded: mla_tree_verify_wgmma.cu (sm_90a)" in text


def test_kernel_check_without_a_gpu_records_what_compiled(monkeypatch, tmp_path):
    """Without a GPU the check is NVRTC's front end; a kernel whose text, options and NVRTC compiled before is
    not compiled again, a changed one is, and a failing one is never recorded."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC is not available here: {exc}")
    from sglang_kdtree.gpu import runtime

    kdir = tmp_path / "kernels"
    kdir.mkdir()
    monkeypatch.setattr(runtime, "kernels_dir", lambda: kdir)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))

    def check(body: str) -> tuple[bool, str]:
        (kdir / "tiny.cu").write_text('extern "C" __global__ void tiny(int *x) { ' + body + " }\n")
        report = doctor.Report(out=io.StringIO())
        return doctor.check_kernels(report, "torch sees no CUDA device", "90"), report.out.getvalue()

    ok, text = check("x[0] = 1;")
    assert ok and "kernel compile: 1/1 kernels" in text and "earlier check" not in text, text
    ok, text = check("x[0] = 1;")
    assert ok and "1 passed an earlier check of the same source, options and NVRTC" in text, text
    ok, text = check("x[0] = 2;")
    assert ok and "earlier check" not in text, text
    for _ in range(2):
        ok, text = check("x[0] = ;")
        assert not ok and "kernel tiny.cu does not compile" in text, text

