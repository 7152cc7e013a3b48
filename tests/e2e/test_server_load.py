"""Load and leaks, and three request features, on a real KDTREE CPU server (tiny Llama).

One KDTREE server for the module, started with SGLang's own memory checks at their strictest:
``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1`` (after every batch the scheduler asserts that free + cached +
request-held KV slots add up to the pool), ``SGLANG_CHECK_KV_PAGE_INVARIANTS=1`` (no slot a request holds is
in the free list, no slot is free twice) and the idle check SGLang always runs, strict by default
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``: whenever the scheduler is idle, the KV pool and the
request-slot pool must be whole again, else it raises "... memory leak detected!" and the server dies).

* stop strings, ``n > 1`` and streaming: served, and equal to the plain server where that is defined;
* the load test: 240 requests at once (greedy and sampled, prompts of 1 to 300 tokens, aborted through
  ``/abort_request``, streams closed by the client, non-streaming clients that disconnect, grammar requests
  refused at admission), then: no leak reported, ``/v1/loads`` shows no KV slot held, ``/health`` is 200 and
  greedy output still equals the plain server's.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import start_server
import make_tiny_models as tiny
from server_requests import NEW_TOKENS, PROMPTS, _concurrent, _generate_or_error, _greedy, _kdtree_args

# One target is enough here: what is exercised is SGLang's request handling around the KDTREE round.
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.parametrize("plain_server", ["llama"], indirect=True)]

#: What SGLang's memory checks say when they find a leak (``scheduler_components/invariant_checker.py``).
LEAK_MARKERS = ("memory leak detected", "Mem Leak Detected", "KV double free", "KV page use-after-free")
GRAMMAR_REFUSAL = "KDTREE speculative decoding does not support grammar-constrained decoding yet; drop {}"


@pytest.fixture(scope="module")
def load_server(tiny_models, server_logs):
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
           "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    srv = start_server(tiny_models / "llama", server_logs, extra=_kdtree_args(tiny_models, "llama") + ["--enable-metrics"],
                       name="kdtree-load-llama", env=env)
    srv.wait_ready()
    yield srv
    srv.stop()


# --- small HTTP helpers ---------------------------------------------------------------------------------------

def _get_json(server, path: str):
    with urllib.request.urlopen(server.url + path, timeout=30) as r:
        return json.loads(r.read())


def _post(server, path: str, payload: dict) -> int:
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()
        return r.status


def _load(server) -> dict:
    return _get_json(server, "/v1/loads")["loads"][0]


def _aborted_total(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = [float(m.group(1)) for m in re.finditer(r"^sglang:num_aborted_requests_total\{[^}]*\} (\S+)$", text, re.M)]
    return sum(values)


def _stream(server, payload: dict, max_events: int | None = None) -> list[dict]:
    """The ``data:`` events of a streamed ``/generate`` (without ``[DONE]``); with ``max_events``, the client
    closes the connection after that many."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request("POST", "/generate", body=json.dumps(dict(payload, stream=True)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[len("data:"):]))
            if max_events is not None and len(events) >= max_events:
                conn.sock.shutdown(socket.SHUT_RDWR)
                break
        return events
    finally:
        conn.close()


def _wait_idle(server, timeout: float = 180) -> dict:
    deadline = time.time() + timeout
    while True:
        load = _load(server)
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        assert time.time() < deadline, f"server still busy after {timeout:.0f}s: {load}"
        time.sleep(0.5)


def _ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


# --- stop strings -------------------------------------------------------------------------------------------

