"""A byte-level BPE trained on the corpus's training split, saved in the Hugging Face format SGLang loads.

Ids 0..2 are the special tokens, then the 256 byte symbols, then the merges:

* ``<|endoftext|>`` (0): end of a file in the training stream; it is also the bos and eos token (GPT-2's
  convention: the stream has no separate start token, and SGLang adds none);
* ``<|pad|>`` (1): padding only, never in the training stream;
* ``<|mask|>`` (2): the DFlash drafter's mask token. Its id is written into the drafter's
  ``dflash_config.mask_token_id``; SGLang checks that the tokenizer maps ``mask_token`` to the same id.

Byte-level means every string round-trips exactly (``decode(encode(s)) == s``), which serving relies on.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS_TOKEN, PAD_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
MODEL_MAX_LENGTH = 2048


def train(texts: list[str], vocab_size: int):
    """Train the BPE on ``texts`` (deterministic for a given input order); returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [EOS_ID, PAD_ID, MASK_ID]:
        raise RuntimeError(f"special tokens got ids {ids}, expected {[EOS_ID, PAD_ID, MASK_ID]}")
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the BPE reached {tok.get_vocab_size()} tokens, not {vocab_size}: the training text is "
                         "too small for that vocabulary; use a smaller vocab_size")
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json``, written by hand so the files do not depend on the transformers version."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN,
        "unk_token": None,
        "added_tokens_decoder": added,
        # Any clean-up would break the byte-exact round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def save(tok, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def copy_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def encode_stream(tok, texts: list[str]) -> list[int]:
    """The files in order as one token stream, each followed by ``<|endoftext|>``."""
    stream: list[int] = []
    for enc in tok.encode_batch(texts):
        stream.extend(enc.ids)
        stream.append(EOS_ID)
    return stream
