"""Failure isolation (issue #10, item 7): bad rows are told apart from a failed dependency even when
they fill a whole chunk, and a real outage still dead-letters nothing.

Rule under test (docs/contract.md, "Item failures and dependency failures"): a chunk that fails as
a whole (the processor raised something other than ``RetryableError``, or named more than
``outage_failure_ratio`` of its items as failed) is isolated before the dependency is blamed: a
canary (a key this range already processed successfully) is processed alone, and the chunk is
bisected down to the items that fail alone. If some probe succeeds, the dependency is up and only
the items that fail alone are item failures (retried, then dead-lettered); if every probe fails,
or any raises ``RetryableError``, it is an outage: the cursor stays and nothing is recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from core_support import FAST, make_events, run_all, traversal

from airflow_keyset_provider.core import (
    Chunk,
    ChunkResult,
    DependencyFailedError,
    RetryableError,
)
from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.run.item_failures import CANARIES

TROUBLE = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"
BAD = set(range(21, 61))


def _dead_keys(t: Any, round_id: str) -> set[int]:
    return {d["key"] for d in t.dead_letters(round_id, 0, limit=1000)}


class NamesBadItems:
    """Processor that names every bad key in ``ChunkResult.failed`` (a validation failure)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad, self.calls, self.calls_at_41 = bad, 0, 0

    def __call__(self, chunk: Chunk) -> ChunkResult:
        self.calls += 1
        return ChunkResult(
            failed={k: f"row {k}: amount is not a number" for k in chunk.keys if k in self.bad}
        )


class BulkInsert:
    """Processor that copies the chunk into ``sink`` with one multi-row INSERT: one bad row (its
    payload violates the sink's CHECK constraint) makes the whole statement, and so the whole
    chunk, raise. It writes nothing when its dependency (the sink) is gone."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine, self.calls = engine, 0

    def __call__(self, chunk: Chunk) -> None:
        self.calls += 1
        with self.engine.begin() as c:
            c.execute(
                sa.text("INSERT INTO sink VALUES (:s, :p) ON CONFLICT (seq) DO NOTHING"),
                [{"s": r["seq"], "p": r["payload"]} for r in chunk.rows],
            )


def _make_sink(engine: sa.Engine, bad: set[int]) -> None:
    make_events(engine, list(range(1, 101)))
    with engine.begin() as c:
        c.execute(
            sa.text("UPDATE events SET payload = 'bad' WHERE seq = ANY(:b)"), {"b": sorted(bad)}
        )
        c.execute(
            sa.text(
                "CREATE TABLE sink (seq bigint PRIMARY KEY, "
                "payload text NOT NULL CHECK (payload <> 'bad'))"
            )
        )


@pytest.mark.parametrize("kind", ["named", "raised"])
def test_a_cluster_of_bad_rows_filling_chunks_is_dead_lettered(
    kind: str, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Keys 21-60 of 100 are permanently bad, chunk_size=20: chunks (20, 40] and (40, 60] fail as
    a whole. Before: five tries of (20, 40] ended in DependencyFailedError with the cursor at 20
    and nothing dead-lettered. Now the canary (key 20, processed before) succeeds, so the failures
    are the items' own: exactly keys 21-60 are dead-lettered and the other 60 are done, whether the
    processor names the bad items or raises for the whole batch (a bulk INSERT)."""
    _make_sink(pg_engine, BAD)
    proc = NamesBadItems(BAD) if kind == "named" else BulkInsert(pg_engine)
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    res = t.traverse(rnd.round_id, 0, proc, chunk_size=20, max_item_attempts=2, **FAST)
    assert res.complete
    assert (res.done, res.skipped, res.dead) == (60, 0, 40)
    assert _dead_keys(t, rnd.round_id) == BAD
    if kind == "raised":
        with pg_engine.connect() as c:
            sunk = {r[0] for r in c.execute(sa.text("SELECT seq FROM sink"))}
        assert sunk == set(range(1, 101)) - BAD
        # bounded: 5 good chunks; each batch of 20 bad items (two chunks, then two retry passes)
        # costs its own call, one canary and at most 2n - 2 bisection calls
        assert proc.calls <= 5 + 4 * (1 + 1 + 2 * 20 - 2)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.dead) == (60, 40)
    t.close()


