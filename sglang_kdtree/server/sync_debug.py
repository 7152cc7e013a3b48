"""``KDTREE_SYNC_DEBUG``: every host synchronisation inside a decode round, written down with where it came from.

The overlap scheduler only overlaps if the round never waits for the device. ``tests/test_host_syncs.py`` checks
that statically (no ``.item()``, ``.cpu()``, ... in the round's modules); this is the same check on a live CUDA
server, through torch's own detector (``torch.cuda.set_sync_debug_mode("warn")``), scoped to the decode round so
that the scheduler's reads of the round's results, which come after the round, are not counted. It sees what torch
sees: a sync inside CuPy or a custom extension is invisible to it, which is what the static check is for.

Off unless ``KDTREE_SYNC_DEBUG`` names a file; then each sync is one JSON line ``{"file", "line", "message"}``
(``file:line`` is the Python line that called the synchronising operation). The scheduler runs the round on one
thread, which ``warnings.catch_warnings`` needs. Without CUDA there is nothing to detect and the round runs as it is.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

SYNC_DEBUG_ENV = "KDTREE_SYNC_DEBUG"
#: torch's warning text for a synchronising call in "warn" mode (c10/cuda/CUDAFunctions.cpp)
SYNC_MESSAGE = "called a synchronizing CUDA operation"

_PATH = os.environ.get(SYNC_DEBUG_ENV) or None
if _PATH and not torch.cuda.is_available():
    logger.warning("%s=%s: no CUDA device, so no synchronisation can be detected; the round runs unwatched",
                   SYNC_DEBUG_ENV, _PATH)


def watch(round_fn, *args):
    """``round_fn(*args)``, with every host sync it makes appended to ``$KDTREE_SYNC_DEBUG`` when that is set."""
    if _PATH is None or not torch.cuda.is_available():
        return round_fn(*args)
    previous = torch.cuda.get_sync_debug_mode()
    with record_syncs(_PATH):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return round_fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def record_syncs(path: str):
    """Append each sync warning raised inside the block to ``path`` (one JSON line each); other warnings are
    raised again, as if the block had not been watched."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
            if syncs:
                with open(path, "a") as f:
                    for w in syncs:
                        f.write(json.dumps({"file": w.filename, "line": w.lineno,
                                            "message": str(w.message)[:200]}) + "\n")
    for w in caught:
        if SYNC_MESSAGE not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
