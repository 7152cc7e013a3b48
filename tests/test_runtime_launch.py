"""``gpu.runtime.launch``: the plain launch and the programmatic dependent launch's driver call (``cuLaunchKernelEx``
with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION), checked on the CPU against a stand-in for the driver
entry; the launches themselves run in the GPU tests (every top-K select and list tree kernel takes them on sm_90)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from sglang_kdtree.gpu import runtime


def _kernel():
    return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xC0FFEE), name="k")


def test_plain_launch_calls_the_kernel_on_the_current_stream(monkeypatch):
    calls, entered = [], []

    class Kernel:
        def __call__(self, grid, block, args, shared_mem=0):
            calls.append((grid, block, args, shared_mem, list(entered)))

    @contextlib.contextmanager
    def stream():
        entered.append("stream")
        yield

    monkeypatch.setattr(runtime, "current_stream", stream)
    monkeypatch.setattr(runtime, "_pdl_runs_here", lambda: False)
    args = (np.uint64(7), np.int32(3))
    runtime.launch(Kernel(), (2, 3), (128,), args, 256, pdl=True)  # no PDL here: a plain launch
    runtime.launch(Kernel(), (5,), (64,), args)
    assert calls == [((2, 3), (128,), args, 256, ["stream"]), ((5,), (64,), args, 0, ["stream", "stream"])]


def test_dependent_launch_passes_the_config_attribute_and_arguments(monkeypatch):
    seen = {}

    def fake_launch_ex(config_ref, fn, params, extra):
        cfg = ctypes.cast(config_ref, ctypes.POINTER(runtime._LaunchConfig)).contents
        seen["grid"] = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ)
        seen["block"] = (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ)
        seen["smem"], seen["stream"], seen["n_attrs"] = cfg.sharedMemBytes, cfg.hStream, cfg.numAttrs
        seen["attr"] = (cfg.attrs[0].id, cfg.attrs[0].value)
        seen["fn"], seen["extra"] = fn, extra
        types_ = (ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_double)
        seen["args"] = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types_)]
        return 0

    import torch

    monkeypatch.setattr(runtime, "_pdl_runs_here", lambda: True)
    monkeypatch.setattr(runtime, "_cu_launch_kernel_ex", lambda: fake_launch_ex)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0x5150))
    args = (np.uint64(2**63 + 5), np.int64(-(2**40)), np.int32(-7), np.uint32(2**32 - 1), np.float32(1.5),
            np.float64(-0.25))
    runtime.launch(_kernel(), (4, 2), (256,), args, 1024, pdl=True)
    assert seen["grid"] == (4, 2, 1) and seen["block"] == (256, 1, 1) and seen["smem"] == 1024
    assert seen["stream"] == 0x5150 and seen["fn"] == 0xC0FFEE and seen["extra"] is None
    assert seen["n_attrs"] == 1 and seen["attr"] == (6, 1)  # PROGRAMMATIC_STREAM_SERIALIZATION, allowed
    assert seen["args"] == [2**63 + 5, -(2**40), -7, 2**32 - 1, 1.5, -0.25]


def test_dependent_launch_refuses_untyped_arguments_and_reports_driver_errors(monkeypatch):
    import torch

    monkeypatch.setattr(runtime, "_pdl_runs_here", lambda: True)
    monkeypatch.setattr(runtime, "_cu_launch_kernel_ex", lambda: (lambda *a: 1))  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=1))
    with pytest.raises(TypeError, match="numpy scalar"):
        runtime.launch(_kernel(), (1,), (32,), (np.int32(1), 5), pdl=True)  # a Python int: its C type is unknown
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx of k failed with CUresult 1"):
        runtime.launch(_kernel(), (1,), (32,), (np.int32(1),), pdl=True)


def test_layouts_match_cuda_h():
    # CUlaunchAttribute: id, pad to 8, a 64-byte union; CUlaunchConfig: 7 uints, stream, attrs, numAttrs
    assert ctypes.sizeof(runtime._LaunchAttribute) == 72 and runtime._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(runtime._LaunchConfig) == 56
    assert (runtime._LaunchConfig.hStream.offset, runtime._LaunchConfig.attrs.offset,
            runtime._LaunchConfig.numAttrs.offset) == (32, 40, 48)


@pytest.mark.parametrize("value, expected", [("0", "False"), ("1", "True"), (None, "True")])
def test_pdl_switch_follows_the_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_KDTREE_PDL"}
    if value is not None:
        env["SGLANG_KDTREE_PDL"] = value
    out = subprocess.run([sys.executable, "-c", "from sglang_kdtree.gpu import runtime; print(runtime.PDL)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


def test_pdl_status_names_why_dependent_launches_are_off(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "PDL", True)
    monkeypatch.setattr(runtime, "_cu_launch_kernel_ex", lambda: (lambda *a: 0))
    monkeypatch.setattr(runtime, "device_capability", lambda i: (9, 0))
    assert runtime.pdl_status() == "on" and runtime._pdl_runs_here()
    monkeypatch.setattr(runtime, "device_capability", lambda i: (8, 6))
    assert runtime.pdl_status() == "off (compute capability 8.6: they need 9.0+)" and not runtime._pdl_runs_here()
    monkeypatch.setattr(runtime, "_cu_launch_kernel_ex", lambda: None)
    assert runtime.pdl_status() == "off (the CUDA driver has no cuLaunchKernelEx)"
    monkeypatch.setattr(runtime, "PDL", False)
    assert runtime.pdl_status() == "off (SGLANG_KDTREE_PDL=0)" and not runtime._pdl_runs_here()
