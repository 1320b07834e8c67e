"""Scale-out on Celery: a worker lost mid-range, and a message redelivered past visibility_timeout.

``test_round_survives_losing_one_of_two_celery_workers`` (below) kills a worker machine;
``test_traverse_running_past_visibility_timeout_is_redelivered_and_ignored`` (at the end) lets
Redis deliver a running try's message a second time. Both run a fresh deployment.

A real CeleryExecutor deployment (``conftest.py``/``celery_support.py``: API server, scheduler, DAG
processor, triggerer, two ``airflow celery worker`` processes ``w1``/``w2`` with concurrency 1,
Redis broker under the test's key prefix, result backend and metadata in a throwaway PostgreSQL
database) runs ``dags/keyset_celery_kill.py`` over a table of ``ROWS`` keys planned into two
ranges of ``ROWS / 2 / CHUNK`` chunks. The processor (``dags/keyset_celery_effects.py``, given to
the operator as ``"module:function"``) counts every delivery of every key and sleeps per chunk.

Scenario: both traverse tasks run at the same time, one on each worker (the task instances'
``hostname`` in the REST API says which). Once the range that has progressed least has committed
``KILL_AFTER_CHUNKS`` chunks (its cursor in Redis), its worker's machine "fails" in two steps:
SIGKILL of the worker's process group (Celery's main process, its pool process and the task's
supervisor), then of the task process. Airflow 3.3 runs the task process in a process group
of its own, so the group kill alone leaves it running, orphaned: the test checks that it notices
its supervisor's death and stops by itself within one chunk (``core/supervision.py``: at most one
processor call starts after the kill, every chunk it processed is committed, it exits; the test
waits at most ``ORPHAN_WATCH_S``), then kills whatever is left as the machine failure would.
Nobody reports the death; the scheduler finds the try without heartbeat after ``[scheduler]
task_instance_heartbeat_timeout`` and schedules try 2 (``retries`` in ``.partial()``), which
only the surviving worker can run. Try 2 takes the range over by owner lineage and resumes from
the committed cursor.

Guarantees checked (figures in the terminal summary): the traverse tries ran on both workers and
the retry on the survivor; every key of ``(start, end]`` was processed at least once, none outside
its range; no key was processed twice (the orphan committed what it processed before it
stopped), and try 2 began at the committed cursor + 1; the barrier closed the round with done + skipped + dead = ``ROWS``;
the broker's keys lay under the test's prefix, among them the dead try's unacknowledged message.
"""

from __future__ import annotations

import functools
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import celery_support as cs
import deployment_support as ds
import psutil
import pytest
import redis
import sqlalchemy as sa

from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.store import CursorStore

DAG_ID = "keyset_celery_kill"
ROWS = 4000
MAX_RANGES = 2
CHUNK = 20
SLEEP_S = 0.15
KILL_AFTER_CHUNKS = 5
RETRIES = 2
RUN_TIMEOUT_S = 180.0  # from the trigger to a finished run
POLL_S = 0.1
ORPHAN_WATCH_S = 20.0  # how long the orphaned task process may run before the "machine" is gone
SOURCE_CONN, REDIS_CONN = "keyset_celery_db", "keyset_celery_redis"

AirflowDeployment = ds.AirflowDeployment


@dataclass
class Victim:
    range_id: int
    worker: str
    pid: int  # the task process (it ran the processor)
    kill: cs.MachineKill
    cursor: int  # the range's committed cursor once every killed process is gone
    done: int


