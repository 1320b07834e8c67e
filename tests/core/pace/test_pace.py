"""Pause, resume and the shared throughput budget of a stream, on real PostgreSQL and Redis."""

from __future__ import annotations

import threading
import time

from core_support import Recorder, make_events, traversal

from airflow_keyset_provider.core import TraverseOptions
from airflow_keyset_provider.core.pace.governor import Governor
from airflow_keyset_provider.core.pace.stream_control import StreamSwitch

FIGURES: list[str] = []


def _slow(rec: Recorder, seconds: float):
    def proc(chunk):
        rec(chunk)
        time.sleep(seconds)

    return proc


def test_pause_commits_releases_and_returns_then_resume_loses_nothing(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: a range of 20,000 keys is traversed in chunks of 200 (20 ms each). After 10
    chunks the stream is paused from another client. The traverse returns ``paused=True``,
    ``complete=False``, its lease released and its cursor committed exactly where the processor
    stopped (no chunk delivered twice). After ``resume`` a new traverse finishes the range: every
    key delivered exactly once, counters exact."""
    make_events(pg_engine, list(range(1, 20_001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    out: dict = {}
    opts = TraverseOptions(chunk_size=200, control_poll_seconds=0.2, owner_lineage="task-a")

    def run():
        out["res"] = t.traverse(rnd.round_id, 0, _slow(rec, 0.02), options=opts)
        out["returned"] = time.monotonic()

    worker = threading.Thread(target=run)
    worker.start()
    while len(rec.chunks) < 10:
        time.sleep(0.005)
    other = traversal(pg_schema_url, redis_url, key_prefix)  # another client, as the CLI would be
    state = other.pause("replica lag during the sale", by="oncall")
    paused_at = time.monotonic()
    assert state.paused and state.reason == "replica lag during the sale"
    worker.join(30)
    res = out["res"]
    FIGURES.append(
        f"pause noticed and returned in {out['returned'] - paused_at:.2f} s (poll 0.2 s)"
    )
    assert res.paused and res.yielded == "paused" and not res.complete and not res.stopped
    status = t.range_status(rnd.round_id)[0]
    assert not status["owner"]  # the lease was released
    delivered = sum(len(c) for c in rec.chunks)
    assert status["done"] == delivered == res.done  # the chunk in hand was committed
    assert t.control.stream_status().control.paused

    # still paused: a new traverse claims, reads nothing, returns at once
    again = t.traverse(rnd.round_id, 0, rec, options=opts)
    assert again.paused and again.rows_read == 0 and again.done == delivered

    assert other.resume() is True and other.resume() is False
    final = t.traverse(rnd.round_id, 0, rec, options=opts)
    assert final.complete and not final.paused
    assert set(rec.seen) == set(range(1, 20_001)) and max(rec.seen.values()) == 1
    assert (final.done, final.skipped, final.dead) == (20_000, 0, 0)
    assert t.close_round(rnd.round_id).done == 20_000
    print("\n" + "\n".join(FIGURES))


def test_throttle_is_visible_and_a_long_wait_yields(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: the stream is throttled to 100 rows/s while a traverse reads chunks of 500 rows
    and may wait in place at most 1 s: after its first chunk (charged 500 rows, one burst of 500
    saved up) the second charge puts the stream 500 rows in debt, a 5 s wait, so the call commits,
    releases and returns ``yielded="throttled"`` with ``retry_after`` ~5 s. ``throttle(None)``
    lifts the budget and the next call finishes the range."""
    make_events(pg_engine, list(range(1, 3001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    state = t.throttle(100)
    assert state.max_rows_per_second == 100.0
    assert t.control.stream_status().as_dict()["control"]["max_rows_per_second"] == 100.0
    rec = Recorder()
    opts = TraverseOptions(chunk_size=500, yield_after_seconds=1.0, prefetch=False)
    res = t.traverse(rnd.round_id, 0, rec, options=opts)
    assert res.yielded == "throttled" and not res.paused and not res.complete
    assert 1.0 < res.retry_after <= 10.5
    assert res.done == sum(len(c) for c in rec.chunks) == 1000
    assert not t.range_status(rnd.round_id)[0]["owner"]
    assert t.throttle(None).max_rows_per_second is None
    final = t.traverse(rnd.round_id, 0, rec, options=opts)
    assert final.complete and set(rec.seen) == set(range(1, 3001))
    assert max(rec.seen.values()) == 1


def test_bucket_is_shared_and_runs_on_the_server_clock(redis_client, key_prefix):
    """Two governors of one stream (two tasks) draw from one bucket: with a rate of 1,000 rows/s
    and a burst of 1,000, the first charge of 1,000 is free, the second (the other task) owes
    about one second, the third about two."""
    from airflow_keyset_provider.core.store.cursor_store import CursorStore

    a = Governor(CursorStore(redis_client, "s1", prefix=key_prefix))
    b = Governor(CursorStore(redis_client, "s1", prefix=key_prefix))
    assert a.charge(1000, 1000.0, 1000.0) == 0.0
    w1 = b.charge(1000, 1000.0, 1000.0)
    w2 = a.charge(1000, 1000.0, 1000.0)
    assert 0.9 < w1 <= 1.0 and 1.9 < w2 <= 2.0
    other = Governor(CursorStore(redis_client, "s2", prefix=key_prefix))
    assert other.charge(1000, 1000.0, 1000.0) == 0.0  # another stream has its own budget


def test_switch_refuses_a_bad_rate(redis_client, key_prefix):
    import pytest

    from airflow_keyset_provider.core import ConfigurationError
    from airflow_keyset_provider.core.store.cursor_store import CursorStore

    sw = StreamSwitch(CursorStore(redis_client, "s1", prefix=key_prefix))
    for bad in (0, -5):
        with pytest.raises(ConfigurationError, match="max_rows_per_second"):
            sw.throttle(bad)
    assert sw.state().max_rows_per_second is None
