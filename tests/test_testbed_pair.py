"""The testbed pair (``testbed/``) on the CPU: corpus split, tokenizer, the ``--tiny`` build, and the
training forwards against SGLang's inference forwards of the same checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from testbed import corpus as cp  # noqa: E402
from testbed import drafter as dr  # noqa: E402
from testbed import target as tg  # noqa: E402
from testbed import tokenizer as tk  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """On two shared cores, two OpenMP threads per process slow every small matmul several-fold."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # see _one_intra_op_thread
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# ------------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------------


def test_split_rule_is_pinned_and_path_only():
    # Pinned values: a changed salt, hash or threshold moves files between the splits and must show here.
    assert [cp.is_heldout(p) for p in ("datetime.py", "dis.py", "collections/__init__.py")] == [True] * 3
    assert [cp.is_heldout(p) for p in ("json/decoder.py", "ast.py", "asyncio/tasks.py")] == [False] * 3
    fraction = sum(cp.is_heldout(f"pkg{i}/mod{i}.py") for i in range(20000)) / 20000
    assert 0.04 < fraction < 0.06


def test_split_of_the_real_stdlib_is_deterministic_and_disjoint():
    paths = cp.list_sources(cp.default_root())
    assert paths == sorted(paths) and len(paths) == len(set(paths)) and len(paths) > 100
    assert not any(part in cp.EXCLUDED_DIRS for p in paths for part in p.split("/")[:-1])
    assert not any(p.split("/")[0] in cp.EXCLUDED_TOP_DIRS for p in paths)
    heldout = {p for p in paths if cp.is_heldout(p)}
    assert 0.02 * len(paths) < len(heldout) < 0.10 * len(paths)
    again = cp.load(max_files=30, max_heldout_files=5)
    assert [f.path for f in again.heldout] == sorted(heldout)[:5]
    assert not {f.path for f in again.train} & heldout
    assert [f.path for f in again.train] == [p for p in paths if p not in heldout][:30]


