"""Durable by default (``core/rounds/durability.py``): a stream whose Redis state is gone is
restored or refused, never started again below every key without a word.

Real PostgreSQL and Redis; "Redis lost the stream" is every key under the test's own prefix
deleted (``CursorStore.delete_stream``, what a ``FLUSHALL`` does to the stream), never a flush of
the shared database. On the old code each refusal below was a silent restart from ``-inf``."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider.core import KeysetTraversal, StreamStateLostError
from airflow_keyset_provider.core.rounds.durability import PlannedRound, StreamRecord

CHOICES = ("checkpoint mirror", "explicit bounds", "new_stream=True")


@pytest.fixture
def events(pg_engine: sa.Engine) -> sa.Engine:
    make_events(pg_engine, list(range(1, 401)))
    return pg_engine


def _add(engine: sa.Engine, lo: int, hi: int) -> None:
    with engine.begin() as c:
        c.execute(sa.text(f"INSERT INTO events SELECT g, 'e' FROM generate_series({lo}, {hi}) g"))


def _run(t: KeysetTraversal, seen: Counter, **plan: Any) -> Any:
    """Plan, traverse every range (recording each delivered key), close; the round's totals."""
    rnd = t.plan(max_ranges=2, **plan)
    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, lambda c: seen.update(c.keys), chunk_size=50)
    return t.close_round(rnd.round_id)


def _record(t: KeysetTraversal, **kw: Any) -> StreamRecord:
    """What Airflow's asset state would hold after the stream's last close (the seam the
    operators fill from ``keyset://<stream>``)."""
    return StreamRecord(
        source="test record",
        watermark=t.store.watermark(),
        last_round=kw.pop("last_round", None),
        key_fingerprint=t.store.key_fingerprint(),
        **kw,
    )


def _keys_left(t: KeysetTraversal) -> list[Any]:
    return list(t.store.client.scan_iter(match=f"{t.store.base}:*"))


def test_a_lost_stream_without_mirror_or_record_is_refused(
    events, pg_schema_url, redis_url, key_prefix
):
    """Redis loses a stream with a closed round and no mirror: the next chained plan refuses,
    naming the three choices, and writes nothing (every retry refuses the same way); the old
    code planned (-inf, 400] again and delivered all 400 keys a second time."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    assert _run(t, seen, new_stream=True).watermark == 400
    t.store.delete_stream()  # Redis lost the stream
    for _ in range(2):
        with pytest.raises(StreamStateLostError) as err:
            t.plan(max_ranges=2)
        assert all(choice in str(err.value) for choice in CHOICES), err.value
        assert _keys_left(t) == []
    assert max(seen.values()) == 1
    t.close()


def test_the_first_plan_of_a_stream_says_it_is_new(
    events, pg_schema_url, redis_url, key_prefix, caplog
):
    """Without a mirror or a record the engine cannot tell a new stream from a lost one: the
    first chained plan needs ``new_stream=True``, and the log says "new stream". Later plans
    (Redis has the stream) need nothing; explicit bounds are never refused."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    with pytest.raises(StreamStateLostError, match="new_stream=True"):
        t.plan()
    caplog.set_level(logging.INFO, logger="airflow_keyset_provider")
    rnd = t.plan(max_ranges=1, new_stream=True)
    assert rnd.start_key is None and rnd.end_key == 400
    assert "new stream" in caplog.text
    assert t.plan(max_ranges=1).round_id == rnd.round_id  # the open chained round, unchanged
    t.close()
    other = KeysetTraversal(
        pg_schema_url,
        "events",
        "seq",
        redis_url=redis_url,
        stream="explicit",
        key_prefix=key_prefix,
    )
    assert other.plan(max_ranges=1, start_key=0, end_key=100).end_key == 100
    other.close()


def test_a_lost_stream_is_restored_from_the_durable_record(
    events, pg_schema_url, redis_url, key_prefix, caplog
):
    """Redis loses the stream after round r1 closed; the record (Airflow's asset state) holds the
    watermark: the next plan restores it and the round counter, and round r2 delivers only the
    new keys (401-450): nothing is delivered twice."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    _run(t, seen, new_stream=True)
    record = _record(t, last_round="r1")
    t.store.delete_stream()
    _add(events, 401, 450)
    caplog.set_level(logging.WARNING, logger="airflow_keyset_provider")
    totals = _run(t, seen, record=record)
    assert (totals.round_id, totals.start_key, totals.end_key, totals.done) == ("r2", 400, 450, 50)
    assert sorted(seen) == list(range(1, 451)) and max(seen.values()) == 1
    assert "restored from it" in caplog.text and "test record" in caplog.text
    t.close()


def test_a_round_open_when_redis_lost_it_is_refused_not_replayed(
    events, pg_schema_url, redis_url, key_prefix
):
    """Round r2 is mid-way (range 0 committed two chunks) when Redis loses the stream; the record
    knows r1 closed at 400 and r2 (400, 500] planned. A chained plan refuses (naming r2, its
    bounds and the choices) instead of planning (400, 500] again with every committed chunk
    delivered again; so does a retry. Planning those keys again with explicit bounds is the
    person's choice, and chained plans then continue from its end."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    _run(t, seen, new_stream=True)
    _add(events, 401, 500)
    r2 = t.plan(max_ranges=2)
    record = _record(
        t, last_round="r1", planned=PlannedRound(r2.round_id, r2.start_encoded, r2.end_encoded)
    )
    o: dict[str, Any] = {"chunk_size": 20}
    with pytest.raises(StreamStateLostError):  # stand-in for a crash after two chunks
        t.traverse(r2.round_id, 0, _lose_after(t, 2, seen), **o)
    for _ in range(2):
        with pytest.raises(StreamStateLostError, match=r"round r2 \(400, 500\] was open") as err:
            t.plan(max_ranges=2, record=record)
        assert all(choice in str(err.value) for choice in CHOICES)
    assert t.store.watermark() is None  # nothing was written
    r3 = t.plan(max_ranges=1, start_key=400, end_key=500, record=record)  # the person's choice
    assert r3.round_id == "r3"  # ids stay unique: the counter moved past the record's rounds
    for spec in r3.ranges:
        t.traverse(r3.round_id, spec.range_id, lambda c: seen.update(c.keys), chunk_size=50)
    assert t.close_round(r3.round_id).watermark == 500
    _add(events, 501, 510)
    assert _run(t, seen, record=record).start_key == 500
    t.close()


