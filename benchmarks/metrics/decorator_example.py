"""Issue 29: the decorator example, ``dags/cancel_stale_orders.py`` itself, end to end, against
what an engineer would write by hand for the same outcome.

The table (``benchmarks/data.py``, role ``orders``, ``--deco-rows`` rows, default 10^6): the
example's (``tests/airflow/test_decorator.py``): ``id bigint`` primary key, ``created_at
timestamptz``, ``status text``, ``cancel_reason text``, unique ``(created_at, id)``; every order
PENDING and older than a day. Before every timed run, outside the timer, every row is set back to
PENDING with no reason and the table is VACUUM ANALYZEd. After every run every row must be
CANCELLED with the reason the example writes (``unpaid since YYYY-MM-DD HH:MM`` of its
``created_at``), else the benchmark raises.

Variants, interleaved, ``--repeat`` times:

- provider: ``dag.test()`` of the unmodified example DAG file in a fresh process on the ``airflow``
  group's throwaway ``AIRFLOW_HOME`` (``benchmarks/metrics/airflow.py``): connection ``orders_db``
  on the benchmark schema (``search_path``; the driver ``PostgresHook`` hands out, psycopg 3),
  ``redis_default`` on the benchmark's Redis, ``[keyset] key_prefix`` the run's prefix. Its stream
  is the DAG id; a second round of it would cover only the keys after the first's end, so before
  each repetition (outside the timer) the stream's Redis keys and its durable record in Airflow
  are deleted: every repetition is the stream's first round, over every row. Timed: the ``dag.test()`` call (plan, 16 mapped traverse tasks of 1,000-row chunks, each chunk's
  ``update_rows`` in the engine's transaction, the barrier); Airflow's import is reported apart;
- statement: one ``UPDATE orders SET status = 'CANCELLED', cancel_reason = 'unpaid since ' ||
  to_char(created_at, 'YYYY-MM-DD HH24:MI') WHERE status = 'PENDING' AND created_at < now() -
  interval '1 day'`` (psycopg 3, connect and commit inside the timer): the strongest baseline;
- chunked (information): the resumable job by hand: a keyset loop of 1,000-row chunks
  (``(created_at, id) > last``, the example's ``where``), the reason formatted in Python as the
  example does, one ``UPDATE ... FROM unnest(...)`` guarded by ``status = 'PENDING'`` and one
  commit per chunk.

No untimed warm-up run (a provider run costs about a minute at 10^6 rows): the repetitions'
min/max show what the first one paid. Rates are rows cancelled / seconds. A repetition's ratio is the provider's rate over the
baseline's (the baseline's seconds over the provider's); the metrics report their min/median/max
and the load average. No target: informational, as ``airflow_overhead``.
"""

from __future__ import annotations

import datetime as dt
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg

from airflow_keyset_provider.durable_record import asset_name
from benchmarks import procs
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.data import ensure_table
from benchmarks.metrics.airflow import (
    _airflow_env,
    airflow_home,
    postgres_connection,
    redis_connection,
    run_dag_test,
    task_durations,
)
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median

GROUP = "decorator_example"
DAG_FILE = procs.ROOT / "dags" / "cancel_stale_orders.py"
STREAM = "cancel_stale_orders"  # the example's stream: its DAG id
CHUNK = 1000  # the example's chunk_size
WHERE = "status = 'PENDING' AND created_at < now() - interval '1 day'"  # the example's where
REASON_SQL = "'unpaid since ' || to_char(created_at, 'YYYY-MM-DD HH24:MI')"


def reset(ctx: BenchContext, table: str, rows: int) -> None:
    """Every order PENDING again with no reason, the table vacuumed (outside the timer)."""
    with pg_cursor(ctx) as cur:
        cur.execute(
            f"UPDATE {table} SET status = 'PENDING', cancel_reason = NULL "
            "WHERE status <> 'PENDING' OR cancel_reason IS NOT NULL"
        )
        cur.execute(f"VACUUM ANALYZE {table}")
        cur.execute(f"SELECT count(*) FROM {table} WHERE {WHERE}")
        found = cur.fetchone()
    if found is None or found[0] != rows:
        raise RuntimeError(
            f"{table}: {found} stale PENDING orders after the reset, expected {rows}"
        )


