"""``verify=`` on a round under ``dag.test()`` on real PostgreSQL and MariaDB and real Redis
(``keyset_verify_dags.py``): the barrier verifies after every range is complete and before the
round closes. A round whose processor did its job verifies and closes; rows put back into the
predicate behind the traversal's back fail the verification, and either fail the barrier naming
the count and the keys (the round stays open) or go once through the processor and verify."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import keyset_verify_dags as kv
import pytest
import redis
import sqlalchemy as sa
from airflow.utils.state import DagRunState
from conftest import postgres_conn
from sqlalchemy.pool import NullPool
from test_downstream_example import asset_events
from test_example_dags import control, states, xcom
from test_keyset_mysql import mysql_conn

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.store.cursor_store import CursorStore

pytestmark = pytest.mark.airflow

# in the last range, before its last chunk: mapped tasks run in any order, so a row of another
# range could still be processed after the writer changed it back
REOPENED = [205, 230, 250]


@pytest.fixture(params=["postgresql", "mariadb"])
def orders_url(
    request: pytest.FixtureRequest, airflow_env: dict[str, Any], pg_url: str, monkeypatch: Any
) -> Iterator[str]:
    """``kt_orders`` (1..LAST, all open) and ``kt_reopen`` (empty) on the database of the
    parameter, the connection ``kt_verify_db`` pointing at it; its SQLAlchemy URL."""
    if request.param == "postgresql":
        url = request.getfixturevalue("pg_schema_url")
        monkeypatch.setenv(
            "AIRFLOW_CONN_KT_VERIFY_DB", postgres_conn(pg_url, airflow_env["schema"])
        )
    else:
        url = request.getfixturevalue("mariadb_db_url")
        monkeypatch.setenv("AIRFLOW_CONN_KT_VERIFY_DB", mysql_conn(url, "pymysql"))
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE kt_orders (id bigint NOT NULL PRIMARY KEY, "
                "status varchar(16) NOT NULL)"
            )
        )
        c.execute(sa.text("CREATE TABLE kt_reopen (id bigint NOT NULL PRIMARY KEY)"))
        c.execute(
            sa.text("INSERT INTO kt_orders VALUES (:i, 'open')"),
            [{"i": i} for i in range(1, kv.LAST + 1)],
        )
    engine.dispose()
    yield url


def _reopen_behind_the_back(url: str, keys: list[int]) -> None:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO kt_reopen VALUES (:i)"), [{"i": i} for i in keys])
    engine.dispose()


def _open_orders(url: str) -> list[int]:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.connect() as c:
        ids = [i for (i,) in c.execute(sa.text("SELECT id FROM kt_orders WHERE status = 'open'"))]
    engine.dispose()
    return sorted(ids)


def test_a_round_whose_processor_did_its_job_verifies_and_closes(orders_url, airflow_env):
    dr = kv.kt_verify_repair.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    totals = xcom(dr, "cancel_open.barrier")
    assert totals["done"] == kv.LAST
    assert totals["verification"]["state"] == "verified"
    assert totals["verification"]["matching"] == 0 and totals["verification"]["repaired"] is None
    assert totals["verification"]["rows_scanned"] == kv.LAST
    events = asset_events("kt_verify_repair", dr.run_id)
    assert [e["extra"]["verification"]["state"] for e in events] == ["verified"]


def test_rows_changed_behind_the_back_are_repaired_once_then_the_round_verifies(
    orders_url, airflow_env
):
    _reopen_behind_the_back(orders_url, REOPENED)
    dr = kv.kt_verify_repair.test()
    assert dr.state == DagRunState.SUCCESS, states(dr)
    v = xcom(dr, "cancel_open.barrier")["verification"]
    assert (v["state"], v["repaired"], v["matching"]) == ("verified", 3, 0)
    assert _open_orders(orders_url) == []
    rnd = control(airflow_env, "kt_verify_repair").round_status("r1")
    assert rnd.closed and rnd.verification_dict == v | {"seconds": rnd.verification_dict["seconds"]}


def test_fail_mode_fails_the_barrier_with_the_count_and_keys_and_leaves_the_round_open(
    orders_url, airflow_env
):
    _reopen_behind_the_back(orders_url, REOPENED)
    kv.FAILURES.clear()
    dr = kv.kt_verify_fail.test()
    assert dr.state == DagRunState.FAILED
    assert (
        "AirflowFailException: round r1: verification failed: 3 row(s) still match (first "
        "keys: 205, 230, 250)" in kv.FAILURES["barrier"]
    )
    got = states(dr)
    assert got["barrier"] == "failed" and got["traverse[0]"] == "success", got
    ctl = control(airflow_env, "kt_verify_fail")
    rnd = ctl.round_status("r1")
    assert not rnd.closed and ctl.watermark() is None  # nothing downstream sees it as done
    v = rnd.verification_dict
    assert v is not None
    assert (v["state"], v["matching"], v["first_keys"]) == ("failed", 3, ["205", "230", "250"])
    assert _open_orders(orders_url) == REOPENED  # fail mode repairs nothing


def test_the_deferred_barrier_verifies_and_repairs_in_execute_complete(
    orders_url, airflow_env, redis_url
):
    """The barrier defers before the round is traversed (by a thread, as workers elsewhere
    would); its trigger fires once every range is complete, and ``execute_complete`` verifies,
    repairs, closes and puts the verification on the asset event."""
    _reopen_behind_the_back(orders_url, REOPENED)
    stream, prefix = "kt_verify_defer", airflow_env["prefix"]
    client = redis.Redis.from_url(redis_url)
    channel = CursorStore(client, stream, prefix=prefix).events_channel
    errors: list[BaseException] = []

    def workers_elsewhere() -> None:
        try:
            deadline = time.monotonic() + 60
            while client.pubsub_numsub(channel)[0][1] == 0:  # until the trigger listens
                assert time.monotonic() < deadline, "the barrier never deferred to its trigger"
                time.sleep(0.05)
            t = KeysetTraversal(
                orders_url,
                "kt_orders",
                "id",
                redis_url,
                stream=stream,
                key_prefix=prefix,
                target_url=orders_url,
            )
            for spec in t.round("r1").ranges:
                t.traverse("r1", spec.range_id, kv.cancel_orders, chunk_size=50)
            t.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=workers_elsewhere, daemon=True)
    thread.start()
    dr = kv.kt_verify_defer.test()
    thread.join(30)
    assert not errors, errors
    assert dr.state == DagRunState.SUCCESS, states(dr)
    v = xcom(dr, "barrier")["verification"]
    assert (v["state"], v["repaired"]) == ("verified", 3)
    assert _open_orders(orders_url) == []
    events = asset_events("kt_verify_defer", dr.run_id)
    assert [(e["extra"]["verification"]["repaired"]) for e in events] == [3]
