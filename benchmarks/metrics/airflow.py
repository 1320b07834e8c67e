"""Target 10: Airflow overhead: the same rows through ``dag.test()`` with mapped ranges vs the engine alone.

Rows: the first ``min(N, 1,000,000)`` keys of ``seq``, no-op processor, 10k-row chunks (``--chunk-size``).

Project: ``dag.test()`` of ``PlanRangesOperator -> TraverseRangeOperator.partial(...).expand_kwargs
-> BarrierSensor`` (poke mode) with 8 ranges, in a fresh Python process, on a throwaway
``AIRFLOW_HOME`` (SQLite metadata migrated once per benchmark run with ``airflow db migrate``; a
DAGs folder holding only the benchmark's DAG file). Connections come from ``AIRFLOW_CONN_*``
environment variables pointing at the benchmark's PostgreSQL table and Redis; the engine's keys
go under the run's prefix (deleted at the end of the run), one fresh stream per DAG run.
Timed: the ``dag.test()`` call only (bundle sync, parse, serialization, the task runs, the
barrier); importing Airflow and the DAG file is reported apart, as the process wall.

Baseline: the engine alone in this process: ``KeysetTraversal``, ``plan(max_ranges=8)``, the 8
``traverse`` calls one after the other (``dag.test()`` also runs its tasks one at a time),
``close_round``, ``close``.

The overhead ``dag.test() - engine`` is split in two, from a second DAG run in the same run:

- fixed: ``dag.test()`` of the same DAG with 1 range over ``FIXED_ROWS`` rows, minus the engine
  alone over those rows. That DAG run has 3 tasks (plan, one mapped range, barrier);
- per task: ``(dag.test() - engine - fixed) / (tasks - 3)``, the cost of each further mapped
  range task.

Every DAG run is checked: it succeeded, the round is closed and counted every row.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal, StreamControl
from airflow_keyset_provider.core.store.cursor_store import CursorStore
from benchmarks import procs
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median, median_seconds

MAX_ROWS = 1_000_000
RANGES = 8
FIXED_ROWS = 1_000
FIXED_TASKS = 3  # plan, one mapped traverse, barrier
DAG_ID = "kbench_airflow_overhead"
SOURCE_CONN_ID = "kbench_source"
REDIS_CONN_ID = "kbench_redis"
SUBPROCESS_TIMEOUT_S = 600

# The benchmark's DAG, shaped by environment variables that the runner sets (read at parse time).
DAG_SOURCE = textwrap.dedent('''\
    """Benchmark DAG (written by benchmarks/metrics/airflow.py into a throwaway AIRFLOW_HOME)."""

    from __future__ import annotations

    import datetime as dt
    import os

    from airflow.sdk import DAG

    from airflow_keyset_provider import BarrierSensor, PlanRangesOperator, TraverseRangeOperator


    def noop(chunk):
        return None


    env = os.environ
    with DAG(dag_id=env["KBENCH_AF_DAG_ID"], schedule=None, start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
             catchup=False) as dag:
        plan = PlanRangesOperator(
            task_id="plan", source_conn_id=env["KBENCH_AF_SOURCE_CONN"], redis_conn_id=env["KBENCH_AF_REDIS_CONN"],
            table=env["KBENCH_AF_TABLE"], key="seq", stream=env["KBENCH_AF_STREAM"],
            key_prefix=env["KBENCH_AF_PREFIX"], start_key=0, end_key=int(env["KBENCH_AF_END"]),
            max_ranges=int(env["KBENCH_AF_RANGES"]),
        )
        traverse = TraverseRangeOperator.partial(
            task_id="traverse", processor=noop, redis_conn_id=env["KBENCH_AF_REDIS_CONN"],
            chunk_size=int(env["KBENCH_AF_CHUNK_SIZE"]),
        ).expand_kwargs(plan.output)
        deferrable = env.get("KBENCH_AF_DEFERRABLE") == "1"
        barrier = BarrierSensor(
            task_id="barrier", plan_task_id="plan", redis_conn_id=env["KBENCH_AF_REDIS_CONN"],
            mode="reschedule" if deferrable else "poke", deferrable=deferrable, poke_interval=0.1,
            timeout=600,
        )
        plan >> traverse >> barrier
''')

# The same shape with plain Airflow (issue 29's baseline for the fixed cost per round): a Python
# plan task returning one kwargs dict per range, mapped no-op Python tasks, and a deferrable
# sensor whose trigger fires at once.
BARE_DAG_SOURCE = textwrap.dedent('''\
    """Bare benchmark DAG (written by benchmarks/metrics/airflow.py): Airflow alone, same shape."""

    from __future__ import annotations

    import datetime as dt
    import os

    from airflow.providers.standard.operators.python import PythonOperator
    from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
    from airflow.sdk import DAG, BaseSensorOperator


    def plan_ranges(ranges):
        return [{"op_kwargs": {"range_id": i}} for i in range(int(ranges))]


    def noop(range_id):
        return None


    class FiresAtOnce(BaseSensorOperator):
        def execute(self, context):
            self.defer(trigger=TimeDeltaTrigger(dt.timedelta(0)), method_name="done")

        def done(self, context, event=None):
            return None


    env = os.environ
    with DAG(dag_id=env["KBENCH_AF_DAG_ID"] + "_bare", schedule=None,
             start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC), catchup=False) as dag:
        plan = PythonOperator(task_id="plan", python_callable=plan_ranges,
                              op_kwargs={"ranges": env["KBENCH_AF_RANGES"]})
        traverse = PythonOperator.partial(task_id="traverse", python_callable=noop).expand_kwargs(
            plan.output
        )
        barrier = FiresAtOnce(task_id="barrier", timeout=600)
        plan >> traverse >> barrier
''')

# Runs in the subprocess: import the DAG file, time dag.test(), write what happened as JSON.
RUNNER_SOURCE = textwrap.dedent("""\
    import json
    import sys
    import time

    started = time.perf_counter()
    import importlib  # noqa: E402

    sys.path.insert(0, sys.argv[1])
    module = importlib.import_module(sys.argv[3] if len(sys.argv) > 3 else "kbench_airflow_dag")

    imported = time.perf_counter()
    dr = module.dag.test()
    ended = time.perf_counter()

    from airflow.utils.session import create_session  # noqa: E402

    with create_session() as session:
        dr = session.merge(dr)
        tis = [{"task_id": ti.task_id, "map_index": ti.map_index, "state": str(ti.state),
                "duration": ti.duration} for ti in dr.get_task_instances(session=session)]
        state = str(dr.state)
    with open(sys.argv[2], "w") as fh:
        json.dump({"dag_test_s": ended - imported, "import_s": imported - started, "state": state,
                   "tasks": tis}, fh)
