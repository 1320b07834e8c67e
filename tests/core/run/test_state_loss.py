"""Redis loses the round (FLUSHDB mid-round): never reported complete; with a mirror, bounded replay."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import traversal
from test_pull import Deliveries, RedisLoss, analyzed_events

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import (
    KeysetTraversal,
    RetentionError,
    RoundIncompleteError,
    RoundStateLostError,
    TraverseOptions,
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
    rnd = t.plan(max_ranges=2, new_stream=True)
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
    rnd = t.plan(max_ranges=2, new_stream=True)  # ranges (-inf, 2000], (2000, 4000]
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
    nxt = t.plan(
        max_ranges=1, new_stream=True
    )  # the watermark comes back from the mirror: no full re-traversal
    assert nxt.start_key == 4000 and nxt.round_id != rnd.round_id


def test_incomplete_restored_round_still_refuses_to_close(
    events, pg_schema_url, redis_url, key_prefix, redis_client
):
    t = events_traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    rnd = t.plan(max_ranges=2, new_stream=True)
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
    rnd = t.plan(max_ranges=2, new_stream=True)  # (-inf, 2000], (2000, 4000]
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
    rnd = t.plan(max_ranges=2, new_stream=True)  # (-inf, 2000], (2000, 4000]
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


# ---- a split the checkpoint mirror missed (issue #18, item 3) ----------------------------------


class Killed(BaseException):
    """The worker's process dies (an Airflow kill): nothing of the run's own cleanup is owed."""


def _mirror_away(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE keyset_checkpoints RENAME TO keyset_checkpoints_away")


def _mirror_back(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE keyset_checkpoints_away RENAME TO keyset_checkpoints")


def test_a_split_the_mirror_missed_is_carried_by_the_ranges_later_checkpoints(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client, caplog
):
    """Double fault: the mirror is down (its table renamed away) when the owner of the round's
    one range splits it at its median, and back for the later checkpoints, which write the shrunken
    range; then Redis loses everything. The split's mark on the range (written by the split
    itself) makes each of those checkpoints carry the new range too, so the round restored from
    the mirror is a partition: it closes with exact totals and every key is delivered."""
    keys = list(range(1, 1001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=1, start_key=0, end_key=1000)
    ghost = traversal(pg_schema_url, redis_url, key_prefix)
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=301)

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        if chunk.keys[0] == 101:  # the mirror goes away; an idle task asks for a split
            _mirror_away(pg_engine)
            assert ghost.store.request_split(rnd.round_id, 0, "ghost#1") == "asked"
        if chunk.keys[0] == 111:  # the split was answered after the last commit: mirror back
            _mirror_back(pg_engine)
        redis_loss(chunk)  # Redis restarts without persistence

    caplog.set_level("WARNING", logger="airflow_keyset_provider")
    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10), tasks=1
    )
    assert "did not record the split" in caplog.text
    assert "restored from the checkpoint mirror" in caplog.text
    assert redis_loss.done and res.finished
    status = t.control.round_status(rnd.round_id)
    assert status.n_ranges == 2 and status.ranges[0].hi == status.ranges[1].lo
    assert set(seen.seen) == set(keys)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    ghost.close()
    t.close()


def test_a_split_whose_owner_died_before_mirroring_is_carried_by_the_next_owner(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """The owner splits with the mirror down and dies at its next chunk (a kill: nothing of its
    own cleanup runs past the raise). The mark stays on the range in Redis, so the owner that
    takes the range over (another process, nothing in its memory) carries the new range with
    its first checkpoint; Redis then loses everything, and the round restored from the mirror is
    a partition: every key delivered, exact totals."""
    keys = list(range(1, 1001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=1, start_key=0, end_key=1000)
    ghost = traversal(pg_schema_url, redis_url, key_prefix)
    seen = Deliveries()

    def dying(chunk: Any) -> None:
        seen.record("w1", chunk)
        if chunk.keys[0] == 101:
            _mirror_away(pg_engine)
            assert ghost.store.request_split(rnd.round_id, 0, "ghost#1") == "asked"
        if chunk.keys[0] == 111:
            raise Killed()

    with pytest.raises(Killed):
        t.traverse_round(
            rnd.round_id, dying, options=TraverseOptions(owner_lineage="w1", chunk_size=10), tasks=1
        )
    _mirror_back(pg_engine)
    assert t.store.round_info(rnd.round_id)["n_ranges"] == "2"
    redis_client.hset(t.store.range_key(rnd.round_id, 0), "lease_until", 0)  # its lease ran out
    redis_loss = RedisLoss(redis_client, key_prefix, at=301)

    def proc(chunk: Any) -> None:
        seen.record("w2", chunk)
        redis_loss(chunk)

    t2 = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t2.checkpoint_seconds = 0
    res = t2.traverse_round(
        rnd.round_id,
        proc,
        options=TraverseOptions(owner_lineage="w2", chunk_size=10),
        first_range=0,  # the dead owner's range first, before range 1 (no coalescing)
    )
    assert next(r for w, r, _ in seen.order if w == "w2") == 0
    assert redis_loss.done and res.finished
    assert set(seen.seen) == set(keys)
    totals = t2.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    for x in (ghost, t, t2):
        x.close()


def test_a_restore_ends_a_parent_the_mirror_holds_from_before_its_split(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Range 1 was split into range 2 with the mirror down, its owner died before any later
    record of it, and range 2's own owner checkpointed it: the mirror holds range 1 as it was
    before the split, overlapping range 2. The restore ends range 1 where range 2 starts (and
    writes that back to the mirror), so the round is a partition and closes with exact totals."""
    keys = list(range(1, 1001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=2, start_key=0, end_key=1000)
    lo1, hi1 = t.store.range(rnd.round_id, 1)["lo"], t.store.range(rnd.round_id, 1)["hi"]
    c = t.store.claim(rnd.round_id, 1, "w#dead", "w", 60_000)
    at = t.source.encode([800])
    assert c.cursor == lo1 and t.store.split(rnd.round_id, 1, "w#dead", at) == 2
    two = t.store.snapshot_range(rnd.round_id, 2)
    t.mirror.save_range(t.stream, rnd.round_id, 2, two)  # range 2's own record
    _flush_prefix(redis_client, key_prefix)  # range 1's split record never reached the mirror
    assert t.control.restore(rnd.round_id)
    ranges = {
        r.range_id: (r.lo_encoded, r.hi_encoded) for r in t.control.range_status(rnd.round_id)
    }
    assert ranges[1] == (lo1, at) and ranges[2] == (at, hi1)
    assert t.mirror.load_round(t.stream, rnd.round_id)[1][1]["hi"] == at  # written back
    seen = Deliveries()
    res = t.traverse_round(
        rnd.round_id, lambda ch: seen.record("w", ch), options=TraverseOptions(chunk_size=50)
    )
    assert res.finished and set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    t.close()
