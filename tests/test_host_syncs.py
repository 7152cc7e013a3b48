"""No new host synchronisation on the decode round's path: an ``ast`` scan against an explicit allow-list.

SGLang's overlap scheduler issues round k+1 while round k runs on the device; one host read of a device value in
the round (``.item()``, ``.tolist()``, ``.cpu()``, a pageable host-to-device copy, ...) makes the host wait for
the device and the overlap is lost. The scan flags the calls that can do that; each one that is allowed is listed
in ``ALLOWED`` as ``(module, function, call): (count, reason)``. A call not listed (or one more of a listed kind
in the same function) fails with its file:line; a listed entry whose calls are gone fails too, so the list stays
exact. What the scan cannot see (a boolean-mask gather ``x[mask]``, ``bool(tensor)`` of a plain name) is for a
CUDA run under ``torch.cuda.set_sync_debug_mode("error")``.

By this package's naming convention a name ending in ``_cpu`` holds a host tensor: its reductions are not flagged.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sglang_kdtree"

#: the modules a decode round runs (serving only: offline tools, kernels' numpy twins and startup checks are not)
DECODE_PATH = (
    "round/*.py", "contract.py", "state.py", "server/prewarm.py", "server/sync_debug.py", "server/host_times.py",
    "reference/backend.py", "gpu/*.py", "patches/*.py", "moe/forward.py", "moe/launch.py", "moe/routing.py",
    "moe/weights.py",
)
#: numpy / float64 twins of kernels under the globs above: the tests run them, a server never does
NOT_SERVED = {"gpu/mla_reference.py"}

#: methods whose call reads a device value on the host (or waits for the device)
_SYNC_METHODS = {"item", "tolist", "cpu", "numpy", "synchronize", "empty_cache", "nonzero"}
_REDUCTIONS = {"any", "all", "sum", "max", "min"}
_HOST_BUILT = {"tensor", "as_tensor", "from_numpy"}

ALLOWED: dict[tuple[str, str, str], tuple[int, str]] = {
    # the round's fault words, on the host once SGLang has the round's results (not on the round's path)
    ("round/faults.py", "finish_faulty_requests", ".tolist()"):
        (1, "a host copy, read in on_verify_complete_cpu after SGLang's copy_done: it has landed, no wait"),
    ("round/faults.py", "release_round_caches", ".empty_cache()"): (1, "failure path: OOM retry"),
    ("round/width_choice.py", "DeviceTimer.read", ".tolist()"):
        (1, "a pinned host copy read only once its end event has completed (settle checks ready()): no wait"),
    ("round/width_choice.py", "DeviceTimer.wait", ".synchronize()"):
        (1, "only settle(wait=True), which only the round log calls (diagnostics, KDTREE_ROUND_LOG)"),
    ("round/width_choice.py", "agreed_width", ".tolist()"):
        (1, "TP > 1, automatic width: a CPU tensor of a gloo broadcast between the ranks' host processes, no device"),
    ("round/width_choice.py", "HostTimer.read", ".tolist()"):
        (1, "a host tensor: the CPU server's statistics never left the host"),
    # seeded prefill (T > 0 requests with sampling_seed, outside deterministic mode)
    ("reference/backend.py", "_np", '.to("cpu")'):
        (1, "reference backend: numpy by design (on CUDA only the seeded prefill's draw uses it)"),
    ("reference/backend.py", "_np", ".numpy()"):
        (1, "reference backend: numpy by design (on CUDA only the seeded prefill's draw uses it)"),
    ("reference/backend.py", "ReferenceBackend._t", "host tensor .to(device)"):
        (1, "reference backend: numpy by design (on CUDA only the seeded prefill's draw uses it)"),
    # opt-in diagnostics
    ("round/log.py", "RoundMarks._steps", ".synchronize()"): (1, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "_sibling_accepts", '.to("cpu")'): (3, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "_sibling_accepts", ".tolist()"): (2, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "write_round_record", '.to("cpu")'): (1, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "write_round_record", ".tolist()"): (1, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "_depth_reach", '.to("cpu")'): (1, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "_depth_reach", ".tolist()"): (1, "diagnostics only (KDTREE_ROUND_LOG)"),
    ("round/log.py", "dump_verify", ".cpu()"): (5, "diagnostics only (KDTREE_DUMP_VERIFY, first rounds)"),
    ("gpu/mla_attention.py", "launch_counts", ".item()"): (1, "diagnostics only (the round log's kernel counts)"),
    ("patches/mla_tree_verify.py", "check_stats", ".tolist()"): (1, "diagnostics only (SGLANG_KDTREE_MLA=check)"),
    # test and debug modes
    ("round/verify_input.py", "host_prefix_lens", '.to("cpu")'): (1, "check mode (KDTREE_CHECK_HOST_LENS, e2e tests)"),
    ("round/verify_input.py", "host_prefix_lens", ".tolist()"): (2, "check mode: the failure's message"),
    ("round/verify_input.py", "host_prefix_lens", "bool(.any())"): (1, "check mode: compares two host copies"),
    ("gpu/topk.py", "raise_on_flag", ".item()"): (1, "check=True test mode"),
    ("gpu/errors.py", "error_bits", ".tolist()"): (1, "check=True test mode and error messages"),
    ("moe/routing.py", "raise_on_route_error", ".item()"): (1, "tests and debugging"),
    ("gpu/verify.py", "verify_outputs", ".item()"): (1, "only without seq_lens_sum; the worker always passes it"),
    ("patches/torch_native_verify.py", "verify_attention", ".tolist()"):
        (2, "the CPU verify attention (torch_native), host-side by design"),
    # startup
    ("server/prewarm.py", "prewarm_round", ".synchronize()"): (2, "startup (the round's rehearsal)"),
    ("moe/weights.py", "pack_int4", "bool(.any())"): (1, "startup (weight packing)"),
    ("gpu/runtime.py", "launch", ".item()"): (1, "numpy scalars of a kernel launch's arguments (host values)"),
}


def _host_name(node: ast.expr) -> bool:
    """``x_cpu`` / ``obj.x_cpu``: a host tensor by the package's naming convention."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("_cpu")


