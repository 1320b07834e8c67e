"""Redis loses the round (FLUSHDB mid-round): never reported complete; with a mirror, bounded replay."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import (
    KeysetTraversal,
    RetentionError,
    RoundIncompleteError,
    RoundStateLostError,
)


def _flush_prefix(client, prefix: str) -> None:
    for k in list(client.scan_iter(f"{prefix}:*")):
        client.delete(k)


@pytest.fixture
def events(pg_engine):
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1, 4000) g"))
    return pg_engine


def events_traversal(url: str, redis_url: str, key_prefix: str, **kw: Any) -> KeysetTraversal:
    """A traversal of the ``events`` table, stream ``s``, under the test's key prefix."""
    return KeysetTraversal(
        url, table="events", key="seq", redis_url=redis_url, stream="s", key_prefix=key_prefix, **kw
    )


def test_lost_round_is_an_error_never_complete(
    events, pg_schema_url, redis_url, key_prefix, redis_client
):
    t = events_traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=2)
    t.traverse(rnd.round_id, 0, lambda c: None, chunk_size=500)
    _flush_prefix(redis_client, key_prefix)
    with pytest.raises(RoundStateLostError, match="no state in Redis"):
        t.traverse(rnd.round_id, 1, lambda c: None)
    with pytest.raises(RoundStateLostError):
        t.close_round(rnd.round_id)


def test_mirror_restores_lost_round_with_bounded_replay(
    events, pg_schema_url, redis_url, key_prefix, redis_client, caplog
):
    seen: Counter = Counter()
    t = events_traversal(
        pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url, checkpoint_seconds=0
    )

    class Flush(BaseException):
        pass

    def proc(chunk):
        seen.update(chunk.keys)
        if 1005 in chunk.keys:
            return ChunkResult(failed={1005: "bad"})
        if chunk.keys[0] == 1501 and not flushed:
            flushed.append(1)
            _flush_prefix(redis_client, key_prefix)  # Redis restarts without persistence
        return None

    flushed: list[int] = []
    rnd = t.plan(max_ranges=2)  # ranges (-inf, 2000], (2000, 4000]
    res = t.traverse(
        rnd.round_id, 0, proc, chunk_size=250, max_item_attempts=2, item_retry_delay=0.01
    )
    # the advance of chunk (1500, 1750] found no state: the round was restored from the mirror at the
    # last checkpoint (cursor 1500, checkpoint_seconds=0) and the traversal went on from there
    assert res.complete and (res.done, res.dead) == (1999, 1)
    assert "restored from the checkpoint mirror" in caplog.text
    replayed = sorted(k for k, n in seen.items() if n > 1 and k != 1005)
    assert replayed == list(range(1501, 1751))  # one chunk
    t.traverse(rnd.round_id, 1, proc, chunk_size=250)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (3999, 0, 1)
    assert set(seen) == set(range(1, 4001))
    _flush_prefix(redis_client, key_prefix)  # lose everything again, between rounds
    with events.begin() as c:
        c.execute(sa.text("INSERT INTO events VALUES (4001, 'new')"))
    nxt = t.plan(max_ranges=1)  # the watermark comes back from the mirror: no full re-traversal
    assert nxt.start_key == 4000 and nxt.round_id != rnd.round_id


def test_incomplete_restored_round_still_refuses_to_close(
    events, pg_schema_url, redis_url, key_prefix, redis_client
):
    t = events_traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    rnd = t.plan(max_ranges=2)
    t.traverse(rnd.round_id, 0, lambda c: None, chunk_size=500)
    _flush_prefix(redis_client, key_prefix)
    with pytest.raises(RoundIncompleteError, match="range 1"):
        t.close_round(rnd.round_id)  # restored: range 0 complete, range 1 never started
    assert t.traverse(rnd.round_id, 1, lambda c: None).complete
    assert t.close_round(rnd.round_id).done == 4000


def test_retention_floor_is_lowest_open_cursor_else_watermark(
    events, pg_schema_url, redis_url, key_prefix
):
    t = events_traversal(pg_schema_url, redis_url, key_prefix)
    assert t.retention_floor() is None
    rnd = t.plan(max_ranges=2)  # (-inf, 2000], (2000, 4000]
    assert t.retention_floor() is None  # range 0 has read nothing yet: keep everything

    def stop_after(n):
        def proc(chunk):
            if chunk.keys[-1] >= n:
                t.request_stop()

        return proc

    t.traverse(rnd.round_id, 1, lambda c: None)
    assert t.traverse(rnd.round_id, 0, stop_after(750), chunk_size=250).stopped
    t = events_traversal(
        pg_schema_url, redis_url, key_prefix
    )  # a stop request is final for its traversal object
    assert t.retention_floor() == 750
    t.traverse(rnd.round_id, 0, lambda c: None)
    t.close_round(rnd.round_id)
    assert t.retention_floor() == 4000


def test_retention_past_a_cursor_makes_the_round_unrecoverable(
    events, pg_schema_url, redis_url, key_prefix
):
    with events.begin() as c:
        c.execute(sa.text("CREATE TABLE retention (deleted_through bigint)"))
        c.execute(sa.text("INSERT INTO retention VALUES (NULL)"))
    kw = {
        "table": "events",
        "key": "seq",
        "redis_url": redis_url,
        "stream": "s",
        "key_prefix": key_prefix,
        "retention_sql": "SELECT deleted_through FROM retention",
    }
    t = KeysetTraversal(pg_schema_url, **kw)
    rnd = t.plan(max_ranges=2)  # (-inf, 2000], (2000, 4000]
    t.traverse(
        rnd.round_id, 0, lambda ch: t.request_stop() if ch.keys[-1] >= 750 else None, chunk_size=250
    )
    assert t.retention_floor() == 750
    with events.begin() as c:  # a retention job deletes at the floor: harmless
        c.execute(sa.text("DELETE FROM events WHERE seq <= 750"))
        c.execute(sa.text("UPDATE retention SET deleted_through = 750"))
    assert t.traverse(rnd.round_id, 1, lambda ch: None).complete
    with events.begin() as c:  # then past it: rows range 0 has not read are gone
        c.execute(sa.text("DELETE FROM events WHERE seq <= 1200"))
        c.execute(sa.text("UPDATE retention SET deleted_through = 1200"))
    with pytest.raises(
        RetentionError, match=r"retention boundary 1200 passed range 0's cursor 750"
    ):
        t.traverse(rnd.round_id, 0, lambda ch: None)
    with pytest.raises(RetentionError, match="unrecoverable"):
        t.close_round(rnd.round_id)
    assert t.watermark() is None  # never reported complete, the watermark did not move
    assert t.range_status(rnd.round_id)[0]["cursor"] == 750
