"""Is a testbed pair the reference pair? ``DIR/metadata.json`` and DIR's files against the reference metadata
(``benchmarks/results/pair_metadata.json``: the H200 build behind RESULTS.md).

    python -m testbed.pair_check DIR [--against REF] [--record]   # exit 0: the reference's recipe and data; 1: not
    python -m testbed.pair_check --build-args [--against REF]     # build_pair's options that rebuild REF

Required to be equal:

* complete: the build ran to its end (the drafter stage is in the metadata) and both checkpoints have the
  recorded sizes;
* recipe: the sources of the modules the build runs (``RECIPE_MODULES``), as ``recipe_digest``. A metadata
  without one (the build does not write it; ``--record`` adds it) names its recipe through ``code_digest``, a
  digest of every ``testbed/*.py`` of its checkout: the current recipe if some set of the current modules that
  holds all of ``RECIPE_MODULES`` hashes to it (modules added since, which the build never imports, left out);
* settings: preset, seed, shapes, training settings, continuation sizes, parameter and byte counts;
* data: the corpus (files, bytes and sha256 of each split, held-out paths) and its token counts, which pin the
  tokenizer; where the reference records ``outputs_sha256``, also every file of the pair that the CPU writes
  (tokenizer, configs): two builds give byte-identical ones.

Printed, never required: the weights and the held-out continuations (``outputs_sha256`` of the safetensors files
and ``heldout_prompts.jsonl``). GPU training is not bit-reproducible (atomic adds in attention backward), so two
builds of one recipe can differ in the last bits, more so on another GPU model (H100 against H200) or torch
version; the line says whether they did. Likewise the package versions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from itertools import combinations
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = HERE.parent / "benchmarks" / "results" / "pair_metadata.json"
# build_pair.py and what it imports; acceptance.py, near_ties.py, sglang_check.py and this file only read a pair
RECIPE_MODULES = ("__init__.py", "build_pair.py", "corpus.py", "drafter.py", "target.py", "tokenizer.py")
# outputs of GPU arithmetic: compared with the reference's but never required to equal them
GPU_OUTPUTS = ("target/model.safetensors", "drafter/model.safetensors", "heldout_prompts.jsonl")

SETTINGS = ("preset", "seed", "tokenizer.vocab_size", "tokenizer.eos_id", "tokenizer.pad_id", "tokenizer.mask_id",
            "target.architecture", "target.shape", "target.train_settings", "target.params", "target.dtype",
            "target.bytes", "continuations.prompts", "continuations.prompt_len", "continuations.new_tokens",
            "continuations.batch", "continuations.heldout_prompts", "drafter.architecture", "drafter.shape",
            "drafter.train_settings", "drafter.params", "drafter.dtype", "drafter.bytes", "pair_bytes")
DATA = ("corpus.split_rule", "corpus.train.files", "corpus.train.bytes", "corpus.train.sha256", "corpus.train.tokens",
        "corpus.heldout.files", "corpus.heldout.bytes", "corpus.heldout.sha256", "corpus.heldout.tokens",
        "corpus.heldout_paths", "corpus.skipped_undecodable")
VERSIONS = ("versions.python", "versions.torch", "versions.tokenizers", "versions.safetensors")
MISSING = "<missing>"


def digest_of(names) -> str:
    """``build_pair.code_digest``'s hash over the named ``testbed/*.py`` files only."""
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    return h.hexdigest()[:16]


def recipe_digest() -> str:
    return digest_of(RECIPE_MODULES)


def names_current_recipe(code_digest) -> bool:
    """Whether ``code_digest`` (over every module of some checkout) covers today's recipe modules unchanged."""
    others = sorted(p.name for p in HERE.glob("*.py") if p.name not in RECIPE_MODULES)
    return any(digest_of(RECIPE_MODULES + extra) == code_digest
               for n in range(len(others) + 1) for extra in combinations(others, n))


def recipe_of(meta: dict):
    """The recipe digest a metadata names, or None where it names none this checkout can compute."""
    if meta.get("recipe_digest"):
        return meta["recipe_digest"]
    return recipe_digest() if names_current_recipe(meta.get("code_digest")) else None