def _sync_kind(node: ast.Call) -> str | None:
    """The kind of host sync ``node`` can be, or None."""
    f = node.func
    if isinstance(f, ast.Attribute):
        if f.attr in _SYNC_METHODS:
            return f".{f.attr}()"
        if f.attr == "to":
            targets = list(node.args[:1]) + [k.value for k in node.keywords if k.arg == "device"]
            if any(isinstance(a, ast.Constant) and a.value == "cpu" for a in targets):
                return '.to("cpu")'
            built = f.value
            if (isinstance(built, ast.Call) and isinstance(built.func, ast.Attribute)
                    and built.func.attr in _HOST_BUILT and not any(k.arg == "device" for k in built.keywords)):
                return "host tensor .to(device)"  # a pageable copy: the host waits for it
        if (f.attr in ("tensor", "as_tensor") and isinstance(f.value, ast.Name) and f.value.id == "torch"
                and any(k.arg == "device" for k in node.keywords)):
            return "torch.tensor(device=)"
    if isinstance(f, ast.Name) and f.id in ("bool", "int", "float") and len(node.args) == 1:
        arg = node.args[0]
        if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in _REDUCTIONS
                and not _host_name(arg.func.value)):
            return f"{f.id}(.{arg.func.attr}())"
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self):
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []  # (function, kind, line)

    def _enter(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call):
        kind = _sync_kind(node)
        if kind is not None:
            self.found.append((".".join(self.scope) or "<module>", kind, node.lineno))
        self.generic_visit(node)


def scan(source: str) -> list[tuple[str, str, int]]:
    """``(function, kind, line)`` of every call in ``source`` that can sync the host with the device."""
    visitor = _Scan()
    visitor.visit(ast.parse(source))
    return visitor.found


