"""The measured round over ``big``: 4,096 ranges, 16 pull-mode task processes, and its baselines.

One run, on the table of ``data.py`` (key ``id``, gaps included), interleaved variants, each a
set of ``TASKS`` fresh processes started together (``child.py``), makespan = last end - first
start:

- ``noop``: a 4,096-range round (plan timed on its own, explicit bounds so the commit-order wait
  is not timed), the tasks run as ``PlanRangesOperator(max_tasks=16)`` runs them (first ranges
  spread over the key order, then pulling, coalescing and splitting as ``core/run/pull.py`` does),
  no-op processor; the round must close with every row counted once;
- ``few``: the same with a 16-range round (the per-range cost is the difference);
- ``writeback``: the 4,096-range round with the guarded write-back processor (``child.py``): one
  row in ``WB_EVERY`` written back, each chunk in its own transaction;
- ``loop``: the hand-written keyset loop (one fenced Redis advance per chunk) on 16 equal slices;
- ``copy``: ``COPY`` of the key column on the same 16 slices (the practical read limit).

Redis bytes (``MEMORY USAGE`` summed over the stream's keys) are read after the plan, after the
round and after ``close_round``; Redis commands are the server's ``total_commands_processed``
delta over the round (machine-wide: other users' commands count too, an upper bound).
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import time
from typing import Any

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.run.pull import first_positions
from benchmarks import procs
from benchmarks.context import BenchContext, pg_cursor
from benchmarks.metrics.memory import redis_bytes
from benchmarks.scale.child import WB_EVERY
from benchmarks.scale.data import key_of

log = logging.getLogger("benchmarks")

TASKS = 16
MANY = 4096
FEW = 16


def spawn(command: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale.child", command, json.dumps(args, default=str)],
        cwd=procs.ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def wait_for_connections(ctx: BenchContext, needed: int, timeout_s: float = 900.0) -> int:
    """Wait (up to ``timeout_s``) until the shared server has ``needed`` free connection slots.

    The server is shared: other sessions may hold most of ``max_connections``, and one child that
    cannot connect fails the whole variant. Returns the free slots seen last (go on regardless)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with pg_cursor(ctx) as cur:
            cur.execute(
                "SELECT current_setting('max_connections')::int - "
                "current_setting('superuser_reserved_connections')::int - count(*) "
                "FROM pg_stat_activity"
            )
            free = int(cur.fetchone()[0])
        if free >= needed or time.monotonic() > deadline:
            if free < needed:
                log.warning("only %d free connections, %d wanted; going on", free, needed)
            return free
        time.sleep(2)


def run_together(children: list[subprocess.Popen[str]]) -> dict[str, Any]:
    """Start the ready children at once; makespan, rows, client CPU and per-task peaks."""
    procs.start_together(children)
    results = [procs.result(c) for c in children]
    return {
        "seconds": max(r["end"] for r in results) - min(r["start"] for r in results),
        "rows": sum(r["rows"] for r in results),
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "hwm_mb": [round(r["hwm_kb"] / 1024, 1) for r in results],
        "tasks": results,
    }


def slices(rows: int, parts: int = TASKS) -> list[tuple[int, int]]:
    """``parts`` key slices ``(lo, hi]`` of equal row counts covering the whole table."""
    cuts = [key_of(k * rows // parts) for k in range(parts + 1)]
    return list(itertools.pairwise(cuts))


def baseline(
    ctx: BenchContext, table: str, rows: int, command: str, tasks: int = TASKS
) -> dict[str, Any]:
    """``command`` (``loop`` or ``copy``) in ``tasks`` processes over equal slices, checked."""
    base = procs.child_args(ctx, table=table)
    wait_for_connections(ctx, tasks + 4)
    children = [spawn(command, {**base, "lo": lo, "hi": hi}) for lo, hi in slices(rows, tasks)]
    out = run_together(children)
    if out["rows"] != rows:
        raise RuntimeError(f"{command} read {out['rows']} rows, expected {rows}")
    return out


def _commands(ctx: BenchContext) -> int:
    client = ctx.redis()
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def engine_round(
    ctx: BenchContext,
    table: str,
    rows: int,
    ranges: int,
    writeback: tuple[str, str] | None,
    tasks: int = TASKS,
) -> dict[str, Any]:
    """Plan (timed) and run one pull round; its figures, checked complete."""
    t = KeysetTraversal(
        ctx.pg_url,
        table=table,
        key="id",
        redis_url=ctx.redis_url,
        stream=ctx.stream(f"scale{ranges}"),
        key_prefix=ctx.prefix,
    )
    try:
        started = time.perf_counter()
        rnd = t.plan(max_ranges=ranges, start_key=0, end_key=key_of(rows))
        plan_s = time.perf_counter() - started
        stages = {"planned": redis_bytes(ctx, t.stream)[0]}
        ordered = [s.range_id for s in sorted(rnd.ranges, key=lambda s: s.lo_encoded)]
        firsts = [ordered[i] for i in first_positions(len(ordered), tasks)]
        base = procs.child_args(
            ctx,
            table=table,
            stream=t.stream,
            round_id=rnd.round_id,
            tasks=tasks,
            writeback=writeback,
        )
        wait_for_connections(ctx, len(firsts) * (2 if writeback else 1) + 4)
        children = [
            spawn("pull", {**base, "lineage": f"task{k}", "first_range": firsts[k]})
            for k in range(len(firsts))
        ]
        commands0 = _commands(ctx)
        out = run_together(children)
        out["redis_commands"] = _commands(ctx) - commands0
        stages["finished"] = redis_bytes(ctx, t.stream)[0]
        totals = t.close_round(rnd.round_id)
        stages["closed"] = redis_bytes(ctx, t.stream)[0]
    finally:
        t.close()
    done = out["tasks"]
    if (
        totals.done + totals.skipped != rows
        or totals.skipped
        or not all(r["finished"] for r in done)
    ):
        raise RuntimeError(f"round {rnd.round_id}: {totals} for {rows} rows: {done}")
    out.update(
        plan_s=plan_s,
        planned_ranges=len(rnd.ranges),
        redis_bytes=stages,
        claims=sum(r["claims"] for r in done),
        coalesced=sum(r["coalesced"] for r in done),
        splits_asked=sum(r["splits_asked"] for r in done),
        splits_won=sum(r["splits_won"] for r in done),
        chunks=sum(r["chunks"] for r in done),
        written=rows // WB_EVERY if writeback else 0,
    )
    return out


def flip_status(ctx: BenchContext, schema: str) -> tuple[str, str]:
    """The write-back's ``(from, to)`` status: alternates run to run, so no reset scan is needed."""
    with pg_cursor(ctx) as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {schema}._scale_wb (status text NOT NULL)")
        cur.execute(f"SELECT status FROM {schema}._scale_wb")
        row = cur.fetchone()
        frm = row[0] if row else "PENDING"
        to = "DONE" if frm == "PENDING" else "PENDING"
    return frm, to


def record_status(ctx: BenchContext, schema: str, status: str) -> None:
    with pg_cursor(ctx) as cur:
        cur.execute(f"DELETE FROM {schema}._scale_wb")
        cur.execute(f"INSERT INTO {schema}._scale_wb VALUES (%s)", (status,))
