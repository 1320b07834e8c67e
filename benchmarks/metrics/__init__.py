"""One module per concern; each ``run(ctx)`` returns its table rows.

``GROUPS`` maps the names ``--only`` accepts to the module that measures them and the metric
names it reports (``--only`` also accepts a metric name, which runs its whole group).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from benchmarks.context import BenchContext
from benchmarks.metrics import writeback_sql as _wb_sql
from benchmarks.report import Metric

GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "noop": ("throughput", ("noop_vs_loop", "noop_vs_copy")),
    "io": ("io_bound", ("io_prefetch",)),
    "ts": ("timestamp_key", ("ts_key",)),
    "memory": (
        "memory",
        ("memory_rss", "redis_round_bytes", "redis_round_scaling", "redis_4096_bytes"),
    ),
    "planning": (
        "planning",
        ("plan_time", "plan_scaling", "plan_balance_zipf", "plan_balance_seq"),
    ),
    "writeback": ("writeback", ("writeback_vs_onebyone", "writeback_vs_executemany")),
    "writeback_mysql": (
        "writeback_mysql",
        ("writeback_mysql_vs_onebyone", "writeback_mysql_vs_executemany"),
    ),
    # the verdict of issue 29: the helpers against hand-written SQL of the same outcome
    "writeback_sql": ("writeback_sql", _wb_sql.metric_names(_wb_sql.GROUP_PG)),
    "writeback_sql_mysql": ("writeback_sql_mysql", _wb_sql.metric_names(_wb_sql.GROUP_MYSQL)),
    "parallel": ("parallel", ("two_processes",)),
    "offset": ("offset", ("keyset_vs_offset",)),
    "airflow": ("airflow", ("airflow_overhead",)),
    "governor": ("governor", ("governor_rate", "adaptive_chunks")),
    "straggler": ("straggler", ("straggler_split",)),
    "ranges": ("many_ranges", ("ranges_overhead",)),
    "mariadb": ("mariadb", ("mariadb_noop_vs_loop", "mariadb_plan_time")),
    "exactly_once": ("exactly_once", ("exactly_once_writeback",)),
    "reads": ("read_designs", ("read_pg_vs_copy", "read_mariadb_vs_loop")),
    "airflow_bare": ("airflow_bare", ("airflow_vs_bare",)),
    "verify": ("verify", ("verify_vs_traverse",)),
    "preview": ("preview", ("preview_eta",)),
    # issue 29: the docs' decorator example end to end, against the same outcome by hand
    "decorator_example": (
        "decorator_example",
        ("decorator_vs_statement", "decorator_vs_chunked"),
    ),
}


def resolve(only: list[str] | None) -> list[str]:
    """Group names to run, in table order; raises ValueError naming the valid choices."""
    if not only:
        return list(GROUPS)
    wanted = set()
    for name in only:
        group = (
            name
            if name in GROUPS
            else next((g for g, (_, ms) in GROUPS.items() if name in ms), None)
        )
        if group is None:
            choices = ", ".join([*GROUPS, *(m for _, ms in GROUPS.values() for m in ms)])
            raise ValueError(f"--only {name!r}: unknown; choose from {choices}")
        wanted.add(group)
    return [g for g in GROUPS if g in wanted]


def runner(group: str) -> Callable[[BenchContext], list[Metric]]:
    module = importlib.import_module(f"benchmarks.metrics.{GROUPS[group][0]}")
    run: Callable[[BenchContext], list[Metric]] = module.run
    return run
