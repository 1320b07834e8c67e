"""Scenario 4, dependency outage: the processor's dependency fails for a while.

Guarantee: while the dependency is down the cursor does not move and nothing is dead-lettered
because of the outage; the chunk is retried with exponential backoff inside the task and the
range finishes after the dependency recovers. When the outage outlasts the in-task budget the
call raises ``DependencyFailedError`` with the cursor where it was (an Airflow retry, here a new
``traverse``, finishes the range). This holds however the outage shows: a ``RetryableError``, an
unexpected exception, or every item of a chunk reported failed (``outage_failure_ratio``).

The dependencies are real: the PostgreSQL table the processor writes to (locked by another
session, so the processor's ``lock_timeout`` fires), or a local TCP service that is stopped and
started again.
"""

from __future__ import annotations

import random
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import (
    Chunk,
    ChunkResult,
    DependencyFailedError,
    KeysetTraversal,
    RetryableError,
)
from airflow_keyset_provider.core.keys import encode_key

N_ROWS = 200


class AckHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for _line in self.rfile:
            self.wfile.write(b"ok\n")


class AckService:
    """A local TCP service the processor must reach before it records a chunk. ``stop`` closes
    the listening socket (connections are refused), ``start`` binds the same port again."""

    def __init__(self) -> None:
        self.port = 0
        self.server: socketserver.ThreadingTCPServer | None = None
        self.start()

    def start(self) -> None:
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), AckHandler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        ).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        self.server = None

    def ack(self, n: int) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(f"{n}\n".encode())
            if s.makefile().readline().strip() != "ok":
                raise ConnectionError("no ack")


class OutageProcessor:
    """Writes each chunk to ``effects`` (``lock_timeout`` 50 ms), after an ack from the TCP service
    in ``tcp`` mode. Every failure snapshots the range's committed cursor and chunk count.

    mode ``lock``: a lock timeout becomes ``RetryableError``; ``tcp``: the ``ConnectionRefusedError``
    propagates as is; ``items``: the chunk is reported as every item failed.
    """

    def __init__(
        self, engine: sa.Engine, t: KeysetTraversal, mode: str, service: AckService | None
    ) -> None:
        self.engine, self.t, self.mode, self.service = engine, t, mode, service
        self.failures: list[tuple[int, tuple[Any, ...], float]] = []
        self.lock = threading.Lock()

    def __call__(self, chunk: Chunk) -> ChunkResult | None:
        time.sleep(0.005)
        encoded = [encode_key((k,)) for k in chunk.keys]
        try:
            if self.service is not None:
                self.service.ack(len(encoded))
            with self.engine.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '50ms'"))
                conn.execute(
                    sa.text(
                        "INSERT INTO effects (k, round_id, range_id, pid, worker, batch, chunk_attempt, "
                        "ok) VALUES (:k, :r, :i, 0, 'w', :b, :a, true)"
                    ),
                    [
                        {
                            "k": e,
                            "r": chunk.round_id,
                            "i": chunk.range_id,
                            "b": f"{id(chunk)}-{time.time()}",
                            "a": chunk.attempt,
                        }
                        for e in encoded
                    ],
                )
        except (sa.exc.OperationalError, OSError) as exc:
            snap = self.t.store.client.hmget(
                self.t.store.range_key(chunk.round_id, chunk.range_id), "cursor", "chunks"
            )
            with self.lock:
                self.failures.append((chunk.range_id, tuple(snap), time.monotonic()))
            if self.mode == "tcp":
                raise
            if self.mode == "items":
                return ChunkResult(failed={k: "sink unavailable (503)" for k in chunk.keys})
            raise RetryableError(f"sink is locked: {str(exc).splitlines()[0]}") from exc
        return None


def _setup(engine: sa.Engine) -> list[str]:
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text(f"INSERT INTO items SELECT g, 'p' FROM generate_series(1, {N_ROWS}) g"))
    rs.create_effects_table(engine)
    return rs.encoded_keys(engine, "items", "id")


@contextmanager
def table_locked(url: str) -> Iterator[None]:
    """Another session holds an ACCESS EXCLUSIVE lock on ``effects``: the dependency is down."""
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with eng.connect() as conn:
        tx = conn.begin()
        conn.execute(sa.text("LOCK TABLE effects IN ACCESS EXCLUSIVE MODE"))
        try:
            yield
        finally:
            tx.rollback()
    eng.dispose()


def _rows(engine: sa.Engine) -> int:
    with engine.connect() as c:
        return int(c.execute(sa.text("SELECT count(*) FROM effects")).scalar() or 0)


