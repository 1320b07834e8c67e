"""Named connections and the commit-order wait across streams, on real PostgreSQL and MariaDB.

Every connection a traversal opens carries ``keyset:<stream>:<round>:<range>`` (``keyset:<stream>:
plan`` before a range): ``application_name`` on PostgreSQL (psycopg2 and psycopg 3), the
connection attribute ``program_name`` on MariaDB with PyMySQL, the user variable
``@keyset_program_name`` with mysqlclient (``core/sql/naming.py``). A plan of
one stream does not wait for the provider's workers of another stream that do not write its
source (sequence-fed key), does wait for one that writes it, and its timeout error names whom it
waited for (pid, application_name, transaction age), never a row's values.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import CommitOrderTimeoutError
from airflow_keyset_provider.core.sql import naming

PG_DRIVERS = ["postgresql+psycopg2", "postgresql+psycopg"]
MY_DRIVERS = ["mysql+pymysql", "mysql+mysqldb"]
SECRET = "do-not-log-me-4711"


def _url(url: str, driver: str) -> str:
    return sa.engine.make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def _traversal(url: str, table: str, stream: str, redis_url: str, prefix: str, **kw: Any):
    return KeysetTraversal(
        url, table=table, key="id", redis_url=redis_url, stream=stream, key_prefix=prefix, **kw
    )


# ---------------------------------------------------------------------------- the names


def test_stream_tags_are_short_plain_and_distinct():
    assert naming.stream_tag("orders") == "orders"
    long_a, long_b = "x" * 40 + "a", "x" * 40 + "b"
    tags = {naming.stream_tag(s) for s in (long_a, long_b, "a:b", "a_b", "ü")}
    assert len(tags) == 5  # shortened names keep a hash: no two streams share a tag
    for s in (long_a, "a:b", "ü", "x" * 500):
        tag = naming.stream_tag(s)
        assert len(tag) <= naming.STREAM_CHARS and ":" not in tag and tag.isascii()
    name = naming.ConnectionName("y" * 300)
    name.at_range("r" * 100, 12345)
    assert len(name.text.encode()) <= naming.LIMIT and name.text.startswith(name.prefix)
    assert naming.is_other_stream("keyset:other:r1:0", naming.stream_prefix("orders"))
    assert not naming.is_other_stream("keyset:orders:r1:0", naming.stream_prefix("orders"))
    assert not naming.is_other_stream("psql", naming.stream_prefix("orders"))


def _names(engine: sa.Engine, prefix: str) -> list[str]:
    with engine.connect() as c:
        return sorted(
            r[0]
            for r in c.execute(
                sa.text(
                    "SELECT application_name FROM pg_stat_activity "
                    "WHERE application_name LIKE :p AND datname = current_database()"
                ),
                {"p": prefix + "%"},
            )
        )


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_every_postgresql_connection_names_stream_round_and_range(
    driver, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """While range i runs, the source's read connection and the processor's target connection
    both carry ``keyset:<stream>:<round>:<i>``; moving to the next range renames them."""
    with pg_engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE ev (id bigserial PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql("INSERT INTO ev (p) SELECT 'x' FROM generate_series(1, 40)")
    url = _url(pg_schema_url, driver)
    stream = f"names_{driver[-1]}"
    t = _traversal(url, "ev", stream, redis_url, key_prefix, target_url=url, checkpoint_url=url)
    seen: dict[int, tuple[str, list[str]]] = {}
    try:
        rnd = t.plan(max_ranges=2, new_stream=True)
        assert len(rnd.ranges) == 2
        for r in rnd.ranges:

            def processor(chunk, rid=r.range_id):
                own = chunk.connection.exec_driver_sql(
                    "SELECT current_setting('application_name')"
                ).scalar_one()
                seen.setdefault(rid, (own, _names(pg_engine, f"keyset:{stream}:")))

            t.traverse(rnd.round_id, r.range_id, processor, chunk_size=10, prefetch=False)
        assert t.mirror is not None  # the checkpoint mirror's connections follow too
        with t.mirror.engine.connect() as c:
            mirror_name = c.exec_driver_sql("SELECT current_setting('application_name')").scalar()
        assert mirror_name == f"keyset:{stream}:{rnd.round_id}:1"
    finally:
        t.close()
    for rid in (0, 1):
        want = f"keyset:{stream}:{rnd.round_id}:{rid}"
        own, everyone = seen[rid]
        assert own == want
        # the held read connection and the target's: both named after the running range (an
        # idle pooled one, e.g. the mirror's, keeps its last name until it is checked out)
        assert everyone.count(want) >= 2, everyone


# ---------------------------------------------------------------------------- the wait


@contextmanager
def _worker_holding_a_write(
    url: str, redis_url: str, prefix: str, write_sql: str
) -> Iterator[tuple[KeysetTraversal, str]]:
    """Stream ``a`` traverses table ``a`` with ``target_url`` = the same database; its processor
    runs ``write_sql`` in the chunk's transaction, then blocks until the block ends. Yields the
    traversal and the name its connections carry."""
    a = _traversal(url, "a", "a", redis_url, prefix, target_url=url)
    rnd = a.plan(max_ranges=1, new_stream=True)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def processor(chunk):
        chunk.connection.exec_driver_sql(write_sql)
        inside.set()
        release.wait(120)

    def run():
        try:
            a.traverse(rnd.round_id, 0, processor, chunk_size=100, prefetch=False)
        except BaseException as exc:  # reported below
            errors.append(exc)

    th = threading.Thread(target=run)
    th.start()
    try:
        assert inside.wait(60), errors
        yield a, f"keyset:a:{rnd.round_id}:0"
    finally:
        release.set()
        th.join(120)
        a.close()
    assert not errors, errors


def _plan_b_beside_a_worker(url: str, redis_url: str, prefix: str) -> None:
    """While stream a's worker holds a write on its target ``a_out`` open, stream b plans (a
    1 s wait bound) and delivers its three keys."""
    write = f"INSERT INTO a_out VALUES (1, '{SECRET}')"
    with _worker_holding_a_write(url, redis_url, prefix, write):
        b = _traversal(url, "b", "b", redis_url, prefix, commit_wait_timeout=1.0)
        try:
            rnd = b.plan(max_ranges=1, new_stream=True)
            seen: list[int] = []
            b.traverse(rnd.round_id, 0, lambda ch: seen.extend(ch.keys))
            assert seen == [1, 2, 3]
        finally:
            b.close()


def _tables(engine: sa.Engine, b_key: str = "id bigserial PRIMARY KEY") -> None:
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE a (id bigserial PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql("INSERT INTO a (p) SELECT 'x' FROM generate_series(1, 10)")
        c.exec_driver_sql("CREATE TABLE a_out (id bigint PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql(f"CREATE TABLE b ({b_key}, p text NOT NULL)")
        if "serial" in b_key:
            c.exec_driver_sql("INSERT INTO b (p) VALUES ('1'), ('2'), ('3')")
        else:
            c.exec_driver_sql("INSERT INTO b (id, p) VALUES (1, '1'), (2, '2'), (3, '3')")


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_plan_does_not_wait_for_another_streams_worker_that_does_not_write_its_source(
    driver, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Stream a's worker holds a write transaction on its own target (``a_out``) open; a plan
    of stream b (a bigserial key on table b) returns at once. Before: CommitOrderTimeoutError."""
    _tables(pg_engine)
    url = _url(pg_schema_url, driver)
    _plan_b_beside_a_worker(url, redis_url, key_prefix)