def _create_tables(engine: sa.Engine, rows: int) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE celery_events (seq bigint PRIMARY KEY, payload text NOT NULL)"
        )
        conn.exec_driver_sql(
            f"INSERT INTO celery_events SELECT g, 'event ' || g FROM generate_series(1, {rows}) g"
        )
        conn.exec_driver_sql(
            "CREATE TABLE celery_effects (seq bigint PRIMARY KEY, range_id int NOT NULL, "
            "processed int NOT NULL, tries int[] NOT NULL)"
        )
        conn.exec_driver_sql(
            "CREATE TABLE celery_chunks (range_id int NOT NULL, try_number int NOT NULL, "
            "pid int NOT NULL, ppid int NOT NULL, worker text NOT NULL, first_key bigint NOT NULL, "
            "last_key bigint NOT NULL, n int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.exec_driver_sql("ANALYZE celery_events")


# --------------------------------------------------------------------------- REST helpers


_ti_path = functools.partial(ds.ti_path, DAG_ID)


def _xcom(
    dep: AirflowDeployment, run_id: str, task_id: str, key: str, map_index: int | None = None
) -> Any:
    return ds.xcom(dep, DAG_ID, run_id, task_id, key, map_index)


def _tries(dep: AirflowDeployment, run_id: str, map_index: int) -> dict[int, dict[str, Any]]:
    """try_number -> that try of traverse[map_index] (history plus the current try)."""
    hist = dep.get(f"{_ti_path(run_id, 'traverse', map_index)}/tries")["task_instances"]
    return {int(t["try_number"]): t for t in hist}


# --------------------------------------------------------------------------- the kill


def _task_pid(engine: sa.Engine, range_id: int) -> int:
    with engine.connect() as conn:
        pids = (
            conn.execute(
                sa.text(
                    "SELECT DISTINCT pid FROM celery_chunks WHERE range_id = :r AND try_number = 1"
                ),
                {"r": range_id},
            )
            .scalars()
            .all()
        )
    assert len(pids) == 1, f"range {range_id}: try 1 ran in {len(pids)} processes: {pids}"
    return int(pids[0])


def _pick_victim(
    dep: AirflowDeployment, run_id: str, status: list[dict[str, Any]]
) -> tuple[int, str] | None:
    """(range, worker) to kill once both ranges run try 1 on different workers and the one that
    progressed least has committed KILL_AFTER_CHUNKS chunks; None while that is not yet so."""
    tis = {r: ds.get_or_none(dep, _ti_path(run_id, "traverse", r)) for r in range(MAX_RANGES)}
    if any(
        ti is None or (ti["state"], ti["try_number"]) != ("running", 1) or not ti.get("hostname")
        for ti in tis.values()
    ):
        return None
    hosts = {r: ti["hostname"] for r, ti in tis.items()}
    assert len(set(hosts.values())) == MAX_RANGES, f"both ranges run on one worker: {hosts}"
    slowest = min(status, key=lambda s: s["done"])
    if slowest["done"] < KILL_AFTER_CHUNKS * CHUNK:
        return None
    r = int(slowest["range_id"])
    worker = next(name for name in ("w1", "w2") if cs.worker_host(name) == hosts[r])
    return r, worker


def _orphan_stops(
    ctl: StreamControl, round_id: str, range_id: int, alive: list[int]
) -> dict[str, Any]:
    """What the range's orphaned task process does after its worker's group was killed: waits
    (at most ORPHAN_WATCH_S) for it to exit by itself. -> whether it did, and the chunks the range
    committed meanwhile."""

    def chunks() -> int:
        return int(
            next(s for s in ctl.range_status(round_id) if int(s["range_id"]) == range_id)["chunks"]
        )

    before = chunks()
    procs = [psutil.Process(pid) for pid in alive if psutil.pid_exists(pid)]
    end = time.monotonic() + ORPHAN_WATCH_S
    while any(ds.alive(p) for p in procs) and time.monotonic() < end:
        time.sleep(0.05)
    return {"exited": not any(ds.alive(p) for p in procs), "committed": chunks() - before}


def _orphan_chunks(engine: sa.Engine, pid: int, killed_at: float) -> tuple[int, int]:
    """(processor calls the task process ``pid`` started after ``killed_at``, the last key it
    was handed)."""
    with engine.connect() as conn:
        after, last = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE at > to_timestamp(:t)), max(last_key) "
                "FROM celery_chunks WHERE pid = :pid"
            ),
            {"pid": pid, "t": killed_at},
        ).one()
    return int(after), int(last)


