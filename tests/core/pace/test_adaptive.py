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


def _events(engine: sa.Engine, narrow: int, wide: int) -> None:
    """``events``: keys 1..3000, payloads of ``narrow`` characters up to 1500, ``wide`` above."""
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(
            sa.text(
                "INSERT INTO events SELECT g, repeat('x', CASE WHEN g <= 1500 THEN :n ELSE :w "
                "END) FROM generate_series(1, 3000) g"
            ),
            {"n": narrow, "w": wide},
        )


def test_adaptive_traversal_changes_size_and_keeps_the_contract(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: 3,000 keys whose payload is 10x wider in the upper half; the processor takes
    2 us per payload byte; target 20 ms per chunk, starting at 10 rows. The chunks grow in the
    narrow half and shrink in the wide one (no timing is asserted, only that sizes moved within
    the bounds), every key is delivered exactly once and the counters are exact."""
    _events(pg_engine, narrow=100, wide=1000)
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


def test_byte_budget_caps_the_size_and_the_duration_steers_within_it() -> None:
    """A 10,000-byte budget: rows of 100 bytes cap the chunk at 100 rows whatever the duration
    asks; a chunk of 1,000-byte rows drops the cap to 10 at once; narrow rows again lift it half
    way per chunk; the duration (1 ms per row, 0.05 s target: 50 rows) steers inside the cap."""
    s = ChunkSizer(1000, None, 1, 100_000, max_bytes=10_000)
    assert s.size == 1000  # no width known yet: the start
    assert s.observe_width(100.0) == 100
    assert s.observe(100, 0.001) == 100  # no target: the duration does not steer
    assert s.observe_width(1000.0) == 10  # wider rows: capped at once
    assert [s.observe_width(100.0) for _ in range(3)] == [
        18,
        30,
        47,
    ]  # the width falls half way back
    steered = ChunkSizer(10, 0.05, 1, 1000, max_bytes=10_000, row_bytes=500.0)
    assert steered.size == 10  # the catalog's width: cap 20, the start 10 below it
    sizes = [steered.observe(steered.size, steered.size * 0.001) for _ in range(4)]
    assert sizes == [20, 20, 20, 20]  # the target (50) is above the cap (20)
    for _ in range(3):  # narrow rows: the cap lifts (39, 75, 140), the duration's 50 holds
        steered.observe_width(10.0)
    assert steered.size == 40  # the duration's last step (2x of 20), held back by the cap so far
    assert [steered.observe(steered.size, steered.size * 0.001) for _ in range(3)] == [50, 50, 50]
    huge = ChunkSizer(1000, None, 10, 100_000, max_bytes=1000, row_bytes=10**6)
    assert huge.size == 1  # one row is always read, below min_chunk_size


def test_a_chunk_of_wide_rows_shrinks_the_next_read_to_the_byte_budget(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: 1,500 narrow rows (10 bytes) then 1,500 wide ones (10,000 bytes), chunk_size
    1,000, a 1 MB budget, prefetch on. The first chunk (narrow) has 1,000 rows; the second, read
    before any wide row was seen, 500 of each; every chunk after it holds at most 1 MB of
    payload (99 rows), and every key is delivered once with exact counters."""
    _events(pg_engine, narrow=10, wide=10_000)
    t = traversal(pg_schema_url, redis_url, key_prefix, columns=["payload"])
    rnd = t.plan(max_ranges=1, new_stream=True)
    rec = Recorder()
    chunks: list[tuple[int, int]] = []  # (rows, payload bytes)

    def proc(chunk):
        rec(chunk)
        chunks.append((len(chunk.values), sum(len(r[-1]) for r in chunk.values)))

    res = t.traverse(rnd.round_id, 0, proc, chunk_size=1000, max_chunk_bytes=1_000_000)
    assert res.complete and (res.done, res.skipped, res.dead) == (3000, 0, 0)
    assert set(rec.seen) == set(range(1, 3001)) and max(rec.seen.values()) == 1
    assert chunks[:2] == [(1000, 10_000), (1000, 5_000 + 5_000_000)], chunks
    after = chunks[2:]
    assert len(after) == 11 and all(b <= 1_000_000 for _n, b in after), chunks
    print(f"\nchunks (rows, bytes): {chunks}")


def test_an_absurd_chunk_size_is_refused_with_the_limit() -> None:
    with pytest.raises(ConfigurationError, match=r"chunk_size must be at most 1,000,000 rows"):
        TraverseOptions(chunk_size=10**9)
    with pytest.raises(ConfigurationError, match=r"max_chunk_size must be at most 1,000,000"):
        TraverseOptions(max_chunk_size=10**7)
    TraverseOptions(chunk_size=1_000_000, max_chunk_bytes=None)  # the limit itself is accepted
