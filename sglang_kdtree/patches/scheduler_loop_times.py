"""Time the steps of SGLang's scheduler loop when ``KDTREE_HOST_TIMES`` is set (``sglang_kdtree.server.host_times``).

SGLang symbols wrapped (``HookType.AROUND``, SGLang 0.5.23), only with ``KDTREE_HOST_TIMES`` set:
``sglang.srt.managers.scheduler.Scheduler.ingest_requests`` (a pass of the loop starts),
``...Scheduler.get_next_batch_to_run``, ``...Scheduler.run_batch``, ``...Scheduler.process_batch_result`` and
``...Scheduler.launch_batch_sample_if_needed``; ``run_batch``'s result gets a ``copy_done`` that times its wait.

Why: whether overlap scheduling pays on a host-paced target is decided by the host's time per round, and which
step of the loop it goes to (``host_times``'s docstring). Each call still runs SGLang's own function, with its
arguments and result; the only change is the result's ``copy_done``, wrapped so that ``synchronize()`` is timed
(``host_times.TimedWait``; every other attribute is the event's). Unset, nothing is registered.
"""

from __future__ import annotations

from sglang_kdtree.server import host_times

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
#: Scheduler method -> the loop step it is timed as
STEPS = {"ingest_requests": "ingest", "get_next_batch_to_run": "schedule", "run_batch": "launch",
         "process_batch_result": "process", "launch_batch_sample_if_needed": "sample"}
TARGETS = tuple(f"{SCHEDULER}.{method}" for method in STEPS)


def ingest_requests(original, *args, **kwargs):
    if not host_times.LOOP.bound:
        from sglang.srt.runtime_context import get_parallel

        host_times.LOOP.bind_rank(get_parallel().tp_rank)
    host_times.LOOP.begin_pass()
    return host_times.LOOP.timed("ingest", original, *args, **kwargs)


def run_batch(original, scheduler, batch, *args, **kwargs):
    result = host_times.LOOP.timed("launch", original, scheduler, batch, *args, **kwargs)
    if batch.forward_mode.is_decode():
        host_times.LOOP.launched_decode(batch.batch_size())
    if getattr(result, "copy_done", None) is not None:
        result.copy_done = host_times.TimedWait(result.copy_done, host_times.LOOP)
    return result


def _step_hook(step: str):
    def hook(original, *args, **kwargs):
        return host_times.LOOP.timed(step, original, *args, **kwargs)

    hook.__name__ = f"timed_{step}"
    return hook


def hooks() -> dict:
    """target -> AROUND hook."""
    special = {"ingest_requests": ingest_requests, "run_batch": run_batch}
    return {f"{SCHEDULER}.{method}": special.get(method) or _step_hook(step) for method, step in STEPS.items()}


def register() -> None:
    """Register the AROUND hooks with SGLang's ``HookRegistry`` when ``KDTREE_HOST_TIMES`` names a file."""
    if not host_times.enabled():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in hooks().items():
        HookRegistry.register(target, hook, HookType.AROUND)
