"""Metrics the engine emits, through whatever sink the orchestrator provides.

Names (a sink may prefix them, e.g. ``keyset.``): counters ``rows.done``, ``rows.skipped``,
``rows.dead``, ``chunks``, ``advance.refused``, ``lease.takeover``, ``state.restored``,
``dependency.failure``; timings (ms) ``chunk.process`` (the processor) and ``chunk.commit`` (the
fenced advance). Every metric carries the tag ``stream``. The Airflow operators send them to
Airflow's ``Stats`` (StatsD or OpenTelemetry, as configured).
"""

from __future__ import annotations

from typing import Protocol


class Metrics(Protocol):
    def incr(self, name: str, count: int = 1, tags: dict[str, str] | None = None) -> None: ...

    def timing(self, name: str, ms: float, tags: dict[str, str] | None = None) -> None: ...


class NullMetrics:
    """Discards everything (the default)."""

    def incr(self, name: str, count: int = 1, tags: dict[str, str] | None = None) -> None:
        return None

    def timing(self, name: str, ms: float, tags: dict[str, str] | None = None) -> None:
        return None
