"""End to end on the real SGLang server (CPU): ``--speculative-algorithm kdtree`` on SGLang's overlap scheduler
(its default) against the same target served without speculation and without overlap, for the tiny Llama (MHA)
and DeepSeek-V3 (MLA + MoE) targets. ``test_server_no_overlap.py`` runs the greedy, sampling and fault tests
again with ``--disable-overlap-schedule``.

Servers are subprocesses on 127.0.0.1 (``conftest.py``); requests go over HTTP, concurrently, so the
scheduler forms batches of requests with different prefix lengths that join and leave while running.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, free_port, start_server
import make_tiny_models as tiny
from server_requests import (ALPHA, BUDGET, LOGPROB_ATOL, NEW_TOKENS, PROMPTS, _assert_top_close, _concurrent,
                             _generate_or_error, _greedy, _hf_sampled, _homogeneity_p, _kdtree_args, _log_count,
                             _logprob_params, _pairs, _pairs_second_unfiltered, _wait_idle_load, _with_faults,
                             VERIFY_WIDTH)

pytestmark = pytest.mark.slow


def serve_kdtree(plain_server, tiny_models, server_logs, overlap: bool = True, widths: str | None = None):
    """A KDTREE server for ``plain_server``'s target, with its round log and fault-injection file; stopped (and
    checked to stop cleanly) when the generator resumes. It verifies the pinned width ``VERIFY_WIDTH``, or with
    ``widths`` chooses per round among those tiers (no ``--speculative-num-draft-tokens``)."""
    name = plain_server.model_name
    tag = name if overlap else f"{name}-no-overlap"
    round_log = server_logs / f"rounds-{tag}.jsonl"
    round_log.unlink(missing_ok=True)
    faults = server_logs / f"faults-{tag}.json"  # test-only fault injection: absent unless a test writes it
    faults.unlink(missing_ok=True)
    host_times = server_logs / f"host-times-{tag}.json"  # the scheduler loop's step times (host_times.py)
    host_times.unlink(missing_ok=True)
    env = {"KDTREE_ROUND_LOG": str(round_log), "KDTREE_TEST_FAULTS": str(faults), "KDTREE_HOST_TIMES": str(host_times)}
    if widths:
        env["SGLANG_KDTREE_VERIFY_WIDTHS"] = widths
    extra = _kdtree_args(tiny_models, name, None if widths else VERIFY_WIDTH)
    server = start_server(tiny_models / name, server_logs, extra=extra, name=f"kdtree-{tag}", env=env,
                          overlap=overlap)
    server.wait_ready()
    server.model_name = name
    server.round_log = round_log
    server.faults = faults
    server.host_times = host_times
    yield server
    pid = server.proc.pid
    started = time.time()
    server.stop()
    # Clean shutdown: the whole process group (launcher, scheduler, detokenizer) is gone, promptly.
    assert time.time() - started < 60
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


@pytest.fixture(scope="module")
def kdtree_server(plain_server, tiny_models, server_logs):
    yield from serve_kdtree(plain_server, tiny_models, server_logs)


#: SGLang's startup warning for an algorithm registered with ``supports_overlap=False``
DEPRECATED = "registered with supports_overlap=False"


def test_the_server_overlaps_and_says_nothing_deprecated(kdtree_server, greedy_results):
    assert "--disable-overlap-schedule" not in kdtree_server._args
    assert DEPRECATED not in kdtree_server.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def greedy_results(plain_server, kdtree_server):
    payloads = [_greedy(p) for p in PROMPTS]
    return _concurrent(plain_server, payloads), _concurrent(kdtree_server, payloads)


def test_greedy_outputs_identical_to_plain_server(greedy_results):
    plain, spec = greedy_results
    for prompt, a, b in zip(PROMPTS, plain, spec):
        assert b["output_ids"] == a["output_ids"], f"prompt {prompt}"
        assert len(b["output_ids"]) == NEW_TOKENS


def test_mean_accept_length_and_metrics(greedy_results):
    _, spec = greedy_results
    tokens = sum(r["meta_info"]["completion_tokens"] for r in spec)
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in spec)
    assert rounds > 0, "no speculative round reached the per-request metrics"
    # every request's own metric is consistent with its counts (the DFLASH meta_info fields)
    for r in spec:
        m = r["meta_info"]
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"] / m["spec_verify_ct"], rel=0.35)
    assert tokens / rounds > 1.5


def test_acceptance_through_non_first_sibling(greedy_results, kdtree_server):
    records = [json.loads(line) for line in kdtree_server.round_log.read_text().splitlines()]
    assert records, "the worker wrote no round records"
    lens = [t for r in records for t in r["accept_lens"]]
    assert max(lens) >= 3, "no multi-token acceptance"
    assert sum(s for r in records for s in r["sibling_accepts"]) > 0, "no accepted non-first sibling"
    assert max(len(r["accept_lens"]) for r in records) > 1, "never more than one request per batch"
    assert all(1 <= n <= BUDGET for r in records for n in r["num_nodes"])


def test_stop_token_inside_accepted_path(plain_server, kdtree_server, greedy_results):
    plain, _ = greedy_results
    # A token the target emits at output index >= 3: with accept lengths ~3-5 it lands inside a path.
    prompt, reference = next((p, r["output_ids"]) for p, r in zip(PROMPTS, plain) if len(set(r["output_ids"][:3])) == 3)
    stop = reference[4]
    cut = reference.index(stop)
    payload = _greedy(prompt, stop_token_ids=[stop])
    a, b = plain_server.generate(payload), kdtree_server.generate(payload)
    assert b["output_ids"] == a["output_ids"]
    assert b["output_ids"][: cut] == reference[:cut] and len(b["output_ids"]) <= cut + 1
    assert b["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("max_new_tokens", [1, 5, 11])
def test_max_new_tokens_cut(plain_server, kdtree_server, max_new_tokens):
    payload = {"input_ids": PROMPTS[5], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    a, b = plain_server.generate(payload), kdtree_server.generate(payload)
    assert b["output_ids"] == a["output_ids"]
    assert len(b["output_ids"]) == max_new_tokens
    assert b["meta_info"]["finish_reason"]["type"] == "length"


def test_sampling_with_seed_is_reproducible_and_exact(kdtree_server, tiny_models):
    def sampled(seed):
        payloads = [{"input_ids": p, "sampling_params": {"max_new_tokens": 16, "temperature": 1.5,
                                                         "sampling_seed": seed, "ignore_eos": True}} for p in PROMPTS[:6]]
        return [r["output_ids"] for r in _concurrent(kdtree_server, payloads)]

    first, again, other = sampled(1234), sampled(1234), sampled(99)
    assert first == again
    assert first != other
    assert all(0 <= t < tiny.VOCAB_SIZE and len(ids) == 16 for ids in first for t in ids)
    # Lossless: every emitted token is the target's own T = 1.5 draw at its position (what autoregressive
    # sampling with the same uniforms gives), whatever the tree accepted.
    for prompt, ids in list(zip(PROMPTS, first))[:2]:
        assert ids == _hf_sampled(tiny_models / kdtree_server.model_name, prompt, 1234, 1.5, 16)


def _expect_startup_failure(tiny_models, server_logs, extra, message):
    server = start_server(tiny_models / "llama", server_logs, extra=extra, name="invalid")
    try:
        rc = server.proc.wait(timeout=180)
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert rc != 0
    assert message in log, log[-3000:]


def test_unsupported_backend_fails_at_startup(tiny_models, server_logs):
    """A real server process exits at startup naming the refused flag. One case is enough for the plumbing (each
    server start costs about 45 s of CI); every refused flag and value, the out-of-range budgets 1 and 1026
    among them, is checked in-process through SGLang's own parser and the same hook
    (``tests/test_registration.py``)."""
    # conftest passes --attention-backend torch_native; a later flag wins in argparse
    args = _kdtree_args(tiny_models, "llama") + ["--attention-backend", "flashmla"]
    _expect_startup_failure(tiny_models, server_logs, args, "KDTREE: --attention-backend flashmla")


def test_abort_mid_flight_leaves_the_server_exact(kdtree_server, greedy_results):
    """A request aborted while its tree rounds run frees its slots without disturbing the others."""
    import urllib.request

    plain, _ = greedy_results
    long_payload = {"input_ids": PROMPTS[3], "rid": "kdtree-abort-me",
                    "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(kdtree_server.generate, long_payload)
        time.sleep(1.0)
        req = urllib.request.Request(kdtree_server.url + "/abort_request",
                                     data=json.dumps({"rid": "kdtree-abort-me"}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        try:
            aborted = pending.result(timeout=120)
            assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(aborted["output_ids"]) < 900
        except urllib.error.HTTPError:
            pass  # SGLang may answer an aborted request with an error status: also an abort
    again = _concurrent(kdtree_server, [_greedy(p) for p in PROMPTS])
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in plain]


def test_service_healthcheck_passes_against_the_kdtree_server_and_fails_on_a_closed_port(kdtree_server):
    """service/healthcheck.sh, the gate of the systemd upgrade, against the real KDTREE server."""
    script = str(REPO / "service" / "healthcheck.sh")
    ok = subprocess.run([script, "--url", kdtree_server.url, "--timeout", "60", "--prompt", "a b c"],
                        capture_output=True, text=True, timeout=420)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "healthy" in ok.stdout
    closed = subprocess.run([script, "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "3"],
                            capture_output=True, text=True, timeout=60)
    assert closed.returncode == 1, closed.stdout + closed.stderr


def test_a_request_up_to_the_context_length_is_exact(plain_server, kdtree_server, tiny_models):
    """A prompt 24 tokens short of the tiny models' 1,024-token context, run to the end: each decode round maps its
    reservation past the committed length into the request's req_to_token row, which must be wide enough
    (``patches/req_to_token_headroom.py``; without it the KDTREE server's scheduler died here). Greedy output equals
    the plain server's, and the server serves the next request."""
    config = json.loads((tiny_models / kdtree_server.model_name / "config.json").read_text())
    context = config["max_position_embeddings"]
    prompt = [random.Random(3).randrange(tiny.NUM_WORDS) for _ in range(context - 24)]
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 22, "temperature": 0, "ignore_eos": True}}
    plain, spec = plain_server.generate(payload), kdtree_server.generate(payload)
    assert spec["output_ids"] == plain["output_ids"] and len(spec["output_ids"]) == 22
    assert kdtree_server.generate(_greedy(PROMPTS[0]))["output_ids"] == plain_server.generate(_greedy(PROMPTS[0]))[
        "output_ids"]


