"""Target 10: Airflow overhead (the same rows through ``dag.test()`` with mapped ranges).

Not measured yet: the operators are being written. Reported as ``n/a`` so the table stays
complete; see docs/performance.md for how it will be measured.
"""

from __future__ import annotations

from benchmarks.context import BenchContext
from benchmarks.report import Metric, not_available


def run(ctx: BenchContext) -> list[Metric]:
    return [not_available("airflow_overhead", "airflow", "dag.test() with 8 mapped ranges vs the engine alone",
                          "report fixed + per-task s",
                          "not measured: the Airflow operators are still being built; to come as "
                          "(dag.test() wall - engine wall) split into fixed and per-task overhead")]