def _outage_trial(
    engine: sa.Engine,
    url: str,
    redis_url: str,
    prefix: str,
    keys: list[str],
    mode: str,
    service: AckService | None,
    trial: int,
    rng: random.Random,
    tally: rs.Tally,
) -> int:
    """Two ranges traversed in parallel; the dependency goes down for 0.3-0.8 s somewhere in the
    middle. Returns the number of failed chunk attempts the outage caused."""
    with engine.begin() as c:
        c.execute(sa.text("TRUNCATE effects"))
    t = KeysetTraversal(
        url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream=f"outage-{trial}",
        key_prefix=prefix,
    )
    rnd = t.plan(max_ranges=2, new_stream=True)
    proc = OutageProcessor(engine, t, mode, service)
    results: dict[int, Any] = {}

    def run(range_id: int) -> None:
        try:
            results[range_id] = t.traverse(
                rnd.round_id,
                range_id,
                proc,
                chunk_size=10,
                max_chunk_attempts=1000,
                backoff_base=0.02,
                backoff_max=0.1,
                lease_seconds=5,
            )
        except Exception as exc:
            results[range_id] = exc

    def committed() -> list[tuple[bytes, bytes]]:
        return [
            tuple(t.store.client.hmget(t.store.range_key(rnd.round_id, i), "cursor", "chunks"))
            for i in (0, 1)
        ]

    with rs.CursorWatcher(redis_url, t.store, rnd.round_id, 2) as watcher:
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
        for th in threads:
            th.start()
        start_after = rng.randint(10, N_ROWS // 2)
        rs.wait_for(lambda: _rows(engine) >= start_after, what="progress")
        hold = rng.uniform(0.3, 0.8)
        if service is not None:
            service.stop()
            time.sleep(hold)
            during = committed()
            service.start()
        else:
            with table_locked(url):
                time.sleep(hold)
                during = committed()
        for th in threads:
            th.join(120)
    tally.trials += 1
    # within the outage every failure saw the same committed cursor, and it was still there at the end
    for i in (0, 1):
        snaps = {snap for r, snap, _ in proc.failures if r == i}
        if len(snaps) > 1 or (snaps and snaps != {during[i]}):
            tally.fail(
                f"trial {trial} range {i}: the cursor moved during the outage: {snaps} / {during[i]}"
            )
    for i, res in sorted(results.items()):
        if isinstance(res, Exception) or not res.complete:
            tally.fail(f"trial {trial} range {i}: did not finish after recovery: {res!r}")
    dead = [d for i in (0, 1) for d in t.dead_letters(rnd.round_id, i)]
    if dead:
        tally.fail(
            f"trial {trial}: {len(dead)} item(s) dead-lettered because of the outage: {dead[:3]}"
        )
    if not proc.failures:
        tally.fail(f"trial {trial}: the outage never hit the processor; the trial proved nothing")
    tally.replay(rs.replay_report(rs.effects(engine, rnd.round_id)).max_batches)
    tally.check(f"trial {trial}", rs.check_round(engine, t.store, rnd.round_id, keys), watcher)
    t.close()
    return len(proc.failures)


@pytest.mark.parametrize("mode", ["lock", "tcp", "items"])
def test_outage_keeps_the_cursor_and_the_range_finishes(
    mode: str, pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    keys = _setup(pg_engine)
    service = AckService() if mode == "tcp" else None
    tally = rs.Tally()
    failed_attempts = 0
    try:
        for trial in range(rs.trials(1, 30)):
            failed_attempts += _outage_trial(
                pg_engine,
                pg_schema_url,
                redis_url,
                key_prefix,
                keys,
                mode,
                service,
                trial,
                rng,
                tally,
            )
            if tally.failures:
                break
    finally:
        if service is not None and service.server is not None:
            service.stop()
    tally.record(
        "4 dependency outage",
        note=f"{mode}: {failed_attempts} failed chunk attempts, no dead letter",
    )
    assert not tally.failures, tally.verdict(seed)


def test_outage_longer_than_the_budget_raises_then_a_new_traverse_finishes(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    keys = _setup(pg_engine)

    def traversal() -> KeysetTraversal:
        return KeysetTraversal(
            pg_schema_url,
            table="items",
            key="id",
            redis_url=redis_url,
            stream="budget",
            key_prefix=key_prefix,
        )

    t1 = traversal()
    rnd = t1.plan(max_ranges=1, new_stream=True)
    proc = OutageProcessor(pg_engine, t1, "lock", None)

    def five_chunks_then_stop(chunk: Chunk) -> ChunkResult | None:
        if _rows(pg_engine) >= 40:
            t1.request_stop()
        return proc(chunk)

    assert t1.traverse(
        rnd.round_id, 0, five_chunks_then_stop, chunk_size=10, lease_seconds=5
    ).stopped
    before = t1.range_status(rnd.round_id)[0]
    assert before["cursor"] == 50 and before["done"] == 50
    t2 = traversal()
    with rs.CursorWatcher(redis_url, t2.store, rnd.round_id, 1) as watcher:
        with table_locked(pg_schema_url):
            with pytest.raises(DependencyFailedError) as err:
                t2.traverse(
                    rnd.round_id,
                    0,
                    proc,
                    chunk_size=10,
                    max_chunk_attempts=3,
                    backoff_base=0.01,
                    backoff_max=0.02,
                    lease_seconds=5,
                )
            during = t2.range_status(rnd.round_id)[0]
        done = traversal().traverse(
            rnd.round_id, 0, proc, chunk_size=10, max_chunk_attempts=3, lease_seconds=5
        )
    msg = str(err.value)
    cov = rs.check_round(pg_engine, t2.store, rnd.round_id, keys)
    rs.record(
        "4 dependency outage",
        trials=1,
        keys_lost=len(cov.lost),
        counter_errors=len(cov.counter_errors),
        note="budget exhausted -> DependencyFailedError at the kept cursor, a new traverse finished",
    )
    assert (
        "failed 3 times in a row" in msg
        and "cursor stays at 50" in msg
        and "nothing was skipped" in msg
    )
    assert (during["cursor"], during["done"], during["dead"], during["retries"]) == (50, 50, 0, 0)
    assert during["state"] == "pending" and during["owner"] == ""  # released, not left running
    assert done.complete and (done.done, done.skipped, done.dead) == (N_ROWS, 0, 0)
    assert not t2.dead_letters(rnd.round_id, 0) and not cov.lost and not cov.counter_errors
    assert not watcher.violations


def test_outage_during_item_retries_dead_letters_nothing(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """Items that failed on their own wait in the retry set; the sink goes down while their retry
    passes run and the processor reports every item of the pass as failed, for a new reason. The
    outage must not use up their attempts: like a chunk where more than ``outage_failure_ratio``
    of the items failed, such a pass is a dependency failure. (Poison items that keep failing for
    their own reason are still dead-lettered: ``test_reliability_poison.py``.)"""
    keys = _setup(pg_engine)
    t = KeysetTraversal(
        pg_schema_url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream="retry-outage",
        key_prefix=key_prefix,
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    flaky = {7, 70, 140, 190}
    proc = OutageProcessor(pg_engine, t, "items", None)

    def processor(chunk: Chunk) -> ChunkResult | None:
        if chunk.attempt == 1 and len(chunk) == 10:  # main pass: the flaky items fail on their own
            bad = {k: "flaky" for k in chunk.keys if k in flaky}
            ok = [k for k in chunk.keys if k not in flaky]
            res = proc(
                Chunk(
                    chunk.round_id,
                    chunk.range_id,
                    chunk.columns,
                    [v for v in chunk.values if v[0] in ok],
                    chunk.key_of,
                    chunk.attempt,
                )
            )
            if res is not None:  # every item failed: pass the outage on as it is
                return ChunkResult(failed={**dict(res.failed), **bad})
            return ChunkResult(failed=bad)
        return proc(chunk)

    locked = threading.Event()
    release = threading.Event()

    def lock_when_main_pass_is_done() -> None:
        rs.wait_for(
            lambda: t.range_status(rnd.round_id)[0]["cursor_encoded"] == rnd.ranges[0].hi_encoded,
            timeout=60,
            what="the main pass",
        )
        with table_locked(pg_schema_url):
            locked.set()
            release.wait(10)

    locker = threading.Thread(target=lock_when_main_pass_is_done, daemon=True)
    locker.start()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["r"] = t.traverse(
                rnd.round_id,
                0,
                processor,
                chunk_size=10,
                max_item_attempts=3,
                item_retry_delay=0.5,
                backoff_base=0.05,
                backoff_max=0.2,
                lease_seconds=5,
            )
        except Exception as exc:
            result["r"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    locked.wait(60)
    rs.wait_for(
        lambda: len(proc.failures) >= 3 or not runner.is_alive(),
        timeout=30,
        what="failed retry passes",
    )
    release.set()
    locker.join(30)
    runner.join(120)
    dead = t.dead_letters(rnd.round_id, 0)
    status = t.range_status(rnd.round_id)[0]
    rs.record(
        "4 dependency outage",
        trials=1,
        note=f"outage during item retries: {len(dead)} item(s) dead-lettered by the outage (expected 0)",
    )
    assert not dead, (
        f"{len(dead)} item(s) dead-lettered because the sink was down during their retry passes: "
        f"{[(d['key'], d['error']) for d in dead]}"
    )
    assert proc.failures, "the outage never hit a retry pass; the test proved nothing"
    assert not isinstance(result["r"], Exception) and result["r"].complete, result["r"]
    assert status["state"] == "complete"
    assert (status["done"], status["dead"]) == (len(keys), 0)
