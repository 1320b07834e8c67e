"""``execution_timeout`` as a time budget that ends at a chunk boundary.

Airflow ends an execution that outlasts the task's ``execution_timeout`` by raising
``AirflowTaskTimeout`` from a ``SIGALRM`` handler, wherever the worker is: most often inside the
processor call, whose chunk is then neither finished nor committed (the next try delivers it
again). So a traverse task gives the engine a time budget that ends ``timeout_margin`` before
Airflow's alarm: ``max_task_seconds = min(max_task_seconds, execution_timeout - margin - time
already spent in this execution)``. The engine yields ``"budget"`` at the first chunk boundary
past it, with everything processed committed and the range released; when the timeout is what
bound the budget, the task then fails the try with ``AirflowTaskTimeout`` itself (as Airflow
would have, retries apply), instead of deferring as a ``max_task_seconds`` budget does.

Only a chunk still running when the alarm fires (one that started before the budget ran out and
takes longer than the margin) is delivered again by the next try.
"""

from __future__ import annotations

import datetime as dt
import time

from airflow.sdk.exceptions import AirflowTaskTimeout

#: The margin before Airflow's alarm: a tenth of ``execution_timeout``, at least ``MARGIN_MIN``
#: and at most ``MARGIN_MAX`` seconds (a chunk longer than that may still be cut by the alarm).
MARGIN_FRACTION = 0.1
MARGIN_MIN = 1.0
MARGIN_MAX = 60.0
#: The least budget an execution gets (the engine always runs one chunk before it yields).
BUDGET_MIN = 0.001


def timeout_margin(execution_timeout: dt.timedelta) -> float:
    """Seconds between the end of the budget and Airflow's alarm."""
    seconds = execution_timeout.total_seconds()
    return min(MARGIN_MAX, max(MARGIN_MIN, MARGIN_FRACTION * seconds))


def execution_budget(
    max_task_seconds: float | None, execution_timeout: dt.timedelta | None, started: float
) -> tuple[float | None, bool]:
    """The engine's ``max_task_seconds`` for an execution that began at ``started``
    (``time.monotonic()``), and whether ``execution_timeout`` is what bounds it."""
    if execution_timeout is None:
        return max_task_seconds, False
    spent = time.monotonic() - started
    left = execution_timeout.total_seconds() - timeout_margin(execution_timeout) - spent
    left = max(left, BUDGET_MIN)
    if max_task_seconds is not None and max_task_seconds <= left:
        return max_task_seconds, False
    return left, True


def timed_out(what: str, execution_timeout: dt.timedelta, cursor: str) -> AirflowTaskTimeout:
    """The error a try ends with when its ``execution_timeout`` budget was spent."""
    return AirflowTaskTimeout(
        f"{what}: execution_timeout ({execution_timeout.total_seconds():g} s) is near; the try "
        f"stopped at a chunk boundary {timeout_margin(execution_timeout):g} s before it, with "
        f"everything it processed committed ({cursor}) and the lease released; the next try "
        "resumes from there"
    )


__all__ = ["execution_budget", "timed_out", "timeout_margin"]
