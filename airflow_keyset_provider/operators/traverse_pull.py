"""Pull mode of ``TraverseRangeOperator`` (``pull=True``, from ``PlanRangesOperator(max_tasks=...)``).

A pull task does not own one range: it works through the round (``KeysetTraversal.
traverse_round``: the ranges its lineage held, its first range, the unclaimed ones, those with no
live owner, then halves of stragglers split for it) until nothing is left for it. The owner lineage
is the task instance's, as in one-range mode, so a retry resumes what the failed try held.

Past ``max_task_seconds`` (3600 s by default in pull mode) the task commits the chunk in hand,
releases its range and defers for a moment (``KeysetResumeTrigger``, ``wait_for="budget"``); it
continues in a fresh worker process, resuming by lineage. The task succeeds when nothing is left
for it; the round is complete when the barrier says so.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException

from airflow_keyset_provider.core import KeysetTraversal, RoundPullResult
from airflow_keyset_provider.core.chunk import Processor
from airflow_keyset_provider.core.options import TraverseOptions
from airflow_keyset_provider.operators.traverse_task import RangeTask

#: ``max_task_seconds`` of a pull task when none is given: well under Celery's default
#: ``visibility_timeout`` (24 h) and any sane ``execution_timeout``.
PULL_TASK_SECONDS = 3600.0


def pull_budget(pull: bool, max_task_seconds: float | None) -> float | None:
    """The engine's ``max_task_seconds``: as given, else ``PULL_TASK_SECONDS`` in pull mode and no
    budget for a one-range task (existing DAGs do not change)."""
    if max_task_seconds is None and pull:
        return PULL_TASK_SECONDS
    return max_task_seconds


def pull_label(task: RangeTask) -> str:
    """The task's map index label, e.g. ``worker 4/16 of round r7``."""
    worker = task.worker if isinstance(task.worker, int) else 0
    workers = task.workers if isinstance(task.workers, int) else "?"
    return f"worker {worker + 1}/{workers} of round {task.round_id}"


def run_pull(
    task: RangeTask,
    t: KeysetTraversal,
    processor: Processor,
    options: TraverseOptions,
    first_range: int,
) -> RoundPullResult:
    return t.traverse_round(
        str(task.round_id),
        processor,
        options=options,
        first_range=first_range,
        split=task.split_stragglers,
        tasks=task.workers if isinstance(task.workers, int) else None,
    )


def report_pull(task: RangeTask, res: RoundPullResult) -> dict[str, Any]:
    """Log what the task did; its summary if nothing is left for it, else fail the try (every
    range it held is committed and released, so the retry resumes them)."""
    task.log.info(
        "round %s: %s ran %d range(s) (%s), read %d rows in %d chunks, %.1f s; split requests "
        "%d, new ranges won %d",
        res.round_id,
        pull_label(task),
        len(res.ranges),
        ", ".join(str(r.range_id) for r in res.ranges[:20])
        + (" ..." if len(res.ranges) > 20 else ""),
        res.rows_read,
        res.chunks,
        res.seconds,
        res.splits_asked,
        res.splits_won,
    )
    if not res.finished:
        raise AirflowException(
            f"round {res.round_id}: {pull_label(task)} stopped on request; every range it held is "
            "committed and released, and the next try resumes them"
        )
    return res.as_dict()


__all__ = ["PULL_TASK_SECONDS", "pull_budget", "pull_label", "report_pull", "run_pull"]