""")


def _airflow_env(home: Path) -> dict[str, str]:
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }


def airflow_home(ctx: BenchContext) -> Path:
    """A throwaway, migrated ``AIRFLOW_HOME`` with the benchmark DAG: made once per benchmark run
    (cached on the context), removed when the process exits."""
    cached = ctx.cache.get("airflow_home")
    if cached is not None:
        return Path(cached)
    home = Path(tempfile.mkdtemp(prefix="kbench-airflow-home-"))
    atexit.register(shutil.rmtree, home, True)
    (home / "dags").mkdir()
    (home / "dags" / "kbench_airflow_dag.py").write_text(DAG_SOURCE)
    (home / "dags" / "kbench_bare_dag.py").write_text(BARE_DAG_SOURCE)
    (home / "run_dag_test.py").write_text(RUNNER_SOURCE)
    airflow_bin = Path(sys.executable).with_name("airflow")
    cmd = [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]
    with Stopwatch() as sw:
        proc = subprocess.run(
            [*cmd, "db", "migrate"],
            env={**os.environ, **_airflow_env(home)},
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"airflow db migrate failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    ctx.cache["airflow_home"] = str(home)
    ctx.cache["airflow_migrate_s"] = sw.seconds
    return home


def postgres_connection(ctx: BenchContext, search_path: str | None = None) -> str:
    """An Airflow ``postgres`` connection (JSON form) on the benchmark's server; with
    ``search_path`` its sessions resolve unqualified table names in that schema."""
    pg = sa.engine.make_url(ctx.pg_url)
    conn: dict[str, Any] = {
        "conn_type": "postgres",
        "host": pg.host,
        "port": pg.port,
        "login": pg.username,
        "password": pg.password,
        "schema": pg.database,
    }
    if search_path:
        conn["extra"] = {"sqlalchemy_query": {"options": f"-csearch_path={search_path}"}}
    return json.dumps(conn)


def redis_connection(ctx: BenchContext) -> str:
    """An Airflow ``redis`` connection (JSON form) on the benchmark's Redis."""
    rd = sa.engine.make_url(ctx.redis_url)
    store: dict[str, Any] = {
        "conn_type": "redis",
        "host": rd.host,
        "port": rd.port,
        "extra": {"db": int(rd.database or 0)},
    }
    if rd.password:
        store["password"] = rd.password
    return json.dumps(store)


