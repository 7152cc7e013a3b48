"""The committed tiny models (tests/e2e/tiny_models) are the current generator's build.

The end-to-end servers load them instead of fitting the four models at every run. When
``tests/e2e/make_tiny_models.py`` changes, the e2e fixture falls back to building into a temp folder; this
test fails so the committed copy is rebuilt with the command in its message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent / "e2e"
sys.path.insert(0, str(E2E))
import make_tiny_models  # noqa: E402

COMMITTED = E2E / "tiny_models"
REBUILD = "python tests/e2e/make_tiny_models.py tests/e2e/tiny_models"


def test_committed_tiny_models_are_the_generators_build():
    manifest = json.loads((COMMITTED / "MANIFEST.json").read_text())
    assert manifest["source_hash"] == make_tiny_models.source_hash(), (
        f"tests/e2e/make_tiny_models.py changed since tests/e2e/tiny_models was built: run {REBUILD}")
    assert manifest["vocab_size"] == make_tiny_models.VOCAB_SIZE
    assert manifest["block_size"] == make_tiny_models.BLOCK_SIZE
    assert sorted(manifest["models"]) == ["dsv3", "llama"]
    for name in manifest["models"]:
        for folder in (name, f"{name}-dflash"):
            config = json.loads((COMMITTED / folder / "config.json").read_text())
            assert (COMMITTED / folder / "model.safetensors").stat().st_size > 0, folder
            assert config["vocab_size"] == make_tiny_models.VOCAB_SIZE, folder
