"""The waits a ``TraverseRangeOperator`` task defers instead of holding its worker slot.

When the engine yields (stream paused, source unhealthy, rows/s budget spent, ``max_task_seconds``
reached) the task has committed the chunk in hand and released its lease; ``log_yield`` says why
in the task log, and ``resume_trigger`` is the ``KeysetResumeTrigger`` the task defers to (the
triggerer polls every ``resume_poll_seconds``; a timed wait also ends at ``retry_after``). A range
held by another live owner defers the same way (``wait_for="lease"``).
"""

from __future__ import annotations

import time

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.run.range_run import BUDGET
from airflow_keyset_provider.operators.traverse_task import RangeTask
from airflow_keyset_provider.triggers.keyset import KeysetResumeTrigger


def log_yield(task: RangeTask, t: KeysetTraversal, why: str, retry_after: float) -> None:
    """One task-log line saying why the try yields and what it waits for."""
    if why == "paused":
        c = t.control.control_state()
        task.log.warning(
            "stream %s is paused%s (%s); chunk committed, lease released; deferring until "
            "`airflow-keyset resume` (the worker slot is freed)",
            t.stream,
            f" by {c.paused_by}" if c.paused_by else "",
            c.reason or "no reason given",
        )
    elif why == "unhealthy":
        task.log.warning(
            "stream %s: the source is unhealthy; chunk committed, lease released; deferring "
            "%.1f s (the worker slot is freed)",
            t.stream,
            retry_after,
        )
    elif why == BUDGET:
        task.log.info(
            "stream %s: this task ran max_task_seconds=%g s; chunk committed, range "
            "released; deferring for a moment to continue in a fresh process",
            t.stream,
            task.max_task_seconds,
        )
    else:
        task.log.info(
            "stream %s is over its rows/s budget for %.1f s more; chunk committed, lease "
            "released; deferring (the worker slot is freed)",
            t.stream,
            retry_after,
        )


def resume_trigger(
    task: RangeTask, stream: str, range_id: int, why: str, retry_after: float
) -> KeysetResumeTrigger:
    """The trigger that wakes the task when it may go on (``why``: what it waits for)."""
    return KeysetResumeTrigger(
        stream=stream,
        round_id=task.round_id,
        range_id=range_id,
        wait_for=why,
        redis_conn_id=task.redis_conn_id,
        key_prefix=task.key_prefix,
        poll_interval=task.resume_poll_seconds,
        until=(time.time() + retry_after if why in ("throttled", "unhealthy", BUDGET) else None),
    )


__all__ = ["log_yield", "resume_trigger"]
