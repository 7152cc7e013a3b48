"""The test-only CUDA ``sgl_kernel`` stand-in (``tests/e2e/sgl_kernel_cuda``), on CPU.

Its torch ops are device-agnostic, so they are checked here against plain float64 math; unknown names must
raise ``NotImplementedError`` naming the op; the import shims must apply only when what they replace is
missing. The package is loaded under a private name so it never shadows an installed ``sgl_kernel``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

STANDIN = Path(__file__).resolve().parent / "e2e" / "sgl_kernel_cuda"


def _load(package_dir: Path, alias: str):
    spec = importlib.util.spec_from_file_location(alias, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sk():
    module = _load(STANDIN / "sgl_kernel", "kdtree_cuda_standin_sgl_kernel")
    yield module
    sys.modules.pop("kdtree_cuda_standin_sgl_kernel", None)


def _rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm(sk, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    want = _rms64(x, w, 1e-6)
    got = sk.rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    out = torch.empty_like(x)
    assert sk.rmsnorm(x, w, 1e-5, out=out) is out
    torch.testing.assert_close(out.double(), _rms64(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_in_place(sk, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(dtype)
    r = torch.randn(5, 64, generator=g).to(dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    total = x.double() + r.double()
    assert sk.fused_add_rmsnorm(x, r, w, 1e-6) is None
    torch.testing.assert_close(r.double(), total, **TOL[dtype])
    torch.testing.assert_close(x.double(), _rms64(total, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize(("name", "act"), [
    ("silu_and_mul", lambda t: t * torch.sigmoid(t)),
    ("gelu_and_mul", lambda t: 0.5 * t * (1 + torch.erf(t / 2 ** 0.5))),
    ("gelu_tanh_and_mul", lambda t: 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3)))),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_and_mul(sk, name, act, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 4, 2 * 40, generator=g) * 2).to(dtype)
    x64 = x.double()
    want = act(x64[..., :40]) * x64[..., 40:]
    op = getattr(sk, name)
    got = op(x)
    assert got.shape == (3, 4, 40) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    out = torch.full((3, 4, 40), float("nan"), dtype=dtype)
    assert op(x, out) is out
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_reduce(sk, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 6, 32, generator=g).to(dtype)
    out = torch.full((9, 32), float("nan"), dtype=dtype)
    assert sk.moe_sum_reduce(x, out, 2.5) is None
    torch.testing.assert_close(out.double(), x.double().sum(1) * 2.5, **TOL[dtype])


def test_moe_align_block_size_delegates_to_sglang_jit(sk, monkeypatch):
    moe_align = pytest.importorskip("sglang.kernels.ops.moe.moe_align")
    calls = []
    monkeypatch.setattr(moe_align, "moe_align_block_size", lambda *a, **k: calls.append((a, k)))
    args = ("topk_ids", 5, 16, "sorted", "experts", "post_pad", "cumsum")
    assert sk.moe_align_block_size(*args, True) is None
    assert calls == [(args + (True,), {})]
    with pytest.raises(NotImplementedError, match="ignore_invalid_expert"):
        sk.moe_align_block_size(*args, True, True)


def test_weak_ref_tensor_aliases_memory(sk):
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, ::2]
    ref = sk.weak_ref_tensor(view)
    assert ref.shape == view.shape and ref.stride() == view.stride()
    assert ref.data_ptr() == view.data_ptr()
    ref.fill_(-1)
    assert (base[1:, ::2] == -1).all() and (base[0] != -1).all()


def test_is_arch_support_pdl_delegates_to_sglang(sk, monkeypatch):
    jit_utils = pytest.importorskip("sglang.kernels.jit.utils")
    utils = importlib.import_module("kdtree_cuda_standin_sgl_kernel.utils")
    for answer in (True, False):
        monkeypatch.setattr(jit_utils, "is_arch_support_pdl", lambda answer=answer: answer)
        assert utils.is_arch_support_pdl() is answer


@pytest.mark.parametrize("name", ["fused_experts", "merge_state_v2", "top_k_renorm_prob", "flash_mla_decode"])
def test_unknown_op_raises_by_name(sk, name):
    with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name} is not provided"):
        getattr(sk, name)(torch.zeros(1))


def test_unknown_submodule_op_raises_by_name(sk):
    kvcacheio = importlib.import_module("kdtree_cuda_standin_sgl_kernel.kvcacheio")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.kvcacheio\.transfer_kv_direct"):
        kvcacheio.transfer_kv_direct()
    with pytest.raises(AttributeError):
        kvcacheio.__wrapped__  # noqa: B018  (dunders stay AttributeError: inspect / pickle probe them)


def test_marlin_ops_file_is_merged(tmp_path):
    package = tmp_path / "sgl_kernel"
    shutil.copytree(STANDIN / "sgl_kernel", package)
    (package / "_marlin_ops.py").write_text(textwrap.dedent("""
        import types
        __all__ = ["moe_wna16_marlin_gemm_probe"]
        def moe_wna16_marlin_gemm_probe():
            return "marlin"
        scalar_type = types.ModuleType("scalar_type")
        scalar_type.scalar_types = "the scalar types"
    """))
    alias = "kdtree_cuda_standin_sgl_kernel_marlin"
    try:
        module = _load(package, alias)
        assert module.moe_wna16_marlin_gemm_probe() == "marlin"
        assert sys.modules[f"{alias}.scalar_type"].scalar_types == "the scalar types"
        with pytest.raises(NotImplementedError):
            module.some_other_op()
    finally:
        sys.modules.pop(alias, None)
        sys.modules.pop(f"{alias}.scalar_type", None)


def test_import_shims_in_a_fresh_interpreter():
    """sitecustomize: shims apply only where the real module is missing (hidden here by a finder that
    sits after ours); the dist-info metadata and the package are found first."""
    code = textwrap.dedent("""
        import importlib.abc, importlib.metadata, sys

        class Hide(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name in ("soundfile", "cutlass"):
                    raise ModuleNotFoundError(name)
                return None

        assert [type(f).__name__ for f in sys.meta_path[:2]] == ["_ShimFinder", "_AfterImportFinder"]
        sys.meta_path.insert(2, Hide())

        import soundfile
        assert soundfile.__file__.endswith("shims/soundfile.py"), soundfile.__file__
        try:
            soundfile.read("x.wav")
        except NotImplementedError as e:
            assert "soundfile.read" in str(e)
        else:
            raise AssertionError("soundfile.read did not raise")

        import sglang.kernels.ops.gemm.cutedsl_dual_gemm as dg
        assert dg.__file__.endswith("shims/cutedsl_dual_gemm.py"), dg.__file__
        assert dg.can_use_dual_gemm(dg.MAX_DUAL_GEMM_DECODE_TOKENS, 4096, 14336, dg.DualGemmQuantMode.UNQUANT) is False
        assert not dg.DualGemmQuantMode.UNQUANT.is_quantized and dg.DualGemmQuantMode.DYNAMIC_PER_TOKEN.is_dynamic
        try:
            dg.dual_gemm_swiglu(None, None)
        except NotImplementedError as e:
            assert "dual_gemm_swiglu" in str(e)
        else:
            raise AssertionError("dual_gemm_swiglu did not raise")

        # DFLASH's sampled verify needs FlashInfer's headers: declared unavailable without flashinfer (on
        # CPU SGLang already says False, so set it True first to see the patch act; flashinfer counts as
        # missing here whether or not this machine has its package)
        import sitecustomize
        import sglang.srt.speculative.dflash_utils as du
        sitecustomize._importable_elsewhere = lambda name: name != "flashinfer"
        assert type(sys.meta_path[1]).PATCHES["sglang.srt.speculative.dflash_utils"] is (
            sitecustomize._dflash_sampling_without_flashinfer)
        du._DFLASH_SAMPLING_VERIFY_AVAILABLE = True
        sitecustomize._dflash_sampling_without_flashinfer(du)
        assert du.is_dflash_sampling_verify_available() is False

        assert "kdtree.cuda.standin" in importlib.metadata.version("sglang-kernel")
        import sgl_kernel
        assert "kdtree.cuda.standin" in sgl_kernel.__version__
        print("SHIMS-OK")
    """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "SHIMS-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# --- the server harness's pure parts (tests/e2e/cuda_servers.py) ------------------------------------------


@pytest.fixture(scope="module")
def cs():
    sys.path.insert(0, str(STANDIN.parent))
    import cuda_servers

    return cuda_servers


def test_harness_prompts_and_server_args(cs, tmp_path):
    batch = cs.prompts()
    assert len(batch) == cs.NUM_PROMPTS >= 32 and len({len(p) for p in batch}) > 10
    assert all(0 <= t < cs.tiny.NUM_WORDS for p in batch for t in p)
    v = cs.Variant("llama", tmp_path / "t", tmp_path / "d", "float32")
    plain = cs.server_args(v, 1234, kdtree=False, cuda_graph=True)
    for flag in ("--attention-backend", "--page-size", "--disable-overlap-schedule", "--disable-radix-cache",
                 "--sleep-on-idle", "--cuda-graph-bs-decode", "--cuda-graph-bs-prefill"):
        assert flag in plain
    assert plain[plain.index("--attention-backend") + 1] == "triton"
    assert "--speculative-algorithm" not in plain and "--disable-cuda-graph" not in plain
    assert max(cs.DECODE_GRAPH_BS) >= cs.MAX_RUNNING >= cs.NUM_PROMPTS
    spec = cs.server_args(v, 1234, kdtree=True, cuda_graph=False)
    assert "--disable-cuda-graph" in spec and "--cuda-graph-bs-decode" not in spec
    assert spec[spec.index("--speculative-algorithm") + 1] == "kdtree"
    assert spec[spec.index("--speculative-num-draft-tokens") + 1] == "17"
    assert spec[spec.index("--speculative-draft-model-path") + 1] == str(tmp_path / "d")
    assert "--tp-size" not in spec
    tp2 = cs.server_args(cs.Variant("kimi", tmp_path / "t", tmp_path / "d", "bfloat16", tp=2), 1, kdtree=True,
                         cuda_graph=True)
    assert tp2[tp2.index("--tp-size") + 1] == "2"
    env = cs.server_env({"KDTREE_ROUND_LOG": "x"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(STANDIN) and env["KDTREE_ROUND_LOG"] == "x"


_STUB_SERVER = """
import http.server, pathlib, sys
arg = lambda name: sys.argv[sys.argv.index(name) + 1]
mark, status = pathlib.Path(arg("--mark")), int(arg("--freeze-status"))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):
        if self.path == "/freeze_gc":
            mark.write_text(self.command)
        self.send_response(status if self.path == "/freeze_gc" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(arg("--port"))), Handler).serve_forever()
