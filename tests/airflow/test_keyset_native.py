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
from keyset_examples_common import create_example_tables, example_metadata

from airflow_keyset_provider import PlanRangesOperator, TraverseRangeOperator
from airflow_keyset_provider.core import ConfigurationError

pytestmark = pytest.mark.airflow

DAGS_DIR = os.environ["AIRFLOW__CORE__DAGS_FOLDER"]  # set by conftest.py before Airflow loads


def xcom(
    dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1
) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=run_id, dag_ids=dag_id, task_ids=task_id, key=key, map_indexes=map_index
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


# --------------------------------------------------------------------------- links and lineage

# Prepended to a subprocess script: the process behaves as if the OpenLineage provider (and its
# client library) were not installed: their modules cannot be imported and Airflow's provider
# discovery does not see the distribution.
HIDE_OPENLINEAGE = """
import importlib.abc, importlib.metadata, sys
import importlib_metadata

HIDDEN = ("airflow.providers.openlineage", "openlineage")


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
for _md in (importlib.metadata, importlib_metadata):
    _orig = _md.distributions

    def _visible(*a, _orig=_orig, **k):
        return [d for d in _orig(*a, **k)
                if not (d.metadata["Name"] or "").lower().startswith(
                    ("apache-airflow-providers-openlineage", "openlineage"))]

    _md.distributions = _visible
"""


@pytest.fixture
def native_run(airflow_env, pg_engine) -> Any:
    """``kt_native`` (plan -> 2 traverse -> barrier over 300 rows) run once with ``dag.test()``."""
    import keyset_native_dags as kn
    from airflow.utils.state import DagRunState

    events_table(pg_engine, 300)
    dr = kn.kt_native.test()
    assert dr.state == DagRunState.SUCCESS
    return dr


def test_extra_link_opens_the_round_on_the_keyset_page(native_run):
    """Every task of the run (plan, each mapped traverse task, barrier) stores the "Keyset round"
    link, resolved by Airflow when the task finished: the page filtered to the run's round."""
    dr = native_run
    url = "/keyset/?stream=kt_native&round=r1"
    assert xcom("kt_native", dr.run_id, "plan", key="_link_KeysetRoundLink") == url
    for i in (0, 1):
        assert xcom("kt_native", dr.run_id, "traverse", "_link_KeysetRoundLink", i) == url
    assert xcom("kt_native", dr.run_id, "barrier", key="_link_KeysetRoundLink") == url


def test_openlineage_names_the_traversed_table(native_run, airflow_env, pg_url):
    """With the OpenLineage provider installed, plan and traverse tasks report the table as their
    input dataset, named like the official postgres provider names it: ``postgres://host:port``,
    ``database.schema.table`` (the schema from the connection's search_path)."""
    import keyset_native_dags as kn
    from airflow.providers.openlineage.extractors import OperatorLineage
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    expected = (
        f"postgres://{url.host}:{url.port}",
        f"{url.database}.{airflow_env['schema']}.im_events",
    )
    plan = kn.kt_native.get_task("plan")
    ranges = xcom("kt_native", native_run.run_id, "plan")
    traverse = TraverseRangeOperator(
        task_id="traverse",
        processor=kn.count_only,
        **{
            k: ranges[0][k]
            for k in (
                "round_id",
                "range_id",
                "source_conn_id",
                "table",
                "key",
                "stream",
                "key_prefix",
            )
        },
    )
    for op in (plan, traverse):
        lineage = op.get_openlineage_facets_on_complete(None)
        assert isinstance(lineage, OperatorLineage)
        assert [(d.namespace, d.name) for d in lineage.inputs] == [expected]
        assert lineage.outputs == []
    qualified = PlanRangesOperator(
        task_id="q", source_conn_id="keyset_examples_db", table="other.t", key="id"
    )
    assert (
        qualified.get_openlineage_facets_on_complete(None).inputs[0].name
        == f"{url.database}.other.t"
    )


def test_operators_work_without_the_openlineage_provider(airflow_env, pg_engine):
    """The provider does not need OpenLineage: with ``airflow.providers.openlineage`` hidden, the
    package imports, a plan -> traverse -> barrier run succeeds, and the lineage methods return
    None."""
    events_table(pg_engine, 300)
    script = HIDE_OPENLINEAGE + (
        "import json\n"
        "import keyset_native_dags as kn\n"
        "dr = kn.kt_native.test()\n"
        "lineage = kn.kt_native.get_task('plan').get_openlineage_facets_on_complete(None)\n"
        "try:\n"
        "    import airflow.providers.openlineage.extractors\n"
        "    hidden = False\n"
        "except ImportError:\n"
        "    hidden = True\n"
        "print('RESULT ' + json.dumps({'state': str(dr.state), 'lineage': repr(lineage),\n"
        "                              'hidden': hidden}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DAGS_DIR), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result == {"state": "success", "lineage": "None", "hidden": True}


def test_openlineage_listener_emits_the_table_as_input(airflow_env, pg_engine, pg_url, tmp_path):
    """End to end: with an OpenLineage transport configured (a file), the provider's listener
    calls the operators' method when their task instances complete, and the COMPLETE events of
    the plan and traverse tasks carry the table as their input dataset."""
    from sqlalchemy.engine import make_url

    events_table(pg_engine, 300)
    out = tmp_path / "ol.jsonl"
    transport = {"type": "file", "log_file_path": str(out), "append": True}
    run = run_dag_test(
        "kt_native",
        {
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "keyset-test",
        },
    )
    assert run["state"] == "success", run
    url = make_url(pg_url)
    expected = {
        "namespace": f"postgres://{url.host}:{url.port}",
        "name": f"{url.database}.{airflow_env['schema']}.im_events",
    }
    events = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    complete = {e["job"]["name"]: e for e in events if e.get("eventType") == "COMPLETE"}
    for job in ("kt_native.plan", "kt_native.traverse"):
        assert job in complete, sorted(complete)
        inputs = [{k: d[k] for k in ("namespace", "name")} for d in complete[job]["inputs"]]
        assert inputs == [expected], complete[job]["inputs"]
