"""Airflow's own cost, against Airflow (issue 29): the provider's round DAG vs a bare DAG of the
same shape, in the same deployment, same run, interleaved.

Both run as ``dag.test()`` in a fresh process on the ``airflow`` group's throwaway, migrated
``AIRFLOW_HOME`` (``benchmarks/metrics/airflow.py``; warm: the home is migrated once, each DAG run
is a new process that imports Airflow, which is timed apart):

- provider: ``PlanRangesOperator`` -> ``TraverseRangeOperator`` mapped over ``RANGES`` ranges of a
  small table (``ROWS`` keys of ``seq``, no-op processor) -> ``BarrierSensor(deferrable=True)``;
- bare: a ``PythonOperator`` plan returning ``RANGES`` kwargs dicts -> mapped no-op
  ``PythonOperator`` -> a sensor that defers on ``TimeDeltaTrigger(0)`` (fires at once).

Verdict: provider / bare ``dag.test()`` seconds, target <= 1.2x. Details: each variant's
min/median/max and the summed task-instance durations by task, i.e. where the extra seconds go.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.metrics.airflow import airflow_home, dag_test
from benchmarks.report import Metric
from benchmarks.timing import Sample, interleaved, median, median_seconds, spread

ROWS = 1_000
RANGES = 8


def _by_task(samples: list[Sample]) -> dict[str, float]:
    """Median over the runs of each task's summed durations (mapped instances together)."""
    runs: list[dict[str, float]] = []
    for x in samples:
        sums: dict[str, float] = {}
        for name, d in x.extra["task_durations"].items():
            task = name.split("[")[0]
            sums[task] = sums.get(task, 0.0) + (d or 0.0)
        runs.append(sums)
    return {t: round(median([r.get(t, 0.0) for r in runs]), 3) for t in runs[0]}


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    rows = min(ROWS, ctx.rows)
    airflow_home(ctx)
    load_before = os.getloadavg()[0]
    dag_test(ctx, table, rows, RANGES, bare=True)  # warm: the first process pays cold caches
    s = interleaved(
        {
            "provider": lambda: dag_test(ctx, table, rows, RANGES, deferrable=True),
            "bare": lambda: dag_test(ctx, table, rows, RANGES, bare=True),
        },
        ctx.repeat,
    )
    p, b = median_seconds(s["provider"]), median_seconds(s["bare"])
    details: dict[str, Any] = {
        name: {
            **spread(v, rate=False),
            "tasks_by_task_s": _by_task(v),
            "process_s": median([x.extra["process_s"] for x in v]),
            "import_s": median([x.extra["import_s"] for x in v]),
        }
        for name, v in s.items()
    }
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    return [
        Metric(
            "airflow_vs_bare",
            "airflow_bare",
            f"dag.test(): provider round ({RANGES} ranges, {rows:,} rows) vs bare DAG, same shape",
            p,
            b,
            "s",
            p / b,
            "<= 1.20x",
            p / b <= 1.2,
            f"provider tasks {details['provider']['tasks_by_task_s']}, bare tasks "
            f"{details['bare']['tasks_by_task_s']}; {load}",
            details,
        )
    ]
