"""SGLang plugin entry point (``[project.entry-points."sglang.srt.plugins"] kdtree``).

SGLang calls ``register()`` with no arguments in every process that loads plugins (launcher, each
scheduler / TP rank, detokenizer); it must be idempotent and must not touch the GPU.

Startup refusals: every ``ValueError`` the plugin raises while SGLang resolves the server arguments is printed as
one ``kdtree:`` block on stderr (a line per problem: a launch with several mistakes names all of them), when it is
raised and once more at exit, after SGLang's traceback.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

_registered = False
_resolution_hook_registered = False
#: Why ``register()`` could not finish (the algorithm may be registered while its patches are not): a
#: KDTREE server is then refused at startup instead of running half-patched.
_load_error: str | None = None


class WorkerUnavailableError(RuntimeError):
    """Raised when a KDTREE server is started but the worker cannot be built on this installation."""


def refusal_block(message: str) -> str:
    """A refusal's text as one ``kdtree:`` block: a line per problem (each message line, without its ``KDTREE:``
    tag), under a count when there are several."""
    lines = []
    for line in str(message).splitlines():
        text = " ".join(line.split())
        if text[:7].upper() == "KDTREE:":
            text = text[7:].lstrip()
        if text:
            lines.append(text)
    if len(lines) == 1:
        return f"kdtree: {lines[0]}"
    return "\n".join([f"kdtree: {len(lines)} problems with this launch:"] + [f"kdtree:   {x}" for x in lines])


_last_words: list = []


def _print_last_words() -> None:
    for block in _last_words:
        print(block, file=sys.stderr, flush=True)


def report_refusal(message: str) -> None:
    """Print the refusal's ``kdtree:`` block on stderr now, and once more when the process exits, after the
    traceback SGLang's launcher prints, so the last lines a user sees name every problem and its fix."""
    block = refusal_block(message)
    print(block, file=sys.stderr, flush=True)
    if not _last_words:
        import atexit

        atexit.register(_print_last_words)
    if block not in _last_words:
        _last_words.append(block)


def refuse(message: str) -> ValueError:
    """Report a startup refusal on stderr and return the ``ValueError`` to raise."""
    report_refusal(message)
    return ValueError(message)


def missing_path_problem(flag: str, path: str | None) -> str | None:
    """Why ``path`` (the value of ``flag``) cannot name a checkpoint, or None.

    None for an existing path, a remote URI, or a Hugging Face repo id that is not a local path (SGLang
    downloads those). Anything else that does not exist is reported: an absolute or ``./``-style path, or a
    string that is not a valid repo id either.
    """
    if path is None or "://" in str(path):
        return None
    path = str(path)
    if os.path.exists(os.path.expanduser(path)):
        return None
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.endswith(os.sep)
    if not looks_local:
        try:
            from huggingface_hub.utils import validate_repo_id

            validate_repo_id(path)
            return None  # e.g. "org/model": SGLang will fetch it from the Hub
        except Exception:
            pass
    return f"{flag} {path}: the path does not exist"


def _check_model_paths(server_args, previous) -> None:
    """Resolution step ``handle_model_source_paths`` for KDTREE servers: refuse missing checkpoint paths
    before SGLang's model-config readers turn them into a Hugging Face repo-id error."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_kdtree import state

    cfg = resolving_view(server_args)
    if state.is_kdtree(cfg.speculative_algorithm):
        problems = [
            problem
            for problem in (
                missing_path_problem("--model-path", cfg.model_path),
                missing_path_problem("--speculative-draft-model-path", cfg.speculative_draft_model_path),
            )
            if problem
        ]
        if problems:
            raise refuse("KDTREE: " + "; ".join(problems))
    previous(server_args)


def _validate_server_args(server_args) -> None:
    """``spec.validate_server_args`` with its refusals reported as one ``kdtree: ...`` line."""
    from sglang_kdtree.server import spec

    if _load_error is not None:
        raise refuse(
            f"KDTREE: the sglang-kdtree plugin did not load completely ({_load_error}); refusing to start "
            "half-patched. Run `python -m sglang_kdtree doctor` for the cause and the fix"
        )
    try:
        spec.validate_server_args(server_args)
    except ValueError as exc:
        report_refusal(str(exc))
        raise


def _worker_factory(server_args):
    """Return the worker class SGLang's scheduler constructs for ``--speculative-algorithm kdtree``."""
    try:
        from sglang_kdtree.round.worker import KDTreeWorker
    except ImportError as exc:
        message = (
            "KDTREE: the DDTree worker (sglang_kdtree.round.worker.KDTreeWorker) is not available in this build of "
            f"sglang-kdtree ({exc}); refusing to fall back to another algorithm. Upgrade sglang-kdtree or "
            "choose a different --speculative-algorithm."
        )
        report_refusal(message)
        raise WorkerUnavailableError(message) from exc
    return KDTreeWorker


def register() -> None:
    """Register the KDTREE algorithm (and its SGLang patches) with SGLang. Safe to call more than once."""
    global _registered, _resolution_hook_registered, _load_error
    if _registered:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_kdtree import state
    from sglang_kdtree.server import spec

    if get_spec(state.ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(
            state.ALGORITHM_NAME,
            supports_overlap=spec.SUPPORTS_OVERLAP,
            validate_server_args=_validate_server_args,
            spec_class=spec.KDTreeSpec,
        )(_worker_factory)
    if not _resolution_hook_registered:
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook("handle_model_source_paths")(_check_model_paths)
        _resolution_hook_registered = True
    try:
        from sglang_kdtree.patches import register_all

        register_all()
    except Exception as exc:
        _load_error = f"registering its SGLang patches raised {type(exc).__name__}: {exc}"
        report_refusal(f"plugin registration failed: {_load_error}")
        raise
    _load_error = None
    _registered = True
    logger.debug("sglang-kdtree: registered speculative algorithm %s", state.ALGORITHM_NAME)
