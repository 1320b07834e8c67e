"""``airflow backfill create`` under a real scheduler (issue 30 item 5: "a backfill of a chained
DAG is green and empty"), with the DAGs of ``dags/keyset_backfill_dags.py`` over one source.

One deployment, two backfills of the same 3 daily intervals (from 10 days ago), created at once
with the CLI as a user would:

- ``keyset_backfill_chained`` (no ``start_key``, ``max_active_runs=1``), the CLI's defaults:
  every backfill run fails at ``plan`` on its first try (``AirflowFailException``, not retried
  although the task has retries) with the message naming the fix, nothing runs after it, and
  nothing of its stream exists in Redis: no round planned, no open round handed out. Before the
  refusal the three runs succeeded having done nothing.
- ``keyset_backfill_bounded`` (bounds from the data interval, docs/howto-backfills.md), with
  ``--max-active-runs 1``: the three runs succeed, each row of the three intervals
  ``(start, end]`` is delivered exactly once (in the round of its interval) and no row outside
  them; the runs did not overlap (the backfill's own ``max_active_runs``, which the scheduler
  counts apart from the DAG's).

The backfill's ``max_active_runs`` each backfill got (10 by default, whatever the DAG says) and
the most runs seen running at once are printed as figures.
"""

from __future__ import annotations

import datetime as dt
import itertools
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import deployment_support as ds
import pytest
import redis
import sqlalchemy as sa
from scheduler_support import FIGURES, AirflowDeployment

CHAINED = "keyset_backfill_chained"
BOUNDED = "keyset_backfill_bounded"
DAY = dt.timedelta(days=1)
# the DAGs' first day, 10 days ago: the backfill's dates are past whatever the machine's clock says
START = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0) - 10 * DAY
FROM, TO = START.date().isoformat(), (START + 2 * DAY).date().isoformat()  # three intervals
DATES = ("--from-date", FROM, "--to-date", TO)
WINDOW = (START.timestamp(), (START + 3 * DAY).timestamp())  # (start, end] of the three together
STEP_S = 1800  # one source row per 30 minutes, midnights included (the bounds' edge cases)
BOUND_S = 240.0
CLI_TIMEOUT_S = 120


def _create_tables(engine: sa.Engine) -> list[int]:
    first, last = int((START - DAY).timestamp()), int((START + 4 * DAY).timestamp())
    keys = list(range(first, last + 1, STEP_S))
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE bf_events (ts bigint PRIMARY KEY)")
        conn.execute(sa.text("INSERT INTO bf_events VALUES (:ts)"), [{"ts": k} for k in keys])
        conn.exec_driver_sql(  # no unique key: a row delivered twice would stay twice
            "CREATE TABLE bf_delivered (ts bigint NOT NULL, round_id text NOT NULL)"
        )
    return keys


