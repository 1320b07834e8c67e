"""The scale round under a real scheduler: ``python -m benchmarks.scale airflow --rows N``.

A real deployment (``tests/deployment_support.start_deployment``: LocalExecutor scheduler, DAG
processor, triggerer, API server on loopback, a throwaway PostgreSQL metadata database, dropped at
the end) runs the DAG shape of the scale round over ``kbench_scale_<N>.big``: ``plan``
(``PlanRangesOperator(max_ranges=4096, max_tasks=16)``), ``traverse`` (16 mapped pull tasks,
no-op processor) and ``barrier`` (a deferrable ``BarrierSensor`` that depends on ``plan`` only, so
it waits in the triggerer). Its makespan (the DAG run's start to end, from the REST API) is set
against the engine alone over the same round in the same run (``round.engine_round``: plan + 16
pull processes), and the run's task instances' timestamps say where the rest goes.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import procs
from benchmarks.context import BenchContext
from benchmarks.scale import round as sr
from benchmarks.scale.data import ensure_big, key_of

DAG_ID = "kbench_scale_round"
RUN_TIMEOUT_S = 1800
DAG_SOURCE = textwrap.dedent('''\
    """The scale round's DAG (written by benchmarks/scale/airflow_round.py)."""

    import datetime as dt
    import os

    from airflow.sdk import DAG

    from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator


    def noop(chunk):
        return None


    env = os.environ
    with DAG(dag_id="kbench_scale_round", schedule=None, catchup=False,
             start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC)) as dag:
        plan = PlanRangesOperator(
            task_id="plan", source_conn_id="kbench_scale_db", redis_conn_id="kbench_scale_redis",
            table="big", key="id", stream=env["KBENCH_SCALE_STREAM"],
            key_prefix=env["KBENCH_SCALE_PREFIX"], start_key=0, end_key=int(env["KBENCH_SCALE_END"]),
            max_ranges=int(env["KBENCH_SCALE_RANGES"]), max_tasks=int(env["KBENCH_SCALE_TASKS"]),
        )
        traverse = TraverseRangeOperator.partial(
            task_id="traverse", processor=noop, redis_conn_id="kbench_scale_redis",
            chunk_size=int(env["KBENCH_SCALE_CHUNK"]), retries=int(env["KBENCH_SCALE_RETRIES"]),
            retry_delay=dt.timedelta(seconds=1),
        ).expand_kwargs(plan.output)
        barrier = BarrierSensor(
            task_id="barrier", plan_task_id="plan", redis_conn_id="kbench_scale_redis",
            deferrable=True, poke_interval=float(env["KBENCH_SCALE_POKE_S"]), timeout=3600,
        )
        plan >> [traverse, barrier]
