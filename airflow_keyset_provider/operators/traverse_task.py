"""``RangeTask``: what the helpers of ``TraverseRangeOperator`` need to know of the task.

The operator builds one per try (after templating) and hands it to its helpers
(``traverse_pull``, ``traverse_state``, ``traverse_waits``), so none of them imports the operator
back: the operator composes them, as ``KeysetTraversal`` composes the engine's rooms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RangeTask:
    """One try of a traverse task: its round and range (or, in pull mode, its place among the
    round's tasks), where its waits poll, and its task logger."""

    round_id: str
    log: Any  # the task's logger (Airflow's structlog logger; ``logging``-like)
    lo: Any = None
    hi: Any = None
    pull: bool = False
    worker: int | None = None
    workers: int | None = None
    split_stragglers: bool = True
    state_store_seconds: float | None = 5.0
    redis_conn_id: str = "redis_default"
    key_prefix: str = "ks"
    resume_poll_seconds: float = 5.0
    max_task_seconds: float | None = None


__all__ = ["RangeTask"]