def _run_and_kill(
    dep: AirflowDeployment,
    workers: Mapping[str, subprocess.Popen[bytes]],
    engine: sa.Engine,
    ctl: StreamControl,
    run_id: str,
) -> tuple[str, Victim | None, float]:
    """Poll the run (REST) and the ranges (Redis) until the run ends; kill one worker machine
    mid-range (see ``_pick_victim``). -> (final state, victim, seconds)."""
    started = time.monotonic()
    victim: Victim | None = None
    round_id: str | None = None
    next_poll = 0.0
    while True:
        now = time.monotonic()
        if now - started > RUN_TIMEOUT_S:
            pytest.fail(
                f"DAG run {run_id} not finished after {RUN_TIMEOUT_S:.0f} s (victim: {victim})\n"
                f"{cs.diagnostics(dep, DAG_ID)}"
            )
        if now < next_poll:
            time.sleep(POLL_S)
            continue
        next_poll = now + (0.25 if victim is None else 1.0)
        dead = [
            c
            for c in dep.dead_components()
            if not (victim and c.startswith(f"worker-{victim.worker}"))
        ]
        if dead:
            pytest.fail(f"Airflow components died: {dead}\n{cs.diagnostics(dep, DAG_ID)}")
        state = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
        if state in ("success", "failed"):
            return state, victim, time.monotonic() - started
        if round_id is None:
            xcom = ds.get_or_none(dep, f"{_ti_path(run_id, 'plan')}/xcomEntries/round_id")
            round_id = xcom["value"] if xcom else None
        if round_id is None or victim is not None:
            continue
        status = ctl.range_status(round_id)
        if any(s["state"] == "complete" for s in status):
            pytest.fail(
                f"a range completed before both ran at once and one was killed: {status}; make the "
                f"ranges longer\n{cs.diagnostics(dep, DAG_ID)}"
            )
        picked = _pick_victim(dep, run_id, status)
        if picked is None:
            continue
        r, worker = picked
        pid = _task_pid(engine, r)
        ti = dep.get(_ti_path(run_id, "traverse", r))
        assert ti["pid"] == pid, (
            f"range {r}: REST shows pid {ti['pid']}, the processor ran in {pid}"
        )
        watch = functools.partial(_orphan_stops, ctl, round_id, r)
        kill = cs.kill_machine(workers[worker], worker, pid, between=watch)
        time.sleep(0.5)  # an advance the victim wrote to its socket just before dying lands first
        after = next(s for s in ctl.range_status(round_id) if int(s["range_id"]) == r)
        victim = Victim(r, worker, pid, kill, int(after["cursor"]), int(after["done"]))


# --------------------------------------------------------------------------- the figures


def _effects(engine: sa.Engine, ranges: list[dict[str, Any]]) -> dict[str, Any]:
    """What the processor's own record says about coverage and replay."""
    out: dict[str, Any] = {"outside_range": 0, "rows_in_range": {}}
    with engine.connect() as conn:
        q = lambda sql, **kw: conn.execute(sa.text(sql), kw).all()  # noqa: E731
        out["lost"] = q(
            "SELECT count(*) FROM celery_events s WHERE NOT EXISTS "
            "(SELECT 1 FROM celery_effects e WHERE e.seq = s.seq)"
        )[0][0]
        out["lost_sample"] = [
            r[0]
            for r in q(
                "SELECT seq FROM celery_events EXCEPT SELECT seq FROM celery_effects "
                "ORDER BY 1 LIMIT 10"
            )
        ]
        out["unknown"] = q(
            "SELECT count(*) FROM celery_effects e WHERE NOT EXISTS "
            "(SELECT 1 FROM celery_events s WHERE s.seq = e.seq)"
        )[0][0]
        for spec in ranges:
            lo, hi, r = (
                -1 if spec["lo"] is None else int(spec["lo"]),
                int(spec["hi"]),
                int(spec["range_id"]),
            )
            out["outside_range"] += q(
                "SELECT count(*) FROM celery_effects WHERE range_id = :r "
                "AND NOT (seq > :lo AND seq <= :hi)",
                r=r,
                lo=lo,
                hi=hi,
            )[0][0]
            out["rows_in_range"][r] = q(
                "SELECT count(*) FROM celery_events WHERE seq > :lo AND seq <= :hi", lo=lo, hi=hi
            )[0][0]
        out["replayed_keys"] = {
            int(r): int(n)
            for r, n in q(
                "SELECT range_id, count(*) FROM celery_effects WHERE processed > 1 GROUP BY range_id"
            )
        }
        out["max_processed"] = q("SELECT coalesce(max(processed), 0) FROM celery_effects")[0][0]
        out["tries"] = {
            int(r): sorted(t)
            for r, t in q(
                "SELECT range_id, array_agg(DISTINCT try_number) FROM celery_chunks GROUP BY range_id"
            )
        }
        out["workers"] = {
            (int(r), int(t)): w
            for r, t, w in q(
                "SELECT range_id, try_number, string_agg(DISTINCT worker, ',') FROM celery_chunks "
                "GROUP BY range_id, try_number"
            )
        }
        out["resumed_at"] = {
            int(r): int(m)
            for r, m in q(
                "SELECT range_id, min(first_key) FROM celery_chunks WHERE try_number = 2 GROUP BY range_id"
            )
        }
    return out


