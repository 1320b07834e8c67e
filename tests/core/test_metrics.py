"""The engine reports what it does through a metrics sink (Airflow's Stats in the operators)."""

from __future__ import annotations

from collections import Counter

import sqlalchemy as sa

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal


class Recording:
    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.timings: Counter = Counter()
        self.tags: set = set()

    def incr(self, name, count=1, tags=None):
        self.counts[name] += count
        self.tags.add(tuple(sorted((tags or {}).items())))

    def timing(self, name, ms, tags=None):
        self.timings[name] += 1


def test_engine_emits_counters_and_timings(pg_engine, pg_schema_url, redis_url, key_prefix):
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY)"))
        c.execute(sa.text("INSERT INTO events SELECT generate_series(1, 1000)"))
    sink = Recording()
    t = KeysetTraversal(
        pg_schema_url,
        table="events",
        key="seq",
        redis_url=redis_url,
        stream="m",
        key_prefix=key_prefix,
        metrics=sink,
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    t.traverse(
        rnd.round_id,
        0,
        lambda ch: ChunkResult(failed={5: "bad"}, skipped=[6]) if 5 in ch.keys else None,
        chunk_size=100,
        max_item_attempts=1,
    )
    assert (
        sink.counts["rows.done"] == 998
        and sink.counts["rows.skipped"] == 1
        and sink.counts["rows.dead"] == 1
    )
    assert sink.counts["chunks"] == 10
    assert sink.timings["chunk.process"] == 10 and sink.timings["chunk.commit"] == 10
    assert sink.tags == {(("stream", "m"),)}