def test_return_sampling_mask_is_refused_with_a_message(kdtree_server, greedy_results):
    """Refused at admission (HTTP 400 naming the field; SGLang's own path answered a greedy one with HTTP 500),
    and the server serves the next request exactly."""
    refused = _generate_or_error(kdtree_server, {**_greedy(PROMPTS[0]), "return_sampling_mask": True})
    assert refused.get("http_status") == 400 and "drop return_sampling_mask" in refused["error"], refused
    assert kdtree_server.generate(_greedy(PROMPTS[0]))["output_ids"] == greedy_results[0][0]["output_ids"]


@pytest.mark.parametrize("fault", ["draft_nan", "target_nan"])
def test_a_fault_in_one_request_ends_only_that_request(kdtree_server, greedy_results, fault):
    """NaN forced (``KDTREE_TEST_FAULTS``) into one request's draft or target verify logits while it shares
    batches with others: that request ends with an abort naming the fault; the others' outputs equal the
    plain server's, and afterwards the server is healthy and still exact."""
    import urllib.request

    plain, _ = greedy_results
    kdtree_server.faults.write_text(json.dumps({"kdtree-faulty-": fault}))
    try:
        payloads = [dict(_greedy(p), rid=f"kdtree-ok-{fault}-{i}") for i, p in enumerate(PROMPTS[:6])]
        payloads.insert(2, dict(_greedy(PROMPTS[7]), rid=f"kdtree-faulty-{fault}"))
        with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
            results = list(pool.map(lambda p: _generate_or_error(kdtree_server, p), payloads))
    finally:
        kdtree_server.faults.unlink()
    faulty = results.pop(2)
    if "http_status" in faulty:
        assert "KDTREE round failed" in faulty["error"], faulty
    else:
        reason = faulty["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "KDTREE round failed" in reason["message"], reason
        assert ("NaN" in reason["message"]), reason
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in plain[:6]]
    with urllib.request.urlopen(kdtree_server.url + "/health", timeout=30) as r:
        assert r.status == 200
    again = _concurrent(kdtree_server, [_greedy(p) for p in PROMPTS[:4]])
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in plain[:4]]


