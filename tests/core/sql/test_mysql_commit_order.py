"""MariaDB commit order: ``AUTO_INCREMENT`` keys taken before the bound was read and committed after
it are still delivered; what defeats the wait is refused unless ``settle_seconds`` opts in.

InnoDB hands out ``AUTO_INCREMENT`` values at insert and makes them visible at commit, so key 1
can commit after key 2 was read as ``max(key)``. ``plan`` waits, bounded, for every InnoDB
transaction open when it read the bound (``information_schema.INNODB_TRX``, PROCESS privilege).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import CommitOrderTimeoutError, ConfigurationError


def _table(url: str, engine: str = "InnoDB") -> sa.Engine:
    eng = sa.create_engine(url, poolclass=NullPool)
    with eng.begin() as c:
        c.exec_driver_sql(
            f"CREATE TABLE ev (seq bigint AUTO_INCREMENT PRIMARY KEY, p int NOT NULL) ENGINE={engine}"
        )
    return eng


def _traversal(url: str, redis_url: str, key_prefix: str, **kw: Any) -> KeysetTraversal:
    return KeysetTraversal(
        url, table="ev", key="seq", redis_url=redis_url, stream="ev", key_prefix=key_prefix, **kw
    )


def _hold_lower_key(eng: sa.Engine) -> tuple[sa.Connection, Any, int]:
    """A transaction that took key 1 and has not committed; key 2 committed after it."""
    held = eng.connect()
    tx = held.begin()
    held.exec_driver_sql("INSERT INTO ev (p) VALUES (1)")
    low = int(held.exec_driver_sql("SELECT LAST_INSERT_ID()").scalar_one())
    with eng.begin() as c:
        c.exec_driver_sql("INSERT INTO ev (p) VALUES (2)")
    return held, tx, low


def test_a_lower_key_committed_after_the_bound_was_read_is_delivered(
    mariadb_db_url, redis_url, key_prefix
):
    """Without the wait, ``plan`` returns end=2 at once while key 1 is uncommitted; key 1 then
    commits below the stream's watermark and no round ever delivers it. With it, ``plan`` returns
    only after the holder ended, and the round delivers key 1."""
    eng = _table(mariadb_db_url)
    held, tx, low = _hold_lower_key(eng)
    state = {"open": True}
    out: dict[str, Any] = {}
    t = _traversal(mariadb_db_url, redis_url, key_prefix, commit_wait_timeout=120)

    def plan() -> None:
        try:
            out["round"] = t.plan(max_ranges=1, new_stream=True)
            out["returned_while_open"] = state["open"]
        except BaseException as exc:  # surfaced by the assertion below
            out["error"] = exc

    th = threading.Thread(target=plan)
    th.start()
    th.join(2.0)  # gives a plan that does not wait time to return early; decides nothing
    state["open"] = False  # cleared *before* the commit is sent
    tx.commit()
    held.close()
    th.join(120)
    assert "error" not in out, out.get("error")
    assert out["returned_while_open"] is False
    rnd = out["round"]
    seen: list[int] = []
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, lambda ch: seen.extend(ch.keys))
    assert sorted(seen) == [low, low + 1]
    t.close_round(rnd.round_id)
    with eng.begin() as c:
        c.exec_driver_sql("INSERT INTO ev (p) VALUES (3)")
    rnd2 = t.plan(
        max_ranges=1, new_stream=True
    )  # the next round starts above key 2: key 1 was delivered once
    for r in rnd2.ranges:
        t.traverse(rnd2.round_id, r.range_id, lambda ch: seen.extend(ch.keys))
    assert sorted(seen) == [low, low + 1, low + 2]
    t.close()
    eng.dispose()


def test_the_wait_is_bounded_and_names_the_blocker(mariadb_db_url, redis_url, key_prefix):
    eng = _table(mariadb_db_url)
    held, tx, _low = _hold_lower_key(eng)
    thread = held.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()
    t = _traversal(mariadb_db_url, redis_url, key_prefix, commit_wait_timeout=0.5)
    try:
        with pytest.raises(
            CommitOrderTimeoutError,
            match=rf"did not end within .* s: thread {thread} user root .*KILL {thread}",
        ):
            t.plan(new_stream=True)
    finally:
        tx.rollback()
        held.close()
        t.close()
        eng.dispose()


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_a_stale_copy_of_innodb_trx_does_not_hide_the_holder(
    driver, mariadb_db_url, redis_url, key_prefix
):
    """InnoDB answers INNODB_TRX from a copy it refreshes only after 0.1 s in which no session
    read it: a monitor polling it every 20 ms keeps serving the copy taken before key 1 was
    taken. Before: the plan read that copy, saw no holder and returned end=2 while key 1 was
    uncommitted. Now it reads again until the copy is as of its read (once the monitor stops)
    and waits for the holder."""
    url = sa.engine.make_url(mariadb_db_url).set(drivername=f"mysql+{driver}")
    url_text = url.render_as_string(hide_password=False)
    eng = _table(url_text)
    stop, polled = threading.Event(), threading.Event()
    monitor = eng.connect().execution_options(isolation_level="AUTOCOMMIT")

    def poll() -> None:
        while not stop.is_set():
            monitor.exec_driver_sql("SELECT COUNT(*) FROM information_schema.INNODB_TRX").all()
            polled.set()
            stop.wait(0.02)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out: dict[str, Any] = {}
    state = {"open": True}
    t = _traversal(url_text, redis_url, key_prefix, commit_wait_timeout=120)
    try:
        assert polled.wait(60)
        held, tx, low = _hold_lower_key(eng)

        def plan() -> None:
            try:
                out["round"] = t.plan(max_ranges=1, new_stream=True)
                out["returned_while_open"] = state["open"]
            except BaseException as exc:  # surfaced by the assertion below
                out["error"] = exc

        th = threading.Thread(target=plan)
        th.start()
        th.join(1.5)  # the plan reads while the monitor pins the old copy; decides nothing
        stop.set()
        watcher.join(30)
        th.join(1.0)  # gives a plan that does not wait time to return early; decides nothing
        state["open"] = False  # cleared *before* the commit is sent
        tx.commit()
        held.close()
        th.join(120)
        assert "error" not in out, out.get("error")
        assert out["returned_while_open"] is False
        assert out["round"].end_key == low + 1
    finally:
        stop.set()
        watcher.join(30)
        monitor.close()
        t.close()
        eng.dispose()


@pytest.fixture
def user_without_process(mariadb_url: str, mariadb_db_url: str):
    """A user with every privilege on the test's database but not PROCESS; dropped afterwards."""
    name = f"ks_np_{uuid.uuid4().hex[:8]}"
    db = sa.engine.make_url(mariadb_db_url).database
    admin = sa.create_engine(mariadb_url, poolclass=NullPool)
    with admin.begin() as c:
        c.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'pw'")
        c.exec_driver_sql(f"GRANT ALL ON `{db}`.* TO '{name}'@'127.0.0.1'")
    url = sa.engine.make_url(mariadb_db_url).set(username=name, password="pw")
    yield url.render_as_string(hide_password=False)
    with admin.begin() as c:
        c.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")
    admin.dispose()


