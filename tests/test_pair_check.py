"""The testbed pair's check against the reference metadata (``testbed/pair_check.py``) and the device scripts'
``ensure_pair`` (``device/steps.sh``), on the CPU: the reference's own metadata, altered copies of it, and the
``--tiny`` build."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testbed import pair_check as pc  # noqa: E402

REFERENCE = json.loads(pc.REFERENCE.read_text())


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **extra)  # two shared cores; the CPU build
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # ensure_pair runs `python3`: this interpreter, which has torch
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def write_pair(folder: Path, meta: dict) -> Path:
    """A pair folder with ``meta`` as its metadata and weight files of the recorded sizes (sparse, zeros)."""
    for part in ("target", "drafter"):
        (folder / part).mkdir(parents=True, exist_ok=True)
        with (folder / part / "model.safetensors").open("wb") as f:
            f.truncate(meta[part]["bytes"])
    (folder / "heldout_prompts.jsonl").write_text("{}\n")
    (folder / "metadata.json").write_text(json.dumps(meta))
    return folder


def altered(meta: dict, dotted, value) -> dict:
    """A copy of ``meta`` with one field replaced: ``dotted`` is "a.b.c", or a tuple of keys holding dots."""
    meta = copy.deepcopy(meta)
    *path, last = dotted.split(".") if isinstance(dotted, str) else dotted
    node = meta
    for key in path:
        node = node[key]
    node[last] = value
    return meta


def run_check(pair: Path, ref: dict) -> tuple[bool, str]:
    ok, lines = pc.check(pair, ref)
    return ok, "\n".join(lines)


def test_the_reference_names_this_checkouts_recipe():
    assert pc.recipe_of(REFERENCE) == pc.recipe_digest(), (
        f"the testbed's recipe modules {pc.RECIPE_MODULES} changed since the reference pair was built (its "
        f"code_digest {REFERENCE['code_digest']}): the device scripts would build another pair and refuse it. "
        "Rebuild it on the GPU machine (device/device_pair_build.sh) and copy the pair_metadata.json that comes "
        "back over benchmarks/results/pair_metadata.json")


def test_a_pair_with_the_references_metadata_matches(tmp_path):
    ok, report = run_check(write_pair(tmp_path, REFERENCE), REFERENCE)
    assert ok, report
    assert f"recipe    ok   recipe_digest {pc.recipe_digest()}" in report
    assert "reference records no outputs_sha256" in report and report.endswith("MATCH")


@pytest.mark.parametrize("dotted, value, group, both", [
    ("code_digest", "0123456789abcdef", "recipe", ("code_digest 0123456789abcdef", "code_digest 7388000e00c25917")),
    ("recipe_digest", "fedcba9876543210", "recipe", ("pair fedcba9876543210", f"reference {pc.recipe_digest()}")),
    ("corpus.train.sha256", "0" * 64, "data", ("0" * 64, REFERENCE["corpus"]["train"]["sha256"])),
    ("corpus.heldout.tokens", 131066, "data", ("pair 131066", "reference 131065")),
    ("seed", 1, "settings", ("seed: pair 1", "reference 0")),
    ("target.shape.hidden", 384, "settings", ("target.shape: pair {'hidden': 384}", "reference {'hidden': 320}")),
])
def test_a_changed_recipe_setting_or_corpus_fails_naming_both_values(tmp_path, dotted, value, group, both):
    ok, report = run_check(write_pair(tmp_path, altered(REFERENCE, dotted, value)), REFERENCE)
    assert not ok and report.endswith(f"MISMATCH: {group}"), report
    fail = [line for line in report.splitlines() if " FAIL " in line]
    assert len(fail) == 1 and fail[0].startswith(f"  {group}"), report
    assert all(value_text in fail[0] for value_text in both), fail[0]


def test_changed_held_out_paths_name_only_the_differing_ones(tmp_path):
    paths = REFERENCE["corpus"]["heldout_paths"][1:] + ["zz_new.py"]
    ok, report = run_check(write_pair(tmp_path, altered(REFERENCE, "corpus.heldout_paths", paths)), REFERENCE)
    assert not ok
    assert "only in the pair ['zz_new.py'], only in the reference ['_distutils_system_mod.py']" in report


def test_a_reference_of_another_recipe_says_to_rebuild_it(tmp_path):
    ref = altered(REFERENCE, "code_digest", "0123456789abcdef")
    ok, report = run_check(write_pair(tmp_path, REFERENCE), ref)
    assert not ok and "names no set of this checkout's testbed modules" in report
    assert "code_digest 7388000e00c25917" in report and "code_digest 0123456789abcdef" in report


def test_an_unfinished_or_truncated_build_is_not_the_pair(tmp_path):
    # metadata.json as a build stopped in its drafter stage leaves it
    unfinished = {k: v for k, v in REFERENCE.items() if k not in ("drafter", "pair_bytes")}
    unfinished["timings_s"] = {k: v for k, v in REFERENCE["timings_s"].items() if k != "drafter"}
    pair = write_pair(tmp_path / "a", REFERENCE)
    (pair / "metadata.json").write_text(json.dumps(unfinished))
    ok, report = run_check(pair, REFERENCE)
    assert not ok and "the build did not finish: stages done: corpus, tokenizer, target, continuations" in report
    truncated = write_pair(tmp_path / "b", REFERENCE)
    with (truncated / "target" / "model.safetensors").open("r+b") as f:
        f.truncate(100)
    ok, report = run_check(truncated, REFERENCE)
    assert not ok and f"100 bytes, metadata says {REFERENCE['target']['bytes']}" in report
    ok, report = run_check(tmp_path / "none", REFERENCE)
    assert not ok and "metadata.json is missing: no pair here" in report


def test_build_args_rebuild_the_reference():
    assert pc.build_args(REFERENCE) == ["--seed", "0", "--target-steps", "600", "--drafter-steps", "4000"]
    assert pc.build_args(altered(REFERENCE, "preset", "tiny"))[0] == "--tiny"
    with pytest.raises(SystemExit, match="'huge'"):
        pc.build_args(altered(REFERENCE, "preset", "huge"))


# ------------------------------------------------------------------------------------------------------
# the --tiny build: --record, the files' digests, ensure_pair
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    """A --tiny pair with recipe_digest and outputs_sha256 recorded: the form a new reference takes."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    out = tmp_path_factory.mktemp("pair")
    build = subprocess.run([sys.executable, "-m", "testbed.build_pair", "--out", str(out), "--tiny", "--device", "cpu"],
                           cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "testbed.pair_check", str(out), "--against",
                            str(out / "metadata.json"), "--record"],
                           cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.endswith("MATCH\n"), check.stdout + check.stderr
    return out