# --------------------------------------------------------------------------- the tests


def _dag_env(
    pg_url: str, pg_schema: str, redis_url: str, key_prefix: str, stream: str, max_ranges: int
) -> dict[str, str]:
    """Connections and DAG settings for every process of the deployment."""
    return {
        f"AIRFLOW_CONN_{SOURCE_CONN.upper()}": ds.postgres_conn(pg_url, pg_schema),
        f"AIRFLOW_CONN_{REDIS_CONN.upper()}": ds.redis_conn(redis_url),
        "KEYSET_CELERY_SOURCE_CONN": SOURCE_CONN,
        "KEYSET_CELERY_REDIS_CONN": REDIS_CONN,
        "KEYSET_CELERY_KEY_PREFIX": key_prefix,
        "KEYSET_CELERY_STREAM": stream,
        "KEYSET_CELERY_MAX_RANGES": str(max_ranges),
        "KEYSET_CELERY_CHUNK_SIZE": str(CHUNK),
        "KEYSET_CELERY_SLEEP_S": str(SLEEP_S),
        "KEYSET_CELERY_RETRIES": str(RETRIES),
        "KEYSET_CELERY_RETRY_DELAY_S": "3",
        "KEYSET_CELERY_BARRIER_TIMEOUT_S": str(int(RUN_TIMEOUT_S)),
    }


