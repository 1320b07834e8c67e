"""Issue 29 on MariaDB: see ``writeback_sql.py`` (both databases share its machinery)."""

from benchmarks.metrics.writeback_sql import run_mysql as run

__all__ = ["run"]
