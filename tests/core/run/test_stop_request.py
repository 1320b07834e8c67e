"""Stop requests (issue #10, item 15): ``KeysetTraversal.request_stop`` (the operator's
``on_kill``) ends every wait of a running traverse at once.

Rule under test (docs/contract.md, "Stop requests"): every sleep of a run (the backoff after a
dependency failure, the wait before an item retry pass) waits on the stop event, and the stop is
checked between chunks, between isolation probes and between retry passes; the run commits what
it processed and returns ``stopped=True``, the cursor where the last commit left it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from core_support import make_events, traversal

from airflow_keyset_provider.core import Chunk, ChunkResult, RetryableError
from airflow_keyset_provider.core.keys import encode_key

# Waits of an hour: a wait the stop does not end keeps the call running far past ``RETURNS``;
# a stop that ends it returns within seconds. No outcome depends on the machine's speed.
HOUR = 3600.0
SLOW = {"backoff_base": HOUR, "backoff_max": 2 * HOUR, "prefetch": False, "chunk_size": 20}
#: How long the test waits for the call to return (a liveness bound, 30x below the waits).
RETURNS = 120.0


def _returns(call: Callable[[], Any]) -> Any:
    """``call()`` in a thread; its result, asserting it returned within ``RETURNS``."""
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.setdefault("r", call()), daemon=True)
    th.start()
    th.join(RETURNS)
    assert not th.is_alive(), "the call is still in a wait the stop should have ended"
    return out["r"]


def _stop_when(t: Any, event: threading.Event) -> threading.Thread:
    def stopper() -> None:
        if event.wait(30):
            time.sleep(0.3)  # let the run enter its wait
            t.request_stop()

    th = threading.Thread(target=stopper)
    th.start()
    return th


def test_stop_ends_a_backoff_sleep(pg_engine, pg_schema_url, redis_url, key_prefix):
    """The processor raises RetryableError from chunk (40, 60] on, and backoff_base is 1 h.
    Before: the stop waited out the backoff sleep. Now traverse returns within seconds of
    request_stop, with stopped=True and the cursor unchanged at 40."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    failing = threading.Event()

    def proc(chunk: Chunk) -> None:
        if chunk.keys[-1] > 40:
            failing.set()
            raise RetryableError("HTTP 503 from dispatch-api")

    stopper = _stop_when(t, failing)
    res = _returns(lambda: t.traverse(rnd.round_id, 0, proc, **SLOW))
    stopper.join(30)
    assert res.stopped and not res.complete
    assert res.cursor == encode_key((40,)) and res.done == 40
    t.close()


@pytest.mark.parametrize("how", ["retry wait", "retry backoff"])
def test_stop_ends_an_item_retry_pass(how: str, pg_engine, pg_schema_url, redis_url, key_prefix):
    """Key 50 fails on its own. With item_retry_delay=1 h ("retry wait"), or with every retry
    pass raising RetryableError and backoff_base=1 h ("retry backoff"), the stop lands while the
    range drains its retries. Before: the stop was not looked at during retry passes, so the call
    ran all of them (minutes). Now it returns within seconds: stopped=True, the cursor at hi, the
    item still waiting for retry, the range not complete."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    draining = threading.Event()

    def proc(chunk: Chunk) -> ChunkResult:
        if chunk.keys[-1] == 100:
            draining.set()
        if how == "retry backoff" and chunk.keys == [50]:
            raise RetryableError("HTTP 503 from dispatch-api")
        return ChunkResult(
            failed={50: "row 50: amount is not a number"} if 50 in chunk.keys else {}
        )

    delay = HOUR if how == "retry wait" else 0.01
    stopper = _stop_when(t, draining)
    res = _returns(lambda: t.traverse(rnd.round_id, 0, proc, item_retry_delay=delay, **SLOW))
    stopper.join(30)
    assert res.stopped and not res.complete
    assert res.cursor == encode_key((100,)) and (res.done, res.dead) == (99, 0)
    assert t.range_status(rnd.round_id)[0].retries == 1
    t.close()
