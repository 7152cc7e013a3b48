"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] kdtree``).

SGLang calls ``register()`` with no arguments in every process that loads plugins (launcher, each
scheduler / TP rank, detokenizer); it must be idempotent and must not touch the GPU.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


class WorkerUnavailableError(RuntimeError):
    """Raised when a KDTREE server is started but the worker cannot be built on this installation."""


def _worker_factory(server_args):
    """Return the worker class SGLang's scheduler constructs for ``--speculative-algorithm kdtree``."""
    try:
        from sglang_kdtree.worker import KDTreeWorker
    except ImportError as exc:
        raise WorkerUnavailableError(
            "KDTREE: the DDTree worker (sglang_kdtree.worker.KDTreeWorker) is not available in this build of "
            f"sglang-kdtree ({exc}); refusing to fall back to another algorithm. Upgrade sglang-kdtree or "
            "choose a different --speculative-algorithm."
        ) from exc
    return KDTreeWorker


def register() -> None:
    """Register the KDTREE algorithm (and its SGLang patches) with SGLang. Safe to call more than once."""
    global _registered
    if _registered:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_kdtree import spec

    if get_spec(spec.ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            spec.ALGORITHM_NAME,
            supports_overlap=spec.SUPPORTS_OVERLAP,
            validate_server_args=spec.validate_server_args,
            spec_class=spec.KDTreeSpec,
        )(_worker_factory)
    from sglang_kdtree.patches import register_all

    register_all()
    _registered = True
    logger.debug("sglang-kdtree: registered speculative algorithm %s", spec.ALGORITHM_NAME)