def _lose_after(t: KeysetTraversal, chunks: int, seen: Counter) -> Any:
    calls = {"n": 0}

    def processor(chunk: Any) -> None:
        calls["n"] += 1
        if calls["n"] > chunks:
            t.store.delete_stream()  # Redis lost the stream mid-round
            raise StreamStateLostError("crash")
        seen.update(chunk.keys)

    return processor


def test_an_empty_record_makes_a_new_stream(events, pg_schema_url, redis_url, key_prefix, caplog):
    """A record that saw nothing of the stream (Airflow: no plan ever recorded on its asset) and
    no state in Redis: a genuinely new stream, planned below every key, logged as new."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    caplog.set_level(logging.INFO, logger="airflow_keyset_provider")
    rnd = t.plan(max_ranges=1, record=StreamRecord(source="test record"))
    assert rnd.start_key is None and "new stream" in caplog.text
    t.close()


def test_new_stream_ignores_a_record_but_keeps_round_ids_unique(
    events, pg_schema_url, redis_url, key_prefix
):
    """``new_stream=True`` after a loss starts again below every key, knowingly; the round counter
    still moves past the record's rounds, so no round id (asset events are keyed by it) repeats."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    _run(t, seen, new_stream=True)
    record = _record(t, last_round="r1")
    t.store.delete_stream()
    rnd = t.plan(max_ranges=1, record=record, new_stream=True)
    assert (rnd.round_id, rnd.start_key) == ("r2", None)
    t.close()


def test_the_explicit_replan_a_refusal_names_becomes_the_streams_base(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The refusal's choice (2): after Redis lost the stream, an explicit round (100, 150] is
    planned. While it is open a chained plan still refuses (Redis holds a round counter, no
    watermark); once it closes the chained plan continues from 150. The old code planned
    (-inf, 150] and delivered keys 1-100 a second time (the model's ``explicit-replan-restart``)."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    assert _run(t, seen, new_stream=True).watermark == 100
    t.store.delete_stream()  # Redis lost the stream
    with pytest.raises(StreamStateLostError, match="explicit bounds"):
        t.plan(max_ranges=2)
    _add(pg_engine, 101, 200)
    rnd = t.plan(max_ranges=2, start_key=100, end_key=150)
    with pytest.raises(StreamStateLostError, match="no watermark"):
        t.plan(max_ranges=2)  # the explicit round is still open: no base yet
    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, lambda c: seen.update(c.keys), chunk_size=50)
    assert t.close_round(rnd.round_id).watermark == 150
    nxt = t.plan(max_ranges=2)
    assert (nxt.start_encoded, nxt.created) == (t.store.watermark(), True)
    assert t.watermark() == 150
    for spec in nxt.ranges:
        t.traverse(nxt.round_id, spec.range_id, lambda c: seen.update(c.keys), chunk_size=50)
    assert t.close_round(nxt.round_id).watermark == 200
    assert sorted(seen) == list(range(1, 201)) and max(seen.values()) == 1
    t.close()


def test_an_explicit_round_of_a_declared_new_stream_does_not_move_the_watermark(
    events, pg_schema_url, redis_url, key_prefix
):
    """An explicit round planned with ``new_stream=True`` (a backfill of a new stream) is no
    re-plan: it closes above a gap and the watermark stays absent; a chained plan then refuses
    (Redis holds rounds of the stream but no watermark) unless the caller says new_stream=True,
    which starts below every key."""
    t = traversal(pg_schema_url, redis_url, key_prefix)
    seen: Counter = Counter()
    assert _run(t, seen, start_key=100, end_key=150, new_stream=True).watermark is None
    with pytest.raises(StreamStateLostError, match="no watermark"):
        t.plan(max_ranges=2)
    assert _run(t, seen, new_stream=True).watermark == 400
    t.close()
