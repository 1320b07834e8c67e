"""The scale round's machinery (``benchmarks/scale``) end to end on a tiny table, no speed asserted.

Builds the gapped ``big`` table at 2,345 rows in its own schema (dropped at the end), runs one
repetition of every variant with 2 tasks and a 64-range round in 200-row chunks, and checks what
the report is made of: every variant read every row once, the write-back flipped exactly the
rows it targets, the figures are numbers and every verdict is decided (RSS has no 10M reference
here). The reuse check: a second ``ensure_big`` keeps the table (same build seconds, no reload).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.context import BenchContext, pg_cursor
from benchmarks.scale import run
from benchmarks.scale.child import WB_EVERY
from benchmarks.scale.data import ensure_big, key_of, schema_for

ROWS = 2_345


@pytest.fixture
def ctx(pg_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[BenchContext]:
    # a schema of this test's own: two suites side by side must not share the table
    monkeypatch.setenv("KEYSET_BENCH_SCALE_SCHEMA", f"kbench_scale_t{uuid.uuid4().hex[:8]}")
    c = BenchContext(rows=ROWS, pg_url=pg_url, redis_url=redis_url, chunk_size=200)
    with pg_cursor(c) as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {schema_for(ROWS)} CASCADE")
    yield c
    c.cleanup_redis()
    with pg_cursor(c) as cur:
        cur.execute(f"DROP SCHEMA IF EXISTS {schema_for(ROWS)} CASCADE")


def test_scale_round_reads_every_row_and_reports_each_figure(
    ctx: BenchContext, tmp_path: Path
) -> None:
    built = ensure_big(ctx, ROWS)
    again = ensure_big(ctx, ROWS)
    assert again["seconds"] == built["seconds"] and again["stage"] == "ready"
    with pg_cursor(ctx) as cur:
        cur.execute(f"SELECT count(*), min(id), max(id) FROM {built['table']}")
        assert cur.fetchone() == (ROWS, key_of(1), key_of(ROWS))

    raw = run.measure(ctx, ROWS, repeat=1, shape=(2, 64, 4))
    for name, runs in raw["runs"].items():
        assert [r["rows"] for r in runs] == [ROWS], name
    assert raw["runs"]["noop"][0]["planned_ranges"] > 4
    with pg_cursor(ctx) as cur:
        cur.execute(f"SELECT status, count(*) FROM {built['table']} GROUP BY 1 ORDER BY 1")
        counts = dict(cur.fetchall())
    written = sum(1 for g in range(1, ROWS + 1) if key_of(g) % WB_EVERY == 0)
    assert counts == {"DONE": written, "PENDING": ROWS - written}

    s = run.summarize(ROWS, raw, None)
    for key in ("noop_vs_loop", "noop_vs_copy", "plan_s", "peak_rss_mb_per_task"):
        assert math.isfinite(s[key]) and s[key] > 0, key
    assert set(s["redis_bytes"]) == {"planned", "finished", "closed"}
    assert s["coalesced"] + s["claims"] >= 1
    assert [k for k, v in s["verdicts"].items() if v is None] == ["RSS within 10 MB of the 10M run"]
    path = run.write({"summary": s, "raw": raw}, ROWS, tmp_path)
    assert path.name.startswith(f"scale-{ROWS}-")
    assert "no-op vs COPY" in run.text(s)


def test_scheduler_breakdown_reads_the_task_instances_timestamps() -> None:
    from benchmarks.scale.airflow_round import breakdown

    def at(s: float) -> str:
        return f"2026-12-01T20:00:{s:06.3f}+00:00"

    def ti(task: str, q: float, s: float, e: float, i: int = -1) -> dict[str, object]:
        return {
            "task_id": task,
            "map_index": i,
            "queued_when": at(q),
            "start_date": at(s),
            "end_date": at(e),
            "duration": e - s,
        }

    run = {"start_date": at(0), "end_date": at(30)}
    tis = [
        ti("plan", 0.5, 1, 10),
        ti("traverse", 11, 12, 20, 0),
        ti("traverse", 11, 13, 29, 1),
        ti("barrier", 24, 12.5, 25),
    ]
    b = breakdown(run, tis)
    assert b["makespan_s"] == 30
    assert b["plan"] == {"queued_when": 0.5, "start_date": 1, "end_date": 10}
    assert (b["traverse_first_start_s"], b["traverse_last_start_s"]) == (12, 13)
    assert b["traverse_last_end_s"] == 29
    assert b["traverse_queue_wait_s"] == [1, 2]
    assert b["traverse_durations_s"] == [8, 16]
    assert b["barrier_after_last_traverse_s"] == -4
    assert b["run_end_after_barrier_s"] == 5