#: The message of a request ended by an allocation failure of its round (``sglang_kdtree/round/faults.py``).
OOM_MESSAGE = "KDTREE round could not allocate memory (OutOfMemoryError: KDTREE test fault round_oom"


#: What SGLang's memory checks say when they find a leak (as in ``test_server_load.py``).
LEAK_MARKERS = ("memory leak detected", "Mem Leak Detected", "KV double free", "KV page use-after-free")


def test_round_oom_retried_once_changes_no_output(kdtree_server, greedy_results):
    """``round_oom``: every round of a batch holding the named request raises ``torch.OutOfMemoryError`` at its
    buffer reservation on the first attempt; the retry succeeds, so that request and its batch mates (one with
    logprobs) finish normally with the plain server's greedy output."""
    plain, _ = greedy_results
    retries = _log_count(kdtree_server, "KDTREE round: retrying once")
    payloads = [dict(_greedy(p), rid=f"kdtree-oom-once-mate-{i}") for i, p in enumerate(PROMPTS[:3])]
    payloads[2].update(_logprob_params())
    payloads.insert(1, dict(_greedy(PROMPTS[7]), rid="kdtree-oom-once-0"))
    results = _with_faults(kdtree_server, {"kdtree-oom-once-0": "round_oom"}, payloads)
    assert all("output_ids" in r for r in results), results
    assert [r["output_ids"] for r in results] == [plain[i]["output_ids"] for i in (0, 7, 1, 2)]
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    assert len(results[3]["meta_info"]["output_token_logprobs"]) == NEW_TOKENS
    # the fault fired and was retried (every round of the named request's batches)
    retried = _log_count(kdtree_server, "KDTREE round: retrying once") - retries
    assert retried >= results[1]["meta_info"]["spec_verify_ct"]


