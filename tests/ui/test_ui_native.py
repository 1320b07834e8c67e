"""A DAG run's round in the Airflow UI: the "Keyset round" extra link and the DAG run tab.

Against the real API server of ``conftest.py``: a plan -> traverse -> barrier run
(``tests/airflow/keyset_native_dags.py``) is made with ``dag.test()`` in a subprocess that uses the
server's metadata database, Redis connection and key prefix; then the REST API serves the tasks'
extra links, the plugin lists its ``dag_run`` external view, and ``/keyset/run/{dag_id}/{run_id}``
(what that view embeds) leads to the run's round. ``rounds_of_run`` is also checked on its own
against real Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import _services
import redis
import sqlalchemy as sa
from keyset_page import open_in_airflow
from sqlalchemy.engine import make_url

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.plugins import status

REPO = Path(__file__).resolve().parents[2]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def get_no_redirect(srv: Any, path: str, token: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        srv.base_url + path, headers={"Authorization": f"Bearer {token}", "Accept": "text/html"}
    )
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def run_native_dag(
    srv: Any, pg_url: str, pg_schema: str, redis_url: str, dag: str = "kt_native"
) -> str:
    """``dag`` of ``keyset_native_dags`` (``kt_native`` by default) run by ``dag.test()`` in the
    API server's AIRFLOW_HOME; returns the run id."""
    dags = srv.home / "dags"
    for src in (
        REPO / "tests/airflow/keyset_native_dags.py",
        REPO / "dags/keyset_examples_common.py",
    ):
        if not (dags / src.name).exists():
            (dags / src.name).symlink_to(src)
    url = make_url(pg_url)
    pg_conn = {
        "conn_type": "postgres",
        "host": url.host,
        "port": url.port,
        "login": url.username,
        "password": url.password,
        "schema": url.database,
        "extra": {"sqlalchemy_query": {"options": f"-csearch_path={pg_schema}"}},
    }
    redis_conn = {
        "conn_type": "redis",
        "host": make_url(redis_url).host,
        "port": make_url(redis_url).port,
        "extra": {"db": int(make_url(redis_url).database or 0)},
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "KEYSET_AIRFLOW", "KEYSET_EXAMPLE"))
    }
    env.update(
        {
            "AIRFLOW_HOME": str(srv.home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{srv.home / 'airflow.db'}",
            "AIRFLOW_CONN_KEYSET_EXAMPLES_DB": json.dumps(pg_conn),
            f"AIRFLOW_CONN_{srv.redis_conn_id.upper()}": json.dumps(redis_conn),
            "KEYSET_EXAMPLE_SOURCE_CONN": "keyset_examples_db",
            "KEYSET_EXAMPLE_REDIS_CONN": srv.redis_conn_id,
            "KEYSET_EXAMPLE_KEY_PREFIX": srv.key_prefix,
            "PYTHONPATH": os.pathsep.join([str(dags), *sys.path]),
        }
    )
    script = (
        "import json, sqlalchemy as sa\n"
        "from airflow_keyset_provider.hooks.keyset import KeysetHook\n"
        "from keyset_examples_common import create_example_tables, example_metadata\n"
        "engine = KeysetHook('keyset_examples_db').get_conn()\n"
        "create_example_tables(engine)\n"
        "with engine.begin() as c:\n"
        "    rows = [{'user_id': i % 5, 'kind': 'msg', 'payload': f'p{i}'} for i in range(100)]\n"
        "    c.execute(example_metadata().tables['im_events'].insert(), rows)\n"
        "import keyset_native_dags as kn\n"
        f"dr = kn.{dag}.test()\n"
        "print('RESULT ' + json.dumps({'run_id': dr.run_id, 'state': str(dr.state)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["state"] == "success", result
    return str(result["run_id"])


RUN_TAB_JS = """(() => {
    const app = document.querySelector('#keyset-app');
    return {iframes: document.querySelectorAll('iframe').length, text: app.innerText,
            rounds: [...app.querySelectorAll('section.round')].map(r => [r.dataset.round, r.dataset.state]),
            lost: [...app.querySelectorAll('.round-lost')].map(e => e.innerText)};
})()"""


def test_a_dag_runs_round_from_its_links_and_its_run_tab(
    airflow_api_server: Any, chromium: Any, pg_url: str, pg_schema: str, redis_url: str
) -> None:
    """A real run's round through its extra links, the API and its "Keyset round" tab (the React
    app in the Airflow UI); then Redis loses the stream: the tab says the round was lost (the
    run's XCom says it was planned), not that none was planned."""
    srv = airflow_api_server
    run_id = run_native_dag(srv, pg_url, pg_schema, redis_url)
    token = srv.token()
    auth = {"Authorization": f"Bearer {token}"}
    run = urllib.parse.quote(run_id, safe="")
    page = "/keyset/?stream=kt_native&round=r1"

    # Extra links through the REST API: plan, a mapped traverse task, barrier.
    for task, query in (("plan", ""), ("traverse", "?map_index=1"), ("barrier", "")):
        code, _, body = srv.http(
            "GET",
            f"/api/v2/dags/kt_native/dagRuns/{run}/taskInstances/{task}/links{query}",
            headers=auth,
        )
        assert code == 200, body
        assert json.loads(body)["extra_links"] == {"Keyset round": page}, (task, body)

    # The plugin lists the DAG run tab and the task instance tab, React apps of one bundle.
    code, _, body = srv.http("GET", "/api/v2/plugins", headers=auth)
    assert code == 200, body
    plugin = next(p for p in json.loads(body)["plugins"] if p["name"] == "keyset")
    tab = next(v for v in plugin["react_apps"] if v["destination"] == "dag_run")
    assert (tab["name"], tab["url_route"]) == ("Keyset round", "keyset-run")

    # /keyset/run/... (the former tab, kept for links) leads to the round on the page.
    code, headers, body = get_no_redirect(srv, f"/keyset/run/kt_native/{run}", token)
    assert code == 307, body
    assert headers["location"] == page
    code, _, body = srv.http("GET", f"/keyset/api/runs/kt_native/{run}", headers=auth)
    assert code == 200, body
    found = json.loads(body)
    assert found["rounds"] == [
        {
            "stream": "kt_native",
            "round_id": "r1",
            "task_id": "plan",
            "map_index": None,
            "known_from": "redis",
            "in_redis": True,
            "lost_message": None,
        }
    ]
    assert (found["planned_known"], found["absent_reason"]) == (True, None)
    code, _, body = srv.http("GET", "/keyset/api/streams/kt_native/rounds/r1", headers=auth)
    assert code == 200 and json.loads(body)["state"] == "closed", body

    # The run's tab in the Airflow UI shows the round, in Airflow's layout (no frame).
    tab_route = f"dags/kt_native/runs/{run}/plugin/keyset-run?refresh=0"
    open_in_airflow(chromium, srv.base_url, tab_route, token)
    chromium.wait("document.querySelector('#keyset-app section.round')")
    shown = chromium.evaluate(RUN_TAB_JS)
    assert shown["iframes"] == 0 and shown["rounds"] == [["r1", "closed"]], shown
    assert "planned by task plan: stream kt_native, round r1" in shown["text"]

    # A traverse task instance's "Keyset range" tab: the same round, its range highlighted.
    ti_route = f"dags/kt_native/runs/{run}/tasks/traverse/mapped/1/plugin/keyset-range?refresh=0"
    open_in_airflow(chromium, srv.base_url, ti_route, token)
    chromium.wait("document.querySelector('#keyset-app section.round')")
    highlighted = chromium.evaluate(
        "[...document.querySelectorAll('#keyset-app tr.range-row.highlighted')]"
        ".map(tr => tr.dataset.range)"
    )
    assert highlighted == ["1"], highlighted
    # The link a stopped range gives to its last task instance follows this installed UI's route
    # (test_ui_page.py checks the page writes it so): it opens that task instance.
    chromium.open(
        f"{srv.base_url}/dags/kt_native/runs/{run}/tasks/traverse/mapped/1",
        "document.body && document.body.innerText.includes('traverse')",
        timeout=60,
    )
    assert "Page Not Found" not in chromium.evaluate("document.body.innerText")

    # Another run: planned nothing (Airflow's record says so); no login: 401.
    code, _, body = get_no_redirect(srv, "/keyset/run/kt_native/no_such_run", token)
    assert code == 404 and b"Run no_such_run of DAG kt_native planned no keyset round" in body
    assert srv.http("GET", f"/keyset/run/kt_native/{run}")[0] == 401

    # Redis loses the stream (everything under the key prefix): lost, not "never planned".
    _services.delete_prefix(redis_url, srv.key_prefix)
    code, _, body = srv.http("GET", f"/keyset/api/runs/kt_native/{run}", headers=auth)
    assert code == 200, body
    [lost] = json.loads(body)["rounds"]
    assert (lost["known_from"], lost["in_redis"]) == ("airflow", False), lost
    said = (
        "Redis has lost round r1 of stream kt_native, which task plan of this run planned "
        "(its XCom keyset_round)"
    )
    assert lost["lost_message"].startswith(said), lost
    open_in_airflow(chromium, srv.base_url, tab_route, token)
    chromium.wait("document.querySelector('#keyset-app .round-lost')")
    shown = chromium.evaluate(RUN_TAB_JS)
    assert shown["lost"] and shown["lost"][0].startswith(said), shown
    assert "No keyset round was planned" not in shown["text"] and shown["rounds"] == []


def test_rounds_of_run_finds_the_runs_plan_tasks_only(
    sqlite_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """Round keys ``<dag_id>/<run_id>/<task_id>[/<map_index>]`` in any stream; the DAG's own
    stream first; run ids with glob characters match literally; other runs never match."""
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY)")
        conn.execute(sa.text("INSERT INTO t VALUES (:k)"), [{"k": i} for i in range(1, 21)])
    engine.dispose()
    run = "manual__2026-01-01T00:00:00+00:00*?"
    plans = [
        ("other", f"d/{run}/plan_b/3", 1),
        ("d", f"d/{run}/plan", 5),
        ("d", f"d/{run}x/plan", 5),  # another run
        ("d", "d/manual__2026-01-01T00:00:00+00:00ab/plan", 5),  # an unescaped glob matches it
        ("d", f"e/{run}/plan", 5),  # another DAG
    ]
    for stream, round_key, end in plans:
        t = KeysetTraversal(
            sqlite_url,
            table="t",
            key="k",
            redis_url=redis_url,
            stream=stream,
            key_prefix=key_prefix,
        )
        try:
            t.plan(max_ranges=1, start_key=0, end_key=end, round_key=round_key)
        finally:
            t.close()
    found = status.rounds_of_run(redis_client, key_prefix, "d", run)
    assert found == [
        {"stream": "d", "round_id": "r1", "task_id": "plan", "map_index": None},
        {"stream": "other", "round_id": "r1", "task_id": "plan_b", "map_index": 3},
    ]
    assert status.rounds_of_run(redis_client, key_prefix, "d", "nothing") == []