"""


@pytest.mark.parametrize("status", [200, 500])
def test_harness_freezes_the_gc_once_healthy(cs, tmp_path, status):
    """A server counts as ready once /health answers, and the harness then POSTs /freeze_gc (SGLang's own
    post-warm-up step, which --skip-server-warmup makes fail inside the server); ``gc_frozen`` says whether it
    took. A stand-in HTTP server plays SGLang's two endpoints; a failed freeze leaves the server ready."""
    stub = tmp_path / "stub_server.py"
    stub.write_text(_STUB_SERVER)
    mark = tmp_path / "froze"
    args = [sys.executable, str(stub), "--port", str(cs.free_port()), "--mark", str(mark),
            "--freeze-status", str(status)]
    server = cs.CudaServer("stub", args, tmp_path / "stub.log")
    try:
        assert cs.wait_all({"stub": server}, timeout=60) == {}
        assert server.ready_s is not None and mark.read_text() == "POST"
        assert server.gc_frozen is (status == 200)
    finally:
        server.stop()


def test_harness_first_mismatch(cs):
    a = [{"output_ids": [1, 2, 3]}, {"output_ids": [4, 5]}]
    assert cs.first_mismatch(a, [dict(r) for r in a]) is None
    b = [{"output_ids": [1, 2, 3]}, {"output_ids": [4, 6]}]
    assert cs.first_mismatch(a, b).startswith("prompt 1: first differing output index 1")
    c = [{"output_ids": [1, 2]}, {"output_ids": [4, 5]}]
    assert "index 2" in cs.first_mismatch(a, c)