def test_record_adds_the_recipe_and_every_files_digest(tiny_pair):
    meta = json.loads((tiny_pair / "metadata.json").read_text())
    assert meta["recipe_digest"] == pc.recipe_digest()
    assert set(meta["outputs_sha256"]) == {p.relative_to(tiny_pair).as_posix() for p in tiny_pair.rglob("*")
                                           if p.is_file()} - {"metadata.json"}
    assert set(pc.GPU_OUTPUTS) <= set(meta["outputs_sha256"])


def test_other_weights_are_reported_but_other_tokenizer_files_fail(tiny_pair):
    ref = json.loads((tiny_pair / "metadata.json").read_text())
    ok, report = run_check(tiny_pair, ref)
    assert ok and "weights   info identical to the reference's" in report
    real = ref["outputs_sha256"]["target/model.safetensors"]
    ok, report = run_check(tiny_pair, altered(ref, ("outputs_sha256", "target/model.safetensors"), "ab" * 32))
    assert ok, report
    assert "differ from the reference's" in report and f"pair {real[:16]}, reference abababababababab" in report
    tok = ref["outputs_sha256"]["tokenizer/tokenizer.json"]
    ok, report = run_check(tiny_pair, altered(ref, ("outputs_sha256", "tokenizer/tokenizer.json"), "cd" * 32))
    assert not ok and f"tokenizer/tokenizer.json: pair {tok}, reference {'cd' * 32}" in report


def ensure_pair(folder: Path, reference: Path, logs: Path) -> subprocess.CompletedProcess:
    script = 'DEADLINE=300; LOGS=$1; source device/steps.sh; ensure_pair "$2"'
    return subprocess.run(["bash", "-c", script, "ensure_pair", str(logs), str(folder)], cwd=REPO,
                          env=subprocess_env(OUT=str(logs.parent / "out"), PAIR_REFERENCE=str(reference),
                                             PAIR_DEVICE="cpu"),
                          capture_output=True, text=True, timeout=300)


def test_ensure_pair_keeps_a_matching_pair_and_builds_a_missing_one_then_fails_loudly(tiny_pair, tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    reference = tiny_pair / "metadata.json"
    found = ensure_pair(tiny_pair, reference, tmp_path / "logs")
    assert found.returncode == 0, found.stdout + found.stderr
    assert "is the reference's recipe" in found.stdout and "building" not in found.stdout
    assert "build_pair" not in (tmp_path / "out" / "steps.txt").read_text()

    # another corpus in the reference: the missing pair is built, then refused with both digests
    ref = json.loads(reference.read_text())
    other = tmp_path / "other_reference.json"
    other.write_text(json.dumps(altered(ref, "corpus.heldout.sha256", "e" * 64)))
    built = tmp_path / "built"
    refused = ensure_pair(built, other, tmp_path / "logs")
    assert f"building the testbed pair (about 3 min) into {built}" in refused.stdout
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "build_pair rc=0" in (tmp_path / "out" / "steps.txt").read_text()
    assert f"corpus.heldout.sha256: pair '{ref['corpus']['heldout']['sha256']}', reference '{'e' * 64}'" \
        in refused.stdout
    assert "NOT the reference's recipe" in refused.stdout
    assert json.loads((tmp_path / "out" / "pair_metadata.json").read_text())["recipe_digest"] == pc.recipe_digest()

    # that build against the true reference: kept, and (CPU builds are deterministic) the same weights
    kept = ensure_pair(built, reference, tmp_path / "logs")
    assert kept.returncode == 0 and "building" not in kept.stdout, kept.stdout + kept.stderr
    assert "weights   info identical to the reference's" in kept.stdout
