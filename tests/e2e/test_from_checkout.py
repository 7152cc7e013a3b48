"""Running from the repository root after a non-editable ``pip install .`` behaves like the installed package.

From the repo root, ``python -m ...`` imports ``./sglang_kdtree`` rather than the installed copy, so the
checkout's package must be complete (``sglang_kdtree/patches`` and ``sglang_kdtree/kernels`` resolve there
as in the wheel). The editable install the other tests use hides the difference; here the package is
installed non-editable into a fresh venv, which sees the CI venv's packages (SGLang, torch, ...) through a
``.pth`` path line: that folder is not a site dir for the new venv, so the CI venv's editable-install finder
never runs in it. Then, from the repo root: ``doctor`` passes, a CPU kdtree server serves a request, and a
server given a missing drafter path refuses with one ``kdtree:`` line before SGLang's traceback.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, Server, base_server_args, free_port, server_env

pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("non_editable") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "ci_venv_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip comes from the CI venv's packages and installs into the running interpreter's venv
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(REPO)],
                   check=True, cwd=venv.parent)
    installed = site / "sglang_kdtree"
    assert (installed / "patches" / "__init__.py").is_file() and not (installed / "patches").is_symlink()
    assert (installed / "kernels" / "tree_accept.cu").is_file()
    assert not list(site.glob("__editable__*sglang_kdtree*")), "the install must not be editable"
    return python


def test_sglang_kdtree_from_the_repo_root_is_the_checkout_and_complete(venv_python):
    probe = ("import sglang_kdtree, sglang_kdtree.patches as p; from sglang_kdtree.gpu import runtime; "
             "print(sglang_kdtree.__file__); print(p.__file__); print(runtime.kernels_dir())")
    out = subprocess.run([str(venv_python), "-c", probe], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.split()
    assert out[0] == str(REPO / "sglang_kdtree" / "__init__.py")  # the checkout shadows the installed copy
    assert out[1] == str(REPO / "sglang_kdtree" / "patches" / "__init__.py")
    assert (Path(out[2]) / "tree_accept.cu").is_file()


def test_doctor_passes_from_the_repo_root(venv_python):
    result = subprocess.run([str(venv_python), "-m", "sglang_kdtree", "doctor"], cwd=REPO, capture_output=True,
                            text=True, timeout=900)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert f"from {REPO / 'sglang_kdtree'} (a source checkout)" in out
    assert "plugin: entry point kdtree loaded by SGLang's load_plugins()" in out
    assert not [line for line in out.splitlines() if line.startswith("FAIL")]
    assert out.rstrip().splitlines()[-1].startswith("status: OK")


def test_cpu_kdtree_server_from_the_repo_root_serves(venv_python, tiny_models, server_logs):
    args = base_server_args(tiny_models / "llama", free_port())
    args[0] = str(venv_python)
    args += ["--speculative-algorithm", "kdtree", "--speculative-draft-model-path", str(tiny_models / "llama-dflash"),
             "--speculative-num-draft-tokens", "9"]
    server = Server(args, server_logs / "from-checkout-kdtree.log")  # cwd and PYTHONPATH: the repo root
    try:
        server.wait_ready()
        out = server.generate({"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 8,
                                                                                  "temperature": 0}})
    finally:
        server.stop()
    assert len(out["output_ids"]) == 8
    assert out["meta_info"]["spec_verify_ct"] >= 1  # the tree rounds ran
    log = server.log_path.read_text(errors="replace")
    assert "Failed to execute general plugin" not in log and "Failed to apply hooks" not in log


def test_missing_drafter_path_is_one_clean_line_from_the_repo_root(venv_python, tiny_models, tmp_path):
    missing = tmp_path / "no-such-drafter"
    args = base_server_args(tiny_models / "llama", free_port())
    args[0] = str(venv_python)
    args += ["--speculative-algorithm", "kdtree", "--speculative-draft-model-path", str(missing)]
    result = subprocess.run(args, cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    expected = f"kdtree: --speculative-draft-model-path {missing}: the path does not exist"
    assert expected in lines, result.stderr[-3000:]
    # the one kdtree: line above SGLang's traceback, and once more as the last word, after it
    assert [line for line in lines if line.startswith("kdtree:")] == [expected, expected]
    traceback_at = next(i for i, line in enumerate(lines) if line.startswith("Traceback"))
    assert lines.index(expected) < traceback_at
    assert len(lines) - 1 - lines[::-1].index(expected) > traceback_at