def field(meta: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(meta, dict) or key not in meta:
            return MISSING
        meta = meta[key]
    return meta


def difference(mine, theirs) -> str:
    """The two values, or only their differing entries where both are dicts or lists (shapes, held-out paths)."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = [k for k in {**theirs, **mine} if mine.get(k, MISSING) != theirs.get(k, MISSING)]
        mine, theirs = ({k: d.get(k, MISSING) for k in keys} for d in (mine, theirs))
    elif isinstance(mine, list) and isinstance(theirs, list) and mine != theirs:
        if sorted(map(str, mine)) != sorted(map(str, theirs)):
            mine, theirs = ([x for x in a if x not in b] for a, b in ((mine, theirs), (theirs, mine)))
            return f"only in the pair {mine!r}, only in the reference {theirs!r}"
    return f"pair {mine!r}, reference {theirs!r}"


def differences(pair: dict, ref: dict, fields) -> list[str]:
    return [f"{f}: {difference(field(pair, f), field(ref, f))}" for f in fields if field(pair, f) != field(ref, f)]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def outputs_sha256(pair_dir: Path) -> dict:
    """sha256 of every file of the pair but ``metadata.json``, by POSIX path relative to ``pair_dir``."""
    return {p.relative_to(pair_dir).as_posix(): sha256_file(p) for p in sorted(pair_dir.rglob("*"))
            if p.is_file() and p != pair_dir / "metadata.json"}


def check_complete(pair_dir: Path, pair: dict) -> list[str]:
    problems = []
    if "drafter" not in pair:
        done = ", ".join(k for k in pair.get("timings_s", {}) if k != "total") or "none"
        problems.append(f"the build did not finish: stages done: {done}")
    for part in ("target", "drafter"):
        weights = pair_dir / part / "model.safetensors"
        want = field(pair, f"{part}.bytes")
        if not weights.is_file():
            problems.append(f"{weights} is missing")
        elif want != MISSING and weights.stat().st_size != want:
            problems.append(f"{weights}: {weights.stat().st_size} bytes, metadata says {want}")
    if not (pair_dir / "heldout_prompts.jsonl").is_file():
        problems.append(f"{pair_dir / 'heldout_prompts.jsonl'} is missing")
    return problems


def check_recipe(pair: dict, ref: dict) -> list[str]:
    mine, theirs = recipe_of(pair), recipe_of(ref)
    if mine and theirs:
        same = mine == theirs
    else:  # one side names no recipe this checkout knows: only identical checkouts are known to agree
        same = pair.get("code_digest") == ref.get("code_digest")
    if same:
        return []
    line = (f"recipe_digest: pair {mine or '?'} (code_digest {pair.get('code_digest')}), reference {theirs or '?'} "
            f"(code_digest {ref.get('code_digest')}, commit {ref.get('commit')})")
    if theirs is None:
        line += ("; the reference's code_digest names no set of this checkout's testbed modules, so the recipe"
                 " changed since it was built: rebuild it (device/device_pair_build.sh) and copy the new"
                 " metadata.json over the reference")
    return [line]


def check_outputs(pair_dir: Path, ref: dict) -> tuple[list[str], str]:
    """(differences in the CPU-written files, the informational line on the GPU-written ones)."""
    recorded = ref.get("outputs_sha256")
    found = outputs_sha256(pair_dir)
    if not recorded:
        return [], ("reference records no outputs_sha256; pair: target " + found.get(GPU_OUTPUTS[0], MISSING)[:16]
                    + ", drafter " + found.get(GPU_OUTPUTS[1], MISSING)[:16])
    cpu_written = sorted((set(recorded) | set(found)) - set(GPU_OUTPUTS))
    problems = [f"{name}: pair {found.get(name, MISSING)}, reference {recorded.get(name, MISSING)}"
                for name in cpu_written if found.get(name) != recorded.get(name)]
    differ = [name for name in GPU_OUTPUTS if found.get(name) != recorded.get(name)]
    if not differ:
        return problems, "identical to the reference's (weights and held-out continuations)"
    return problems, ("differ from the reference's (expected where GPU model or torch differ: GPU training is not "
                      "bit-reproducible): " + "; ".join(f"{n} pair {found.get(n, MISSING)[:16]}, reference "
                                                       f"{recorded.get(n, MISSING)[:16]}" for n in differ))


def check(pair_dir: Path, ref: dict) -> tuple[bool, list[str]]:
    """(whether the pair in ``pair_dir`` is the reference's recipe and data, the report's lines)."""
    meta_path = pair_dir / "metadata.json"
    if not meta_path.is_file():
        return False, [f"  complete  FAIL {meta_path} is missing: no pair here"]
    pair = json.loads(meta_path.read_text())
    file_problems, gpu_line = check_outputs(pair_dir, ref)
    groups = [("complete", check_complete(pair_dir, pair)), ("recipe", check_recipe(pair, ref)),
              ("settings", differences(pair, ref, SETTINGS)),
              ("data", differences(pair, ref, DATA) + file_problems)]
    recipe = recipe_of(pair)
    agreed = {"recipe": f"recipe_digest {recipe}" if recipe else f"code_digest {pair.get('code_digest')}",
              "data": f"corpus sha256 {str(field(pair, 'corpus.train.sha256'))[:16]} (train), "
                      f"{str(field(pair, 'corpus.heldout.sha256'))[:16]} (held out)"}
    lines = []
    for name, problems in groups:
        lines += [f"  {name:<9} FAIL {p}" for p in problems] or [f"  {name:<9} ok   {agreed.get(name, '')}".rstrip()]
    versions = differences(pair, ref, VERSIONS)
    lines.append(f"  {'weights':<9} info {gpu_line}")
    lines.append(f"  {'versions':<9} info " + ("; ".join(versions) if versions else "same as the reference's"))
    failed = [name for name, problems in groups if problems]
    lines.append("MISMATCH: " + ", ".join(failed) if failed else "MATCH")
    return not failed, lines


def record(pair_dir: Path) -> None:
    """Write ``recipe_digest`` and ``outputs_sha256`` into the metadata of a pair this checkout built."""
    meta_path = pair_dir / "metadata.json"
    meta = json.loads(meta_path.read_text())
    recipe = recipe_of(meta)
    if recipe is None:
        raise SystemExit(f"{pair_dir} was not built from this checkout's testbed (code_digest "
                         f"{meta.get('code_digest')}): nothing recorded")
    meta["recipe_digest"], meta["outputs_sha256"] = recipe, outputs_sha256(pair_dir)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def build_args(ref: dict) -> list[str]:
    """build_pair's options that rebuild the reference (its preset, seed and step counts)."""
    if ref.get("preset") not in ("full", "tiny"):
        raise SystemExit(f"reference preset {ref.get('preset')!r}: build_pair knows 'full' and 'tiny'")
    return (["--tiny"] if ref["preset"] == "tiny" else []) + [
        "--seed", str(ref["seed"]), "--target-steps", str(ref["target"]["train_settings"]["steps"]),
        "--drafter-steps", str(ref["drafter"]["train_settings"]["steps"])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pair", type=Path, nargs="?", help="the pair's folder (build_pair's --out)")
    parser.add_argument("--against", type=Path, default=REFERENCE, help=f"reference metadata (default {REFERENCE})")
    parser.add_argument("--record", action="store_true",
                        help="first write recipe_digest and outputs_sha256 into the pair's metadata.json")
    parser.add_argument("--build-args", action="store_true", help="print build_pair's options for the reference")
    args = parser.parse_args(argv)
    if args.build_args:
        print(" ".join(build_args(json.loads(args.against.read_text()))))
        return 0
    if args.pair is None:
        parser.error("give the pair's folder, or --build-args")
    if args.record and (args.pair / "metadata.json").is_file():
        record(args.pair)
    ok, lines = check(args.pair, json.loads(args.against.read_text()))
    print(f"pair {args.pair} against {args.against}")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
