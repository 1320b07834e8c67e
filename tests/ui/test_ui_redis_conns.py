"""The page reads every Redis connection of the deployment, one at a time: a selector of the
Airflow connections of type redis (the configured default first), the choice sent as
``?conn=<connection id>`` (validated by full match, never a URL). Against a real Airflow API
server with two Redis connections (two databases of the test Redis, same key prefix) holding one
stream each, and a real headless Chromium."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from keyset_page import open_in_airflow

from airflow_keyset_provider.core import KeysetTraversal

STREAM_A = "ui-conn-a"
STREAM_B = "ui-conn-b"


def _stream(sqlite_url: str, redis_url: str, prefix: str, stream: str, table: str) -> None:
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (seq INTEGER PRIMARY KEY, v TEXT NOT NULL)")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b'), (3, 'c')")
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, table, "seq", redis_url=redis_url, stream=stream, key_prefix=prefix
    )
    t.plan(max_ranges=1, new_stream=True)
    t.close()


def _two_streams(srv: Any, sqlite_url: str, redis_url: str) -> None:
    _stream(sqlite_url, redis_url, srv.key_prefix, STREAM_A, "conn_a")
    _stream(sqlite_url, srv.second_redis_url, srv.key_prefix, STREAM_B, "conn_b")


def test_api_reads_the_selected_redis_connection(
    airflow_api_server: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    _two_streams(srv, sqlite_url, redis_url)
    auth = {"Authorization": f"Bearer {srv.token()}"}

    def get(path: str) -> tuple[int, Any]:
        status, _, body = srv.http("GET", path, headers=auth)
        return status, json.loads(body)

    status, doc = get("/keyset/api/connections")
    assert status == 200, doc
    # The configured default first, then every connection of type redis; not the postgres one.
    assert doc["default"] == srv.redis_conn_id
    assert doc["connections"] == [srv.redis_conn_id, srv.second_conn_id], doc

    def names(query: str) -> tuple[str, list[str]]:
        status, doc = get(f"/keyset/api/streams{query}")
        assert status == 200, doc
        return doc["redis_conn_id"], [s["stream"] for s in doc["streams"]]

    assert names("") == (srv.redis_conn_id, [STREAM_A])
    assert names(f"?conn={srv.redis_conn_id}") == (srv.redis_conn_id, [STREAM_A])
    assert names(f"?conn={srv.second_conn_id}") == (srv.second_conn_id, [STREAM_B])
    # Each stream's own routes read the chosen connection too.
    status, snap = get(f"/keyset/api/streams/{STREAM_B}?conn={srv.second_conn_id}")
    assert status == 200 and snap["rounds"][0]["round_id"] == "r1", snap
    status, rnd = get(f"/keyset/api/streams/{STREAM_B}/rounds/r1?conn={srv.second_conn_id}")
    assert status == 200 and rnd["n_ranges"] == 1, rnd
    assert get(f"/keyset/api/streams/{STREAM_B}")[0] == 404  # not in the default Redis

    # A URL, a path or any other non-id is refused by the rule before anything is read; a
    # connection that is not of type redis, or none, is a 404 naming it (no secret).
    for bad in ("redis://evil:6379/0", "..%2Fx", "a%20b", "-x", "x" * 251):
        status, doc = get(f"/keyset/api/streams?conn={bad}")
        assert status in (400, 422), (bad, status, doc)
    status, doc = get("/keyset/api/streams?conn=keyset_ui_not_redis")
    assert status == 404 and "keyset_ui_not_redis" in doc["detail"], doc
    assert "127.0.0.1:1" not in doc["detail"]
    status, doc = get("/keyset/api/streams?conn=no_such_conn")
    assert status == 404 and "no_such_conn" in doc["detail"], doc


def test_connections_lists_redis_connections_of_the_metadata_db(airflow_api_server: Any) -> None:
    """A connection of type redis created in Airflow's metadata database (``airflow connections
    add``, as an admin would) is offered too, after the environment's; others are not."""
    srv = airflow_api_server
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        {
            "AIRFLOW_HOME": str(srv.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{srv.home / 'airflow.db'}",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),  # this checkout's plugin
        }
    )

    def cli(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "airflow", "connections", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    auth = {"Authorization": f"Bearer {srv.token()}"}
    cli("add", "zz_db_redis", "--conn-type", "redis", "--conn-host", "127.0.0.1")
    cli("add", "zz_db_postgres", "--conn-type", "postgres", "--conn-host", "127.0.0.1")
    try:
        status, _, body = srv.http("GET", "/keyset/api/connections", headers=auth)
        assert status == 200, body
        assert json.loads(body)["connections"] == [
            srv.redis_conn_id,
            srv.second_conn_id,
            "zz_db_redis",
        ], body
    finally:
        cli("delete", "zz_db_redis")
        cli("delete", "zz_db_postgres")


def test_page_selector_shows_the_streams_of_each_connection(
    airflow_api_server: Any, chromium: Any, sqlite_url: str, redis_url: str
) -> None:
    srv = airflow_api_server
    _two_streams(srv, sqlite_url, redis_url)
    shown = """(() => ({
        conn: document.querySelector('#source-info').dataset.conn,
        options: [...document.querySelectorAll('#redis-conn option')].map(o => o.value),
        streams: [...document.querySelectorAll('section.stream')].map(s => s.dataset.stream)}))()"""
    open_in_airflow(chromium, srv.base_url, "plugin/keyset?refresh=0", srv.token())
    chromium.wait("document.querySelectorAll('#redis-conn option').length === 2")
    got = chromium.evaluate(shown)
    assert got == {
        "conn": srv.redis_conn_id,
        "options": [srv.redis_conn_id, srv.second_conn_id],
        "streams": [STREAM_A],
    }, got
    # Choose the second connection: its stream, and the choice is kept in the URL.
    chromium.driver.execute_script(
        "const s = document.querySelector('#redis-conn');"
        "const set = Object.getOwnPropertyDescriptor(HTMLSelectElement.prototype, 'value').set;"
        f"set.call(s, '{srv.second_conn_id}');"
        "s.dispatchEvent(new Event('change', {bubbles: true}));"
    )
    chromium.wait(f"document.querySelector('#source-info').dataset.conn === '{srv.second_conn_id}'")
    got = chromium.evaluate(shown)
    assert got["streams"] == [STREAM_B], got
    assert f"conn={srv.second_conn_id}" in chromium.driver.current_url
    # Opened with ?conn= (a link someone shared): the same connection.
    open_in_airflow(
        chromium,
        srv.base_url,
        f"plugin/keyset?refresh=0&conn={srv.second_conn_id}",
        srv.token(),
    )
    chromium.wait("document.querySelector('#source-info')")
    got = chromium.evaluate(shown)
    assert got["conn"] == srv.second_conn_id and got["streams"] == [STREAM_B], got
    assert chromium.evaluate("document.querySelector('#redis-conn').value") == srv.second_conn_id