def test_round_survives_losing_one_of_two_celery_workers(
    celery_deployment: Callable[[Mapping[str, str], str], tuple[AirflowDeployment, dict]],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    _create_tables(pg_engine, ROWS)
    stream = f"celery-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    dep, workers = celery_deployment(
        _dag_env(pg_url, pg_schema, redis_url, key_prefix, stream, MAX_RANGES), DAG_ID
    )
    startup_s = time.monotonic() - t0
    ctl = StreamControl(CursorStore(redis_client, stream, prefix=key_prefix))
    run_id = f"celery_{uuid.uuid4().hex[:8]}"
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})

    try:
        state, victim, seconds = _run_and_kill(dep, workers, pg_engine, ctl, run_id)
    except Exception as exc:  # a failed check or call mid-run: show what Airflow was doing
        pytest.fail(f"{type(exc).__name__}: {exc}\n{cs.diagnostics(dep, DAG_ID)}")

    diagnostics = lambda: cs.diagnostics(dep, DAG_ID)  # noqa: E731
    assert state == "success", f"DAG run {run_id} ended {state}\n{diagnostics()}"
    assert victim is not None, "no worker was killed"
    survivor = next(name for name in workers if name != victim.worker)
    round_id = _xcom(dep, run_id, "plan", "round_id")
    ranges = _xcom(dep, run_id, "plan", "return_value")
    totals = _xcom(dep, run_id, "barrier", "return_value")
    tries = {r: _tries(dep, run_id, r) for r in range(len(ranges))}
    hosts = {(r, t): ti["hostname"] for r, by_try in tries.items() for t, ti in by_try.items()}
    timeouts = ds.heartbeat_timeouts(dep, DAG_ID, run_id)
    status = {int(s["range_id"]): s for s in ctl.range_status(round_id)}
    fx = _effects(pg_engine, ranges)
    broker_keys = sorted(
        k.decode() for k in redis_client.scan_iter(match=f"{key_prefix}:celery:*", count=1000)
    )
    # The dead worker's message was never acknowledged (acks_late): the broker keeps it, to deliver
    # it again after visibility_timeout.
    unacked = cs.unacked_messages(redis_client, f"{key_prefix}:celery:")

    v = victim.range_id
    detect_s = ds.since(timeouts.get((v, 1)), victim.kill.killed_at)
    retry_start_s = ds.since(tries[v].get(2, {}).get("start_date"), victim.kill.killed_at)
    replayed = {r: fx["replayed_keys"].get(r, 0) for r in range(len(ranges))}
    orphan_calls, orphan_last = _orphan_chunks(pg_engine, victim.pid, victim.kill.killed_at)
    cs.FIGURES.extend(
        [
            f"run {run_id}: {state} in {seconds:.0f} s after the trigger (deployment + 2 workers ready in "
            f"{startup_s:.0f} s); {ROWS} keys, {len(ranges)} ranges, chunk {CHUNK}, heartbeat timeout "
            f"{ds.HEARTBEAT_TIMEOUT_S} s",
            f"  hostnames (range, try) -> host: {dict(sorted(hosts.items()))}",
            f"  worker {victim.worker}'s processes: {victim.kill.names}",
            f"  killed worker {victim.worker} mid range {v}: group {victim.kill.group} SIGKILLed; outside the group "
            f"(pid -> pgid) {victim.kill.outside_group}; still alive after the group kill {victim.kill.survived_group_kill}"
            f"; the orphan started {orphan_calls} processor call(s) after the kill, was handed keys up to "
            f"{orphan_last} and stopped by itself ({victim.kill.observed}); committed cursor "
            f"{victim.cursor} (done {victim.done})",
            f"  heartbeat timeout found {detect_s:.1f} s after the kill; try 2 started {retry_start_s:.1f} s after it on "
            f"{hosts.get((v, 2))}, resumed at key {fx['resumed_at'].get(v)}; takeovers {status[v]['takeovers']}",
            f"  keys processed twice per range {replayed} (chunk {CHUNK}); max deliveries of one key "
            f"{fx['max_processed']}; keys lost {fx['lost']}; outside their range {fx['outside_range']}",
            f"  barrier totals done {totals['done']} skipped {totals['skipped']} dead {totals['dead']}; broker keys "
            f"{[k.removeprefix(key_prefix + ':celery:') for k in broker_keys]} under {key_prefix}:celery:, "
            f"unacked messages left {unacked}",
            f"  deliveries (worker, task, ignored): {[(d.worker, d.task, d.ignored) for d in cs.deliveries(dep, list(workers))]}",
        ]
    )
    print("\n".join(cs.FIGURES))

    # Both workers ran traverse tries; the retry of the killed range ran on the survivor.
    assert {hosts[(r, 1)] for r in range(len(ranges))} == {cs.worker_host(n) for n in workers}, (
        hosts
    )
    assert hosts[(v, 1)] == cs.worker_host(victim.worker)
    assert hosts.get((v, 2)) == cs.worker_host(survivor), hosts
    assert fx["workers"][(v, 2)] == cs.worker_host(survivor), fx["workers"]
    # The task process is not in the worker's process group: only a whole-machine kill stops it.
    assert victim.pid in victim.kill.outside_group and victim.pid not in victim.kill.group, (
        victim.kill
    )
    # Orphaned by the group kill, the task process stopped by itself within one chunk: at most
    # one processor call started after the kill, everything it was handed is committed.
    assert victim.kill.observed["exited"], (
        f"the orphaned task process did not stop within {ORPHAN_WATCH_S} s: {victim.kill}"
    )
    assert orphan_calls <= 1, f"{orphan_calls} processor calls started after the kill"
    assert orphan_last == victim.cursor, (orphan_last, victim.cursor)
    assert replayed[v] == 0, replayed
    # Airflow found the dead worker by heartbeat and retried the range once; the other ran once.
    assert (v, 1) in timeouts, (
        f"the scheduler never timed out the dead worker's try\n{diagnostics()}"
    )
    for r, by_try in tries.items():
        want = 2 if r == v else 1
        final = by_try[max(by_try)]
        assert (max(by_try), final["state"]) == (want, "success"), (
            r,
            {t: ti["state"] for t, ti in by_try.items()},
        )
    # The retry took the range over and resumed from the committed cursor.
    assert status[v]["takeovers"] >= 1 or fx["resumed_at"][v] == victim.cursor + 1, status[v]
    assert fx["resumed_at"][v] == victim.cursor + 1, (fx["resumed_at"], victim.cursor)
    lo = ranges[v]["lo"] or 0
    assert victim.done == victim.cursor - lo, (
        f"counter {victim.done} at cursor {victim.cursor} (lo {lo})"
    )
    # Coverage: every key of (start, end] at least once, none outside its range.
    assert fx["lost"] == 0, f"{fx['lost']} key(s) never processed, e.g. {fx['lost_sample']}"
    assert (fx["unknown"], fx["outside_range"]) == (0, 0), fx
    # Replay: at most one chunk, only where a worker died.
    assert replayed[v] <= CHUNK, replayed
    assert all(n == 0 for r, n in replayed.items() if r != v), replayed
    assert fx["max_processed"] <= 2, fx["max_processed"]
    # The round is closed, counted exactly.
    assert ctl.round(round_id).state == "closed"
    assert int(totals["done"]) + int(totals["skipped"]) + int(totals["dead"]) == ROWS, totals
    assert (totals["done"], totals["skipped"], totals["dead"]) == (ROWS, 0, 0), totals
    for r, s in status.items():
        assert (s["state"], s["done"]) == ("complete", fx["rows_in_range"][r]), (r, s)
    # The broker lived under the test's own prefix.
    assert broker_keys, f"no broker key under {key_prefix}:celery: (global_keyprefix not applied?)"
    # The dead try's message was never acknowledged: the broker holds it for redelivery.
    assert f"traverse[{v}] try 1" in unacked, unacked


