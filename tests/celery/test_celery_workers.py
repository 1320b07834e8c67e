"""Scale-out on Celery: a worker lost mid-round in pull mode, and a message redelivered past
visibility_timeout.

``test_round_survives_losing_one_of_two_celery_workers`` (below) kills a worker machine;
``test_traverse_running_past_visibility_timeout_is_redelivered_and_ignored`` (at the end) lets
Redis deliver a running try's message a second time. Both run a fresh deployment.

A real CeleryExecutor deployment (``conftest.py``/``celery_support.py``: API server, scheduler, DAG
processor, triggerer, two ``airflow celery worker`` processes ``w1``/``w2``, Redis broker under the
test's key prefix, result backend and metadata in a throwaway PostgreSQL database) runs
``dags/keyset_celery_kill.py``. The processor (``dags/keyset_celery_effects.py``, given to the
operator as ``"module:function"``) counts every delivery of every key, logs every chunk (range,
task map index and try, process, worker) and sleeps per chunk.

The kill test runs the DAG in **pull mode**: ``ROWS`` keys planned into ``MAX_RANGES`` ranges of
``ROWS / MAX_RANGES / CHUNK`` chunks, ``max_tasks=MAX_TASKS`` traverse tasks, each worker with
concurrency ``CONCURRENCY`` so all four run at once, two on each worker; every task works through
the round (its first claim coalesces its share of the ranges, then it claims the next unclaimed
range, rescues ranges without a live owner, asks stragglers to split). The keys above ``ROWS - SLOW_KEYS`` (the last planned range, claimed last) are slow to
process (``SLOW_SLEEP_S`` per chunk): when nothing is left to claim, the idle tasks ask that range
to split.

Scenario: once every task runs try 1 and has processed at least ``KILL_AFTER_KEYS`` keys, the
worker of the task that has processed the fewest keys "fails" in two steps: SIGKILL of the worker's
process group (Celery's main process, its pool processes and the tasks' supervisors), then of its
task processes. Airflow 3.3 runs each task process in a process group of its own, so the group kill
alone leaves them running, orphaned: the test checks that each notices its supervisor's death and
stops by itself within one chunk (``core/run/supervision.py``: at most one processor call starts after
the kill, every chunk it processed is committed, it releases its range and exits; the test waits at
most ``ORPHAN_WATCH_S``), then kills whatever is left as the machine failure would. The surviving
tasks go on pulling and rescue the released ranges from their committed cursors; nobody reports the
death, the scheduler finds the dead tries without heartbeat after ``[scheduler]
task_instance_heartbeat_timeout`` and schedules try 2 of each (``retries`` in ``.partial()``), which
only the surviving worker can run, once a slot is free.

Guarantees checked (figures in the terminal summary): the plan returned ``MAX_TASKS`` dicts for
``MAX_RANGES`` ranges; the tasks ran on both workers, each try 1 over a coalesced share of the
round (several planned ranges), the retries on
the survivor; the orphans stopped within one chunk, and the range each held was finished by another
process from its last key + 1; the straggler was split (the round ends with more ranges than
planned, and a task reports the split it won); every key of ``(start, end]`` was processed, none
outside its range, none twice; the barrier closed the round with done + skipped + dead = ``ROWS``;
the broker's keys lay under the test's prefix, among them the dead tries' unacknowledged messages.
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
from airflow_keyset_provider.core.store.cursor_store import CursorStore

DAG_ID = "keyset_celery_kill"
ROWS = 6400
MAX_RANGES = 64  # 100 keys, 5 chunks each
MAX_TASKS = 4
CONCURRENCY = 2  # per worker: the four pull tasks run at once, two on each worker
CHUNK = 20
SLEEP_S = 0.15
SLOW_KEYS = 100  # the keys above ROWS - SLOW_KEYS (the last range) take SLOW_SLEEP_S per chunk
SLOW_SLEEP_S = 2.0
KILL_AFTER_KEYS = 200  # every task has processed this many keys (2 planned ranges) before the kill
RETRIES = 2
RUN_TIMEOUT_S = 180.0  # from the trigger to a finished run
POLL_S = 0.1
ORPHAN_WATCH_S = 20.0  # how long the orphaned task processes may run before the "machine" is gone
SOURCE_CONN, REDIS_CONN = "keyset_celery_db", "keyset_celery_redis"
WORKER_NAMES = ("w1", "w2")

AirflowDeployment = ds.AirflowDeployment


@dataclass
class Victim:
    worker: str
    tasks: dict[int, int]  # map index -> its task process (it ran the processor)
    kill: cs.MachineKill
    cursors: dict[int, str]  # range -> its committed cursor once every killed process is gone


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
            "CREATE TABLE celery_chunks (range_id int NOT NULL, map_index int NOT NULL, "
            "try_number int NOT NULL, pid int NOT NULL, ppid int NOT NULL, worker text NOT NULL, "
            "first_key bigint NOT NULL, last_key bigint NOT NULL, n int NOT NULL, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        conn.exec_driver_sql("ANALYZE celery_events")


def _rows(engine: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


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


def _progress(engine: sa.Engine) -> dict[int, tuple[int, int, int]]:
    """map index -> (ranges, keys, task process) of its try 1 so far, by the processor's log."""
    rows = _rows(
        engine,
        "SELECT map_index, count(DISTINCT range_id), sum(n), min(pid), max(pid) "
        "FROM celery_chunks WHERE try_number = 1 GROUP BY map_index",
    )
    for mi, _, _, lo, hi in rows:
        assert lo == hi, f"traverse[{mi}] try 1 ran in two processes: {lo}, {hi}"
    return {int(mi): (int(r), int(n), int(pid)) for mi, r, n, pid, _ in rows}