def cancelled(ctx: BenchContext, table: str, rows: int, variant: str) -> int:
    """The rows cancelled with the example's reason; raises unless every row is."""
    with pg_cursor(ctx) as cur:
        cur.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'CANCELLED'), count(*) FILTER "
            f"(WHERE status = 'CANCELLED' AND cancel_reason = {REASON_SQL}) FROM {table}"
        )
        found = cur.fetchone()
    if found is None or set(found) != {rows}:
        raise RuntimeError(
            f"{variant}: (rows, cancelled, with the example's reason) = {found}, expected all {rows}"
        )
    return int(found[2])


def forget_stream(ctx: BenchContext, home: Path) -> None:
    """Make the example's stream (its DAG id) new again: its Redis keys and its durable record
    in the home's Airflow metadata (the asset state of ``keyset://<stream>``) deleted. A second
    round of the stream would cover only the keys after the first one's end: none here."""
    keys = ctx.stream_keys(STREAM)
    if keys:
        client = ctx.redis()
        try:
            client.delete(*keys)
        finally:
            client.close()
    with closing(sqlite3.connect(home / "airflow.db")) as db, db:
        db.execute(
            "DELETE FROM asset_state_store WHERE asset_id IN (SELECT id FROM asset WHERE name = ?)",
            (asset_name(STREAM),),
        )


def provider(ctx: BenchContext, table: str, rows: int) -> Sample:
    """``dag.test()`` of the example DAG file, unmodified, in a fresh process, as the stream's
    first round."""
    reset(ctx, table, rows)
    home = airflow_home(ctx)
    forget_stream(ctx, home)
    link = home / "dags" / DAG_FILE.name
    if not link.exists():
        link.symlink_to(DAG_FILE)
    env = {
        **os.environ,
        **_airflow_env(home),
        "AIRFLOW_CONN_ORDERS_DB": postgres_connection(ctx, search_path=ctx.schema),
        "AIRFLOW_CONN_REDIS_DEFAULT": redis_connection(ctx),
        "AIRFLOW__KEYSET__KEY_PREFIX": ctx.prefix,
    }
    res, process_s = run_dag_test(ctx, DAG_FILE.stem, env)
    done = cancelled(ctx, table, rows, "provider")
    return Sample(
        res["dag_test_s"],
        done,
        {
            "process_s": process_s,
            "import_s": res["import_s"],
            "task_durations": task_durations(res["tasks"]),
        },
    )


def statement(ctx: BenchContext, table: str, rows: int) -> Sample:
    """One UPDATE of every stale order, with the example's reason."""
    reset(ctx, table, rows)
    with Stopwatch() as sw, psycopg.connect(ctx.dsn) as conn:
        cur = conn.execute(
            f"UPDATE {table} SET status = 'CANCELLED', cancel_reason = {REASON_SQL} WHERE {WHERE}"
        )
        n = cur.rowcount
        conn.commit()
    if n != rows:
        raise RuntimeError(f"statement: {n} rows updated, expected {rows}")
    return Sample(sw.seconds, cancelled(ctx, table, rows, "statement"))


