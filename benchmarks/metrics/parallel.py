"""Target 8: two ranges in two processes against one range in one process.

Each repetition plans a one-range and a two-range round over all of ``seq`` (untimed) and runs
each range in its own fresh process. Children import, connect to nothing yet, reflect the table,
say "ready", and start together on the parent's signal; the wall time runs from the first start
to the last end (so an unbalanced split shows). Details carry client CPU seconds and the CPU
used meanwhile by PostgreSQL and Redis processes (machine-wide), to tell a CPU-bound machine
from an engine that does not scale.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks import procs, project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Sample, median, median_rate


def run_round(ctx: BenchContext, table: str, ranges: int) -> Sample:
    t, rnd = project.plan(ctx, table, "seq", 0, ctx.rows, ranges=ranges, stream="par")
    stream = t.stream
    t.close()
    children = [
        procs.spawn(
            "range",
            procs.child_args(
                ctx,
                table=table,
                key="seq",
                stream=stream,
                round_id=rnd.round_id,
                range_id=spec.range_id,
            ),
        )
        for spec in rnd.ranges
    ]
    procs.wait_ready(children)
    server0 = procs.server_cpu_seconds()
    procs.release(children)
    results = [procs.result(c) for c in children]
    server = procs.server_cpu_seconds() - server0
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    rows = sum(r["rows"] for r in results)
    if rows != ctx.rows or not all(r["complete"] for r in results):
        raise RuntimeError(f"{ranges}-range round read {rows} rows, expected {ctx.rows}: {results}")
    return Sample(
        wall,
        rows,
        {
            "client_cpu_s": sum(r["cpu_s"] for r in results),
            "server_cpu_s": server,
            "per_range": [{"rows": r["rows"], "s": r["end"] - r["start"]} for r in results],
        },
    )


def _cpu_summary(samples: list[Sample]) -> dict[str, Any]:
    return {
        "wall_s": median([s.seconds for s in samples]),
        "client_cpu_s": median([s.extra["client_cpu_s"] for s in samples]),
        "server_cpu_s": median([s.extra["server_cpu_s"] for s in samples]),
        "per_range": samples[0].extra["per_range"],
    }


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    one: list[Sample] = []
    two: list[Sample] = []
    for _ in range(ctx.repeat):
        one.append(run_round(ctx, table, 1))
        two.append(run_round(ctx, table, 2))
    p, base = median_rate(two), median_rate(one)
    d1, d2 = _cpu_summary(one), _cpu_summary(two)
    cpu1, cpu2 = ((d["client_cpu_s"] + d["server_cpu_s"]) / (ctx.rows / 1e6) for d in (d1, d2))
    busy = (d1["client_cpu_s"] + d1["server_cpu_s"]) / d1["wall_s"]
    return [
        Metric(
            "two_processes",
            "parallel",
            "two ranges in two processes vs one range in one process",
            p,
            base,
            "rows/s",
            p / base,
            ">= 1.60x",
            p / base >= 1.6,
            f"one range keeps {busy:.2f} cores busy (client {d1['client_cpu_s']:.2f} s + PostgreSQL/Redis "
            f"{d1['server_cpu_s']:.2f} s CPU in {d1['wall_s']:.2f} s); CPU-s per 1M rows: one range "
            f"{cpu1:.2f}, two ranges {cpu2:.2f}; {procs.cpus()} CPUs, load avg {os.getloadavg()[0]:.1f}",
            {"one_range": d1, "two_ranges": d2},
        )
    ]
