"""Dump a CPU KDTREE server's greedy and seeded outputs as JSON, to show a refactor changes no output.

    python tests/e2e/dump_outputs.py OUT.json        # then diff two dumps

For the tiny Llama and DeepSeek-V3 targets: the e2e suite's 18 mixed-length prompts, greedy (24 tokens,
concurrent) and seeded at T = 1.5 with top-p 0.9 / top-k 20 / min-p 0.05 (16 tokens, concurrent): the output
ids. (Not the logprobs: their last bits depend on how the scheduler batched the concurrent requests, about
1e-7 between two runs of the same code.) Not a test: it asserts nothing; the diff of two dumps is the check.
"""

from __future__ import annotations

import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import start_server  # noqa: E402
import make_tiny_models  # noqa: E402
from server_requests import PROMPTS, _kdtree_args  # noqa: E402


def _run(server, payloads):
    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        return [r["output_ids"] for r in pool.map(server.generate, payloads)]


def main(out: str) -> None:
    models = Path(tempfile.gettempdir()) / "kdtree_dump_models"
    make_tiny_models.ensure_built(models)
    logs = Path(tempfile.mkdtemp(prefix="kdtree_dump_logs_"))
    result = {}
    for name in ("llama", "dsv3"):
        server = start_server(models / name, logs, extra=_kdtree_args(models, name), name=f"kdtree-{name}")
        try:
            server.wait_ready()
            greedy = [{"input_ids": p,
                       "sampling_params": {"max_new_tokens": 24, "temperature": 0}} for p in PROMPTS]
            seeded = [{"input_ids": p,
                       "sampling_params": {"max_new_tokens": 16, "temperature": 1.5, "top_p": 0.9, "top_k": 20,
                                           "min_p": 0.05, "sampling_seed": 1234 + i, "ignore_eos": True}}
                      for i, p in enumerate(PROMPTS)]
            result[name] = {"greedy": _run(server, greedy), "seeded": _run(server, seeded)}
        finally:
            server.stop()
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}: {sum(len(v['greedy']) + len(v['seeded']) for v in result.values())} outputs")


if __name__ == "__main__":
    main(sys.argv[1])