def test_load_excludes_tests_generated_data_and_undecodable(tmp_path):
    files = {"a.py": "x = 1\n", "pkg/b.py": "y = 2\n", "pkg/tests/t.py": "t\n", "test/u.py": "u\n",
             "encodings/cp1.py": "e\n", "pydoc_data/topics.py": "d\n", "site-packages/s.py": "s\n",
             "pkg/notes.txt": "n\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    assert cp.list_sources(tmp_path) == ["a.py", "bad.py", "pkg/b.py"]
    # a.py and pkg/b.py land on one side each or both on one: the loader needs both sides non-empty
    sides = {p: cp.is_heldout(p) for p in ("a.py", "pkg/b.py")}
    if len(set(sides.values())) == 1:
        with pytest.raises(ValueError, match="both must be non-empty"):
            cp.load(tmp_path)
    else:
        corpus = cp.load(tmp_path)
        assert corpus.skipped_undecodable == ["bad.py"]
        assert {f.path for f in corpus.train + corpus.heldout} == {"a.py", "pkg/b.py"}
    with pytest.raises(FileNotFoundError, match="--corpus-root"):
        cp.list_sources(tmp_path / "missing")


# ------------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    corpus = cp.load(max_files=8, max_heldout_files=1)
    tok = tk.train([f.text for f in corpus.train], vocab_size=400)
    out = tmp_path_factory.mktemp("tok")
    tk.save(tok, out)
    return tok, out, corpus


def test_tokenizer_round_trips_and_pins_special_ids(small_tokenizer):
    tok, out, corpus = small_tokenizer
    samples = [corpus.heldout[0].text, "def f(x):\n\treturn x  # ünïcødé ✓ 🐍\r\n", "   \n\n", "<|mask|>",
               "".join(chr(c) for c in range(0, 600, 7))]
    for text in samples:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert [tok.token_to_id(t) for t in tk.SPECIAL_TOKENS] == [tk.EOS_ID, tk.PAD_ID, tk.MASK_ID] == [0, 1, 2]
    assert tok.encode("a<|mask|>b").ids[1] == tk.MASK_ID
    stream = tk.encode_stream(tok, ["x = 1\n", "y\n"])
    assert stream.count(tk.EOS_ID) == 2 and stream[-1] == tk.EOS_ID
    reloaded = tk.load(out)
    assert reloaded.encode(samples[1]).ids == tok.encode(samples[1]).ids
    with pytest.raises(ValueError, match="smaller vocab_size"):
        tk.train(["ab ab ab"], vocab_size=4096)


def test_tokenizer_files_load_in_transformers(small_tokenizer):
    transformers = pytest.importorskip("transformers")
    tok, out, corpus = small_tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = corpus.train[0].text[:500]
    assert hf(text, add_special_tokens=True)["input_ids"] == tok.encode(text).ids
    assert hf.decode(tok.encode(text).ids) == text
    assert (hf.mask_token_id, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (2, 0, 1, 0)


# ------------------------------------------------------------------------------------------------------
# model pieces (no SGLang)
# ------------------------------------------------------------------------------------------------------


def tiny_target(seed=0) -> tg.Llama:
    torch.manual_seed(seed)
    model = tg.Llama(tg.TargetShape(vocab_size=64, hidden=32, layers=4, heads=2, head_dim=16, intermediate=48))
    for p in model.parameters():  # larger than the init, so every position's logits differ clearly
        p.data.normal_(0, 0.2)
    return model.eval()


def test_greedy_continue_with_kv_cache_equals_recomputing_everything():
    model = tiny_target()
    prompts = torch.randint(0, 64, (3, 5))
    got = tg.greedy_continue(model, prompts, new_tokens=7, batch=2, device=torch.device("cpu"))
    seq = prompts.clone()
    with torch.no_grad():
        for _ in range(7):
            logits, _ = model(seq)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, seq)


def test_block_mask_and_multi_block_forward_equal_one_block_per_call():
    torch.manual_seed(1)
    shape = dr.DrafterShape(hidden=32, layers=2, heads=2, head_dim=16, intermediate=48, block_size=4,
                            target_layer_ids=(0, 2), num_target_layers=4, vocab_size=64)
    drafter = dr.DFlashDrafter(shape).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.2)
    mask = dr.block_mask(torch.tensor([[2, 5]]), context_len=6, block_size=4)[0, 0]
    assert mask[:4, :6].sum(1).tolist() == [2] * 4 and mask[4:, :6].sum(1).tolist() == [5] * 4
    assert mask[:4, 6:10].all() and not mask[:4, 10:].any() and mask[4:, 10:].all() and not mask[4:, 6:10].any()
    target = tiny_target()
    seqs = torch.randint(3, 64, (2, 20))
    anchors = torch.tensor([[3, 9, 16], [4, 5, 12]])
    with torch.no_grad():
        together, labels = dr.logits_and_labels(drafter, target, seqs, anchors)
        for j in range(3):
            alone, alone_labels = dr.logits_and_labels(drafter, target, seqs, anchors[:, j:j + 1])
            torch.testing.assert_close(together[:, j:j + 1], alone, rtol=0, atol=1e-5)
            assert torch.equal(labels[:, j:j + 1], alone_labels)
            # the context really ends before the anchor: features at or after it do not matter
            cut = seqs.clone()
            cut[:, anchors[0, j] + 1:] = 3
            feats = dr.target_features(target, cut, shape.target_layer_ids)
            feats[:, anchors[0, j]:] = 7.0
            redo, _ = dr.logits_and_labels(drafter, target, seqs, anchors[:, j:j + 1], feats)
            torch.testing.assert_close(redo[0], alone[0], rtol=0, atol=1e-5)
    assert labels[0, 0].tolist() == seqs[0, 4:7].tolist()


def test_greedy_walk_moves_tau_positions_a_round():
    assert dr.greedy_walk([2, 0, 0, 5, 0, 0, 0, 0, 0, 1]) == [3, 6, 2]
    assert dr.greedy_walk([0, 0]) == [1, 1]
    assert dr.greedy_walk([]) == []


def test_repeated_ngram_fraction_counts_loops_in_the_generated_part():
    from testbed.build_pair import repeated_ngram_fraction

    assert repeated_ngram_fraction(torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3]]), start=3, n=3) == 4 / 6
    assert repeated_ngram_fraction(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), start=3, n=3) == 0.0