REDELIVERY_ROWS = 2400  # one range of 120 chunks: runs about twice VISIBILITY_TIMEOUT_S
VISIBILITY_TIMEOUT_S = 10


def test_traverse_running_past_visibility_timeout_is_redelivered_and_ignored(
    celery_deployment: Callable[[Mapping[str, str], str], tuple[AirflowDeployment, dict]],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """A traverse try that runs longer than the broker's ``visibility_timeout`` is delivered again.

    Scenario: ``[celery_broker_transport_options] visibility_timeout`` is ``VISIBILITY_TIMEOUT_S``
    (kombu checks for overdue messages every second: ``unacked_restore_interval`` 1,
    ``unacked_restore_throttle`` 1); the round has one range that runs about twice as long. While
    one worker runs it, Redis hands its message to the other, idle worker. Checked: the duplicate
    reaches that worker (same Celery task id), Airflow refuses to start the running task instance
    again and the worker ignores the message (its log says so); the original try goes on
    undisturbed and succeeds on try 1; every key is processed exactly once, by one process; the
    round closes exactly. (Under load the plan task may be delivered twice as well: whichever
    delivery starts it first runs it, the other is ignored; that is reported, not asserted.)
    """
    _create_tables(pg_engine, REDELIVERY_ROWS)
    stream = f"celery-{uuid.uuid4().hex[:8]}"
    env = _dag_env(pg_url, pg_schema, redis_url, key_prefix, stream, 1)
    env.update(
        {
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": str(
                VISIBILITY_TIMEOUT_S
            ),
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__UNACKED_RESTORE_INTERVAL": "1",
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__UNACKED_RESTORE_THROTTLE": "1",
        }
    )
    dep, workers = celery_deployment(env, DAG_ID)
    ctl = StreamControl(CursorStore(redis_client, stream, prefix=key_prefix))
    run_id = f"celery_{uuid.uuid4().hex[:8]}"
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
    started = time.monotonic()
    state = "queued"
    while state not in ("success", "failed"):
        if time.monotonic() - started > RUN_TIMEOUT_S or dep.dead_components():
            pytest.fail(
                f"DAG run {run_id}: {state} after {time.monotonic() - started:.0f} s, dead components "
                f"{dep.dead_components()}\n{cs.diagnostics(dep, DAG_ID)}"
            )
        time.sleep(1)
        state = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
    seconds = time.monotonic() - started

    diagnostics = lambda: cs.diagnostics(dep, DAG_ID)  # noqa: E731
    assert state == "success", f"DAG run {run_id} ended {state}\n{diagnostics()}"
    round_id = _xcom(dep, run_id, "plan", "round_id")
    ranges = _xcom(dep, run_id, "plan", "return_value")
    totals = _xcom(dep, run_id, "barrier", "return_value")
    tries = _tries(dep, run_id, 0)
    ti = tries[max(tries)]
    runner = next(name for name in workers if cs.worker_host(name) == ti["hostname"])
    seen = cs.deliveries(dep, list(workers))
    traverse = [d for d in seen if d.task == "traverse[0] try 1"]
    refused = sum(
        1
        for line in (dep.home / "api-server.out").read_text(errors="replace").splitlines()
        if "Cannot start Task Instance in invalid state" in line
        and "previous_state=running" in line
    )
    fx = _effects(pg_engine, ranges)
    with pg_engine.connect() as conn:
        pids = conn.execute(sa.text("SELECT DISTINCT pid FROM celery_chunks")).scalars().all()
    cs.FIGURES.extend(
        [
            f"run {run_id}: {state} in {seconds:.0f} s; 1 range of {REDELIVERY_ROWS} keys, chunk {CHUNK}, "
            f"visibility_timeout {VISIBILITY_TIMEOUT_S} s; traverse ran {float(ti.get('duration') or 0):.0f} s on "
            f"{ti['hostname']} (try {ti['try_number']}, {len(pids)} task process)",
            f"  starts refused by the Execution API (409, running) {refused}; deliveries (worker, task, ignored) "
            f"{[(d.worker, d.task, d.ignored) for d in seen]}; keys processed twice {sum(fx['replayed_keys'].values())};"
            f" keys lost {fx['lost']}; barrier totals done {totals['done']} skipped {totals['skipped']} dead "
            f"{totals['dead']}",
        ]
    )
    print("\n".join(cs.FIGURES[-2:]))

    assert len(ranges) == 1, ranges
    assert float(ti["duration"]) > VISIBILITY_TIMEOUT_S, (
        f"the range ran only {ti['duration']} s; make it longer"
    )
    # The duplicate reached the idle worker and was ignored there; the try was not disturbed.
    assert [d.worker for d in traverse if not d.ignored] == [runner], traverse
    assert any(d.ignored and d.worker != runner for d in traverse), (
        f"the traverse message was not delivered again to the idle worker: {traverse}\n{diagnostics()}"
    )
    assert len({d.celery_id for d in traverse}) == 1, traverse
    assert refused >= 1, f"the Execution API never refused a second start\n{diagnostics()}"
    assert (list(tries), ti["state"]) == ([1], "success"), {t: x["state"] for t, x in tries.items()}
    assert len(pids) == 1, f"the range ran in {len(pids)} task processes: {pids}"
    # Exactly once: no key lost, none twice, the round closed with exact counters.
    assert (fx["lost"], fx["unknown"], fx["outside_range"], fx["max_processed"]) == (0, 0, 0, 1), fx
    assert ctl.round(round_id).state == "closed"
    assert (totals["done"], totals["skipped"], totals["dead"]) == (REDELIVERY_ROWS, 0, 0), totals
