"""``exactly_once=True`` with a MariaDB/MySQL target (InnoDB, REPEATABLE READ, the server's
default): the ledger row commits with the processor's writes, a chunk committed whose Redis
advance was lost is not delivered again, a stale owner's transaction rolls back, a group of
chunks is one transaction, and the ledger table is created on first use. With either driver:
PyMySQL and mysqlclient (``mysql+mysqldb://``, the one Airflow's MySQL hook hands out). The
source is PostgreSQL; the target a fresh MariaDB database. (Real servers.)"""

from __future__ import annotations

from collections import Counter
from typing import Any

import _services
import pytest
import sqlalchemy as sa
from core_support import make_events, traversal
from sqlalchemy.pool import NullPool
from test_exactly_once import StealAfter, check_group_commit, check_raising_calls, run_stale_owner

from airflow_keyset_provider.core.errors import LeaseLostError
from airflow_keyset_provider.core.keys import encode_key

DRIVERS = ["pymysql", "mysqldb"]


@pytest.fixture(params=DRIVERS)
def target(request, mariadb_db_url):
    """(URL, engine) of the MariaDB target with the test's driver, holding ``effects`` (no
    unique key: a row written twice shows)."""
    driver = request.param
    if driver == "mysqldb":
        _services.require_module("MySQLdb", _services.MYSQLCLIENT_WHY)
    url = sa.engine.make_url(mariadb_db_url).set(drivername=f"mysql+{driver}")
    rendered = url.render_as_string(hide_password=False)
    engine = sa.create_engine(rendered, poolclass=NullPool)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE effects (seq bigint NOT NULL) ENGINE=InnoDB")
    yield rendered, engine
    engine.dispose()


def _write(chunk: Any) -> None:
    chunk.connection.execute(
        sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in chunk.keys]
    )


def _effects(engine: sa.Engine) -> Counter:
    with engine.connect() as c:
        return Counter(r[0] for r in c.execute(sa.text("SELECT seq FROM effects")))


def _ledger(engine: sa.Engine) -> list[Any]:
    with engine.connect() as c:
        q = "SELECT hi, done, epoch FROM keyset_ledger WHERE seg > 0 ORDER BY seg"
        return list(c.execute(sa.text(q)))


def test_a_chunk_committed_but_not_advanced_is_not_delivered_again(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    url, engine = target
    make_events(pg_engine, list(range(1, 501)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = StealAfter(redis_client, t, rnd, at=201)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=True)
    with pytest.raises(LeaseLostError):
        t.traverse(rnd.round_id, 0, proc, **kw)
    with engine.connect() as c:  # (200, 300] committed with the ledger, its advance refused
        assert c.execute(sa.text("SELECT count(*) FROM effects")).scalar() == 300
    res = t.traverse(rnd.round_id, 0, proc, **kw)
    assert res.complete and res.done == 500
    assert _effects(engine) == Counter(range(1, 501)) and proc.deliveries[201] == 1
    assert _ledger(engine) == [(encode_key((500,)), 500, 2)]
    t.close()


def test_a_stale_owners_transaction_is_rolled_back(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A is in the middle of (200, 300] (its insert done, uncommitted) when B takes the range
    over and finishes it; A's ledger step then finds the epoch raised and rolls back."""
    url, engine = target
    make_events(pg_engine, list(range(1, 501)))
    a = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    b = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    run_stale_owner(a, b, True)
    assert _effects(engine) == Counter(range(1, 501))
    a.close()
    b.close()


def test_group_commit_spans_one_transaction(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    url, engine = target
    make_events(pg_engine, list(range(1, 901)))
    check_group_commit(
        traversal(pg_schema_url, redis_url, key_prefix, target_url=url), engine, redis_client
    )


def test_a_raising_call_and_a_canary_leave_nothing(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """SAVEPOINTs on InnoDB: a call that writes then raises leaves nothing, isolation's canary
    is rolled back, the poison key writes nothing; every other key exactly once."""
    url, engine = target
    make_events(pg_engine, list(range(1, 61)))
    check_raising_calls(traversal(pg_schema_url, redis_url, key_prefix, target_url=url), engine)