#: Prompts no other test sends: the radix cache holds none of their continuations when a round of theirs fails.
OOM_PROMPTS = [[random.Random(1313 + n).randrange(tiny.NUM_WORDS) for _ in range(n)] for n in (6, 11, 17, 25)]


def test_round_oom_twice_ends_its_batch_and_the_server_continues(plain_server, kdtree_server):
    """``round_oom_twice``: the retry fails too, so every request of the failing batch ends with an abort (HTTP
    503) carrying the message; requests not in that batch are served exactly. Afterwards: no leak reported, no
    KV slot held, ``/health`` 200, a greedy batch equals the plain server's, and new requests with the aborted
    prompts, and with an aborted prompt followed by its first greedy tokens, return the plain server's output.
    The last ones reach past the position the failed round never computed: had the aborted request been
    checkpointed into the radix cache (no ``skip_radix_cache_insert``), they would reuse that slot's stale KV
    (the prompts are fresh, so no earlier request cached those positions)."""
    import urllib.request

    prompts = OOM_PROMPTS
    plain = _concurrent(plain_server, [_greedy(p) for p in prompts])
    ended = _log_count(kdtree_server, "KDTREE round could not allocate memory")
    payloads = [dict(_greedy(prompts[0]), rid="kdtree-oom-twice-0")]
    payloads += [dict(_greedy(p), rid=f"kdtree-oom-twice-mate-{i}") for i, p in enumerate(prompts[1:], 1)]
    payloads[-1].update(_logprob_params())  # a logprob request in the failing batch
    results = _with_faults(kdtree_server, {"kdtree-oom-twice-0": "round_oom_twice"}, payloads)

    aborted = []
    for i, r in enumerate(results):
        if "http_status" in r:
            assert r["http_status"] == 503 and OOM_MESSAGE in r["error"], r
            assert "the request was ended, the server continues" in r["error"], r
            aborted.append(i)
        else:  # not in the failing batch: served exactly
            assert r["output_ids"] == plain[i]["output_ids"], (i, r["meta_info"])
    assert aborted and aborted[0] == 0, results  # the named request is always in its own failing batch
    assert _log_count(kdtree_server, "KDTREE round could not allocate memory") > ended

    load = _wait_idle_load(kdtree_server)
    assert load["num_used_tokens"] == 0, load
    with urllib.request.urlopen(kdtree_server.url + "/health", timeout=30) as r:
        assert r.status == 200
    # each aborted prompt followed by its first two greedy tokens t0 t1 (SGLang matches at most all but the last
    # input token, so the match can reach t0's position, the one the failed round never computed, and the tiny
    # targets' second-order language needs t0 to predict what follows t1), then the aborted prompts themselves
    repeat = [prompts[i] + plain[i]["output_ids"][:2] for i in aborted] + [prompts[i] for i in aborted]
    want = _concurrent(plain_server, [_greedy(p) for p in repeat])
    got = [kdtree_server.generate(_greedy(p)) for p in repeat]
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
    again = _concurrent(kdtree_server, [_greedy(p) for p in PROMPTS[:4]])
    reference = _concurrent(plain_server, [_greedy(p) for p in PROMPTS[:4]])
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in reference]

    _wait_idle_load(kdtree_server)
    time.sleep(2)  # the scheduler runs its idle memory check on every idle loop
    assert kdtree_server.proc.poll() is None, kdtree_server.log_tail()
    leaks = [line for line in kdtree_server.log_path.read_text(errors="replace").splitlines()
             if any(m in line for m in LEAK_MARKERS)]
    assert not leaks, "\n".join(leaks[:10])
    print(f"round_oom_twice: requests {aborted} of {len(prompts)} aborted")


