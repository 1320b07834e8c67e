"""MySQL/MariaDB on the Airflow side: ``mysql`` connections through ``KeysetHook`` (source,
checkpoint mirror, processor target), and a plan -> traverse -> barrier DAG under ``dag.test()``
against a real MariaDB with every SQL connection of type ``mysql``, with either driver."""

from __future__ import annotations

import json
import types
from typing import Any

import _services
import pytest
import sqlalchemy as sa
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
from airflow.utils.state import DagRunState
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.extras import MissingExtraError
from airflow_keyset_provider.hooks import mysql_url as mysql_url_mod
from airflow_keyset_provider.hooks.keyset import KeysetHook
from airflow_keyset_provider.hooks.mysql_url import mysql_url

pytestmark = pytest.mark.airflow

STREAM = "kt_mysql_redispatch"  # the DAG id: the plan's default stream


def mysql_conn(url: str, driver: str | None) -> str:
    """An Airflow ``mysql`` connection (JSON) for the SQLAlchemy URL ``url``."""
    u = make_url(url)
    extra: dict[str, Any] = {"driver": driver} if driver else {}
    return json.dumps(
        {
            "conn_type": "mysql",
            "host": u.host,
            "port": u.port,
            "login": u.username,
            "password": u.password,
            "schema": u.database,
            "extra": extra,
        }
    )


def xcom(dr: Any, task_id: str, map_index: int = -1) -> Any:
    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(
                run_id=dr.run_id,
                dag_ids=dr.dag_id,
                task_ids=task_id,
                key="return_value",
                map_indexes=map_index,
            )
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def _insert_events(engine: sa.Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO kt_events (payload) VALUES (:p)"),
            [{"p": f"p{i}"} for i in range(n)],
        )


# ----------------------------------------------------------------------------- the hook


def test_mysql_url_takes_the_connection_fields_and_the_driver_of_the_extra(monkeypatch):
    conn = types.SimpleNamespace(
        host="db.example",
        port=3307,
        login="app",
        password="s3cret",
        schema="shop",
        extra_dejson={"driver": "pymysql"},
    )
    url = mysql_url(conn)
    assert url.drivername == "mysql+pymysql"
    assert (url.host, url.port, url.username, url.database) == ("db.example", 3307, "app", "shop")
    assert url.password == "s3cret" and "s3cret" not in str(url)  # rendered hidden
    assert dict(url.query) == {"charset": "utf8mb4"}

    conn.extra_dejson = {"driver": "oracle"}
    with pytest.raises(MissingExtraError, match="supported: mysqldb, pymysql"):
        mysql_url(conn)
    # a driver named by the extra but not installed: the error names the extra to install
    monkeypatch.setitem(mysql_url_mod.DRIVERS, "pymysql", ("no_such_dbapi_module", "mysql"))
    conn.extra_dejson = {"driver": "pymysql"}
    with pytest.raises(MissingExtraError, match=r"airflow-keyset-provider\[mysql\]"):
        mysql_url(conn)


def test_mysql_url_defaults_to_mysqlclient_when_installed_else_pymysql(monkeypatch):
    conn = types.SimpleNamespace(
        host="h", port=None, login=None, password=None, schema=None, extra_dejson={}
    )
    installed = {"MySQLdb": True, "pymysql": True}
    monkeypatch.setattr(mysql_url_mod, "_installed", lambda m: installed[m])
    assert mysql_url(conn).drivername == "mysql+mysqldb"
    installed["MySQLdb"] = False
    assert mysql_url(conn).drivername == "mysql+pymysql"
    installed["pymysql"] = False
    with pytest.raises(MissingExtraError, match="neither mysqlclient nor PyMySQL"):
        mysql_url(conn)


def test_keyset_hook_accepts_mysql_for_source_checkpoint_and_target(
    airflow_home, mariadb_db_url, monkeypatch
):
    monkeypatch.setenv("AIRFLOW_CONN_KT_MYSQL", mysql_conn(mariadb_db_url, "pymysql"))
    hook = KeysetHook("kt_mysql", checkpoint_conn_id="kt_mysql", target_conn_id="kt_mysql")
    for url in (hook.source_url(), hook.checkpoint_url(), hook.target_url()):
        assert isinstance(url, sa.URL) and url.drivername == "mysql+pymysql"
        assert url.database == make_url(mariadb_db_url).database
    engine = hook.get_conn()
    try:
        with engine.connect() as conn:
            assert "mariadb" in conn.exec_driver_sql("SELECT VERSION()").scalar().lower()
    finally:
        engine.dispose()


