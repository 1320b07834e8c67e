"""Bad items are classified by their outcome (issue #18 items 9 and 10), on real PostgreSQL and
Redis: an item that fails alone while a probe of the dependency succeeds is an item failure, and
is dead-lettered after ``max_item_attempts``, whatever the text of its error and whether or not
the keys that succeeded before still match ``where``."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa
from core_support import FAST, make_events, traversal

from airflow_keyset_provider.core import Chunk


def _dead_keys(t: Any, round_id: str, range_id: int = 0) -> dict[int, dict[str, Any]]:
    return {d["key"]: d for d in t.dead_letters(round_id, range_id, limit=1000)}


def test_bad_items_whose_error_text_changes_per_attempt_are_dead_lettered(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """3 bad keys among 500; the processor raises for a chunk holding one, with a request id in
    the message (a new text at every attempt). The main pass isolates each bad key (the canary
    succeeds); the retry passes fail the same 3 keys again, each time for a "new reason". Before:
    the retry pass's outage rule compared the texts, called it a dependency failure and every
    try ended in ``DependencyFailedError``. Now: the canary succeeded, so the 3 keys failed on
    their own; after 3 attempts they are dead, every other key is done, one try."""
    keys = list(range(1, 501))
    bad = {77, 250, 431}
    make_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=500)
    tries: Counter[int] = Counter()

    def proc(chunk: Chunk) -> None:
        for k in chunk.keys:
            if k in bad:
                if len(chunk) == 1:
                    tries[k] += 1
                raise ValueError(f"bad row {k}, request {uuid.uuid4()}")

    res = t.traverse(rnd.round_id, 0, proc, chunk_size=50, max_item_attempts=3, **FAST)
    assert res.complete and (res.done, res.skipped, res.dead) == (497, 0, 3)
    dead = _dead_keys(t, rnd.round_id)
    assert set(dead) == bad
    for k, letter in dead.items():
        assert letter["error"].startswith(f"ValueError: bad row {k}, request "), letter
        assert int(letter["attempts"]) == 3
    assert set(tries) == bad
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (497, 0, 3)


def test_a_where_filter_does_not_hide_the_canary(pg_engine, pg_schema_url, redis_url, key_prefix):
    """``where="status = 'PENDING'"`` over 1,000 orders; the processor cancels each row of its
    chunk in one transaction (UPDATE status = 'CANCELLED') and raises for two poison rows (their
    amount is negative), writing nothing for that chunk. A finished row no longer matches
    ``where``, so re-reading the canary (a key that succeeded before) through it found nothing:
    the retry pass of the two poison rows had no probe, each failed alone, and every try ended in
    ``DependencyFailedError`` ("no key that succeeded before was there to probe with"). Now the
    canary is probed with the row as it succeeded: the poison rows are dead-lettered after 3
    attempts in one try, the 998 others are cancelled (a canary's row again at each probe)."""
    with pg_engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL, "
                "amount numeric NOT NULL)"
            )
        )
        c.execute(
            sa.text(
                "INSERT INTO orders SELECT g, 'PENDING', CASE WHEN g IN (333, 777) THEN -1 "
                "ELSE g END FROM generate_series(1, 1000) g"
            )
        )
    t = traversal(
        pg_schema_url,
        redis_url,
        key_prefix,
        table="orders",
        key="id",
        where="status = 'PENDING'",
        columns=["id", "status", "amount"],
    )
    rnd = t.plan(max_ranges=1, start_key=0, end_key=1000)
    cancelled: Counter[int] = Counter()

    def cancel(chunk: Chunk) -> None:
        amount = chunk.columns.index("amount")
        with pg_engine.begin() as c:
            for row in chunk.values:
                if row[amount] < 0:
                    raise ValueError(f"order {row[0]}: negative amount")
            c.execute(
                sa.text("UPDATE orders SET status = 'CANCELLED' WHERE id = ANY(:ids)"),
                {"ids": list(chunk.keys)},
            )
        cancelled.update(chunk.keys)

    res = t.traverse(rnd.round_id, 0, cancel, chunk_size=100, max_item_attempts=3, **FAST)
    assert res.complete and (res.done, res.skipped, res.dead) == (998, 0, 2)
    assert set(_dead_keys(t, rnd.round_id)) == {333, 777}
    assert set(cancelled) == set(range(1, 1001)) - {333, 777}
    with pg_engine.connect() as c:
        left = c.execute(sa.text("SELECT id FROM orders WHERE status = 'PENDING' ORDER BY id"))
        assert [r[0] for r in left] == [333, 777]
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (998, 0, 2)