@pytest.mark.parametrize("params", [{"temperature": 1.0, "top_p": 1e-6}, {"temperature": 1.0, "top_k": 1},
                                    {"temperature": 1.0, "min_p": 1.0}])
def test_top_p_and_top_k_filter_the_tree_accept(kdtree_server, greedy_results, params):
    """T = 1 with top_p ~ 0, top_k 1 or min_p 1 (only tokens tied with the max; the tiny targets' logits have
    no such ties) leaves only the argmax: the plain server then answers greedily, and so must KDTREE (an accept
    that ignored the filters would sample at T = 1)."""
    plain, _ = greedy_results
    got = _concurrent(kdtree_server, [{"input_ids": p, "sampling_params": {"max_new_tokens": NEW_TOKENS, **params}}
                                      for p in PROMPTS])
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in plain]


def test_greedy_logprobs_match_the_plain_server(plain_server, kdtree_server):
    """return_logprob with top_logprobs_num 3, token_ids_logprob and input logprobs (logprob_start_len 0) on
    concurrent greedy requests: the same tokens, and every reported logprob within LOGPROB_ATOL of the plain
    server's (output logprobs come from the tree verify rows of the accepted nodes, input ones from prefill)."""
    prompts = PROMPTS[:8]
    payloads = [dict(_greedy(p), **_logprob_params(logprob_start_len=0)) for p in prompts]
    plain, spec = _concurrent(plain_server, payloads), _concurrent(kdtree_server, payloads)
    worst = 0.0
    for prompt, a, b in zip(prompts, plain, spec):
        assert b["output_ids"] == a["output_ids"], f"prompt {prompt}"
        ma, mb = a["meta_info"], b["meta_info"]
        assert mb["spec_verify_ct"] < mb["completion_tokens"], "no multi-token round: nothing from inner nodes"
        assert len(mb["output_token_logprobs"]) == len(b["output_ids"]) == NEW_TOKENS
        for j, ((lp_a, id_a, _), (lp_b, id_b, _)) in enumerate(zip(ma["output_token_logprobs"],
                                                                   mb["output_token_logprobs"])):
            assert id_b == id_a == b["output_ids"][j]
            assert abs(lp_b - lp_a) <= LOGPROB_ATOL, (prompt, j, lp_a, lp_b)
            worst = max(worst, abs(lp_b - lp_a))
        for field in ("output_top_logprobs", "output_token_ids_logprobs"):
            assert len(mb[field]) == NEW_TOKENS
            for j, (got, want) in enumerate(zip(mb[field], ma[field])):
                _assert_top_close(got, want, (field, prompt, j))
        assert [i for _, i, _ in mb["output_token_ids_logprobs"][0]] == [0, 5, tiny.EOS_ID]
        # input logprobs: SGLang's prefill (DFLASH's), one per prompt token, the first without a value
        assert len(mb["input_token_logprobs"]) == len(prompt)
        for (lp_a, id_a, _), (lp_b, id_b, _) in zip(ma["input_token_logprobs"], mb["input_token_logprobs"]):
            assert id_a == id_b and (lp_a is None) == (lp_b is None)
            assert lp_a is None or abs(lp_b - lp_a) <= LOGPROB_ATOL
        for field in ("input_top_logprobs", "input_token_ids_logprobs"):
            for j, (got, want) in enumerate(zip(mb[field], ma[field])):
                if want is None or not want:
                    assert got == want
                else:
                    _assert_top_close(got, want, (field, prompt, j))
    print(f"\n{kdtree_server.model_name}: greedy output logprobs, max |kdtree - plain| = {worst:.2e}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_what_the_plain_server_reports(plain_server, kdtree_server, temperature):
    """A seeded sampled request with logprobs: each output token's reported logprob (and the top-3) equal what
    the plain server reports for that token at that position and temperature, i.e. log_softmax(logits / T) of
    the target (SGLang's rule; unfiltered). The plain server is asked once per position, for that token
    (token_ids_logprob) as its next token. The first token is the worker's seeded redraw of the prefill's."""
    prompt, new = PROMPTS[6], 12
    spec = kdtree_server.generate({"input_ids": prompt, **_logprob_params(), "sampling_params": {
        "max_new_tokens": new, "temperature": temperature, "sampling_seed": 4321, "ignore_eos": True}})
    out, meta = spec["output_ids"], spec["meta_info"]
    assert len(out) == new and meta["spec_verify_ct"] < new
    probes = [{"input_ids": prompt + out[:j], "return_logprob": True, "top_logprobs_num": 3,
               "token_ids_logprob": [out[j]],
               "sampling_params": {"max_new_tokens": 1, "temperature": temperature}} for j in range(new)]
    worst = 0.0
    for j, probe in enumerate(_concurrent(plain_server, probes)):
        (want, token, _), = probe["meta_info"]["output_token_ids_logprobs"][0]
        got, got_token, _ = meta["output_token_logprobs"][j]
        assert got_token == token == out[j]
        assert abs(got - want) <= LOGPROB_ATOL, (j, got, want)
        worst = max(worst, abs(got - want))
        _assert_top_close(meta["output_top_logprobs"][j], probe["meta_info"]["output_top_logprobs"][0], j)
    print(f"\n{kdtree_server.model_name}: T={temperature} output logprobs, max |kdtree - plain| = {worst:.2e}")


def test_seeded_first_token_reports_the_logprob_of_the_redrawn_token(plain_server, kdtree_server):
    """A seeded request's first token is drawn by SGLang's prefill sampler and then redrawn by the worker with
    the request's seed: the logprob reported must be the redrawn token's (at T = 2.5, where the two draws
    often differ), equal to the plain server's for that token."""
    temperature = 2.5
    payloads = [{"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 1, "temperature": temperature, "sampling_seed": 100 + i}} for i, p in enumerate(PROMPTS)]
    spec = _concurrent(kdtree_server, payloads)
    probes = [{"input_ids": p, "return_logprob": True, "token_ids_logprob": r["output_ids"],
               "sampling_params": {"max_new_tokens": 1, "temperature": temperature}} for p, r in zip(PROMPTS, spec)]
    for prompt, r, probe in zip(PROMPTS, spec, _concurrent(plain_server, probes)):
        got, token, _ = r["meta_info"]["output_token_logprobs"][0]
        (want, want_token, _), = probe["meta_info"]["output_token_ids_logprobs"][0]
        assert token == want_token == r["output_ids"][0]
        assert abs(got - want) <= LOGPROB_ATOL, (prompt, token, got, want)


@pytest.mark.parametrize("params, control", [
    ({"temperature": 2.0, "top_p": 0.6}, {"temperature": 2.0}),  # control: the filter ignored
    ({"temperature": 2.0, "top_k": 3}, {"temperature": 2.0}),
    ({"temperature": 0.7}, {"temperature": 1.5}),  # control: another temperature
    # control: min-p applied to the first token only (SGLang's prefill sampler does that on the KDTREE server
    # too), not to the second, which the tree accept draws; at T 2 on this prompt (tiny Llama, transformers in
    # float64) min-p 0.1 keeps 5 first tokens and then cuts 63% of the second token's mass
    ({"temperature": 2.0, "min_p": 0.1}, "min_p"),
], ids=["top_p", "top_k", "temperature", "min_p"])
def test_sampling_distribution_equals_the_plain_server(plain_server, kdtree_server, params, control):
    """Temperature, top-k, top-p and min-p: KDTREE's samples and the plain server's come from one distribution
    (not rejected at ALPHA), while the plain server's samples under ``control`` (what a KDTREE that ignored the
    setting would draw from: other parameters, or, given a field name, that field dropped from the second
    token only) are rejected: the test has power against that error, in this very run."""
    if plain_server.model_name != "llama":
        pytest.skip("one target is enough for the distribution test (CI time)")
    prompt = PROMPTS[3]
    plain = _pairs(plain_server, prompt, params)
    spec = _pairs(kdtree_server, prompt, params)
    if isinstance(control, str):
        other = _pairs_second_unfiltered(plain_server, prompt, params, control)
    else:
        other = _pairs(plain_server, prompt, control)
    p_same = _homogeneity_p(plain, spec)
    p_control = _homogeneity_p(plain, other)
    print(f"\n{params}: distinct pairs plain {len(set(plain))}, kdtree {len(set(spec))}, control {control} "
          f"{len(set(other))}; p(kdtree = plain) = {p_same:.3g}, p(control = plain) = {p_control:.3g}")
    assert p_control < ALPHA, f"the test has no power here: control vs plain p = {p_control}"
    assert p_same >= ALPHA, f"KDTREE's {params} samples differ from the plain server's: p = {p_same}"


def test_a_profiled_decode_window_writes_a_trace(kdtree_server, tmp_path):
    """``benchmarks/idle_gaps.py``'s flow, as the GPU bench runs it: a batch decoding together, SGLang's
    ``/start_profile`` for a few steps, the trace written and read back. On CPU the trace holds host activity only,
    so there are no device figures."""
    from benchmarks import idle_gaps

    batch = [PROMPTS[0], PROMPTS[-1]]
    path, figures = idle_gaps.profile_decode(kdtree_server.url, batch, new_tokens=96, steps=3, folder=tmp_path,
                                             profile_id="cpu-bs2", activities=("CPU",), timeout=240)
    assert path.name.startswith("cpu-bs2-TP-0") and figures is None
    assert any(ev.get("cat") == "cpu_op" for ev in idle_gaps.read_trace(path))


def test_host_times_split_each_decode_round_by_step_of_the_scheduler_loop(kdtree_server, greedy_results):
    """``KDTREE_HOST_TIMES`` on a real server: SGLang's loop methods are wrapped, each decode pass is timed by step,
    KDTREE's round by its own steps on the host clock, and the file is written when the batch size changes (here: a
    lone request after the concurrent ones)."""
    from sglang_kdtree.server import host_times

    kdtree_server.generate(_greedy(PROMPTS[0], max_new_tokens=24))
    _concurrent(kdtree_server, [_greedy(p, max_new_tokens=8) for p in PROMPTS[:2]])  # ends the lone one's stretch
    per_bs = json.loads(kdtree_server.host_times.read_text())
    assert per_bs and "1" in per_bs
    for bs, row in per_bs.items():
        assert set(row) == {"rounds", "round_steps_ms", "period_mean_ms"} | {f"{c}_ms" for c in host_times.COLUMNS}, bs
        steps = row["round_steps_ms"]  # the round by its own marks: within the pass
        assert {"draft", "verify", "accept_commit"} <= set(steps) and min(steps.values()) >= 0, (bs, steps)
        assert row["rounds"] >= 1 and row["period_mean_ms"] > 0 and steps["verify"] < row["period_ms"], (bs, row)
        assert row["period_ms"] >= row["launch_ms"] >= row["worker_ms"] > 0, (bs, row)
        assert row["process_ms"] >= row["wait_ms"] >= 0 and row["process_ms"] > 0, (bs, row)
        assert row["schedule_ms"] > 0 and row["ingest_ms"] > 0, (bs, row)