@pytest.mark.parametrize("driver", PG_DRIVERS)
def test_plan_waits_for_another_streams_worker_that_writes_its_source_and_names_it(
    driver, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Stream a's worker inserted a row into b (stream b's source) and has not committed: b's
    plan waits for it, and the timeout error names its pid, application_name and transaction
    age, without the row's values. Before: the error showed an empty application name."""
    _tables(pg_engine)
    url = _url(pg_schema_url, driver)
    write = f"INSERT INTO b (p) VALUES ('{SECRET}')"
    with _worker_holding_a_write(url, redis_url, key_prefix, write) as (_a, a_name):
        b = _traversal(url, "b", "b", redis_url, key_prefix, commit_wait_timeout=0.5)
        try:
            with pytest.raises(CommitOrderTimeoutError) as err:
                b.plan(max_ranges=1, new_stream=True)
        finally:
            b.close()
    text = str(err.value)
    assert f"application_name {a_name!r}" in text, text
    assert "pid " in text and "transaction open for" in text and "writing the source" in text
    assert SECRET not in text


def test_plan_of_a_key_not_fed_by_a_sequence_still_waits_for_other_streams(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A key whose values are not taken at write time (here: written by the application) could
    have been taken by the other stream's transaction before the bound was read: the plan
    waits, and names the worker."""
    _tables(pg_engine, b_key="id bigint PRIMARY KEY")
    write = f"INSERT INTO a_out VALUES (1, '{SECRET}')"
    with _worker_holding_a_write(pg_schema_url, redis_url, key_prefix, write) as (_a, a_name):
        b = _traversal(pg_schema_url, "b", "b", redis_url, key_prefix, commit_wait_timeout=0.5)
        try:
            with pytest.raises(CommitOrderTimeoutError, match=f"application_name '{a_name}'"):
                b.plan(max_ranges=1, new_stream=True)
        finally:
            b.close()


# ---------------------------------------------------------------------------- MariaDB


@pytest.fixture(scope="module")
def mariadb_ps_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway MariaDB server with the performance schema on and metadata locks recorded
    (the shared test server runs with MariaDB's default, the performance schema off, where no
    connection attribute can be read). Stopped at the end of the module."""
    server, install = shutil.which("mariadbd"), shutil.which("mariadb-install-db")
    if not server or not install:
        pytest.skip("mariadbd / mariadb-install-db are not installed")
    home = tmp_path_factory.mktemp("mariadb-ps")
    data = home / "data"
    subprocess.run(
        [
            install,
            "--no-defaults",
            f"--datadir={data}",
            "--skip-test-db",
            "--user=root",
            "--auth-root-authentication-method=normal",  # root without a password over TCP
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            server,
            "--no-defaults",
            f"--datadir={data}",
            f"--socket={home / 'sock'}",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            "--user=root",
            "--performance-schema=ON",
            "--performance-schema-instrument=wait/lock/metadata/sql/mdl=ON",
            "--innodb-buffer-pool-size=32M",
            "--skip-log-bin",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(home / "err.log", "wb"),  # noqa: SIM115 (closed with the process)
    )
    url = f"mysql+pymysql://root@127.0.0.1:{port}/test"
    try:
        admin = sa.create_engine(url.replace("/test", "/"), poolclass=NullPool)
        for _ in range(300):
            try:
                with admin.begin() as c:
                    c.exec_driver_sql("CREATE DATABASE IF NOT EXISTS test CHARACTER SET utf8mb4")
                break
            except sa.exc.OperationalError:
                if proc.poll() is not None:
                    raise RuntimeError((home / "err.log").read_text()) from None
                time.sleep(0.1)
        admin.dispose()
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def _my_tables(url: str) -> sa.Engine:
    eng = sa.create_engine(url, poolclass=NullPool)
    with eng.begin() as c:
        for t in ("a", "a_out", "b"):
            c.exec_driver_sql(f"DROP TABLE IF EXISTS {t}")
        c.exec_driver_sql("CREATE TABLE a (id bigint AUTO_INCREMENT PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql("INSERT INTO a (p) VALUES ('x'), ('y')")
        c.exec_driver_sql("CREATE TABLE a_out (id bigint PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql("CREATE TABLE b (id bigint AUTO_INCREMENT PRIMARY KEY, p text NOT NULL)")
        c.exec_driver_sql("INSERT INTO b (p) VALUES ('1'), ('2'), ('3')")
    return eng


#: every named connection of the server: (name, processlist id), by attribute or user variable
_MY_NAMES = (
    "SELECT ATTR_VALUE, PROCESSLIST_ID FROM performance_schema.session_connect_attrs "
    "WHERE ATTR_NAME = 'program_name' "
    "UNION ALL SELECT CONVERT(v.VARIABLE_VALUE USING utf8mb4), t.PROCESSLIST_ID "
    "FROM performance_schema.user_variables_by_thread v "
    "JOIN performance_schema.threads t ON t.THREAD_ID = v.THREAD_ID "
    "WHERE v.VARIABLE_NAME = 'keyset_program_name'"
)


@pytest.mark.parametrize("driver", MY_DRIVERS)
def test_mariadb_connections_are_named_after_each_range(
    driver, mariadb_ps_url, redis_url, key_prefix
):
    """PyMySQL: ``program_name`` (``session_connect_attrs``); mysqlclient: ``@keyset_program_name``
    (``user_variables_by_thread``). While range i runs, the source's read connection and the
    target's connection carry ``keyset:<stream>:<round>:<i>``, and nothing of the stream carries
    another name. mysqlclient keeps a user's ``init_command``. Before: mysqlclient's connections
    carried no name."""
    eng = _my_tables(mariadb_ps_url)
    url = _url(mariadb_ps_url, driver)
    if driver.endswith("mysqldb"):  # a user's init_command runs too
        url += "?init_command=SET%20%40user_tag%20%3D%207"
    stream = f"named_{driver[-1]}"
    t = _traversal(url, "a", stream, redis_url, key_prefix, target_url=url)
    found: dict[int, list[tuple[str, bool]]] = {}
    tags: list[Any] = []
    try:
        rnd = t.plan(max_ranges=2, new_stream=True)
        assert len(rnd.ranges) == 2
        for r in rnd.ranges:

            def processor(chunk, rid=r.range_id):
                own = chunk.connection.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()
                if driver.endswith("mysqldb"):
                    tags.append(chunk.connection.exec_driver_sql("SELECT @user_tag").scalar())
                with eng.connect() as c:
                    found.setdefault(rid, []).extend(
                        (str(v), int(pid) == int(own))
                        for v, pid in c.exec_driver_sql(_MY_NAMES)
                        if str(v).startswith(f"keyset:{stream}:")
                    )

            t.traverse(rnd.round_id, r.range_id, processor, prefetch=False)
    finally:
        t.close()
        eng.dispose()
    for rid in (0, 1):
        want = f"keyset:{stream}:{rnd.round_id}:{rid}"
        names = found[rid]
        assert (want, True) in names, names  # the processor's own (target) connection
        # the source's read connection, and no connection of the stream under another name
        assert [v for v, own in names if not own] and all(v == want for v, _ in names), names
    if driver.endswith("mysqldb"):
        assert tags == [7, 7], tags


@pytest.mark.parametrize("driver", MY_DRIVERS)
def test_mariadb_plan_skips_other_streams_worker_unless_it_writes_the_source(
    driver, mariadb_ps_url, redis_url, key_prefix
):
    """Stream a's worker holds a write on its target ``a_out``: b's plan (AUTO_INCREMENT key)
    returns at once (before: CommitOrderTimeoutError; with mysqlclient until its connections
    were named). When a's worker has inserted into b, the plan waits, and the timeout names its
    thread, program_name and age, not the row. (It failed when a's plan had read INNODB_TRX less
    than 0.1 s before b's: InnoDB served b the copy from before a's insert;
    ``test_mysql_commit_order`` has the direct test.)"""
    eng = _my_tables(mariadb_ps_url)
    url = _url(mariadb_ps_url, driver)
    _plan_b_beside_a_worker(url, redis_url, key_prefix)
    write = f"INSERT INTO b (p) VALUES ('{SECRET}')"
    prefix2 = key_prefix + "x"
    with _worker_holding_a_write(url, redis_url, prefix2, write) as (_a, a_name):
        b = _traversal(url, "b", "b", redis_url, prefix2, commit_wait_timeout=0.5)
        try:
            with pytest.raises(CommitOrderTimeoutError) as err:
                b.plan(max_ranges=1, new_stream=True)
        finally:
            b.close()
    text = str(err.value)
    assert f"program_name {a_name!r}" in text and "writing the source" in text, text
    assert "thread " in text and "open for" in text and SECRET not in text
    eng.dispose()


def test_mariadb_without_performance_schema_waits_for_a_named_worker(
    mariadb_db_url, redis_url, key_prefix
):
    """The shared server runs with the performance schema off (MariaDB's default): no session's
    name can be read, so b's plan waits for a's mysqlclient worker although it writes only its
    own target, and times out naming the thread (as before names existed)."""
    url = _url(mariadb_db_url, "mysql+mysqldb")
    _my_tables(url).dispose()
    write = f"INSERT INTO a_out VALUES (1, '{SECRET}')"
    with _worker_holding_a_write(url, redis_url, key_prefix, write):
        b = _traversal(url, "b", "b", redis_url, key_prefix, commit_wait_timeout=0.3)
        try:
            with pytest.raises(CommitOrderTimeoutError) as err:
                b.plan(max_ranges=1, new_stream=True)
        finally:
            b.close()
    text = str(err.value)
    assert "thread " in text and "program_name" not in text and SECRET not in text, text
