"""Reliability scenario 10: traverse tasks SIGKILLed under a real Airflow scheduler lose no key.

A real deployment (``conftest.py``: scheduler with LocalExecutor, DAG processor, triggerer, API
server, throwaway home and metadata database) runs ``dags/keyset_scheduler_kill.py`` over a
PostgreSQL table of ``ROWS`` rows, planned into two ranges of 100 chunks each; the processor
records every delivered key (with the try and the process) in an effects table and sleeps 50 ms
per chunk. Once a range's first try has committed ``KILL_AFTER_CHUNKS`` chunks (its cursor in
Redis), the test kills it from outside, the way an operating system or a machine failure would:

- range 0, ``task``: SIGKILL to the task process (the process running the processor; its pid is
  the one the processor recorded and the one the REST API shows for the task instance). Its
  supervisor sees the signal exit and reports the try failed; Airflow schedules try 2.
- range 1, ``worker``: SIGSTOP to the supervisor (the LocalExecutor worker process), SIGKILL to the
  task process, SIGKILL to the supervisor. Nobody reports anything, as when a worker machine
  dies; the scheduler finds the try without heartbeat after
  ``[scheduler] task_instance_heartbeat_timeout`` (event log ``heartbeat timeout``) and
  schedules try 2.

Guarantees checked, with the figures printed in the terminal summary:

- the DAG run succeeds; each killed range succeeds on try 2, the deferred barrier (which waited in
  the real triggerer while the ranges ran) closes the round;
- every key of the table was processed at least once (keys lost = 0), never outside its range,
  never twice in one try;
- each retry resumed from its range's committed cursor: the keys delivered again are at most one
  chunk per kill per range;
- counters are exact: the barrier's XCom totals (done, skipped, dead) and each range's XCom
  ``done`` equal the row counts, although some chunks were processed twice.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import deployment_support as ds
import psutil
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, HEARTBEAT_TIMEOUT_S, AirflowDeployment

from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.store.cursor_store import CursorStore

DAG_ID = "keyset_scheduler_kill"
ROWS = 3000
MAX_RANGES = 2
CHUNK = 15
KILL_AFTER_CHUNKS = 10
KILLS = {0: "task", 1: "worker"}  # range id -> how its first try is killed
RETRIES = 2
RUN_TIMEOUT_S = 240.0  # from the trigger to a finished run
POLL_S = 0.1
SOURCE_CONN, REDIS_CONN = "keyset_sched_db", "keyset_sched_redis"


@dataclass
class Kill:
    range_id: int
    kind: str
    pid: int
    ppid: int
    cursor: int  # the range's committed cursor once the killed processes are gone
    done: int  # the range's committed ``done`` counter at that moment
    killed_at: float  # time.time() of the SIGKILL


# --------------------------------------------------------------------------- setup helpers


def _create_tables(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE sched_events (seq bigint PRIMARY KEY, payload text NOT NULL)"
        )
        conn.exec_driver_sql(
            f"INSERT INTO sched_events SELECT g, 'event ' || g FROM generate_series(1, {ROWS}) g"
        )
        conn.exec_driver_sql(
            "CREATE TABLE sched_effects (seq bigint NOT NULL, range_id int NOT NULL, try_number int NOT NULL, "
            "pid int NOT NULL, ppid int NOT NULL, chunk_first bigint NOT NULL, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.exec_driver_sql("ANALYZE sched_events")  # planner statistics, as a live table has them


# --------------------------------------------------------------------------- REST helpers


_ti_path = functools.partial(ds.ti_path, DAG_ID)


def _xcom(
    dep: AirflowDeployment, run_id: str, task_id: str, key: str, map_index: int | None = None
) -> Any:
    return ds.xcom(dep, DAG_ID, run_id, task_id, key, map_index)


def _xcom_or_none(dep: AirflowDeployment, run_id: str, task_id: str, key: str) -> Any:
    found = ds.get_or_none(dep, f"{_ti_path(run_id, task_id)}/xcomEntries/{key}")
    return None if found is None else found["value"]


# --------------------------------------------------------------------------- the kill


def _first_try_process(engine: sa.Engine, range_id: int) -> tuple[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT DISTINCT pid, ppid FROM sched_effects WHERE range_id = :r AND try_number = 1"
            ),
            {"r": range_id},
        ).all()
    assert len(rows) == 1, f"range {range_id}: try 1 ran in {len(rows)} processes: {rows}"
    return int(rows[0][0]), int(rows[0][1])


def _kill(
    dep: AirflowDeployment,
    engine: sa.Engine,
    ctl: StreamControl,
    run_id: str,
    round_id: str,
    range_id: int,
) -> Kill:
    """Kill ``range_id``'s first try as ``KILLS`` says, after checking that the processes are that
    task instance's and belong to this deployment; then read the range's committed cursor."""
    kind = KILLS[range_id]
    pid, ppid = _first_try_process(engine, range_id)
    ti = dep.get(_ti_path(run_id, "traverse", range_id))
    assert (ti["try_number"], ti["state"], ti["pid"]) == (1, "running", pid), (
        f"range {range_id}: the REST API shows try {ti['try_number']} {ti['state']} pid {ti['pid']}, "
        f"the processor recorded try 1 in pid {pid}"
    )
    assert dep.owns(pid) and dep.owns(ppid), f"pid {pid}/{ppid} is not a process of this deployment"
    assert psutil.Process(pid).ppid() == ppid, f"pid {pid}'s parent is not the supervisor {ppid}"
    victims = (
        [psutil.Process(pid)] if kind == "task" else [psutil.Process(ppid), psutil.Process(pid)]
    )
    killed_at = time.time()
    if kind == "task":
        os.kill(pid, signal.SIGKILL)
    else:  # the whole worker: freeze the supervisor first so it cannot report the child's death
        os.kill(ppid, signal.SIGSTOP)
        os.kill(pid, signal.SIGKILL)
        os.kill(ppid, signal.SIGKILL)
    psutil.wait_procs(victims, timeout=10)
    time.sleep(0.5)  # a cursor advance the victim wrote to its socket just before dying lands first
    after = next(r for r in ctl.range_status(round_id) if int(r["range_id"]) == range_id)
    return Kill(range_id, kind, pid, ppid, int(after["cursor"]), int(after["done"]), killed_at)


def _run_and_kill(
    dep: AirflowDeployment, engine: sa.Engine, ctl: StreamControl, run_id: str
) -> tuple[str, dict[int, Kill], float]:
    """Poll the run (REST) and the ranges (Redis) until the run ends; kill each range of ``KILLS``
    once its first try has committed ``KILL_AFTER_CHUNKS`` chunks. -> (state, kills, seconds)."""
    started = time.monotonic()
    kills: dict[int, Kill] = {}
    round_id: str | None = None
    next_state_poll = 0.0
    while True:
        now = time.monotonic()
        if now - started > RUN_TIMEOUT_S:
            pytest.fail(
                f"DAG run {run_id} not finished after {RUN_TIMEOUT_S:.0f} s (kills: {kills})\n"
                f"{dep.diagnostics(DAG_ID)}"
            )
        if now >= next_state_poll:
            next_state_poll = now + 1.0
            if dep.dead_components():
                pytest.fail(
                    f"Airflow components died: {dep.dead_components()}\n{dep.diagnostics(DAG_ID)}"
                )
            state = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state, kills, time.monotonic() - started
            if round_id is None:
                round_id = _xcom_or_none(dep, run_id, "plan", "round_id")
        if round_id is not None and len(kills) < len(KILLS):
            for status in ctl.range_status(round_id):
                range_id = int(status["range_id"])
                if range_id not in KILLS or range_id in kills:
                    continue
                if status["state"] == "complete":
                    pytest.fail(
                        f"range {range_id} completed before it could be killed; make it longer\n"
                        f"{dep.diagnostics(DAG_ID)}"
                    )
                if status["done"] >= KILL_AFTER_CHUNKS * CHUNK:
                    kills[range_id] = _kill(dep, engine, ctl, run_id, round_id, range_id)
        time.sleep(POLL_S)


# --------------------------------------------------------------------------- the figures


def _effects(engine: sa.Engine, ranges: list[dict[str, Any]]) -> dict[str, Any]:
    """What the independent record of side effects says about coverage and replay."""
    with engine.connect() as conn:
        q = lambda sql, **kw: conn.execute(sa.text(sql), kw).all()  # noqa: E731
        out = ds.effects_coverage(conn, "sched_events", "sched_effects", ranges)
        out["twice_in_one_try"] = q(
            "SELECT count(*) - count(DISTINCT (seq, range_id, try_number)) FROM sched_effects"
        )[0][0]
        out["tries"] = {
            int(r): sorted(t)
            for r, t in q(
                "SELECT range_id, array_agg(DISTINCT try_number) FROM sched_effects GROUP BY range_id"
            )
        }
        # A replayed chunk: a chunk of a later try holding a key that an earlier try delivered.
        replay = q(
            "SELECT e.range_id, count(DISTINCT (e.try_number, e.chunk_first)), count(*) FROM sched_effects e "
            "WHERE EXISTS (SELECT 1 FROM sched_effects p WHERE p.seq = e.seq AND p.range_id = e.range_id "
            "AND p.try_number < e.try_number) GROUP BY e.range_id"
        )
        out["replayed_chunks"] = {int(r): int(c) for r, c, _ in replay}
        out["replayed_keys"] = {int(r): int(k) for r, _, k in replay}
        out["resumed_at"] = {
            int(r): int(m)
            for r, m in q(
                "SELECT range_id, min(seq) FROM sched_effects WHERE try_number = 2 GROUP BY range_id"
            )
        }
    return out


def _first_try_beyond(engine: sa.Engine, kills: Mapping[int, Kill]) -> dict[int, int]:
    """Per killed range: keys its first try delivered past the committed cursor (the chunk in
    hand when it died; the retry must deliver exactly these again)."""
    with engine.connect() as conn:
        return {
            r: int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM sched_effects WHERE range_id = :r AND try_number = 1 AND seq > :c"
                    ),
                    {"r": r, "c": k.cursor},
                ).scalar()
                or 0
            )
            for r, k in kills.items()
        }


def _heartbeat_timeouts(dep: AirflowDeployment, run_id: str) -> set[tuple[int, int]]:
    """(map_index, try_number) of the traverse tries the scheduler failed for lack of heartbeat."""
    return set(ds.heartbeat_timeouts(dep, DAG_ID, run_id))


def _trigger_fired(dep: AirflowDeployment, run_id: str, round_id: str) -> bool:
    """True if the triggerer logged that it saw the round complete (the barrier's trigger log)."""
    needle = f"round {round_id}: every range is complete"
    folder = dep.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / "task_id=barrier"
    files = [*folder.glob("*trigger*"), dep.home / "triggerer.out"]
    return any(needle in path.read_text(errors="replace") for path in files if path.exists())


# --------------------------------------------------------------------------- the test


def test_sigkilled_traverse_tasks_are_retried_and_lose_nothing(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    _create_tables(pg_engine)
    stream = f"sched-{uuid.uuid4().hex[:8]}"
    dep = airflow_deployment(
        {
            f"AIRFLOW_CONN_{SOURCE_CONN.upper()}": ds.postgres_conn(pg_url, pg_schema),
            f"AIRFLOW_CONN_{REDIS_CONN.upper()}": ds.redis_conn(redis_url),
            "KEYSET_SCHED_SOURCE_CONN": SOURCE_CONN,
            "KEYSET_SCHED_REDIS_CONN": REDIS_CONN,
            "KEYSET_SCHED_KEY_PREFIX": key_prefix,
            "KEYSET_SCHED_STREAM": stream,
            "KEYSET_SCHED_MAX_RANGES": str(MAX_RANGES),
            "KEYSET_SCHED_CHUNK_SIZE": str(CHUNK),
            "KEYSET_SCHED_SLEEP_S": "0.05",
            "KEYSET_SCHED_RETRIES": str(RETRIES),
            "KEYSET_SCHED_RETRY_DELAY_S": "3",
            "KEYSET_SCHED_BARRIER_TIMEOUT_S": str(int(RUN_TIMEOUT_S)),
        },
        DAG_ID,
    )
    ctl = StreamControl(CursorStore(redis_client, stream, prefix=key_prefix))
    run_id = f"kill_{uuid.uuid4().hex[:8]}"
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})

    try:
        state, kills, seconds = _run_and_kill(dep, pg_engine, ctl, run_id)
    except Exception as exc:  # a failed check or call mid-run: show what Airflow was doing
        pytest.fail(f"{type(exc).__name__}: {exc}\n{dep.diagnostics(DAG_ID)}")

    diagnostics = lambda: dep.diagnostics(DAG_ID)  # noqa: E731
    assert state == "success", f"DAG run {run_id} ended {state}\n{diagnostics()}"
    round_id = _xcom(dep, run_id, "plan", "round_id")
    ranges = _xcom(dep, run_id, "plan", "return_value")
    totals = _xcom(dep, run_id, "barrier", "return_value")
    per_range = {
        r: _xcom(dep, run_id, "traverse", "return_value", map_index=r) for r in range(len(ranges))
    }
    tis = {r: dep.get(_ti_path(run_id, "traverse", r)) for r in range(len(ranges))}
    barrier_ti = dep.get(_ti_path(run_id, "barrier"))
    timeouts = _heartbeat_timeouts(dep, run_id)
    fx = _effects(pg_engine, ranges)

    max_replay = max(
        (fx["replayed_chunks"].get(r, 0) / max(1, len(fx["tries"][r]) - 1) for r in fx["tries"]),
        default=0,
    )
    counter_errors = (
        abs(int(totals["done"]) - ROWS)
        + int(totals["skipped"])
        + int(totals["dead"])
        + sum(abs(int(per_range[r]["done"]) - fx["rows_in_range"][r]) for r in per_range)
    )
    beyond_cursor = _first_try_beyond(pg_engine, kills)
    FIGURES.extend(
        [
            f"run {run_id}: {state} in {seconds:.0f} s; {ROWS} rows, {len(ranges)} ranges, chunk {CHUNK}, "
            f"heartbeat timeout {HEARTBEAT_TIMEOUT_S} s",
            *(
                f"  kill range {k.range_id} ({k.kind}): pid {k.pid} (supervisor {k.ppid}) at committed cursor "
                f"{k.cursor} (done {k.done}); try 1 had delivered {beyond_cursor[k.range_id]} key(s) past it; try 2 "
                f"started {ds.since(tis[k.range_id]['start_date'], k.killed_at):.0f} s after the kill, resumed at key "
                f"{fx['resumed_at'].get(k.range_id)}, replayed {fx['replayed_keys'].get(k.range_id, 0)} key(s) in "
                f"{fx['replayed_chunks'].get(k.range_id, 0)} chunk(s)"
                for k in kills.values()
            ),
            f"  tries per range {fx['tries']}; heartbeat timeouts (map_index, try) {sorted(timeouts)}",
            f"  barrier totals done {totals['done']} skipped {totals['skipped']} dead {totals['dead']}; "
            f"per range done {[per_range[r]['done'] for r in sorted(per_range)]}",
            f"  scenario | trials | keys lost | max replay (chunks) | counter errors: real scheduler | 1 | "
            f"{fx['lost']} | {max_replay:g} | {counter_errors}",
        ]
    )
    print("\n".join(FIGURES))

    # Airflow noticed both deaths and retried each range exactly once.
    assert set(kills) == set(KILLS), f"not every planned kill happened: {kills}"
    for r, ti in tis.items():
        expected_try = 2 if r in KILLS else 1
        assert (ti["state"], ti["try_number"]) == ("success", expected_try), (
            f"range {r}: {ti['state']} on try {ti['try_number']}, expected success on try {expected_try}\n"
            f"{diagnostics()}"
        )
    assert (1, 1) in timeouts, (
        f"the scheduler never timed out the dead worker's heartbeat\n{diagnostics()}"
    )
    assert (0, 1) not in timeouts, "the task process kill should be reported by its supervisor"
    # The barrier waited in the real triggerer and closed the round.
    assert (barrier_ti["state"], barrier_ti["try_number"]) == ("success", 1)
    assert _trigger_fired(dep, run_id, round_id), (
        f"the triggerer never fired for {round_id}\n{diagnostics()}"
    )
    assert ctl.round(round_id).state == "closed"
    # Coverage: every key at least once, in its own range, never twice in one try.
    assert fx["lost"] == 0, f"{fx['lost']} key(s) never processed, e.g. {fx['lost_sample']}"
    assert (fx["unknown"], fx["outside_range"], fx["twice_in_one_try"]) == (0, 0, 0), fx
    # Resume: each retry redelivered at most one chunk, and only of its own range.
    for k in kills.values():
        assert fx["tries"][k.range_id] == [1, 2], fx["tries"]
        assert fx["replayed_chunks"].get(k.range_id, 0) <= 1, fx["replayed_chunks"]
        assert fx["replayed_keys"].get(k.range_id, 0) <= CHUNK, fx["replayed_keys"]
        lo = ranges[k.range_id]["lo"] or 0
        assert k.done == k.cursor - lo, (
            f"range {k.range_id}: counter {k.done} at cursor {k.cursor} (lo {lo})"
        )
        assert fx["resumed_at"][k.range_id] == k.cursor + 1, (
            f"range {k.range_id}: try 2 started at key {fx['resumed_at'][k.range_id]}, the committed cursor "
            f"was {k.cursor}"
        )
        assert fx["replayed_keys"].get(k.range_id, 0) == beyond_cursor[k.range_id], fx[
            "replayed_keys"
        ]
    assert set(fx["replayed_chunks"]) <= set(KILLS), fx["replayed_chunks"]
    # Counters: exact, although chunks were replayed.
    assert (totals["done"], totals["skipped"], totals["dead"], totals["end_key"]) == (
        ROWS,
        0,
        0,
        ROWS,
    ), totals
    for r, result in per_range.items():
        assert (result["done"], result["skipped"], result["dead"], result["complete"]) == (
            fx["rows_in_range"][r],
            0,
            0,
            True,
        ), (r, result)
    assert counter_errors == 0