# ----------------------------------------------------------------------------- a DAG on MariaDB


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_dag_on_mariadb_chains_rounds_with_mysql_source_mirror_and_target(
    airflow_env, mariadb_db_url, monkeypatch, driver
):
    if driver == "mysqldb":
        _services.require_module("MySQLdb", _services.MYSQLCLIENT_WHY)
    import keyset_mysql_dags as module

    monkeypatch.setenv("AIRFLOW_CONN_KEYSET_MYSQL_DB", mysql_conn(mariadb_db_url, driver))
    engine = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE kt_events (seq BIGINT AUTO_INCREMENT PRIMARY KEY, "
            "payload VARCHAR(100) NOT NULL) ENGINE=InnoDB"
        )
        conn.exec_driver_sql(
            "CREATE TABLE kt_outbox (event_seq BIGINT PRIMARY KEY, "
            "payload VARCHAR(100) NOT NULL) ENGINE=InnoDB"
        )
    _insert_events(engine, 250)

    dr = module.kt_mysql_redispatch.test()
    assert dr.state == DagRunState.SUCCESS
    ranges = xcom(dr, "plan")
    assert len(ranges) == 3 and ranges[0]["lo"] is None and ranges[-1]["hi"] == 250
    assert {r["checkpoint_conn_id"] for r in ranges} == {"keyset_mysql_db"}
    totals = xcom(dr, "barrier")
    assert (totals["round_id"], totals["end_key"], totals["watermark"]) == ("r1", 250, 250)
    assert (totals["done"], totals["skipped"], totals["dead"]) == (250, 0, 0)

    _insert_events(engine, 70)  # the next run traverses only what arrived in between
    dr2 = module.kt_mysql_redispatch.test()
    assert dr2.state == DagRunState.SUCCESS
    totals2 = xcom(dr2, "barrier")
    assert (totals2["round_id"], totals2["start_key"], totals2["end_key"]) == ("r2", 250, 320)
    assert (totals2["done"], totals2["skipped"], totals2["dead"]) == (70, 0, 0)

    with engine.connect() as conn:
        # the target's transactions committed every chunk's rows, each once
        assert conn.exec_driver_sql(
            "SELECT count(*), count(DISTINCT event_seq), min(event_seq), max(event_seq) "
            "FROM kt_outbox"
        ).one() == (320, 320, 1, 320)
        # the checkpoint mirror on MariaDB holds both rounds, their ranges and the watermark
        mirrored = conn.exec_driver_sql(
            "SELECT round_id, range_id, doc FROM keyset_checkpoints WHERE stream = %s "
            "ORDER BY round_id, range_id",
            (STREAM,),
        ).all()
    engine.dispose()
    assert [json.loads(d)["watermark"] for _, i, d in mirrored if i == -2] == [encode_key((320,))]
    assert {r for r, i, _ in mirrored if i == -1} == {"r1", "r2"}
    assert len([1 for r, i, _ in mirrored if r == "r1" and i >= 0]) == 3


def test_the_nightly_example_dag_runs_on_mariadb(airflow_env, mariadb_db_url, monkeypatch):
    """``dags/nightly_event_redispatch.py`` itself, its tables made by the examples'
    ``create_example_tables`` on MariaDB and its connection ``keyset_examples_db`` of type
    ``mysql``: every event delivered to the outbox once (the upsert on MySQL/MariaDB), the round
    closed, the watermark at the end."""
    import nightly_event_redispatch as module
    from keyset_examples_common import create_example_tables, example_metadata

    monkeypatch.setenv("AIRFLOW_CONN_KEYSET_EXAMPLES_DB", mysql_conn(mariadb_db_url, "pymysql"))
    engine = sa.create_engine(mariadb_db_url, poolclass=NullPool)
    create_example_tables(engine)
    events = example_metadata().tables["im_events"]
    with engine.begin() as conn:
        conn.execute(
            events.insert(),
            [{"user_id": i % 7, "kind": "msg", "payload": f"p{i}"} for i in range(430)],
        )
    dr = module.dag.test()
    assert dr.state == DagRunState.SUCCESS
    totals = xcom(dr, "barrier")
    assert (totals["end_key"], totals["watermark"]) == (430, 430)
    assert (totals["done"], totals["skipped"], totals["dead"]) == (430, 0, 0)
    with engine.connect() as conn:
        assert conn.exec_driver_sql(
            "SELECT count(*), count(DISTINCT event_seq) FROM im_outbox"
        ).one() == (430, 430)
