"""A DAG run's rounds, for its "Keyset round" tab, and true words when Redis holds none of them.

Two records say which rounds a run planned: Redis (a round's key ``<dag_id>/<run_id>/<task_id>``
in the stream's ``by_key`` hash, ``status.rounds_of_run``) and Airflow (the ``keyset_round`` XCom
each ``PlanRangesOperator`` task pushes; ``app.py`` reads it, this module imports nothing from
Airflow). Redis losing a stream loses the first record, never the second, so:

- a round either record names and Redis still holds: shown (``in_redis``);
- a round either record names and Redis no longer holds: **lost** (``lost_message`` says so and
  what to do), never "not planned";
- no round in either: ``absent_reason`` ``never-planned`` (Airflow's record was read and has
  none), ``other-prefix`` (planned under another key prefix than the page reads) or ``unknown``
  (Airflow's record could not be read: the user may not read the DAG's XComs), each with its
  ``absent_message``.
"""

from __future__ import annotations

from typing import Any

from ..core.errors import ConfigurationError
from ..core.store.cursor_store import CursorStore
from .status import rounds_of_run

LOST_HINT = (
    "(flushed, evicted, or restarted without persistence). Nothing was read as complete: re-plan "
    "the round or restore it from its checkpoint mirror (see docs/reliability.md)."
)


def run_view(
    client: Any, prefix: str, dag_id: str, run_id: str, planned: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The run's rounds (``stream``, ``round_id``, ``task_id``, ``map_index``, ``known_from``,
    ``in_redis``, ``lost_message``) and, when there are none, why (see the module docstring).
    ``planned``: the run's ``keyset_round`` XComs (``stream``, ``round_id``, ``key_prefix``,
    ``task_id``, ``map_index``), or None when they could not be read."""
    rounds = [dict(r, known_from="redis") for r in rounds_of_run(client, prefix, dag_id, run_id)]
    seen = {(r["stream"], r["round_id"]) for r in rounds}
    elsewhere = []
    for p in planned or []:
        if p.get("key_prefix") not in (None, prefix):
            elsewhere.append(p)
        elif (p["stream"], p["round_id"]) not in seen:
            seen.add((p["stream"], p["round_id"]))
            keys = ("stream", "round_id", "task_id", "map_index")
            rounds.append({**{k: p[k] for k in keys}, "known_from": "airflow"})
    for r in rounds:
        r["in_redis"] = _held(client, prefix, r["stream"], r["round_id"])
        r["lost_message"] = None if r["in_redis"] else _lost(r, prefix)
    reason, message = _absence(dag_id, run_id, prefix, rounds, planned, elsewhere)
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "key_prefix": prefix,
        "rounds": rounds,
        "planned_known": planned is not None,
        "absent_reason": reason,
        "absent_message": message,
    }


def _held(client: Any, prefix: str, stream: str, round_id: str) -> bool:
    try:
        return CursorStore(client, stream, prefix=prefix).round_state(round_id) is not None
    except ConfigurationError:  # a stream name the store cannot hold: nothing of it in Redis
        return False


def _lost(r: dict[str, Any], prefix: str) -> str:
    task = r["task_id"] + ("" if r["map_index"] is None else f" [{r['map_index']}]")
    source = "its round key in Redis" if r["known_from"] == "redis" else "its XCom keyset_round"
    return (
        f"Redis has lost round {r['round_id']} of stream {r['stream']}, which task {task} of this "
        f"run planned ({source}): Redis holds no state for it under key prefix {prefix} "
        + LOST_HINT
    )


def _absence(
    dag_id: str,
    run_id: str,
    prefix: str,
    rounds: list[dict[str, Any]],
    planned: list[dict[str, Any]] | None,
    elsewhere: list[dict[str, Any]],
) -> tuple[str | None, str | None]:
    if rounds:
        return None, None
    if elsewhere:
        p = elsewhere[0]
        return "other-prefix", (
            f"Run {run_id} planned round {p['round_id']} of stream {p['stream']} under key prefix "
            f"{p['key_prefix']} (task {p['task_id']}'s XCom keyset_round); this page reads key "
            f"prefix {prefix} ([keyset] key_prefix)."
        )
    if planned is not None:
        return "never-planned", (
            f"Run {run_id} of DAG {dag_id} planned no keyset round: none of its tasks recorded "
            f"one (XCom keyset_round) and Redis holds none keyed by it under key prefix {prefix}."
        )
    return "unknown", (
        f"Redis holds no round keyed by run {run_id} of DAG {dag_id} under key prefix {prefix}. "
        "Either the run planned none, or Redis lost the stream's state (flushed, evicted, or "
        "restarted without persistence); the run's XComs, which would tell, could not be read "
        "with your permissions."
    )
