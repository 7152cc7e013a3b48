"""The requests the end-to-end server tests send and how they compare the answers: the shared prompts and
payloads, the KDTREE server's flags, concurrent generation, error bodies, test-fault injection and the server's
load, logprob comparison, the HF model's seeded sampling, and the two-sample test of the distribution tests.
Shared by test_server_kdtree.py and the other modules that start KDTREE servers (and dump_outputs.py)."""

from __future__ import annotations

import json
import random
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import make_tiny_models as tiny

BUDGET = 16
VERIFY_WIDTH = BUDGET + 1
#: verify-width tiers of the servers that choose their width per round: small, to keep CPU rounds short
TIERS = "4,8,17"
NEW_TOKENS = 24


def _prompts(count: int = 18, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 40] + [rng.randint(1, 40) for _ in range(count - 9)]
    return [[rng.randrange(tiny.NUM_WORDS) for _ in range(n)] for n in lengths]


PROMPTS = _prompts()


def _kdtree_args(tiny_models, name: str, width: int | None = VERIFY_WIDTH) -> list[str]:
    """KDTREE's flags for ``name``'s drafter, pinning ``width``; ``width=None``: the width chosen per round."""
    return (["--speculative-algorithm", "kdtree", "--speculative-draft-model-path", str(tiny_models / f"{name}-dflash")]
            + ([] if width is None else ["--speculative-num-draft-tokens", str(width)]))


def _concurrent(server, payloads: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        return list(pool.map(server.generate, payloads))


def _greedy(prompt, **params) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, **params}}


def _generate_or_error(server, payload) -> dict:
    """The response, or for an error status the decoded error body (SGLang answers some aborts so)."""
    try:
        return server.generate(payload)
    except urllib.error.HTTPError as exc:
        return {"http_status": exc.code, "error": exc.read().decode(errors="replace")}


def _log_count(server, text: str) -> int:
    return server.log_path.read_text(errors="replace").count(text)


def _with_faults(server, faults: dict, payloads: list[dict]) -> list[dict]:
    server.faults.write_text(json.dumps(faults))
    try:
        with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
            return list(pool.map(lambda p: _generate_or_error(server, p), payloads))
    finally:
        server.faults.unlink()


def _wait_idle_load(server, timeout: float = 120) -> dict:
    import urllib.request

    deadline = time.time() + timeout
    while True:
        with urllib.request.urlopen(server.url + "/v1/loads", timeout=30) as r:
            load = json.loads(r.read())["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        assert time.time() < deadline, f"server still busy after {timeout:.0f}s: {load}"
        time.sleep(0.5)


#: Logprob tolerance, KDTREE vs the plain server (fp32 on CPU): both take log-softmax of the same target's
#: logits at the same positions, but KDTREE's come from one verify forward over the whole tree (a masked
#: attention over N rows, other GEMM shapes) and the plain server's from one-token decodes, so the logits
#: differ in the last float32 bits; 1e-4 absolute is ~100x what the tiny targets measure.
LOGPROB_ATOL = 1e-4


def _logprob_params(**params) -> dict:
    return {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [0, 5, tiny.EOS_ID], **params}


def _assert_top_close(got, want, where):
    """``[[logprob, id, text], ...]`` lists: values within the tolerance; the same ids except within a near-tie
    (an id may swap places only with one whose logprob is within the tolerance)."""
    assert len(got) == len(want), where
    for (lp_a, id_a, _), (lp_b, id_b, _) in zip(got, want):
        assert abs(lp_a - lp_b) <= LOGPROB_ATOL, (where, got, want)
        if id_a != id_b:
            tied = {i for lp, i, _ in want if abs(lp - lp_a) <= 2 * LOGPROB_ATOL}
            assert id_a in tied, (where, got, want)


def _hf_sampled(model_dir, prompt, seed, temperature, new_tokens):
    """Autoregressive inverse-CDF sampling of the HF model with the worker's per-position uniforms."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_kdtree.reference import position_uniform

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            x = model(input_ids=torch.tensor([seq])).logits[0, -1].double().numpy() / temperature
            cdf = np.cumsum(np.exp(x - x.max()))
            u = position_uniform(seed, len(seq)) * cdf[-1]
            seq.append(min(int(np.searchsorted(cdf, u, side="right")), len(x) - 1))
    return seq[len(prompt):]


#: Distribution tests, KDTREE's sampled accept against the plain server's sampler: the pair (first, second)
#: output token of SAMPLES unseeded requests per server and setting, compared by a two-sample chi-square test
#: of homogeneity (pairs seen fewer than 10 times in both servers together pooled into one cell) at level
#: ALPHA. The first token comes from the prefill sampler, the second from the tree round's accept. Power: the
#: same test must reject the plain server's samples against its samples under a control setting (the filter
#: ignored, another temperature: the bugs this guards against); that control runs in the same test.
SAMPLES = 400


ALPHA = 1e-3


def _pairs(server, prompt, params) -> list[tuple[int, int]]:
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, **params}}
    results = []
    for start in range(0, SAMPLES, 100):  # 100 in flight at a time
        results += _concurrent(server, [payload] * min(100, SAMPLES - start))
    return [tuple(r["output_ids"][:2]) for r in results]


def _pairs_second_unfiltered(server, prompt, params, drop: str) -> list[tuple[int, int]]:
    """What a KDTREE that ignored ``drop`` in its accept would return: the first token as the plain server
    samples it with ``params`` (KDTREE's first token comes from SGLang's own prefill sampler, which applies the
    filter), the second sampled by the plain server after it without ``drop`` (a one-token request on the
    prompt extended by the first token)."""
    firsts = [a for a, _ in _pairs(server, prompt, params)]
    rest = {k: v for k, v in params.items() if k != drop}
    payloads = [{"input_ids": prompt + [a], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True, **rest}}
                for a in firsts]
    results = []
    for start in range(0, len(payloads), 100):
        results += _concurrent(server, payloads[start:start + 100])
    return [(a, r["output_ids"][0]) for a, r in zip(firsts, results)]


def _homogeneity_p(a: list, b: list) -> float:
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    cells = {k: (ca[k], cb[k]) for k in ca.keys() | cb.keys()}
    big = [v for v in cells.values() if sum(v) >= 10]
    pooled = tuple(sum(v[i] for v in cells.values() if sum(v) < 10) for i in (0, 1))
    table = big + ([pooled] if sum(pooled) else [])
    if len(table) < 2:
        return 1.0  # one cell: the two samples cannot differ
    return float(chi2_contingency(table).pvalue)
