"""A pause during the item retry passes (issue #18 item 7), on real PostgreSQL and Redis: the
passes consult the stream's pacer between passes exactly as the main loop does between chunks, so
a pause ends the run (committed, released, ``paused``) with the retries still pending."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from core_support import make_events, traversal

from airflow_keyset_provider.core import Chunk, ChunkResult, TraverseOptions

FLAKY = {30, 70}  # fail twice, then succeed


def test_a_pause_during_item_retry_passes_returns_paused_with_the_retries_pending(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Keys 1..100 in one range, chunks of 20; keys 30 and 70 fail twice, then succeed. The stream
    is paused from another client while the main pass processes its last chunk; the loop ends at
    ``hi`` there (no chunk read follows) and goes to the retry passes, whose first one waits
    ``item_retry_delay`` = 1 h. Before: the passes never looked at the pacer, so their processor
    calls ran after the pause had taken effect (seen: six calls 1.8-9.0 s after a pause) and the
    range completed. Now the wait ends once the pacer has seen the pause (``control_poll_seconds``
    = 0.1) and the run returns ``paused``: no processor call started after the pause, both items
    still wait for retry. After ``resume`` a new traverse completes the range, nothing dead."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    other = traversal(pg_schema_url, redis_url, key_prefix)  # another client, as the CLI would be
    paused = threading.Event()
    after_pause: list[list[Any]] = []  # processor calls that started once the pause was set
    fails: Counter[int] = Counter()
    seen: Counter[int] = Counter()

    def proc(chunk: Chunk) -> ChunkResult:
        if paused.is_set():
            after_pause.append(list(chunk.keys))
        seen.update(chunk.keys)
        failed = {}
        for k in chunk.keys:
            if k in FLAKY and fails[k] < 2:
                fails[k] += 1
                failed[k] = f"row {k}: the ledger is busy"
        if chunk.keys[-1] == 100 and not paused.is_set():  # the main pass's last chunk
            assert other.pause("maintenance", by="oncall").paused
            paused.set()
        return ChunkResult(failed=failed)

    opts = dict(chunk_size=20, max_item_attempts=5, prefetch=False)
    first: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: first.setdefault(
            "res",
            t.traverse(
                rnd.round_id,
                0,
                proc,
                options=TraverseOptions(
                    **opts, control_poll_seconds=0.1, item_retry_delay=3600.0, backoff_max=7200.0
                ),
            ),
        ),
        daemon=True,
    )
    worker.start()
    worker.join(120)  # a liveness bound: without the fix the pass waits an hour
    assert not worker.is_alive(), "the retry pass's wait did not end on the pause"
    res = first["res"]
    assert res.paused and res.yielded == "paused" and not res.complete and not res.stopped
    assert after_pause == []
    status = t.range_status(rnd.round_id)[0]
    assert status.retries == 2 and not status["owner"]  # still pending; the lease released
    assert (status["done"], status["dead"]) == (98, 0)

    assert other.resume()
    final = t.traverse(rnd.round_id, 0, proc, options=TraverseOptions(**opts))
    assert final.complete and (final.done, final.skipped, final.dead) == (100, 0, 0)
    assert set(seen) == set(range(1, 101)) and fails == {30: 2, 70: 2}
    assert t.close_round(rnd.round_id).done == 100
    other.close()
    t.close()