def chunked(ctx: BenchContext, table: str, rows: int) -> Sample:
    """The resumable job by hand: keyset chunks of 1,000, one guarded UPDATE and commit each."""
    reset(ctx, table, rows)
    head = f"SELECT created_at, id FROM {table} WHERE {WHERE}"
    tail = f" ORDER BY created_at, id LIMIT {CHUNK}"
    update = (
        f"UPDATE {table} AS t SET status = 'CANCELLED', cancel_reason = v.reason FROM "
        "unnest(%s::timestamptz[], %s::bigint[], %s::text[]) AS v(created_at, id, reason) "
        "WHERE t.created_at = v.created_at AND t.id = v.id AND t.status = 'PENDING'"
    )
    n = chunks = 0
    with Stopwatch() as sw, psycopg.connect(ctx.dsn) as conn:
        last: tuple[dt.datetime, int] | None = None
        while True:
            if last is None:
                got = conn.execute(head + tail).fetchall()
            else:
                got = conn.execute(
                    head + " AND (created_at, id) > (%s, %s)" + tail, last
                ).fetchall()
            if not got:
                break
            stamps = [r[0] for r in got]
            reasons = [f"unpaid since {t:%F %R}" for t in stamps]
            n += conn.execute(update, (stamps, [r[1] for r in got], reasons)).rowcount
            conn.commit()
            chunks += 1
            last = got[-1]
    if n != rows:
        raise RuntimeError(f"chunked: {n} rows updated, expected {rows}")
    return Sample(sw.seconds, cancelled(ctx, table, rows, "chunked"), {"chunks": chunks})


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": median(values), "max": max(values)}


def _by_task(s: Sample) -> dict[str, float]:
    """One run's task durations summed by task (the 16 mapped traverse instances together)."""
    sums: dict[str, float] = {}
    for name, d in s.extra["task_durations"].items():
        task = name.split("[")[0].removeprefix("cancel_stale.")
        sums[task] = sums.get(task, 0.0) + (d or 0.0)
    return sums


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "orders")
    rows = ctx.deco_rows
    airflow_home(ctx)
    load: list[float] = []

    def loaded(fn: Any) -> Any:
        def call() -> Sample:
            load.append(os.getloadavg()[0])
            return fn(ctx, table, rows)

        return call

    s = interleaved(
        {"provider": loaded(provider), "statement": loaded(statement), "chunked": loaded(chunked)},
        ctx.repeat,
    )
    reset(ctx, table, rows)  # leave the table as it was built
    tasks = [_by_task(x) for x in s["provider"]]
    by_task = {t: round(median([r.get(t, 0.0) for r in tasks]), 2) for t in tasks[0]}
    p_s = median([x.seconds for x in s["provider"]])
    outside = p_s - sum(by_task.values())
    details: dict[str, Any] = {
        "rows": rows,
        "chunk_size": CHUNK,
        "loadavg_1m": load,
        "provider_tasks_s": by_task,
        "provider_outside_tasks_s": outside,
        "provider_import_s": median([x.extra["import_s"] for x in s["provider"]]),
        "provider_process_s": median([x.extra["process_s"] for x in s["provider"]]),
        **{f"{v}_s": _spread([x.seconds for x in xs]) for v, xs in s.items()},
        **{f"{v}_rows_per_s": _spread([x.rate for x in xs]) for v, xs in s.items()},
    }
    out = []
    for base, title in (
        ("statement", "one UPDATE statement"),
        ("chunked", "hand keyset loop, 1,000-row chunks, commit each"),
    ):
        ratios = [b.seconds / p.seconds for p, b in zip(s["provider"], s[base], strict=True)]
        r = _spread(ratios)
        p_rate, b_rate = details["provider_rows_per_s"], details[f"{base}_rows_per_s"]
        note = (
            f"{rows:,} orders cancelled each run; provider {p_rate['median']:,.0f} rows/s end to "
            f"end (dag.test() {p_s:.1f} s: plan {by_task.get('plan', 0):.1f} s, traverse "
            f"{by_task.get('traverse', 0):.1f} s summed, barrier {by_task.get('barrier', 0):.1f} s, "
            f"outside the tasks {outside:.1f} s) vs {base} {b_rate['median']:,.0f} rows/s; ratio "
            f"min/median/max {r['min']:.3f}/{r['median']:.3f}/{r['max']:.3f}; load average "
            f"{min(load):.1f}-{max(load):.1f}"
        )
        out.append(
            Metric(
                f"decorator_vs_{base}",
                GROUP,
                f"decorator example (dag.test(), end to end) vs {title}",
                p_rate["median"],
                b_rate["median"],
                "rows/s",
                r["median"],
                "informational",
                None,
                note,
                {**details, "ratio": r},
            )
        )
    return out
