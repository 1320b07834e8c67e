"""Scenario: clusters of permanently bad rows, with a dependency outage in the middle.

Guarantee (docs/contract.md, "Item failures and dependency failures"): bad rows are dead-lettered
even when they fill whole chunks, whether the processor names them or its bulk write raises for
the whole batch; an outage (``RetryableError`` for a while) dead-letters nothing. Per trial: 400
keys in 2 ranges, ``chunk_size=20``, one or two clusters of 5-45 bad keys per range (not in a
range's first chunk: a range whose first chunk is all bad has no canary, a documented limit),
a random processor style, and an outage of a few calls at a random point. Checked: every range
completes, the dead letters are exactly the bad keys, the sink holds exactly the good keys, the
round's counters add up.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import Chunk, ChunkResult, KeysetTraversal, RetryableError

KEYS = 400


class ClusterProcessor:
    """Copies each chunk into ``sink``; bad rows violate its CHECK constraint. ``style`` "bulk":
    one INSERT per call (one bad row fails the call); "named": bad rows are named in
    ``ChunkResult.failed``. Calls number ``outage`` raise ``RetryableError`` (dependency down)."""

    def __init__(self, engine: sa.Engine, bad: set[int], style: str, outage: range) -> None:
        self.engine, self.bad, self.style, self.outage = engine, bad, style, outage
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, chunk: Chunk) -> ChunkResult | None:
        with self.lock:
            self.calls += 1
            if self.calls in self.outage:
                raise RetryableError("sink unavailable (simulated outage)")
        keys = list(chunk.keys)
        failed = {k: f"row {k}: payload violates sink_check" for k in keys if k in self.bad}
        rows = keys if self.style == "bulk" else [k for k in keys if k not in failed]
        upsert = (
            "ON DUPLICATE KEY UPDATE sink.id = sink.id"
            if self.engine.dialect.name == "mysql"
            else "ON CONFLICT (id) DO NOTHING"
        )
        with self.engine.begin() as c:
            if rows:
                c.execute(
                    sa.text(
                        f"INSERT INTO sink SELECT id, payload FROM items WHERE id IN :ids {upsert}"
                    ).bindparams(sa.bindparam("ids", expanding=True)),
                    {"ids": rows},
                )
        return ChunkResult(failed=failed)


def _bad_keys(rnd: Any, rng: random.Random) -> set[int]:
    bad: set[int] = set()
    for r in rnd.ranges:
        lo = 0 if r.lo is None else r.lo
        first, last = lo + 21, r.hi
        for _ in range(rng.randint(1, 2)):
            length = rng.randint(5, 45)
            start = rng.randint(first, max(first, last - length))
            bad |= set(range(start, min(start + length, last + 1)))
    return bad


def _trial(
    engine: sa.Engine,
    url: str,
    redis_url: str,
    prefix: str,
    trial: int,
    rng: random.Random,
    tally: rs.Tally,
) -> int:
    with engine.begin() as c:
        c.execute(sa.text("TRUNCATE sink"))
        c.execute(sa.text("UPDATE items SET payload = 'ok' WHERE payload <> 'ok'"))
    t = KeysetTraversal(
        url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream=f"clusters-{trial}",
        key_prefix=prefix,
    )
    rnd = t.plan(max_ranges=2, new_stream=True)
    bad = _bad_keys(rnd, rng)
    with engine.begin() as c:
        c.execute(
            sa.text("UPDATE items SET payload = 'bad' WHERE id IN :b").bindparams(
                sa.bindparam("b", expanding=True)
            ),
            {"b": sorted(bad)},
        )
    begin = rng.randint(1, 15)
    proc = ClusterProcessor(
        engine, bad, rng.choice(["bulk", "named"]), range(begin, begin + rng.randint(1, 3))
    )
    tally.trials += 1
    for r in rnd.ranges:
        try:
            res = t.traverse(
                rnd.round_id,
                r.range_id,
                proc,
                chunk_size=20,
                max_item_attempts=2,
                backoff_base=0.01,
                backoff_max=0.05,
                item_retry_delay=0.01,
                lease_seconds=5,
            )
            if not res.complete:
                tally.fail(f"trial {trial} range {r.range_id}: not complete {res}")
        except Exception as exc:
            tally.fail(f"trial {trial} range {r.range_id} ({proc.style}): {exc!r}")
    letters = {
        d["key"] for r in rnd.ranges for d in t.dead_letters(rnd.round_id, r.range_id, limit=1000)
    }
    if letters != bad:
        tally.fail(
            f"trial {trial} ({proc.style}): dead letters differ from the bad keys by "
            f"{sorted(letters ^ bad)[:10]}"
        )
    with engine.connect() as c:
        sunk = {row[0] for row in c.execute(sa.text("SELECT id FROM sink"))}
    good = set(range(1, KEYS + 1)) - bad
    if sunk != good:
        tally.fail(
            f"trial {trial} ({proc.style}): sink differs from the good keys by "
            f"{sorted(sunk ^ good)[:10]}"
        )
    try:
        totals = t.close_round(rnd.round_id)
        if (totals.done, totals.dead) != (len(good), len(bad)):
            tally.counter_errors += 1
            tally.fail(f"trial {trial}: totals {totals} != ({len(good)}, {len(bad)})")
    except Exception as exc:
        tally.fail(f"trial {trial}: close failed: {exc!r}")
    t.close()
    return len(bad)


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_bad_row_clusters_are_dead_lettered_and_outages_are_not(
    database: str, redis_url: str, key_prefix: str, request: pytest.FixtureRequest
) -> None:
    """The source table and the sink live in one database: PostgreSQL, or MariaDB."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    if database == "mariadb":
        url = request.getfixturevalue("mariadb_db_url")
        engine = sa.create_engine(url)
        request.addfinalizer(engine.dispose)
        series = f"SELECT seq, 'ok' FROM seq_1_to_{KEYS}"
    else:
        url, engine = request.getfixturevalue("pg_schema_url"), request.getfixturevalue("pg_engine")
        series = f"SELECT g, 'ok' FROM generate_series(1, {KEYS}) g"
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text(f"INSERT INTO items {series}"))
        c.execute(
            sa.text(
                "CREATE TABLE sink (id bigint PRIMARY KEY, "
                "payload text NOT NULL, CONSTRAINT sink_check CHECK (payload <> 'bad'))"
            )
        )
    tally = rs.Tally()
    bad = 0
    for trial in range(rs.trials(4, 200)):
        bad += _trial(engine, url, redis_url, key_prefix, trial, rng, tally)
        if tally.failures:
            break
    tally.record(
        "bad-row clusters + outage" + ("" if database == "postgresql" else f" ({database})"),
        note=f"{bad} bad keys in clusters of 5-45 (chunk 20), "
        "all dead-lettered; outages dead-lettered none",
    )
    assert not tally.failures, tally.verdict(seed)