def test_layer_ids_sglang_cannot_capture_are_refused():
    with pytest.raises(ValueError, match="capture layers 0..4 only"):
        dr.check_layer_ids((0, 2, 5), num_target_layers=6)


# ------------------------------------------------------------------------------------------------------
# the --tiny build and SGLang
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pair")
    proc = subprocess.run([sys.executable, "-m", "testbed.build_pair", "--out", str(out), "--tiny", "--device", "cpu"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("seconds")
    return out


def test_tiny_build_writes_both_checkpoints_and_metadata(tiny_pair):
    meta = json.loads((tiny_pair / "metadata.json").read_text())
    assert meta["preset"] == "tiny" and meta["seed"] == 0
    assert meta["corpus"]["python_version"] and meta["corpus"]["train"]["tokens"] > 0
    assert meta["target"]["heldout_loss"] < meta["target"]["curve"][0]["heldout_loss"]
    assert len(meta["drafter"]["heldout_offline_acceptance"]["accuracy_by_depth"]) == 15
    for part in ("target", "drafter"):
        names = sorted(p.name for p in (tiny_pair / part).iterdir())
        assert names == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                         "tokenizer_config.json"]
    draft_cfg = json.loads((tiny_pair / "drafter" / "config.json").read_text())
    assert draft_cfg["dflash_config"] == {"block_size": 16, "target_layer_ids": [0, 1, 2],
                                          "mask_token": "<|mask|>", "mask_token_id": 2}
    prompts = [json.loads(line) for line in (tiny_pair / "heldout_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and all(len(p["target_greedy_ids"]) == 64 for p in prompts)


def test_tiny_target_loads_in_transformers_with_our_logits_and_features(tiny_pair):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(str(tiny_pair / "target"))
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.vocab_size) == ("llama", True, 512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_pair / "target"), dtype=torch.float32).eval()
    ours = tg.load(tiny_pair / "target")
    ids = torch.tensor([json.loads((tiny_pair / "heldout_prompts.jsonl").read_text().splitlines()[0])["input_ids"]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        logits, captured = ours(ids, capture=(0, 1, 2))
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-4)
    for i, feature in zip((0, 1, 2), captured):
        torch.testing.assert_close(feature, out.hidden_states[i + 1], rtol=0, atol=1e-4)


SGLANG_SNIPPET = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from testbed import sglang_check as sc
    sc.prepare_cpu_sglang()
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config
    from testbed import drafter as dr
    pair = Path(sys.argv[1])
    parsed = parse_dflash_draft_config(draft_hf_config=get_config(str(pair / "drafter"), trust_remote_code=False))
    good = sc.run(pair)
    exact = dr.block_mask
    dr.block_mask = lambda anchors, t, bs: exact(anchors + 1, t, bs)  # context up to and including the anchor
    bad = sc.run(pair)
    print(json.dumps({"parsed": {"block_size": parsed.block_size, "target_layer_ids": parsed.target_layer_ids,
                                 "mask_token": parsed.mask_token, "mask_token_id": parsed.mask_token_id,
                                 "num_target_layers": parsed.num_target_layers},
                      "good": good, "bad": bad}))
""")


def test_training_forwards_match_sglang_inference_forwards(tiny_pair):
    """SGLang's LlamaForCausalLM and DFlashDraftModel on the tiny checkpoints against ours, fp32 on the CPU,
    tolerance 1e-4 x max |logit|; then the same check with an off-by-one context mask must fail."""
    pytest.importorskip("sglang")
    proc = subprocess.run([sys.executable, "-c", SGLANG_SNIPPET, str(tiny_pair)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["parsed"] == {"block_size": 16, "target_layer_ids": [0, 1, 2], "mask_token": "<|mask|>",
                                "mask_token_id": 2, "num_target_layers": 4}
    good, bad = result["good"], result["bad"]
    for part in ("target_logits", "features", "draft_logits"):
        assert good[part]["pass"], (part, good[part])
        assert good[part]["max_abs_diff"] <= good[part]["tolerance"]
    assert good["draft_rows"] == 2 * 3 * 15 and good["draft_logits"]["argmax_agreement"] == 1.0
    assert not bad["draft_logits"]["pass"] and bad["draft_logits"]["max_abs_diff"] > bad["draft_logits"]["tolerance"]