def test_stop_strings_equal_plain(plain_server, load_server):
    """Greedy with ``stop`` strings: one word of the plain output, two words across a token boundary, the
    prefix of a word (the match ends inside a token), a string that never occurs, and a list. KDTREE accepts
    several tokens per round; the cut must still land where the plain server's does."""
    reference = _concurrent(plain_server, [_greedy(p) for p in PROMPTS[:8]])
    cases = []
    for i, (prompt, ref) in enumerate(zip(PROMPTS, reference)):
        words = ref["text"].split()
        k = min(2 + i % 9, len(words) - 2)  # stop positions 2..10 reach inside multi-token accepted paths
        stops = [" " + words[k], " " + " ".join(words[k: k + 2]), " " + words[k][:-1], " " + words[k][:2] + "x"]
        cases.append((i, _greedy(prompt, stop=stops[i % 4])))
        cases.append((i, _greedy(prompt, stop=["never-occurs", " " + words[k]])))
    payloads = [p for _, p in cases]
    plain, spec = _concurrent(plain_server, payloads), _concurrent(load_server, payloads)
    stopped = 0
    for (i, payload), a, b in zip(cases, plain, spec):
        assert (b["output_ids"], b["text"]) == (a["output_ids"], a["text"]), payload
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], payload
        if b["meta_info"]["finish_reason"]["type"] == "stop":
            stopped += 1
            assert len(b["output_ids"]) < NEW_TOKENS and len(b["text"]) < len(reference[i]["text"])
    # every case but the two whose only stop string never occurs ends early
    assert stopped == len(cases) - 2, stopped


# --- n > 1 --------------------------------------------------------------------------------------------------

def test_n_greater_than_one_is_served(plain_server, load_server):
    """``n``: SGLang caches the prompt with a ``max_new_tokens = 0`` request, then sends n copies. Greedy: n
    copies of the plain server's answer. T = 1 without a seed: n independent draws (not all equal). T = 1 with
    ``sampling_seed``: every copy carries the same seed, so the n draws are identical and equal the n = 1
    answer with that seed (as in SGLang's own seeded sampling, where the draw is a hash of seed and position)."""
    prompts = PROMPTS[:4]
    reference = _concurrent(plain_server, [_greedy(p) for p in prompts])
    greedy = _concurrent(load_server, [_greedy(p, n=2) for p in prompts])
    for ref, got in zip(reference, greedy):
        assert isinstance(got, list) and len(got) == 2
        assert _ids(got) == [ref["output_ids"]] * 2

    sampled = {"max_new_tokens": 16, "temperature": 1.5, "ignore_eos": True}
    draws = _concurrent(load_server, [{"input_ids": p, "sampling_params": dict(sampled, n=4)} for p in prompts])
    for got in draws:
        assert len(got) == 4
        assert all(len(ids) == 16 and all(0 <= t < tiny.VOCAB_SIZE for t in ids) for ids in _ids(got))
    assert any(len({tuple(ids) for ids in _ids(got)}) > 1 for got in draws), "n unseeded draws were all identical"

    seeded = dict(sampled, sampling_seed=4321)
    single = _concurrent(load_server, [{"input_ids": p, "sampling_params": seeded} for p in prompts])
    copies = _concurrent(load_server, [{"input_ids": p, "sampling_params": dict(seeded, n=3)} for p in prompts])
    for one, three in zip(single, copies):
        assert _ids(three) == [one["output_ids"]] * 3


# --- streaming ----------------------------------------------------------------------------------------------

