"""``--disable-overlap-schedule`` still works: a KDTREE server without SGLang's overlap scheduler (the round's
faults are then read right after it, in the same ``on_verify_complete_cpu`` hook) passes the greedy, seeded
sampling, fault and allocation-failure tests of ``test_server_kdtree.py``, whose own server overlaps. Both equal
the plain server (no speculation, no overlap), so the two modes give the same tokens.

This server also chooses its verify width per round among ``TIERS`` (no ``--speculative-num-draft-tokens``), as
the README's launch does, so the same start covers the automatic width (one server start less for CI).

The tests are ``test_server_kdtree.py``'s own functions, collected here again with this module's fixtures."""

from __future__ import annotations

import json

import pytest

from test_server_kdtree import (  # noqa: F401  (collected here: the tests run against this module's server)
    DEPRECATED, serve_kdtree, test_a_fault_in_one_request_ends_only_that_request,
    test_greedy_outputs_identical_to_plain_server, test_host_times_split_each_decode_round_by_step_of_the_scheduler_loop,
    test_max_new_tokens_cut, test_round_oom_retried_once_changes_no_output,
    test_round_oom_twice_ends_its_batch_and_the_server_continues, test_sampling_with_seed_is_reproducible_and_exact,
    test_stop_token_inside_accepted_path)
from server_requests import PROMPTS, TIERS, _concurrent, _greedy

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("plain_server", ["llama"], indirect=True)]


@pytest.fixture(scope="module")
def kdtree_server(plain_server, tiny_models, server_logs):
    yield from serve_kdtree(plain_server, tiny_models, server_logs, overlap=False, widths=TIERS)


@pytest.fixture(scope="module")
def greedy_results(plain_server, kdtree_server):
    payloads = [_greedy(p) for p in PROMPTS]
    return _concurrent(plain_server, payloads), _concurrent(kdtree_server, payloads)


def test_the_server_runs_without_overlap_and_says_nothing_deprecated(kdtree_server):
    """The flag reaches SGLang (its overlap-free loop served the tests above), and SGLang's warning for
    algorithms registered without overlap support is gone."""
    assert "--disable-overlap-schedule" in kdtree_server._args
    assert DEPRECATED not in kdtree_server.log_path.read_text(errors="replace")


def test_automatic_width_is_exact_and_reports_its_predictions(kdtree_server, greedy_results):
    """The choice explores every tier, then picks; outputs stay exact and every round logs the width, the predicted
    and the realised accept length."""
    plain, _ = greedy_results
    start = len(kdtree_server.round_log.read_text().splitlines())
    spec = _concurrent(kdtree_server, [_greedy(p) for p in PROMPTS])
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    rounds = [json.loads(line) for line in kdtree_server.round_log.read_text().splitlines()]
    assert len({r["width"]["width"] for r in rounds}) >= 2
    assert {r["width"]["width"] for r in rounds} <= {int(w) for w in TIERS.split(",")}
    for r in rounds[start:]:
        w = r["width"]
        assert w["predicted"] >= 1.0 and w["predicted_raw"] >= 1.0 and w["round_ms"] > 0