def violations(sources: dict[str, str], allowed: dict) -> list[str]:
    """Calls beyond the allow-list (``file:line``), and allow-list entries with fewer calls than listed."""
    lines: dict[tuple[str, str, str], list[int]] = {}
    for module, source in sources.items():
        for function, kind, line in scan(source):
            lines.setdefault((module, function, kind), []).append(line)
    errors = []
    for key, at in sorted(lines.items()):
        count = allowed.get(key, (0, ""))[0]
        if len(at) > count:
            where = ", ".join(f"{key[0]}:{n}" for n in at)
            errors.append(f"{where}: {key[2]} in {key[1]} ({len(at)} found, {count} allowed): a host sync on the "
                          f"decode path; remove it, or add it to ALLOWED with the reason it may stay")
    counts = Counter({k: len(v) for k, v in lines.items()})
    for key, (count, _) in sorted(allowed.items()):
        if counts[key] < count:
            errors.append(f"ALLOWED lists {count} x {key[2]} in {key[0]}:{key[1]}, found {counts[key]}: "
                          f"update the entry")
    return errors


def _decode_path_sources() -> dict[str, str]:
    out = {}
    for pattern in DECODE_PATH:
        paths = sorted(ROOT.glob(pattern))
        assert paths, f"{pattern} matches no module"
        for path in paths:
            name = path.relative_to(ROOT).as_posix()
            if name not in NOT_SERVED:
                out[name] = path.read_text()
    return out


def test_the_decode_path_has_no_host_sync_beyond_the_allow_list():
    errors = violations(_decode_path_sources(), ALLOWED)
    assert not errors, "\n".join(errors)


def test_every_allowed_sync_says_why():
    assert all(reason.strip() and count > 0 for count, reason in ALLOWED.values())


@pytest.mark.parametrize("body, kind", [
    ("return x.item()", ".item()"),
    ("return x.tolist()", ".tolist()"),
    ("return x.cpu()", ".cpu()"),
    ("return x.numpy()", ".numpy()"),
    ('return x.to("cpu")', '.to("cpu")'),
    ('return x.to(device="cpu", dtype=torch.int64)', '.to("cpu")'),
    ("torch.cuda.synchronize()", ".synchronize()"),
    ("event.synchronize()", ".synchronize()"),
    ("return torch.tensor([1, 2], device=x.device)", "torch.tensor(device=)"),
    ("return torch.tensor([1, 2]).to(x.device)", "host tensor .to(device)"),
    ("return bool((x > 0).any())", "bool(.any())"),
    ("return int(x.sum())", "int(.sum())"),
])
def test_a_new_sync_fails_naming_its_line(body, kind):
    source = f"import torch\n\n\ndef round_step(x, event):\n    {body}\n"
    assert scan(source) == [("round_step", kind, 5)]
    errors = violations({"synthetic.py": source}, {})
    assert len(errors) == 1 and errors[0].startswith(f"synthetic.py:5: {kind} in round_step")
    assert violations({"synthetic.py": source}, {("synthetic.py", "round_step", kind): (1, "why")}) == []


@pytest.mark.parametrize("body", [
    "return x.to(torch.int64)",
    "return x.to(x.device, non_blocking=True)",
    "return int(seq_lens_cpu.sum())",
    "return int(batch.seq_lens_cpu.sum())",
    "return torch.tensor([1, 2])",
    "return x.shape[0]",
])
def test_device_side_and_host_side_calls_are_not_flagged(body):
    assert scan(f"import torch\n\n\ndef round_step(x, batch, seq_lens_cpu):\n    {body}\n") == []


def test_an_allowed_entry_whose_sync_is_gone_fails():
    errors = violations({"synthetic.py": "def f(x):\n    return x\n"}, {("synthetic.py", "f", ".item()"): (1, "why")})
    assert errors == ["ALLOWED lists 1 x .item() in synthetic.py:f, found 0: update the entry"]