def test_without_process_privilege_the_plan_is_refused_unless_settle_opts_in(
    mariadb_db_url, user_without_process, redis_url, key_prefix, redis_client
):
    eng = _table(mariadb_db_url)
    with eng.begin() as c:
        c.exec_driver_sql("INSERT INTO ev (p) VALUES (1), (2)")
    t = _traversal(user_without_process, redis_url, key_prefix)
    with pytest.raises(ConfigurationError, match=r"lacks the PROCESS privilege.*GRANT PROCESS"):
        t.plan(new_stream=True)
    t.close()
    assert [k for k in redis_client.scan_iter(f"{key_prefix}:*") if b":round" in k] == []
    ok = _traversal(user_without_process, redis_url, key_prefix, settle_seconds=0.01)
    rnd = ok.plan(new_stream=True)
    assert rnd.end_key == 2
    ok.close()
    eng.dispose()


def test_a_table_not_in_innodb_is_refused_unless_settle_opts_in(
    mariadb_db_url, redis_url, key_prefix
):
    eng = _table(mariadb_db_url, engine="Aria")
    with eng.begin() as c:
        c.exec_driver_sql("INSERT INTO ev (p) VALUES (1)")
    t = _traversal(mariadb_db_url, redis_url, key_prefix)
    with pytest.raises(ConfigurationError, match=r"stored in Aria, not InnoDB.*ENGINE=InnoDB"):
        t.plan(new_stream=True)
    t.close()
    ok = _traversal(mariadb_db_url, redis_url, key_prefix, settle_seconds=0.01)
    assert ok.plan(new_stream=True).end_key == 1
    ok.close()
    eng.dispose()


def test_a_long_autocommit_select_is_not_waited_for(mariadb_db_url, redis_url, key_prefix):
    """A reporting query running in autocommit (``trx_autocommit_non_locking``) can write no key:
    ``plan`` does not wait for it, whatever ``commit_wait_timeout``."""
    eng = _table(mariadb_db_url)
    with eng.begin() as c:
        c.exec_driver_sql("INSERT INTO ev (p) VALUES (1)")
    reader = eng.connect().execution_options(isolation_level="AUTOCOMMIT")
    reader_id = reader.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()

    def read() -> None:
        with contextlib.suppress(sa.exc.DBAPIError):  # ended by KILL QUERY below
            reader.exec_driver_sql("SELECT SLEEP(60) FROM ev").all()

    th = threading.Thread(target=read, daemon=True)
    th.start()
    probe = eng.connect()
    try:
        for _ in range(500):  # until the SELECT is an open InnoDB transaction (bounded)
            if probe.exec_driver_sql(
                "SELECT COUNT(*) FROM information_schema.INNODB_TRX "
                f"WHERE trx_mysql_thread_id = {reader_id} AND trx_autocommit_non_locking = 1"
            ).scalar_one():
                break
            threading.Event().wait(0.01)
        else:
            pytest.fail("the reader's SELECT never showed in INNODB_TRX")
        t = _traversal(mariadb_db_url, redis_url, key_prefix, commit_wait_timeout=0.5)
        assert (
            t.plan(new_stream=True).end_key == 1
        )  # a wait for the reader would time out after 0.5 s
        t.close()
    finally:
        probe.exec_driver_sql(f"KILL QUERY {reader_id}")
        probe.close()
        th.join(30)
        reader.close()
        eng.dispose()