def test_harness_logprob_pair(cs):
    def rec(ids, lps):
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}

    same = cs.logprob_pair([rec([1, 2], [-0.5, -1.0])], [rec([1, 2], [-0.52, -1.0])])
    assert same["ids_identical"] and same["error"] is None and abs(same["max_abs_diff"] - 0.02) < 1e-9
    other = cs.logprob_pair([rec([1, 2], [-0.5, -1.0])], [rec([1, 3], [-0.5, -1.0])])
    assert not other["ids_identical"]
    missing = cs.logprob_pair([rec([1, 2], [-0.5, -1.0])], [rec([1, 2], [-0.5, None])])
    assert missing["error"] and missing["max_abs_diff"] is None
    table = cs.format_table({"servers": {}, "pairs": {}, "logprob_pairs": {"llama-float32-graph": same}})
    assert "ids same" in table and "2.00e-02" in table


def test_harness_table_names_the_mla_kernel_that_ran(cs):
    servers = {"kimi-kdtree-graph": {"mla_launches": 12, "mla_kernels": ["wgmma"]},
               "kimi-plain-graph": {"mla_kernels": []}}
    table = cs.format_table({"servers": servers, "pairs": {}, "logprob_pairs": {}})
    assert "fused MLA kernels that ran: kimi-kdtree-graph: wgmma" in table
    assert "fused MLA kernels that ran: -" in cs.format_table({"servers": {}, "pairs": {}, "logprob_pairs": {}})