def test_streaming_equals_the_non_streamed_greedy_output(plain_server, load_server):
    """``stream: true``: each event carries the output so far (SGLang's default, non-incremental streaming);
    the text and ids pieces concatenate to the plain server's non-streamed answer, also when a stop string
    ends the request in the middle of an accepted path."""
    prompts = PROMPTS[:8]
    reference = _concurrent(plain_server, [_greedy(p) for p in prompts])
    stop = " " + reference[0]["text"].split()[6]
    stop_ref = plain_server.generate(_greedy(prompts[0], stop=stop))
    payloads = [_greedy(p) for p in prompts] + [_greedy(prompts[0], stop=stop)]
    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        streams = list(pool.map(lambda p: _stream(load_server, p), payloads))
    multi_token_events = 0
    for ref, events in zip(reference + [stop_ref], streams):
        assert events, "no stream events"
        ids, text = [], ""
        for ev in events:
            assert ev["output_ids"][: len(ids)] == ids and ev["text"].startswith(text), "a stream event rewrote the past"
            multi_token_events += len(ev["output_ids"]) - len(ids) > 1
            ids, text = ev["output_ids"], ev["text"]
        assert (ids, text) == (ref["output_ids"], ref["text"])
        assert events[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
    # the stream went through speculative rounds (several tokens per event), not one token at a time
    assert multi_token_events > 0


# --- load and leaks -----------------------------------------------------------------------------------------

LONG = 900  # tokens asked of the requests that are aborted or abandoned: they are still running when cut off


def _load_jobs(seed: int = 13, count: int = 240) -> list[tuple[str, dict]]:
    rng = random.Random(seed)

    def prompt(longest: int = 300) -> list[int]:
        n = rng.choice([1, 2, 3, 5, 8, 13, 21, 40, 64, 100, 180, 300])
        return [rng.randrange(tiny.NUM_WORDS) for _ in range(min(n, longest))]

    jobs = []
    for i in range(count):
        kind = ["greedy"] * 5 + ["sampled"] * 2 + ["abort", "stream_close", "disconnect", "json_schema", "regex"]
        kind = kind[i % 12]
        if kind == "greedy":
            payload = _greedy(prompt(), max_new_tokens=rng.randint(1, 16))
        elif kind == "sampled":
            filters = rng.choice([{"top_p": 0.9}, {"top_k": 5}, {"top_k": 8, "top_p": 0.8}, {}])
            seed = rng.choice([None, rng.randrange(10**6)])
            payload = {"input_ids": prompt(), "sampling_params": {"max_new_tokens": rng.randint(1, 16), "temperature": 1.0,
                                                                  **filters, **({"sampling_seed": seed} if seed else {})}}
        elif kind in ("abort", "stream_close", "disconnect"):
            params = {"max_new_tokens": LONG, "ignore_eos": True, "temperature": rng.choice([0, 1.0])}
            payload = {"input_ids": prompt(longest=64), "rid": f"load-{kind}-{i}", "sampling_params": params}
        elif kind == "json_schema":
            payload = _greedy(prompt(), json_schema=json.dumps({"type": "object"}))
        else:
            payload = {"input_ids": prompt(), "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "regex": "( w1[0-9])+"}}
        jobs.append((kind, payload))
    rng.shuffle(jobs)
    return jobs


def _disconnect(server, payload: dict, after: float) -> None:
    """A non-streaming client that sends its request and goes away without reading the answer."""
    body = json.dumps(payload).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(after)


def _run_job(server, job, abort_status: dict, rng_lock: threading.Lock, rng: random.Random):
    kind, payload = job
    with rng_lock:
        delay = rng.uniform(0.2, 1.5)
    if kind == "abort":
        rid = payload["rid"]

        def abort():
            try:
                abort_status[rid] = _post(server, "/abort_request", {"rid": rid})
            except (urllib.error.URLError, OSError) as exc:
                abort_status[rid] = repr(exc)

        timer = threading.Timer(delay, abort)
        timer.start()
        result = _generate_or_error(server, payload)
        timer.join()
        return result
    if kind == "stream_close":
        return _stream(server, payload, max_events=2)
    if kind == "disconnect":
        return _disconnect(server, payload, delay)
    return _generate_or_error(server, payload)


def _leaks_reported(server) -> list[str]:
    log = server.log_path.read_text(errors="replace")
    return [line for line in log.splitlines() if any(m in line for m in LEAK_MARKERS)]


def test_load_with_aborts_and_disconnects_leaves_no_leak(plain_server, load_server):
    """240 requests, 48 at a time against 32 running slots: greedy and sampled (T = 1, top-p / top-k, some
    seeded) with prompts of 1 to 300 tokens, 20 aborted through ``/abort_request``, 20 streams the client
    closes after two events, 20 non-streaming clients that disconnect, 20 grammar requests refused at
    admission. Then SGLang reported no leak, ``/v1/loads`` shows no KV slot held by a request, the radix cache
    flushes, ``/health`` is 200 and greedy output still equals the plain server's.

    Checked to fail: one KV slot dropped from one ``TokenToKVPoolAllocator.free`` (the busy check stops the
    scheduler: "Full Pool Mem Leak Detected!"), one request slot dropped from one ``ReqToTokenPool.free_rows``
    (the idle check: "req_to_token_pool memory leak detected!")."""
    try:
        _load_and_check(plain_server, load_server)
    except Exception:
        leaks = _leaks_reported(load_server)
        if leaks:  # SGLang's check stops the scheduler on a leak: say so rather than what failed next
            pytest.fail("SGLang's memory check reported a leak:\n" + "\n".join(leaks[:10]))
        raise


def _load_and_check(plain_server, load_server):
    before = _wait_idle(load_server)
    assert before["num_used_tokens"] == 0, before
    aborted_before = _aborted_total(load_server)

    jobs = _load_jobs()
    assert len(jobs) >= 200
    abort_status: dict[str, int] = {}
    lock, rng = threading.Lock(), random.Random(5)
    started = time.time()
    with ThreadPoolExecutor(max_workers=48) as pool:
        results = list(pool.map(lambda job: _run_job(load_server, job, abort_status, lock, rng), jobs))
    by_kind: dict[str, list] = {}
    for (kind, payload), result in zip(jobs, results):
        by_kind.setdefault(kind, []).append((payload, result))

    # served requests: greedy ones equal the plain server's answer, sampled ones are well formed
    greedy = by_kind["greedy"]
    assert all("output_ids" in r for _, r in greedy), [r for _, r in greedy if "output_ids" not in r][:3]
    plain = _concurrent(plain_server, [p for p, _ in greedy])
    mismatched = [p["input_ids"] for (p, r), a in zip(greedy, plain) if r["output_ids"] != a["output_ids"]]
    assert not mismatched, f"{len(mismatched)} greedy requests under load differ from the plain server"
    for payload, r in by_kind["sampled"]:
        assert "output_ids" in r, r
        assert 1 <= len(r["output_ids"]) <= payload["sampling_params"]["max_new_tokens"]
        assert all(0 <= t < tiny.VOCAB_SIZE for t in r["output_ids"])
        assert r["meta_info"]["finish_reason"]["type"] in ("length", "stop")
    # aborted through /abort_request while running: an abort, well short of what was asked
    assert sorted(abort_status.values()) == [200] * len(by_kind["abort"])
    for _, r in by_kind["abort"]:
        if "http_status" in r:  # SGLang may answer an aborted request with an error status
            assert "abort" in r["error"].lower(), r
        else:
            assert r["meta_info"]["finish_reason"]["type"] == "abort", r["meta_info"]
            assert len(r["output_ids"]) < LONG
    # closed streams had started streaming
    assert all(events and events[0]["output_ids"] for _, events in by_kind["stream_close"])
    # refused at admission, with the field named
    for field in ("json_schema", "regex"):
        for _, r in by_kind[field]:
            assert r.get("http_status") == 400, r
            assert json.loads(r["error"])["error"]["message"] == GRAMMAR_REFUSAL.format(field)

    after = _wait_idle(load_server)
    load_s = time.time() - started
    # SGLang counts an abort it forwards to the scheduler for a live request: every /abort_request, and the
    # abandoned clients whose request was still running when SGLang noticed (2-4 s later, of LONG tokens).
    abandoned = len(by_kind["stream_close"]) + len(by_kind["disconnect"])
    aborted = _aborted_total(load_server) - aborted_before
    assert aborted >= len(by_kind["abort"]) + abandoned // 2, (aborted, len(by_kind["abort"]), abandoned)
    # no KV slot is held by a request any more (used = pool - free - cached)
    assert after["num_used_tokens"] == 0 and after["token_usage"] == 0, after
    with urllib.request.urlopen(load_server.url + "/flush_cache", timeout=60) as r:
        assert r.status == 200  # refused while any request still runs or waits
    assert _load(load_server)["num_used_tokens"] == 0

    # still exact afterwards
    final = _concurrent(load_server, [_greedy(p) for p in PROMPTS])
    assert _ids(final) == _ids(_concurrent(plain_server, [_greedy(p) for p in PROMPTS]))
    assert all(len(ids) == NEW_TOKENS for ids in _ids(final))

    _wait_idle(load_server)
    time.sleep(2)  # the scheduler runs its idle check on every idle loop
    with urllib.request.urlopen(load_server.url + "/health", timeout=30) as r:
        assert r.status == 200
    assert load_server.proc.poll() is None, load_server.log_tail()
    leaks = _leaks_reported(load_server)
    assert not leaks, "\n".join(leaks[:10])
    print(f"load: {len(jobs)} requests, {aborted:.0f} aborts counted, idle after {load_s:.1f}s")
