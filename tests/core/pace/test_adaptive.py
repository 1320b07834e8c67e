"""Adaptive chunk size: the sizer's arithmetic, and a real traversal whose chunks change size
while the cursor contract holds (every key once, exact counters)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from core_support import Recorder, traversal

from airflow_keyset_provider.core import ConfigurationError, TraverseOptions
from airflow_keyset_provider.core.pace.adaptive import ChunkSizer


def test_sizer_converges_to_the_target_and_respects_its_bounds() -> None:
    """At 1 ms per row and a 0.2 s target the ideal chunk is 200 rows: from 10 the size at most
    doubles per step, reaches 200 and stays; when rows get 10x slower it halves its way to 20;
    min and max clamp."""
    s = ChunkSizer(10, 0.2, 5, 1000)
    sizes = [s.observe(s.size, s.size * 0.001) for _ in range(8)]
    assert sizes[:4] == [20, 40, 80, 160] and sizes[-1] == 200
    sizes = [s.observe(s.size, s.size * 0.01) for _ in range(12)]
    assert sizes[0] == 100 and sizes[-1] == 20  # halves at most per step, then settles
    fast = ChunkSizer(500, 0.2, 5, 1000)
    assert [fast.observe(fast.size, fast.size * 1e-6) for _ in range(3)] == [1000, 1000, 1000]
    slow = ChunkSizer(10, 0.2, 5, 1000)
    assert [slow.observe(slow.size, 10.0) for _ in range(3)] == [5, 5, 5]
    assert s.observe(0, 1.0) == s.size and s.observe(10, 0.0) == s.size  # nothing learnt


def test_adaptive_traversal_changes_size_and_keeps_the_contract(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: 3,000 keys whose payload is 10x wider in the upper half; the processor takes
    2 us per payload byte; target 20 ms per chunk, starting at 10 rows. The chunks grow in the
    narrow half and shrink in the wide one (no timing is asserted, only that sizes moved within
    the bounds), every key is delivered exactly once and the counters are exact."""
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(
            sa.text(
                "INSERT INTO events SELECT g, repeat('x', CASE WHEN g <= 1500 THEN 100 ELSE 1000 "
                "END) FROM generate_series(1, 3000) g"
            )
        )
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["payload"])
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    sizes: list[int] = []

    def proc(chunk):
        rec(chunk)
        sizes.append(len(chunk.values))
        time.sleep(2e-6 * sum(len(r[-1]) for r in chunk.values))

    opts = TraverseOptions(
        chunk_size=10, target_chunk_seconds=0.02, min_chunk_size=5, max_chunk_size=400
    )
    res = t.traverse(rnd.round_id, 0, proc, options=opts)
    assert res.complete and (res.done, res.skipped, res.dead) == (3000, 0, 0)
    assert set(rec.seen) == set(range(1, 3001)) and max(rec.seen.values()) == 1
    assert (
        sizes[0] == 10 and max(sizes) > 10 and all(5 <= n <= 400 for n in sizes[:-1])
    )  # the last: what was left
    print(f"\nadaptive sizes: first {sizes[:8]} ... last {sizes[-8:]}")


def test_bounds_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="min_chunk_size must be at most"):
        TraverseOptions(min_chunk_size=500, max_chunk_size=100)
