"""``TraverseRangeOperator``'s mirror of its range in Airflow's task state store.

A one-range traverse task writes the range's committed cursor and counters under
``keyset_range`` (``RANGE_STATE_KEY``) in ``context["task_state_store"]`` (Airflow >= 3.3: kept
per task instance across retries, shown by the UI and the REST API), at most every
``state_store_seconds`` and once when its try ends. Redis stays the authority: nothing ever reads
the cursor back from here. A pull task has no one range to mirror and writes nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from airflow.sdk import Context

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.keys import to_json
from airflow_keyset_provider.core.rounds.status import RangeState
from airflow_keyset_provider.core.run.state import CommittedRange
from airflow_keyset_provider.operators.traverse_task import RangeTask

#: The task state store key under which a traverse task instance mirrors its range.
RANGE_STATE_KEY = "keyset_range"


def checked_state_store_seconds(state_store_seconds: Any) -> float | None:
    """``state_store_seconds`` as given, once it is None or a non-negative number (else
    ``ValueError``, when the DAG is parsed)."""
    if state_store_seconds is not None and (
        isinstance(state_store_seconds, bool)
        or not isinstance(state_store_seconds, (int, float))
        or state_store_seconds < 0
    ):
        raise ValueError(
            f"state_store_seconds must be None or a non-negative number, got "
            f"{state_store_seconds!r}"
        )
    return state_store_seconds


def range_state_mirror(
    task: RangeTask, context: Context, t: KeysetTraversal, range_id: int, stream: str
) -> Callable[[CommittedRange], None] | None:
    """A callback writing the range's committed state to the task state store (key
    ``keyset_range``), or None without a task state store or with ``state_store_seconds``
    None. Redis stays the authority: nothing ever reads the cursor back from here."""
    store = context.get("task_state_store")  # Airflow >= 3.3
    if store is None or task.state_store_seconds is None or task.pull:
        return None  # a pull task has no one range to mirror
    ti = context["ti"]
    base = {
        "stream": stream,
        "round_id": str(task.round_id),
        "range_id": range_id,
        "lo": task.lo,
        "hi": task.hi,
        "try_number": getattr(ti, "try_number", None),
        "authority": "redis",
    }

    def record(state: CommittedRange) -> None:
        store.set(
            RANGE_STATE_KEY,
            {
                **base,
                "cursor": to_json(t.decode(state.cursor)),
                "done": state.done,
                "skipped": state.skipped,
                "dead": state.dead,
                "retries": state.retries,
                "complete": state.complete,
                "updated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            },
        )

    return record


def mirror_final_range_state(
    task: RangeTask,
    mirror: Callable[[CommittedRange], None] | None,
    t: KeysetTraversal,
    range_id: int,
) -> None:
    """Once the try ends (complete, stopped or failed): the range as Redis holds it now. Best
    effort: a failure here must not hide the try's own outcome."""
    if mirror is None:
        return
    try:
        status = next(r for r in t.range_status(str(task.round_id)) if r.range_id == range_id)
        mirror(
            CommittedRange(
                status.cursor_encoded,
                status.done,
                status.skipped,
                status.dead,
                status.retries,
                status.state == RangeState.COMPLETE,
            )
        )
    except Exception as exc:
        task.log.warning(
            "round %s range %s: could not mirror the range into the task state store: %s",
            task.round_id,
            range_id,
            exc,
        )


__all__ = [
    "RANGE_STATE_KEY",
    "checked_state_store_seconds",
    "mirror_final_range_state",
    "range_state_mirror",
]