def test_harness_overlap_and_sync_debug(cs, tmp_path, monkeypatch):
    """``--overlap`` drops --disable-overlap-schedule from every server and names them so; ``--sync-debug`` gives
    KDTREE servers a sync log in place of the round log, and the table counts its sites."""
    v = cs.Variant("llama", tmp_path / "t", tmp_path / "d", "float32")
    assert "--disable-overlap-schedule" in cs.server_args(v, 1, kdtree=True, cuda_graph=True)
    monkeypatch.setattr(cs, "OVERLAP", True)
    for kdtree in (False, True):
        assert "--disable-overlap-schedule" not in cs.server_args(v, 1, kdtree=kdtree, cuda_graph=True)
    assert cs.server_name(v, True, True) == "llama-float32-kdtree-graph-overlap"
    log = tmp_path / "syncs.jsonl"
    log.write_text('{"file": "/x/worker.py", "line": 9, "message": "m"}\n' * 2
                   + '{"file": "/x/pipeline.py", "line": 3, "message": "m"}\n')
    syncs = cs.host_syncs(log)
    assert syncs == {"host_syncs": 3, "host_sync_sites": {"/x/worker.py:9": 2, "/x/pipeline.py:3": 1}}
    assert cs.host_syncs(tmp_path / "absent.jsonl") == {"host_syncs": 0, "host_sync_sites": {}}
    table = cs.format_table({"servers": {"k": syncs}, "pairs": {}, "logprob_pairs": {}})
    assert "host syncs in decode rounds k: 3  /x/worker.py:9 x2, /x/pipeline.py:3 x1" in table


def test_trace_records_first_call_per_op(tmp_path, monkeypatch):
    trace = tmp_path / "ops.txt"
    monkeypatch.setenv("KDTREE_STANDIN_TRACE", str(trace))
    alias = "kdtree_cuda_standin_sgl_kernel_traced"
    try:
        module = _load(STANDIN / "sgl_kernel", alias)
        x = torch.ones(2, 8)
        module.rmsnorm(x, torch.ones(8))
        module.rmsnorm(x, torch.ones(8))
        module.silu_and_mul(x)
        names = [line.split()[0] for line in trace.read_text().splitlines()]
        assert names == ["rmsnorm", "silu_and_mul"]
    finally:
        sys.modules.pop(alias, None)