def _connections(ctx: BenchContext) -> dict[str, str]:
    """``AIRFLOW_CONN_*`` for the benchmark's PostgreSQL and Redis (JSON form)."""
    return {
        f"AIRFLOW_CONN_{SOURCE_CONN_ID.upper()}": postgres_connection(ctx),
        f"AIRFLOW_CONN_{REDIS_CONN_ID.upper()}": redis_connection(ctx),
    }


def _round_totals(ctx: BenchContext, stream: str, round_id: str = "r1") -> dict[str, Any]:
    """The closed round's totals (closing is idempotent), read from Redis."""
    client = redis.Redis.from_url(ctx.redis_url)
    try:
        ctl = StreamControl(CursorStore(client, stream, prefix=ctx.prefix))
        return {"state": ctl.round(round_id).state, **ctl.close_round(round_id).as_dict()}
    finally:
        client.close()


def run_dag_test(
    ctx: BenchContext, module: str, env: dict[str, str]
) -> tuple[dict[str, Any], float]:
    """``dag.test()`` of the DAG file ``<module>.py`` of the home's DAGs folder in a fresh process
    whose environment is ``env``. Returns what the runner wrote (``dag_test_s``, ``import_s``,
    ``state``, ``tasks``) and the process wall; raises, with the end of the process's output, if
    the process failed or the DAG run or one of its tasks did not succeed."""
    home = airflow_home(ctx)
    tag = uuid.uuid4().hex[:8]
    out = home / f"result-{tag}.json"
    log_path = home / f"log-{tag}.txt"
    with Stopwatch() as sw, open(log_path, "w") as log_file:
        proc = subprocess.run(
            [sys.executable, str(home / "run_dag_test.py"), str(home / "dags"), str(out), module],
            cwd=procs.ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    log_text = log_path.read_text(errors="replace")
    log_path.unlink(missing_ok=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"dag.test() subprocess failed (exit {proc.returncode}):\n{log_text[-3000:]}"
        )
    res: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    if not res["state"].endswith("success") or any(
        not t["state"].endswith("success") for t in res["tasks"]
    ):
        raise RuntimeError(f"dag.test() of {module} did not succeed: {res}\n{log_text[-3000:]}")
    return res, sw.seconds


def task_durations(tasks: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each task instance's duration by name (``task[map_index]`` for a mapped one)."""
    return {
        (t["task_id"] if t["map_index"] < 0 else f"{t['task_id']}[{t['map_index']}]"): t["duration"]
        for t in tasks
    }


def dag_test(
    ctx: BenchContext,
    table: str,
    rows: int,
    ranges: int,
    *,
    bare: bool = False,
    deferrable: bool = False,
) -> Sample:
    """One ``dag.test()`` in a fresh process over ``(0, rows]`` with ``ranges`` ranges (``bare``:
    the plain-Airflow DAG of the same shape, which reads nothing; ``deferrable``: the provider's
    barrier defers instead of poking).

    ``seconds`` is the ``dag.test()`` call; extra: the process wall (Airflow import and DAG
    parse included), the mapped task count and the task instances' own durations."""
    home = airflow_home(ctx)
    stream = ctx.stream("airflow")
    env = {
        **os.environ,
        **_airflow_env(home),
        **_connections(ctx),
        "KBENCH_AF_DAG_ID": DAG_ID,
        "KBENCH_AF_SOURCE_CONN": SOURCE_CONN_ID,
        "KBENCH_AF_REDIS_CONN": REDIS_CONN_ID,
        "KBENCH_AF_TABLE": table,
        "KBENCH_AF_STREAM": stream,
        "KBENCH_AF_PREFIX": ctx.prefix,
        "KBENCH_AF_END": str(rows),
        "KBENCH_AF_RANGES": str(ranges),
        "KBENCH_AF_CHUNK_SIZE": str(ctx.chunk_size),
        "KBENCH_AF_DEFERRABLE": "1" if deferrable else "0",
    }
    module = "kbench_bare_dag" if bare else "kbench_airflow_dag"
    res, process_s = run_dag_test(ctx, module, env)
    traverse = [t for t in res["tasks"] if t["task_id"] == "traverse"]
    if bare and len(traverse) != ranges:
        raise RuntimeError(f"dag.test() ran {len(traverse)} mapped tasks, expected {ranges}")
    totals = {"state": "closed", "done": rows} if bare else _round_totals(ctx, stream)
    if totals["state"] != "closed" or totals["done"] != rows:
        raise RuntimeError(
            f"dag.test() round over {rows} rows: {totals}, expected closed with {rows} done"
        )
    task_s = [t["duration"] or 0.0 for t in res["tasks"]]
    return Sample(
        res["dag_test_s"],
        rows,
        {
            "process_s": process_s,
            "import_s": res["import_s"],
            "tasks": len(res["tasks"]),
            "mapped": len(traverse),
            "tasks_s": sum(task_s),
            "traverse_tasks_s": sum(t["duration"] or 0.0 for t in traverse),
            "task_durations": task_durations(res["tasks"]),
        },
    )


def engine_alone(ctx: BenchContext, table: str, rows: int, ranges: int) -> Sample:
    """Plan, traverse every range in turn, close the round: all in this process, all timed."""
    with Stopwatch() as sw:
        t = KeysetTraversal(
            ctx.pg_url,
            table=table,
            key="seq",
            redis_url=ctx.redis_url,
            stream=ctx.stream("airflow-engine"),
            key_prefix=ctx.prefix,
        )
        try:
            rnd = t.plan(max_ranges=ranges, start_key=0, end_key=rows)
            read = 0
            for spec in rnd.ranges:
                res = t.traverse(
                    rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=ctx.chunk_size
                )
                if not res.complete:
                    raise RuntimeError(
                        f"range {spec.range_id} of {rnd.round_id} did not complete: {res}"
                    )
                read += res.rows_read
            totals = t.close_round(rnd.round_id)
        finally:
            t.close()
    if read != rows or totals.done != rows:
        raise RuntimeError(
            f"engine alone read {read} rows (round done {totals.done}), expected {rows}"
        )
    return Sample(sw.seconds, rows, {"ranges": len(rnd.ranges)})


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    rows = min(ctx.rows, MAX_ROWS)
    fixed_rows = min(FIXED_ROWS, rows)
    airflow_home(ctx)
    engine_alone(ctx, table, rows, RANGES)  # warm the cache and the server, untimed
    s = interleaved(
        {
            "dag_fixed": lambda: dag_test(ctx, table, fixed_rows, 1),
            "dag": lambda: dag_test(ctx, table, rows, RANGES),
            "engine_fixed": lambda: engine_alone(ctx, table, fixed_rows, 1),
            "engine": lambda: engine_alone(ctx, table, rows, RANGES),
        },
        ctx.repeat,
    )
    dag_s, engine_s = median_seconds(s["dag"]), median_seconds(s["engine"])
    fixed = median_seconds(s["dag_fixed"]) - median_seconds(s["engine_fixed"])
    tasks = s["dag"][0].extra["tasks"]
    mapped = s["dag"][0].extra["mapped"]
    per_task = (dag_s - engine_s - fixed) / max(tasks - FIXED_TASKS, 1)
    process_s = median([x.extra["process_s"] for x in s["dag"]])
    inside = median([x.extra["traverse_tasks_s"] for x in s["dag"]])
    details: dict[str, Any] = {
        "rows": rows,
        "fixed_rows": fixed_rows,
        "ranges": mapped,
        "tasks": tasks,
        "chunk_size": ctx.chunk_size,
        "dag_test_s": dag_s,
        "engine_s": engine_s,
        "fixed_s": fixed,
        "per_task_s": per_task,
        "dag_fixed_s": median_seconds(s["dag_fixed"]),
        "engine_fixed_s": median_seconds(s["engine_fixed"]),
        "dag_process_s": process_s,
        "airflow_import_s": median([x.extra["import_s"] for x in s["dag"]]),
        "traverse_tasks_s": inside,
        "airflow_migrate_s": ctx.cache.get("airflow_migrate_s"),
        "samples": {
            name: [{"seconds": x.seconds, **x.extra} for x in samples]
            for name, samples in s.items()
        },
    }
    note = (
        f"{rows:,} rows, {mapped} mapped ranges ({tasks} tasks): dag.test() {dag_s:.2f} s vs engine "
        f"{engine_s:.2f} s; fixed {fixed:.2f} s (dag.test() of plan + 1 range + barrier over {fixed_rows:,} "
        f"rows, minus its engine time), per further task {per_task:.2f} s; the {mapped} traverse tasks' own "
        f"durations sum to {inside:.2f} s; the process with Airflow import and DAG parse {process_s:.1f} s"
    )
    return [
        Metric(
            "airflow_overhead",
            "airflow",
            f"dag.test() with {RANGES} mapped ranges vs the engine alone",
            dag_s,
            engine_s,
            "s",
            dag_s / engine_s,
            "report fixed + per-task s",
            None,
            note,
            details,
        )
    ]