def _backfill(dep: AirflowDeployment, dag_id: str, *extra: str) -> subprocess.Popen[str]:
    """``airflow backfill create`` as a user runs it, with the deployment's configuration."""
    return subprocess.Popen(
        [*ds.AIRFLOW_CMD, "backfill", "create", "--dag-id", dag_id, *DATES, *extra],
        env=dep.env,
        cwd=dep.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _runs(dep: AirflowDeployment, dag_id: str) -> list[dict[str, Any]]:
    return dep.get(f"/dags/{dag_id}/dagRuns?limit=100")["dag_runs"]


def _plan_log(dep: AirflowDeployment, dag_id: str, run_id: str) -> str:
    paths = (dep.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / "task_id=plan").glob(
        "*.log*"
    )
    return "\n".join(p.read_text(errors="replace") for p in sorted(paths))


def _overlap(runs: list[dict[str, Any]]) -> bool:
    spans = sorted((r["start_date"], r["end_date"]) for r in runs)
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


def test_backfills_of_a_chained_and_a_bounded_dag_under_a_real_scheduler(
    airflow_deployment: Callable[[Mapping[str, str], str], AirflowDeployment],
    pg_url: str,
    pg_schema: str,
    pg_engine: sa.Engine,
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    keys = _create_tables(pg_engine)
    dep = airflow_deployment(
        {
            "AIRFLOW_CONN_KEYSET_BF_DB": ds.postgres_conn(pg_url, pg_schema),
            "AIRFLOW_CONN_KEYSET_BF_REDIS": ds.redis_conn(redis_url),
            "KEYSET_BF_KEY_PREFIX": key_prefix,
            "KEYSET_BF_START": FROM,
            # the components import this checkout's package (the venv may hold another one)
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        },
        CHAINED,
    )
    started = time.monotonic()
    clis = [_backfill(dep, CHAINED), _backfill(dep, BOUNDED, "--max-active-runs", "1")]
    for cli in clis:
        out, _ = cli.communicate(timeout=CLI_TIMEOUT_S)
        assert cli.returncode == 0, out
    most_running = dict.fromkeys((CHAINED, BOUNDED), 0)
    while True:
        runs = {dag_id: _runs(dep, dag_id) for dag_id in (CHAINED, BOUNDED)}
        for dag_id, rs in runs.items():
            running = sum(1 for r in rs if r["state"] == "running")
            most_running[dag_id] = max(most_running[dag_id], running)
        if all(
            len(rs) == 3 and all(r["state"] in ("success", "failed") for r in rs)
            for rs in runs.values()
        ):
            break
        if time.monotonic() - started > BOUND_S or dep.dead_components():
            pytest.fail(
                f"the backfills did not finish in {BOUND_S} s: "
                f"{ {d: [(r['dag_run_id'], r['state']) for r in rs] for d, rs in runs.items()} }\n"
                f"{dep.diagnostics()}"
            )
        time.sleep(1)
    seconds = time.monotonic() - started
    backfills = {b["dag_id"]: b for b in dep.get("/backfills?dag_id=" + CHAINED)["backfills"]}
    backfills |= {b["dag_id"]: b for b in dep.get("/backfills?dag_id=" + BOUNDED)["backfills"]}
    FIGURES.append(
        f"backfills of 3 intervals: {seconds:.0f} s; backfill max_active_runs "
        f"chained {backfills[CHAINED]['max_active_runs']} (CLI default, DAG says 1), "
        f"bounded {backfills[BOUNDED]['max_active_runs']}; most runs seen running at once "
        f"{most_running}"
    )
    assert all(r["run_type"] == "backfill" for rs in runs.values() for r in rs), runs

    # (a) the chained DAG: every run failed at plan, at once, saying what to do; nothing planned
    for run in runs[CHAINED]:
        assert run["state"] == "failed", run
        plan = dep.get(ds.ti_path(CHAINED, run["dag_run_id"], "plan"))
        assert (plan["state"], plan["try_number"]) == ("failed", 1), plan
        log = _plan_log(dep, CHAINED, run["dag_run_id"])
        assert "AirflowFailException" in log and "this is a backfill run" in log, log[-3000:]
        assert "start_key='{{ data_interval_start }}'" in log and "howto-backfills.md" in log
        barrier = dep.get(ds.ti_path(CHAINED, run["dag_run_id"], "barrier"))
        assert barrier["state"] == "upstream_failed", barrier
    assert redis_client.keys(f"{key_prefix}:{{bf_chained}}*") == []

    # (b) the bounded DAG: each interval's rows once, in its own round; the runs one at a time
    assert all(r["state"] == "success" for r in runs[BOUNDED]), dep.diagnostics(BOUNDED)
    assert not _overlap(runs[BOUNDED]), [(r["start_date"], r["end_date"]) for r in runs[BOUNDED]]
    with pg_engine.connect() as c:
        delivered = list(c.execute(sa.text("SELECT ts, round_id FROM bf_delivered")))
    expected = [k for k in keys if WINDOW[0] < k <= WINDOW[1]]
    assert Counter(ts for ts, _ in delivered) == Counter(expected)
    by_round = sorted(
        sorted(ts for ts, r in delivered if r == rnd) for rnd in {r for _, r in delivered}
    )
    day = len(expected) // 3
    assert by_round == [expected[i * day : (i + 1) * day] for i in range(3)]  # one round a day