def test_a_single_poison_row_in_a_bulk_insert_is_isolated(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """One row (37) violates the sink's CHECK constraint, so the bulk INSERT of its chunk raises as
    a whole; another (5) does the same in the range's first chunk, where no key has succeeded yet
    (no canary: a half that succeeds proves the dependency up). Before: DependencyFailedError at
    cursor 0. Now only 5 and 37 are dead-lettered; the 98 others reach the sink."""
    _make_sink(pg_engine, {5, 37})
    proc = BulkInsert(pg_engine)
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    res = t.traverse(rnd.round_id, 0, proc, chunk_size=20, max_item_attempts=2, **FAST)
    assert res.complete and (res.done, res.dead) == (98, 2)
    assert _dead_keys(t, rnd.round_id) == {5, 37}
    letters = t.dead_letters(rnd.round_id, 0)
    assert all("check constraint" in d["error"].lower() for d in letters), letters
    with pg_engine.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM sink")).scalar() == 98
    t.close()


def _assert_outage(t: Any, rnd: Any, proc: Any, cursor: int, *quoted: str) -> None:
    with pytest.raises(DependencyFailedError) as err:
        t.traverse(rnd.round_id, 0, proc, chunk_size=20, max_item_attempts=2, **FAST)
    for phrase in quoted:  # the message troubleshooting.md quotes
        assert phrase in str(err.value) and phrase in TROUBLE.read_text(), phrase
    st = t.range_status(rnd.round_id)[0]
    assert t.store.range(rnd.round_id, 0)["cursor"] == encode_key((cursor,))
    assert (st.dead, st.retries) == (0, 0), st
    assert t.dead_letters(rnd.round_id, 0) == []


def test_a_retryable_outage_dead_letters_nothing(pg_engine, pg_schema_url, redis_url, key_prefix):
    """The processor raises RetryableError from its third chunk on (the dependency is down): the
    cursor stays at 40, nothing is dead-lettered or queued for retry."""
    make_events(pg_engine, list(range(1, 101)))

    def proc(chunk: Chunk) -> None:
        if chunk.keys[-1] > 40:
            raise RetryableError("HTTP 503 from dispatch-api")

    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    _assert_outage(t, rnd, proc, 40)
    t.close()


@pytest.mark.parametrize("how", ["dropped", "named"])
def test_a_dependency_that_fails_every_item_dead_letters_nothing(
    how: str, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """After two chunks the sink the processor writes to is dropped: every call raises (an
    UndefinedTable error, not RetryableError), or, with a processor that catches per item, names
    every item as failed. The canary (key 40) fails too, so it is an outage: DependencyFailedError
    with the cursor at 40, nothing dead-lettered or queued, and the processor was called a bounded
    number of times (the chunk and its canaries per attempt: a canary that fails is tried again
    with other keys that succeeded before, up to ``CANARIES``)."""
    _make_sink(pg_engine, set())
    bulk = BulkInsert(pg_engine)

    def proc(chunk: Chunk) -> Any:
        if chunk.keys[-1] == 40 and len(chunk) == 20:
            out = bulk(chunk)
            with pg_engine.begin() as c:
                c.execute(sa.text("DROP TABLE sink"))
            return out
        if how == "dropped":
            return bulk(chunk)
        try:
            return bulk(chunk)
        except sa.exc.DBAPIError as exc:
            return ChunkResult(failed={k: str(exc.orig) for k in chunk.keys})

    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    _assert_outage(
        t,
        rnd,
        proc,
        40,
        " items failed as a whole (first: ",
        "), and the canary, a key that succeeded before, failed too); the cursor stays at ",
    )
    assert bulk.calls <= 2 + 5 * (1 + CANARIES)  # per attempt: the chunk and its canaries
    t.close()


class Crash(BaseException):
    """Kills the traverse call like a worker crash (no handler in the engine catches it)."""


def test_a_try_resumed_inside_the_cluster_finds_a_canary(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The first try dies when it reaches chunk (40, 60], inside the bad cluster 21-60, so the new
    try starts with no key it saw succeed and a committed cursor (40) that waits in the retry set.
    Its canary is a committed key of the range that neither waits for retry nor is dead (20), so
    the cluster is still told apart from an outage: the range completes with exactly 21-60 dead."""
    _make_sink(pg_engine, BAD)
    named = NamesBadItems(BAD)

    def dies_once(chunk: Chunk) -> ChunkResult:
        if chunk.keys[0] == 41 and len(chunk) == 20 and not named.calls_at_41:
            named.calls_at_41 = 1
            raise Crash
        return named(chunk)

    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    with pytest.raises(Crash):
        t.traverse(rnd.round_id, 0, dies_once, chunk_size=20, max_item_attempts=2, **FAST)
    assert t.store.range(rnd.round_id, 0)["cursor"] == encode_key((40,))
    res = t.traverse(rnd.round_id, 0, dies_once, chunk_size=20, max_item_attempts=2, **FAST)
    assert res.complete and (res.done, res.dead) == (60, 40)
    assert _dead_keys(t, rnd.round_id) == BAD
    t.close()


class NamesBadPayloads:
    """Processor that validates each row as it is now: a row whose payload is 'bad' is named
    failed (its data changed since it was last delivered, it fails validation now)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, chunk: Chunk) -> ChunkResult:
        self.calls += 1
        return ChunkResult(
            failed={r["seq"]: "payload is not valid" for r in chunk.rows if r["payload"] == "bad"}
        )


@pytest.mark.parametrize("resumed", [False, True], ids=["same try", "resumed try"])
def test_a_canary_whose_row_went_bad_since_is_not_taken_for_an_outage(
    resumed: bool, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A way to the one-world model's long-mode seed 12 (a round never closed once the faults
    stopped, every try ended in DependencyFailedError naming a poisoned item; the model poisons
    keys that already succeeded, as a row updated since does): key 20 succeeds, then its row is
    updated to a payload that fails validation (rows are mutable; only keys are not). Chunk (20, 40] is
    all bad, so it is isolated, and its canary is key 20, read again as it is now: it fails. The
    old code took that for an outage on every try (the canary of a resumed try is key 20 again),
    so the bad keys were never dead-lettered and the range never completed. A canary that fails
    is tried again with other keys the range committed: one of them succeeds, the dependency is
    up, and exactly 21-40 are dead-lettered."""
    make_events(pg_engine, list(range(1, 61)))
    with pg_engine.begin() as c:
        c.execute(sa.text("UPDATE events SET payload = 'bad' WHERE seq BETWEEN 21 AND 40"))
    proc = NamesBadPayloads()

    crashed: list[int] = []

    def spoils_20(chunk: Chunk) -> ChunkResult:
        if resumed and chunk.keys[0] == 21 and not crashed:
            crashed.append(21)
            raise Crash  # the try dies after (0, 20]: the next one resumes with no canary seen
        out = proc(chunk)
        if chunk.keys[-1] == 20 and len(chunk) == 20:
            with pg_engine.begin() as c:
                c.execute(sa.text("UPDATE events SET payload = 'bad' WHERE seq = 20"))
        return out

    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=1, start_key=0, end_key=60)
    if resumed:
        with pytest.raises(Crash):
            t.traverse(rnd.round_id, 0, spoils_20, chunk_size=20, max_item_attempts=2, **FAST)
        assert t.store.range(rnd.round_id, 0)["cursor"] == encode_key((20,))
    res = t.traverse(rnd.round_id, 0, spoils_20, chunk_size=20, max_item_attempts=2, **FAST)
    assert res.complete and (res.done, res.dead) == (40, 20)
    assert _dead_keys(t, rnd.round_id) == set(range(21, 41))
    t.close()


def _bad_range_world(pg_engine: sa.Engine, how: str) -> tuple[BulkInsert, Any]:
    """A sink whose CHECK refuses payload 'bad', and a processor that writes each chunk with one
    statement: ``raised`` lets the statement's error fail the chunk, ``named`` names every item
    of a chunk whose statement failed (a processor that catches per chunk)."""
    bulk = BulkInsert(pg_engine)

    def proc(chunk: Chunk) -> Any:
        if how == "raised":
            return bulk(chunk)
        try:
            return bulk(chunk)
        except sa.exc.DBAPIError as exc:
            return ChunkResult(failed={k: str(exc.orig).splitlines()[0] for k in chunk.keys})

    return bulk, proc


def _spoil(pg_engine: sa.Engine, keys: list[int]) -> None:
    with pg_engine.begin() as c:
        c.execute(sa.text("UPDATE events SET payload = 'bad' WHERE seq = ANY(:b)"), {"b": keys})


@pytest.mark.parametrize("how", ["raised", "named"])
def test_a_range_of_only_bad_items_finds_its_canary_in_another_range(
    how: str, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The one-world model's long-mode seed 9 (``no-canary-outage``): a range whose keys so far
    all fail (here every key of range 1) has no key of its own that succeeded before, so the old
    code took each try for an outage and the round never closed. Its canary is now a committed
    key of another range of the round (range 0 succeeded): the dependency is up, every key of
    range 1 is dead-lettered after its attempts, and the round closes."""
    _make_sink(pg_engine, set())
    _, proc = _bad_range_world(pg_engine, how)
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=2, start_key=0, end_key=100)
    assert len(rnd.ranges) == 2
    second = [k for k in range(1, 101) if k > int(rnd.ranges[1].lo)]
    _spoil(pg_engine, second)
    t.traverse(rnd.round_id, 0, proc, chunk_size=20, max_item_attempts=2, **FAST)
    res = t.traverse(rnd.round_id, 1, proc, chunk_size=20, max_item_attempts=2, **FAST)
    assert res.complete and (res.done, res.dead) == (0, len(second))
    assert {d["key"] for d in t.dead_letters(rnd.round_id, 1, limit=1000)} == set(second)
    t.close_round(rnd.round_id)
    t.close()


def test_a_round_of_only_bad_items_is_not_told_apart_and_probes_nothing_outside_it(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The next chained round holds two keys, both bad, in one range: no key of the round has
    ever succeeded, so there is no canary and no part that succeeds. That is the documented case
    the engine does not tell apart from an outage (docs/contract.md, "What is not told apart"):
    ``DependencyFailedError``, cursor at the round's start, nothing dead-lettered. No key of the
    previous round is probed: every key a processor is handed in round ``r2`` is inside its
    bounds (the one-world model's oracle, "effects outside its bounds")."""
    _make_sink(pg_engine, set())
    _, proc = _bad_range_world(pg_engine, "raised")
    handed: list[int] = []

    def watched(chunk: Chunk) -> Any:
        if chunk.round_id == "r2":
            handed.extend(chunk.keys)
        return proc(chunk)

    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    first = t.plan(max_ranges=1, new_stream=True)
    run_all(t, first, watched, chunk_size=20, max_item_attempts=2, **FAST)
    t.close_round(first.round_id)
    with pg_engine.begin() as c:
        c.execute(sa.text("INSERT INTO events VALUES (101, 'bad'), (102, 'bad')"))
    rnd = t.plan(max_ranges=1)
    assert (rnd.round_id, len(rnd.ranges)) == ("r2", 1)
    with pytest.raises(DependencyFailedError, match="no key that succeeded before"):
        t.traverse(rnd.round_id, 0, watched, chunk_size=20, max_item_attempts=2, **FAST)
    assert set(handed) == {101, 102}
    assert t.store.range(rnd.round_id, 0)["cursor"] == encode_key((100,))
    assert t.dead_letters(rnd.round_id, 0) == []
    t.close()


def test_an_outage_is_still_an_outage_when_the_canary_is_another_ranges(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """The sink is dropped after range 0 completed: range 1 has no key of its own that succeeded,
    its canaries are range 0's keys, and they fail too. An outage: the cursor stays at the
    range's lower bound, nothing is dead-lettered or queued, and each attempt costs the chunk,
    its bisection's bounded misses and at most ``CANARIES`` canaries."""
    _make_sink(pg_engine, set())
    bulk, proc = _bad_range_world(pg_engine, "raised")
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["seq", "payload"])
    rnd = t.plan(max_ranges=2, start_key=0, end_key=100)
    t.traverse(rnd.round_id, 0, proc, chunk_size=20, max_item_attempts=2, **FAST)
    with pg_engine.begin() as c:
        c.execute(sa.text("DROP TABLE sink"))
    calls = bulk.calls
    with pytest.raises(DependencyFailedError):
        t.traverse(rnd.round_id, 1, proc, chunk_size=20, max_item_attempts=2, **FAST)
    lo = rnd.ranges[1].lo
    assert t.store.range(rnd.round_id, 1)["cursor"] == encode_key((int(lo),))
    st = t.range_status(rnd.round_id)[1]
    assert (st.dead, st.retries) == (0, 0), st
    assert bulk.calls - calls <= 5 * (1 + CANARIES)  # per attempt: the chunk and its canaries
    t.close()
