"""``--disable-overlap-schedule`` still works: a KDTREE server without SGLang's overlap scheduler (the round's
faults are then read right after it, in the same ``on_verify_complete_cpu`` hook) passes the greedy, seeded
sampling, fault and allocation-failure tests of ``test_server_kdtree.py``, whose own server overlaps. Both equal
the plain server (no speculation, no overlap), so the two modes give the same tokens.

The tests are ``test_server_kdtree.py``'s own functions, collected here again with this module's fixtures."""

from __future__ import annotations

import pytest

from test_server_kdtree import (  # noqa: F401  (collected here: the tests run against this module's server)
    DEPRECATED, serve_kdtree, test_a_fault_in_one_request_ends_only_that_request,
    test_greedy_outputs_identical_to_plain_server, test_max_new_tokens_cut, test_round_oom_retried_once_changes_no_output,
    test_round_oom_twice_ends_its_batch_and_the_server_continues, test_sampling_with_seed_is_reproducible_and_exact,
    test_stop_token_inside_accepted_path)
from server_requests import PROMPTS, _concurrent, _greedy

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("plain_server", ["llama"], indirect=True)]


@pytest.fixture(scope="module")
def kdtree_server(plain_server, tiny_models, server_logs):
    yield from serve_kdtree(plain_server, tiny_models, server_logs, overlap=False)


@pytest.fixture(scope="module")
def greedy_results(plain_server, kdtree_server):
    payloads = [_greedy(p) for p in PROMPTS]
    return _concurrent(plain_server, payloads), _concurrent(kdtree_server, payloads)


def test_the_server_runs_without_overlap_and_says_nothing_deprecated(kdtree_server):
    """The flag reaches SGLang (its overlap-free loop served the tests above), and SGLang's warning for
    algorithms registered without overlap support is gone."""
    assert "--disable-overlap-schedule" in kdtree_server._args
    assert DEPRECATED not in kdtree_server.log_path.read_text(errors="replace")