def _pick_victim(
    dep: AirflowDeployment, engine: sa.Engine, run_id: str
) -> tuple[str, dict[int, int]] | None:
    """(worker, {map index: task pid} of its tasks) to kill once every task runs try 1 and has
    processed KILL_AFTER_KEYS keys: the worker of the task that processed the fewest keys.
    None while that is not yet so."""
    tis = {mi: ds.get_or_none(dep, _ti_path(run_id, "traverse", mi)) for mi in range(MAX_TASKS)}
    if any(
        ti is None or (ti["state"], ti["try_number"]) != ("running", 1) or not ti.get("hostname")
        for ti in tis.values()
    ):
        return None
    progress = _progress(engine)
    if any(progress.get(mi, (0, 0, 0))[1] < KILL_AFTER_KEYS for mi in range(MAX_TASKS)):
        return None
    hosts = {mi: ti["hostname"] for mi, ti in tis.items()}
    assert set(hosts.values()) == {cs.worker_host(w) for w in WORKER_NAMES}, (
        f"the tasks do not run on both workers: {hosts}"
    )
    slowest = min(range(MAX_TASKS), key=lambda mi: progress[mi][1])
    worker = next(w for w in WORKER_NAMES if cs.worker_host(w) == hosts[slowest])
    tasks = {mi: progress[mi][2] for mi, host in hosts.items() if host == hosts[slowest]}
    for mi, pid in tasks.items():
        assert tis[mi]["pid"] == pid, (
            f"traverse[{mi}]: REST shows pid {tis[mi]['pid']}, the processor ran in {pid}"
        )
    return worker, tasks


def _orphans_stop(alive: list[int]) -> dict[str, Any]:
    """Waits (at most ORPHAN_WATCH_S) for the orphaned task processes, left running by the group
    kill, to exit by themselves. -> whether they did, and how long it took."""
    procs = [psutil.Process(pid) for pid in alive if psutil.pid_exists(pid)]
    start = time.monotonic()
    while any(ds.alive(p) for p in procs) and time.monotonic() < start + ORPHAN_WATCH_S:
        time.sleep(0.05)
    return {
        "exited": not any(ds.alive(p) for p in procs),
        "seconds": round(time.monotonic() - start, 1),
    }


def _run_and_kill(
    dep: AirflowDeployment,
    workers: Mapping[str, subprocess.Popen[bytes]],
    engine: sa.Engine,
    ctl: StreamControl,
    run_id: str,
) -> tuple[str, Victim | None, float]:
    """Poll the run (REST) and the processor's log until the run ends; kill one worker machine
    mid-round (see ``_pick_victim``). -> (final state, victim, seconds)."""
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
        if all(s["state"] == "complete" for s in status):
            pytest.fail(
                f"the round completed before every task processed {KILL_AFTER_KEYS} keys and a "
                f"worker was killed; make the round longer\n{cs.diagnostics(dep, DAG_ID)}"
            )
        picked = _pick_victim(dep, engine, run_id)
        if picked is None:
            continue
        worker, tasks = picked
        kill = cs.kill_machine(workers[worker], worker, min(tasks.values()), between=_orphans_stop)
        time.sleep(0.5)  # an advance a victim wrote to its socket just before dying lands first
        cursors = {int(s["range_id"]): str(s["cursor"]) for s in ctl.range_status(round_id)}
        victim = Victim(worker, tasks, kill, cursors)


