"""Airflow-native integration: the mapping cap follows Airflow's configuration, OpenLineage
facets, operator extra links. DAGs in ``keyset_native_dags.py``; real PostgreSQL and Redis."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from conftest import DAGS_DIR
from keyset_examples_common import create_example_tables, example_metadata

from airflow_keyset_provider import PlanRangesOperator
from airflow_keyset_provider.core import ConfigurationError

pytestmark = pytest.mark.airflow


def xcom(dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=run_id, dag_ids=dag_id, task_ids=task_id, key=key, map_indexes=-1
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def events_table(pg_engine: sa.Engine, rows: int) -> None:
    create_example_tables(pg_engine)
    table = example_metadata().tables["im_events"]
    with pg_engine.begin() as conn:
        conn.execute(
            table.insert(),
            [{"user_id": i % 5, "kind": "msg", "payload": f"p{i}"} for i in range(rows)],
        )


def run_dag_test(dag_id: str, extra_env: dict[str, str]) -> dict[str, str]:
    """``dag.test()`` of a DAG of ``keyset_native_dags.py`` in a fresh process whose environment
    (Airflow's configuration) includes ``extra_env``; returns its run id and state."""
    script = (
        "import json, keyset_native_dags as kn\n"
        f"dr = kn.{dag_id}.test()\n"
        "print('RESULT ' + json.dumps({'run_id': dr.run_id, 'state': str(dr.state)}))\n"
    )
    env = {**os.environ, **extra_env, "PYTHONPATH": os.pathsep.join([str(DAGS_DIR), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# --------------------------------------------------------------------------- max_map_length


def test_default_max_map_length_caps_max_ranges(airflow_env):
    """Airflow's default ``[core] max_map_length`` (1024) is the plan operator's limit."""
    with pytest.raises(
        ConfigurationError, match=r"from 1 to 1024 \(Airflow's \[core\] max_map_length"
    ):
        PlanRangesOperator(task_id="p", source_conn_id="x", table="t", key="id", max_ranges=1500)


def test_raised_max_map_length_lets_the_plan_make_more_ranges(airflow_env, pg_engine):
    """Issue #11: the operator capped ``max_ranges`` at min(conf, 1024), so raising Airflow's
    ``[core] max_map_length`` did not help. With ``AIRFLOW__CORE__MAX_MAP_LENGTH=2048`` a plan
    with ``max_ranges=1500`` over 3000 rows makes 1500 ranges (more than 1024) that cover the
    table; the same run with ``max_ranges=1500`` over fewer keys just makes fewer ranges."""
    events_table(pg_engine, 3000)
    run = run_dag_test(
        "kt_wide_plan", {"AIRFLOW__CORE__MAX_MAP_LENGTH": "2048", "KT_WIDE_MAX_RANGES": "1500"}
    )
    assert run["state"] == "success", run
    ranges = xcom("kt_wide_plan", run["run_id"], "plan")
    assert len(ranges) == 1500
    assert ranges[0]["lo"] is None and ranges[-1]["hi"] == 3000
    assert all(a["hi"] == b["lo"] for a, b in itertools.pairwise(ranges))
