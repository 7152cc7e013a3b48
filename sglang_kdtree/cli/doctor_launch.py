"""Doctor check 8: a server command line through SGLang's own argument parser and KDTREE's startup checks.

``launch_args_problem`` is the one implementation; ``python -m sglang_kdtree doctor --launch-command "..."`` and
``service/install.sh``'s preflight both call it, so a flag the server would refuse at startup (before it loads
anything) is reported before a restart. ``doctor`` also checks the command's checkpoints (check 7) unless its own
``--model-path`` / ``--speculative-draft-model-path`` name them: a launch that parses but names a folder that is
not there would otherwise pass here and fail at the weight load.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_kdtree.gpu.limits import DeviceLimits


def parse_launch_args(argv: list[str]) -> tuple[argparse.Namespace | None, str | None]:
    """``(namespace, None)`` from SGLang's own argument parser, or ``(None, why it refuses them)``."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv), None
    except SystemExit:
        lines = err.getvalue().strip().splitlines() or ["(no message)"]
        return None, f"SGLang's argument parser refuses it: {lines[-1]}"  # its last line; the rest is the usage


def launch_args_problem(argv: list[str], limits: "DeviceLimits | None" = None) -> str | None:
    """Why ``python -m sglang.launch_server`` with these arguments would stop at startup, or None.

    SGLang's argument parser first (an unknown flag, a bad value), then ``kdtree_problem`` on what it parsed.
    ``limits``: the GPU to judge for (``spec.device_limits``); None: this machine's, as the server would."""
    namespace, problem = parse_launch_args(argv)
    return problem if problem is not None else kdtree_problem(namespace, limits)


def kdtree_problem(namespace: argparse.Namespace, limits: "DeviceLimits | None" = None) -> str | None:
    """For ``--speculative-algorithm kdtree``: ``spec.validate_server_args`` on parsed server arguments (the checks
    the plugin runs during SGLang's argument resolution), every problem in one block; None otherwise."""
    from sglang_kdtree import state
    from sglang_kdtree.server import spec

    if not state.is_kdtree(getattr(namespace, "speculative_algorithm", None)):
        return None
    try:
        spec.validate_server_args(namespace, limits)
    except ValueError as exc:
        from sglang_kdtree.plugin import refusal_block

        return refusal_block(str(exc))  # every problem of the launch, as the server would print them
    return None


def server_argv(command_line: str) -> list[str]:
    """The server's arguments in a command line: what follows ``sglang.launch_server`` (or ``sglang serve``)
    when present, else the whole line."""
    argv = shlex.split(command_line)
    for i, word in enumerate(argv):
        if word == "sglang.launch_server" or (word == "serve" and i > 0 and argv[i - 1].endswith("sglang")):
            return argv[i + 1:]
    return argv


def check_launch_command(report, command_line: str, limits: "DeviceLimits | None" = None,
                         checkpoints: bool = True) -> bool:
    """Check 8, then (``checkpoints``) check 7 on the checkpoints the command names."""
    namespace, problem = parse_launch_args(server_argv(command_line))
    if namespace is not None:
        problem = kdtree_problem(namespace, limits)
    if problem is None:
        where = f" (for {limits.arch_name})" if limits is not None else ""
        report.ok(f"launch command: passes SGLang's argument parser and KDTREE's startup checks{where}")
    else:
        report.fail(f"launch command would not start: {problem}", "change the command line as the message says")
    if checkpoints and namespace is not None:
        from sglang_kdtree.cli.doctor_checkpoints import check_drafter, check_target

        layers = None
        if getattr(namespace, "model_path", None):
            layers = check_target(report, namespace.model_path, bool(namespace.trust_remote_code)) or None
        if getattr(namespace, "speculative_draft_model_path", None):
            check_drafter(report, namespace.speculative_draft_model_path,
                          getattr(namespace, "speculative_dflash_block_size", None), layers)
    return problem is None