# --------------------------------------------------------------------------- the figures


def _effects(engine: sa.Engine, ranges: list[dict[str, Any]]) -> dict[str, Any]:
    """What the processor's own record says about coverage and replay; ``ranges``: dicts with
    ``range_id``, ``lo``, ``hi`` (the round's final ranges)."""
    with engine.connect() as conn:
        q = lambda sql, **kw: conn.execute(sa.text(sql), kw).all()  # noqa: E731
        out = ds.effects_coverage(conn, "celery_events", "celery_effects", ranges)
        out["replayed_keys"] = {
            int(r): int(n)
            for r, n in q(
                "SELECT range_id, count(*) FROM celery_effects WHERE processed > 1 GROUP BY range_id"
            )
        }
        out["max_processed"] = q("SELECT coalesce(max(processed), 0) FROM celery_effects")[0][0]
    return out


@dataclass
class Orphan:
    """What one killed task process did, by the processor's log."""

    map_index: int
    pid: int
    calls_after_kill: int  # processor calls it started after the group kill
    range_id: int  # the range of its last chunk
    last_key: int  # the last key it was handed
    resumed_at: int | None  # the first key another process was handed in that range
    resumed_by: str | None  # that process's task, ``traverse[<map index>] try <n>``


def _orphan(engine: sa.Engine, map_index: int, pid: int, killed_at: float) -> Orphan:
    after, range_id, last = _rows(
        engine,
        "SELECT count(*) FILTER (WHERE at > to_timestamp(:t)), "
        "(array_agg(range_id ORDER BY at DESC))[1], (array_agg(last_key ORDER BY at DESC))[1] "
        "FROM celery_chunks WHERE pid = :pid",
        pid=pid,
        t=killed_at,
    )[0]
    nxt = _rows(
        engine,
        "SELECT first_key, map_index, try_number FROM celery_chunks "
        "WHERE range_id = :r AND pid <> :pid ORDER BY first_key LIMIT 1",
        r=range_id,
        pid=pid,
    )
    resumed_at, by = (
        (int(nxt[0][0]), f"traverse[{nxt[0][1]}] try {nxt[0][2]}") if nxt else (None, None)
    )
    return Orphan(map_index, pid, int(after), int(range_id), int(last), resumed_at, by)


def _per_task(engine: sa.Engine) -> dict[tuple[int, int], dict[str, Any]]:
    """(map index, try) -> ranges (distinct, in order of first chunk), keys and workers, by the
    processor's log."""
    rows = _rows(
        engine,
        "SELECT map_index, try_number, array_agg(range_id ORDER BY at), sum(n), "
        "string_agg(DISTINCT worker, ',') FROM celery_chunks GROUP BY map_index, try_number",
    )
    return {
        (int(mi), int(t)): {"ranges": list(dict.fromkeys(rs)), "keys": int(n), "worker": w}
        for mi, t, rs, n, w in rows
    }


def _start_offsets(tries: Mapping[int, Mapping[int, Mapping[str, Any]]]) -> dict[int, float]:
    """map index -> seconds from the first try 1 start to this task's try 1 start."""
    starts = {mi: by_try[1].get("start_date") for mi, by_try in tries.items() if 1 in by_try}
    first = min((ds.since(iso, 0) for iso in starts.values() if iso), default=0.0)
    return {mi: round(ds.since(iso, first), 1) for mi, iso in sorted(starts.items())}


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