''')


def _ds() -> Any:
    sys.path.insert(0, str(procs.ROOT / "tests"))
    import deployment_support

    return deployment_support


def _ts(iso: str | None) -> float | None:
    return dt.datetime.fromisoformat(iso).timestamp() if iso else None


def breakdown(run: dict[str, Any], tis: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the makespan goes, from the DAG run's and task instances' REST timestamps."""
    t0, t1 = _ts(run["start_date"]), _ts(run["end_date"])
    assert t0 is not None and t1 is not None
    plan = next(t for t in tis if t["task_id"] == "plan")
    trav = [t for t in tis if t["task_id"] == "traverse"]
    barrier = next(t for t in tis if t["task_id"] == "barrier")

    def rel(ti: dict[str, Any], field: str) -> float | None:
        v = _ts(ti.get(field))
        return None if v is None else round(v - t0, 3)

    starts = [_ts(t["start_date"]) or t0 for t in trav]
    ends = [_ts(t["end_date"]) or t1 for t in trav]
    queued = [_ts(t.get("queued_when")) or s for t, s in zip(trav, starts, strict=True)]
    return {
        "makespan_s": round(t1 - t0, 3),
        "plan": {f: rel(plan, f) for f in ("queued_when", "start_date", "end_date")},
        "plan_duration_s": plan.get("duration"),
        "traverse_first_start_s": round(min(starts) - t0, 3),
        "traverse_last_start_s": round(max(starts) - t0, 3),
        "traverse_last_end_s": round(max(ends) - t0, 3),
        "traverse_queue_wait_s": [round(s - q, 3) for s, q in zip(starts, queued, strict=True)],
        "traverse_durations_s": sorted(round(e - s, 3) for s, e in zip(starts, ends, strict=True)),
        "barrier": {f: rel(barrier, f) for f in ("queued_when", "start_date", "end_date")},
        "barrier_after_last_traverse_s": round((_ts(barrier["end_date"]) or t1) - max(ends), 3),
        "run_end_after_barrier_s": round(t1 - (_ts(barrier["end_date"]) or t1), 3),
    }


def _env(
    ctx: BenchContext, schema: str, rows: int, stream: str, parallelism: int, tasks: int
) -> dict[str, str]:
    ds = _ds()
    return {
        "AIRFLOW_CONN_KBENCH_SCALE_DB": ds.postgres_conn(ctx.pg_url, schema),
        "AIRFLOW_CONN_KBENCH_SCALE_REDIS": ds.redis_conn(ctx.redis_url),
        "AIRFLOW__CORE__PARALLELISM": str(parallelism),
        "AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG": str(parallelism),
        "KBENCH_SCALE_STREAM": stream,
        "KBENCH_SCALE_PREFIX": ctx.prefix,
        "KBENCH_SCALE_END": str(key_of(rows)),
        "KBENCH_SCALE_RANGES": str(sr.MANY),
        "KBENCH_SCALE_TASKS": str(tasks),
        "KBENCH_SCALE_CHUNK": str(ctx.chunk_size),
        "KBENCH_SCALE_POKE_S": "1",
        "KBENCH_SCALE_RETRIES": "1",  # a task that met a full server (too many clients) retries
    }


def _task_logs(home: Path, run_id: str, task_ids: tuple[str, ...]) -> dict[str, list[str]]:
    """The task processes' own log lines (timestamped) of ``task_ids``' first tries in DAG run
    ``run_id``: where a task's time goes between its process start and its end."""
    out: dict[str, list[str]] = {}
    for path in sorted((home / "logs").rglob("*.log")):
        for task_id in task_ids:
            where = str(path)
            if f"run_id={run_id}" in where and f"task_id={task_id}" in where and task_id not in out:
                out[task_id] = path.read_text(errors="replace").splitlines()[:400]
    return out


def _wait_run(dep: Any, run_id: str) -> dict[str, Any]:
    end = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < end:
        run: dict[str, Any] = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}")
        if run["state"] in ("success", "failed"):
            return run
        time.sleep(1)
    raise RuntimeError(f"DAG run {run_id} did not end in {RUN_TIMEOUT_S} s")


def measure(
    ctx: BenchContext,
    rows: int,
    parallelism: int,
    metadata: str = "postgres",
    tasks: int = sr.TASKS,
    runs: int = 1,
) -> dict[str, Any]:
    """Engine alone, then the DAG run on a fresh deployment; both figures and the breakdown.

    ``tasks``: the plan's ``max_tasks`` (the mapped pull tasks; the engine alone always runs
    ``sr.TASKS`` processes). ``runs``: DAG runs one after the other on the same deployment, each
    after its own engine-alone round (the first pays the deployment's cold start, the later ones
    show a warm deployment). ``metadata``: ``postgres`` (a throwaway database on the same server)
    or ``sqlite`` (a file in the throwaway home: fewer connections on a shared server;
    LocalExecutor either way). The top-level figures are the first run's; ``runs`` holds all."""
    ds = _ds()
    built = ensure_big(ctx, rows)
    with tempfile.TemporaryDirectory(prefix="kbench-af-") as tmp:
        root = Path(tmp)
        dags = root / "dags"
        dags.mkdir()
        (dags / "kbench_scale_dag.py").write_text(DAG_SOURCE)
        stream = f"scaleaf-{uuid.uuid4().hex[:8]}"
        with ds.Deployments(ctx.pg_url) as deployments:
            started = time.perf_counter()
            home = root / "home"
            sqlite = f"sqlite:///{home / 'airflow.db'}"
            dep = ds.start_deployment(
                home,
                sqlite if metadata == "sqlite" else deployments.database_url(),
                dags,
                _env(ctx, built["schema"], rows, stream, parallelism, tasks),
                DAG_ID,
                deployments.started,
            )
            ready_s = time.perf_counter() - started
            results = [_one_run(ctx, dep, home, built["table"], rows) for _ in range(runs)]
    return {
        "rows": rows,
        "parallelism": parallelism,
        "pull_tasks": tasks,
        "metadata": metadata,
        "deployment_ready_s": round(ready_s, 1),
        **results[0],
        "runs": results,
    }


def _one_run(ctx: BenchContext, dep: Any, home: Path, table: str, rows: int) -> dict[str, Any]:
    """The engine alone on the running deployment, then one DAG run; its figures."""
    engine = sr.engine_round(ctx, table, rows, sr.MANY, None)
    run_id = f"scale_{uuid.uuid4().hex[:8]}"
    sr.wait_for_connections(ctx, sr.TASKS + 12)
    dep.request("POST", f"/dags/{DAG_ID}/dagRuns", {"dag_run_id": run_id, "logical_date": None})
    run = _wait_run(dep, run_id)
    tis = dep.get(f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances?limit=100")["task_instances"]
    if run["state"] != "success":
        raise RuntimeError(f"DAG run {run_id} {run['state']}:\n{dep.diagnostics(DAG_ID)}")
    b = breakdown(run, tis)
    engine_s = engine["plan_s"] + engine["seconds"]
    return {
        "run_id": run_id,
        "tries": {f"{t['task_id']}/{t['map_index']}": t.get("try_number") for t in tis},
        "engine_alone_s": round(engine_s, 3),
        "engine_plan_s": round(engine["plan_s"], 3),
        "engine_round_s": round(engine["seconds"], 3),
        "airflow_makespan_s": b["makespan_s"],
        "airflow_overhead": round(b["makespan_s"] / engine_s - 1, 3),
        "breakdown": b,
        "task_logs": _task_logs(home, run_id, ("plan", "barrier")),
        "task_instances": [
            {
                k: t.get(k)
                for k in (
                    "task_id",
                    "map_index",
                    "state",
                    "queued_when",
                    "start_date",
                    "end_date",
                    "duration",
                )
            }
            for t in tis
        ],
    }


def main(
    ctx: BenchContext,
    rows: int,
    parallelism: int,
    metadata: str = "postgres",
    tasks: int = sr.TASKS,
    runs: int = 1,
) -> str:
    doc = measure(ctx, rows, parallelism, metadata, tasks, runs)
    out = procs.ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scale-airflow-{rows}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    head = f"{rows:,} rows, {tasks} pull tasks, parallelism {parallelism}, {metadata} metadata"
    return "\n".join([head, *(_run_text(i, r) for i, r in enumerate(doc["runs"])), f"JSON: {path}"])


def _run_text(i: int, r: dict[str, Any]) -> str:
    b = r["breakdown"]
    return (
        f"run {i + 1}: Airflow {r['airflow_makespan_s']:.2f} s vs engine alone "
        f"{r['engine_alone_s']:.2f} s (+{r['airflow_overhead'] * 100:.0f} %)\n"
        f"  plan queued/start/end at {b['plan']} s (duration {b['plan_duration_s']})\n"
        f"  traverse: first start {b['traverse_first_start_s']} s, last start "
        f"{b['traverse_last_start_s']} s, last end {b['traverse_last_end_s']} s; durations "
        f"{b['traverse_durations_s']}\n"
        f"  barrier {b['barrier']} s: ends {b['barrier_after_last_traverse_s']} s after the last "
        f"traverse; the run ends {b['run_end_after_barrier_s']} s after the barrier"
    )