def _pull_env() -> dict[str, str]:
    """Pull mode over two workers of CONCURRENCY slots each, and the straggler."""
    return {
        "KEYSET_CELERY_MAX_TASKS": str(MAX_TASKS),
        "KEYSET_CELERY_SLOW_ABOVE": str(ROWS - SLOW_KEYS),
        "KEYSET_CELERY_SLOW_SLEEP_S": str(SLOW_SLEEP_S),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(CONCURRENCY),
        "AIRFLOW__CORE__PARALLELISM": str(2 * MAX_TASKS),
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
    env = _dag_env(pg_url, pg_schema, redis_url, key_prefix, stream, MAX_RANGES) | _pull_env()
    dep, workers = celery_deployment(env, DAG_ID)
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
    survivors = sorted(set(range(MAX_TASKS)) - set(victim.tasks))
    round_id = _xcom(dep, run_id, "plan", "round_id")
    planned = int(_xcom(dep, run_id, "plan", "keyset_round")["ranges"])
    task_dicts = _xcom(dep, run_id, "plan", "return_value")
    totals = _xcom(dep, run_id, "barrier", "return_value")
    tries = {mi: _tries(dep, run_id, mi) for mi in range(len(task_dicts))}
    results = {mi: _xcom(dep, run_id, "traverse", "return_value", mi) for mi in tries}
    hosts = {(mi, t): ti["hostname"] for mi, by_try in tries.items() for t, ti in by_try.items()}
    timeouts = ds.heartbeat_timeouts(dep, DAG_ID, run_id)
    status = {int(s["range_id"]): s for s in ctl.range_status(round_id)}
    fx = _effects(pg_engine, [{"range_id": r, "lo": s.lo, "hi": s.hi} for r, s in status.items()])
    per_task = _per_task(pg_engine)
    killed_at = victim.kill.killed_at
    orphans = [_orphan(pg_engine, mi, pid, killed_at) for mi, pid in sorted(victim.tasks.items())]
    broker_keys = sorted(
        k.decode() for k in redis_client.scan_iter(match=f"{key_prefix}:celery:*", count=1000)
    )
    # The dead workers' messages were never acknowledged (acks_late): the broker keeps them, to
    # deliver them again after visibility_timeout.
    unacked = cs.unacked_messages(redis_client, f"{key_prefix}:celery:")
    replayed = sum(fx["replayed_keys"].values())
    splits_won = sum(int(res["splits_won"]) for res in results.values())
    slow_ranges = sorted(  # ranges holding slow keys (not those coalesced away, empty)
        r for r, s in status.items() if int(s.hi) > ROWS - SLOW_KEYS and s.merged_into is None
    )
    cs.FIGURES.extend(
        [
            f"run {run_id}: {state} in {seconds:.0f} s after the trigger (deployment + 2 workers ready in "
            f"{startup_s:.0f} s); {ROWS} keys, {planned} ranges planned over {len(task_dicts)} pull tasks "
            f"(concurrency {CONCURRENCY} per worker), {len(status)} ranges at the end, chunk {CHUNK}, "
            f"heartbeat timeout {ds.HEARTBEAT_TIMEOUT_S} s",
            f"  hostnames (task, try) -> host: {dict(sorted(hosts.items()))}; try 1 started "
            f"(s after the first) {_start_offsets(tries)}",
            "  per task and try: ranges run / keys: "
            + ", ".join(
                f"traverse[{mi}] try {t} {len(x['ranges'])}/{x['keys']}"
                for (mi, t), x in sorted(per_task.items())
            ),
            "  task results (ranges, splits asked/won): "
            + ", ".join(
                f"[{mi}] {len(res['ranges'])}, {res['splits_asked']}/{res['splits_won']}"
                for mi, res in sorted(results.items())
            )
            + f"; the slow keys ended in ranges {slow_ranges}",
            f"  killed worker {victim.worker} (tasks {sorted(victim.tasks)}): group {victim.kill.group} "
            f"SIGKILLed; outside the group (pid -> pgid) {victim.kill.outside_group}; the orphans "
            f"{victim.kill.observed}",
            "  orphans (task, calls after the kill, range, last key, resumed at, by): "
            + "; ".join(
                f"[{o.map_index}] {o.calls_after_kill}, {o.range_id}, {o.last_key}, {o.resumed_at}, "
                f"{o.resumed_by}"
                for o in orphans
            ),
            "  heartbeat timeouts / try 2 starts after the kill: "
            + ", ".join(
                f"[{mi}] {ds.since(timeouts.get((mi, 1)), killed_at):.1f} s / "
                f"{ds.since(tries[mi].get(2, {}).get('start_date'), killed_at):.1f} s"
                for mi in sorted(victim.tasks)
            ),
            f"  keys processed twice {replayed} (chunk {CHUNK}); max deliveries of one key "
            f"{fx['max_processed']}; keys lost {fx['lost']}; outside their range {fx['outside_range']}",
            f"  barrier totals done {totals['done']} skipped {totals['skipped']} dead {totals['dead']}; broker keys "
            f"{[k.removeprefix(key_prefix + ':celery:') for k in broker_keys]} under {key_prefix}:celery:, "
            f"unacked messages left {unacked}",
        ]
    )
    print("\n".join(cs.FIGURES))

    # Pull mode: many more ranges than tasks, each task's try 1 through a coalesced share of them.
    assert planned == MAX_RANGES and len(task_dicts) == MAX_TASKS < planned, (planned, task_dicts)
    assert all(d["pull"] for d in task_dicts), task_dicts
    for mi in tries:
        assert per_task[(mi, 1)]["keys"] >= KILL_AFTER_KEYS, per_task
    for mi, res in results.items():
        assert res["mode"] == "pull", res
        final = (mi, max(tries[mi]))
        assert set(per_task.get(final, {"ranges": []})["ranges"]) <= set(res["ranges"]), (
            mi,
            res,
            per_task.get(final),
        )
    # Both workers ran pull tasks; the retries of the killed worker's tasks ran on the survivor.
    assert {hosts[(mi, 1)] for mi in tries} == {cs.worker_host(n) for n in workers}, hosts
    for mi in victim.tasks:
        assert hosts[(mi, 1)] == cs.worker_host(victim.worker), hosts
        assert hosts.get((mi, 2)) == cs.worker_host(survivor), hosts
    # The task processes are not in the worker's process group: only a machine kill stops them.
    for pid in victim.tasks.values():
        assert pid in victim.kill.outside_group and pid not in victim.kill.group, victim.kill
    # Orphaned by the group kill, each task process stopped by itself within one chunk: at most
    # one processor call started after the kill; the range it held was finished by another process
    # from its last key + 1 (it committed everything it was handed), or by itself to its end.
    # A surviving task's try 1 rescued it: the round did not wait for the heartbeat timeout.
    assert victim.kill.observed["exited"], (
        f"the orphaned task processes did not stop within {ORPHAN_WATCH_S} s: {victim.kill}"
    )
    for o in orphans:
        assert o.calls_after_kill <= 1, o
        if o.resumed_at is None:
            assert o.last_key == int(status[o.range_id].hi), (o, status[o.range_id])
        else:
            assert o.resumed_at == o.last_key + 1, (o, victim.cursors.get(o.range_id))
            assert o.resumed_by in {f"traverse[{mi}] try 1" for mi in survivors}, o
    # Airflow found the dead workers' tries by heartbeat and retried each once; the others ran once.
    for mi, by_try in tries.items():
        if mi in victim.tasks:  # try 2 ran once the survivors had finished everything
            assert (mi, 1) in timeouts, f"no heartbeat timeout of traverse[{mi}]\n{diagnostics()}"
            assert (mi, 2) not in per_task, per_task
        want = 2 if mi in victim.tasks else 1
        final = by_try[max(by_try)]
        assert (max(by_try), final["state"]) == (want, "success"), (
            mi,
            {t: ti["state"] for t, ti in by_try.items()},
        )
    # The straggler (the last range, slow keys) was split for an idle task: more ranges at the end
    # than planned, and the last key lies in a range split off.
    assert len(status) > planned and splits_won >= 1, (len(status), planned, results)
    assert max(slow_ranges) >= planned, slow_ranges
    # Coverage: every key of (start, end] at least once, none outside its range.
    assert fx["lost"] == 0, f"{fx['lost']} key(s) never processed, e.g. {fx['lost_sample']}"
    assert (fx["unknown"], fx["outside_range"]) == (0, 0), fx
    # Replay: none (the orphans committed what they processed); the contract bound is one chunk
    # per range per crash.
    assert all(n <= CHUNK for n in fx["replayed_keys"].values()), fx["replayed_keys"]
    assert (replayed, fx["max_processed"]) == (0, 1), fx["replayed_keys"]
    # The round is closed, counted exactly.
    assert ctl.round(round_id).state == "closed"
    assert (totals["done"], totals["skipped"], totals["dead"]) == (ROWS, 0, 0), totals
    for r, s in status.items():
        assert (s["state"], s["done"]) == ("complete", fx["rows_in_range"][r]), (r, s)
    # The broker lived under the test's own prefix.
    assert broker_keys, f"no broker key under {key_prefix}:celery: (global_keyprefix not applied?)"
    # The dead tries' messages were never acknowledged: the broker holds them for redelivery.
    for mi in victim.tasks:
        assert f"traverse[{mi}] try 1" in unacked, unacked


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
