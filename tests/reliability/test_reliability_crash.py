"""Scenario 1, crash anywhere: SIGKILL at random points, resumed by a new process.

Guarantee: after any number of crashes, anywhere in a worker, a new worker resumes each range
from its committed cursor; every key of the round is processed at least once, each crash makes
at most one chunk of its range be delivered again, the counters are exact
(``done + skipped + dead`` = keys in the round, ``done`` = distinct keys processed successfully),
and no cursor ever moves backwards. The resuming worker takes over at once when it is a new
attempt of the same lineage, and after the lease expires otherwise.

Each trial plans a fresh round of 4 ranges over a table that keeps growing above the round's end,
then drives every range (in parallel) through 1-3 worker processes that die at a random hook point
(or from a SIGKILL at a random time) and a final worker that finishes it. The side-effects table
is the independent witness.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal, RoundIncompleteError
from airflow_keyset_provider.core.keys import decode_key

POINTS = [
    "fetch",
    "processor_before_effect",
    "processor_after_effect",
    "advance_before",
    "advance_after",
    "retry_pass",
    "timer",
]

# variant -> (table kind, group_commit_chunks, source database): with group commit the bound is one
# group per crash. The effects record stays in PostgreSQL whatever the source.
VARIANTS = {
    "bigint": ("bigint", 1, "postgresql"),
    "composite": ("composite", 1, "postgresql"),
    "bigint-group3": ("bigint", 3, "postgresql"),
    "bigint-mariadb": ("bigint", 1, "mariadb"),
    "composite-mariadb": ("composite", 1, "mariadb"),
}
TABLES = {
    "bigint": ("items", "id"),
    "composite": ("orders", ["created_at", "id"]),
}


def _make_table(engine: sa.Engine, kind: str, rng: random.Random, n: int) -> None:
    mysql = engine.dialect.name == "mysql"
    with engine.begin() as c:
        if kind == "bigint":
            c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
            ids = sorted(rng.sample(range(1, n * 5), n))  # sequence gaps
            c.execute(sa.text("INSERT INTO items VALUES (:i, 'p')"), [{"i": i} for i in ids])
        else:
            c.execute(
                sa.text(
                    "CREATE TABLE orders (created_at "
                    + ("datetime(6)" if mysql else "timestamptz")
                    + " NOT NULL, id bigint NOT NULL, payload text NOT NULL, "
                    "PRIMARY KEY (created_at, id))"
                )
            )
            base = dt.datetime(2026, 1, 1, tzinfo=None if mysql else dt.UTC)
            c.execute(
                sa.text("INSERT INTO orders VALUES (:t, :i, 'p')"),
                [{"t": base + dt.timedelta(seconds=i // 3), "i": i} for i in range(n)],
            )


def _grow(engine: sa.Engine, kind: str, stop: threading.Event) -> None:
    """Rows keep arriving above the round's end while it is traversed (next round's work)."""
    j = 0
    step = "INTERVAL 1 SECOND" if engine.dialect.name == "mysql" else "interval '1 s'"
    while not stop.wait(0.02):
        j += 1
        with engine.begin() as c:
            if kind == "bigint":
                c.execute(sa.text("INSERT INTO items SELECT max(id) + 1, 'late' FROM items"))
            else:
                c.execute(
                    sa.text(
                        f"INSERT INTO orders SELECT max(created_at) + {step}, :j, 'late' "
                        "FROM orders"
                    ),
                    {"j": 10_000_000 + j},
                )


@dataclass
class Run:
    """One worker process on one range."""

    worker: str
    point: str | None  # the planned crash point (None: a worker that must finish)
    crashed: bool
    exitcode: int | None
    status: str | None  # None: the worker left no outcome (it died, or failed before writing one)
    error: str | None
    takeover: bool
    expire: bool  # resumed by another lineage after the lease expired (else the same lineage)


@dataclass
class CrashTrial:
    """One round of 4 ranges, each driven through dying workers and a finishing one."""

    env: dict[str, Any]  # what every worker spec shares
    tmp_path: Path
    rng: random.Random
    trial: int
    chunk_size: int
    group: int  # group_commit_chunks: chunks committed together
    runs: dict[int, list[Run]] = field(default_factory=dict)

    def drive(self, range_id: int, seed: float) -> None:
        r = random.Random(seed)
        n_chunks = 480 // 4 // self.chunk_size + 2
        expire = r.random() < 0.2
        lineage = f"trial{self.trial}/range{range_id}"
        history = self.runs.setdefault(range_id, [])

        def run(point: str | None) -> None:
            n = len(history)
            spec = dict(
                self.env,
                range_id=range_id,
                chunk_size=self.chunk_size,
                group_commit_chunks=self.group,
                worker=f"{lineage}/w{n}",
                result_path=str(self.tmp_path / f"{self.env['stream']}-{range_id}-{n}.json"),
                lineage=f"{lineage}/a{n}" if expire else lineage,
                lease_seconds=1 if expire else 30,
                crash=None
                if point in (None, "timer")
                else {
                    "point": point,
                    "nth": r.randint(1, 2 if point == "retry_pass" else n_chunks),
                },
            )
            w = rs.Worker(spec)
            if point == "timer":
                time.sleep(r.uniform(0.0, 0.25))
                w.kill()
            w.join()
            out = w.outcome or {}
            history.append(
                Run(
                    spec["worker"],
                    point,
                    w.crashed,
                    w.process.exitcode,
                    out.get("status"),
                    out.get("error"),
                    bool(out.get("takeover")),
                    expire,
                )
            )

        for _ in range(r.randint(1, 3)):  # workers planned to die (the hook may not be reached)
            run(r.choice(POINTS))
            if not history[-1].crashed:
                break
        while history[-1].crashed:  # then workers that finish the range
            run(None)

    def check_replays(self, tally: rs.Tally, rows: list[rs.EffectRow]) -> None:
        """After a crash the next worker may repeat the dead worker's uncommitted chunk (or group of
        chunks, with group commit), once; a worker that follows a clean exit repeats nothing."""
        for range_id, history in self.runs.items():
            report = rs.replay_report(r for r in rows if r.range_id == range_id)
            tally.replay(report.max_batches)
            for i, h in enumerate(history):
                allowed = self.group if i > 0 and history[i - 1].crashed else 0
                got = report.per_worker.get(h.worker, 0)
                if got > allowed:
                    tally.fail(
                        f"trial {self.trial} range {range_id}: {h.worker} replayed {got} chunk(s) after "
                        f"{history[i - 1] if i else 'nothing'}"
                    )
            crashed = sum(h.crashed for h in history)
            if report.duplicates > crashed * self.chunk_size * self.group:
                tally.fail(
                    f"trial {self.trial} range {range_id}: {report.duplicates} duplicate deliveries for "
                    f"{crashed} crash(es) of chunk_size {self.chunk_size} x group {self.group}"
                )
            if history[-1].status != "complete":
                tally.fail(
                    f"trial {self.trial} range {range_id}: the last worker did not finish; workers: "
                    + "; ".join(map(str, history))
                )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_crash_anywhere_then_resume(
    variant: str,
    pg_engine: sa.Engine,
    pg_schema_url: str,
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kind, group, database = VARIANTS[variant]
    table, key = TABLES[kind]
    src_url = pg_schema_url
    if database == "mariadb":
        src_url = request.getfixturevalue("mariadb_db_url")
    src_engine = pg_engine if database == "postgresql" else sa.create_engine(src_url)
    request.addfinalizer(src_engine.dispose)
    _make_table(src_engine, kind, rng, 480)
    rs.create_effects_table(pg_engine)
    end_key = decode_key(rs.encoded_keys(src_engine, table, key)[-1])
    end_key = end_key[0] if isinstance(key, str) else end_key
    tally = rs.Tally()
    by_point: Counter[str] = Counter()
    expired_takeovers = odd_exits = 0
    for trial in range(rs.trials(3, 120)):
        with pg_engine.begin() as c:
            c.execute(sa.text("TRUNCATE effects"))
        stream = f"crash-{variant}-{trial}"
        t = KeysetTraversal(
            src_url,
            table=table,
            key=key,
            redis_url=redis_url,
            stream=stream,
            key_prefix=key_prefix,
        )
        rnd = t.plan(
            max_ranges=4, end_key=end_key, new_stream=True
        )  # rows the writer adds land above the end
        keys = [
            k
            for k in rs.encoded_keys(src_engine, table, key)
            if rnd.start_encoded < k <= rnd.end_encoded
        ]
        assert len(keys) == 480
        env = {
            "db_url": src_url,
            "effects_url": pg_schema_url,
            "redis_url": redis_url,
            "key_prefix": key_prefix,
            "stream": stream,
            "table": table,
            "key": key,
            "round_id": rnd.round_id,
            "sleep_per_chunk": 0.004,
            "flaky": rng.sample(keys, len(keys) // 30),
        }  # items that fail once on their own
        ct = CrashTrial(env, tmp_path, rng, trial, rng.choice([7, 10, 16]), group)
        stop = threading.Event()
        writer = threading.Thread(target=_grow, args=(src_engine, kind, stop), daemon=True)
        with rs.CursorWatcher(redis_url, t.store, rnd.round_id, len(rnd.ranges)) as watcher:
            writer.start()
            with ThreadPoolExecutor(len(rnd.ranges)) as pool:
                list(
                    pool.map(
                        ct.drive,
                        [r.range_id for r in rnd.ranges],
                        [rng.random() for _ in rnd.ranges],
                    )
                )
            stop.set()
            writer.join()
        tally.trials += 1
        for history in ct.runs.values():
            by_point.update(h.point for h in history if h.crashed and h.point)
            odd_exits += sum(h.crashed and h.exitcode != -9 for h in history)
            expired_takeovers += sum(h.takeover and h.expire for h in history)
        ct.check_replays(tally, rs.effects(pg_engine, rnd.round_id))
        cov = rs.check_round(pg_engine, t.store, rnd.round_id, keys)
        try:
            totals = t.close_round(rnd.round_id)
            if (totals.done, totals.skipped, totals.dead) != (len(keys), 0, 0):
                cov.counter_errors.append(f"round totals {totals.as_dict()} for {len(keys)} keys")
        except RoundIncompleteError as exc:
            tally.fail(f"trial {trial}: the round does not close: {exc}")
        tally.check(f"trial {trial}", cov, watcher)
        t.close()
        if tally.failures:
            break
    points = ", ".join(f"{p} {n}" for p, n in sorted(by_point.items()))
    if odd_exits:
        points += f"; {odd_exits} death(s) reported with an exit code other than -9"
    scenario = (
        "1 crash anywhere" if group == 1 else f"1 crash anywhere, group commit of {group} chunks"
    )
    if database != "postgresql":
        scenario += f" ({database} source)"
    tally.record(
        scenario,
        note=f"{variant} key: {sum(by_point.values())} SIGKILLs ({points}), "
        f"{expired_takeovers} lease-expiry takeovers",
    )
    assert not tally.failures, tally.verdict(seed)
    assert sum(by_point.values()) > 0


def test_resume_takes_over_at_once_for_the_same_lineage(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """A killed worker's lease is long (60 s); a new attempt of the same lineage must not wait for
    it, and a worker of another lineage must (it is refused within its claim timeout)."""
    _make_table(pg_engine, "bigint", random.Random(7), 200)
    rs.create_effects_table(pg_engine)
    t = KeysetTraversal(
        pg_schema_url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream="lineage",
        key_prefix=key_prefix,
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    base = {
        "db_url": pg_schema_url,
        "redis_url": redis_url,
        "key_prefix": key_prefix,
        "stream": "lineage",
        "table": "items",
        "key": "id",
        "round_id": rnd.round_id,
        "range_id": 0,
        "chunk_size": 10,
        "lease_seconds": 60,
    }
    w = rs.Worker(
        dict(
            base,
            worker="a",
            lineage="dag/run/task/0",
            result_path=str(tmp_path / "a.json"),
            crash={"point": "processor_after_effect", "nth": 3},
        )
    )
    w.join()
    assert w.crashed
    other = rs.Worker(
        dict(
            base,
            worker="b",
            lineage="another/lineage",
            claim_timeout=0.5,
            result_path=str(tmp_path / "b.json"),
        )
    )
    other.join()
    assert other.outcome is not None and other.outcome["status"] == "error"
    assert (
        "LeaseHeldError" in other.outcome["error"] and "dag/run/task/0#" in other.outcome["error"]
    )
    again = rs.Worker(
        dict(
            base,
            worker="c",
            lineage="dag/run/task/0",
            claim_timeout=0.5,
            result_path=str(tmp_path / "c.json"),
        )
    )
    again.join()
    assert again.outcome is not None and again.outcome["status"] == "complete", again.outcome
    assert again.outcome["takeover"] is True
    cov = rs.check_round(
        pg_engine, t.store, rnd.round_id, rs.encoded_keys(pg_engine, "items", "id")
    )
    report = rs.replay_report(rs.effects(pg_engine, rnd.round_id))
    rs.record(
        "1 crash anywhere",
        trials=1,
        keys_lost=len(cov.lost),
        max_replay=report.max_batches,
        counter_errors=len(cov.counter_errors),
    )
    assert not cov.lost and not cov.counter_errors
    assert report.per_worker == {"c": 1} and report.duplicates == 10  # exactly the chunk in hand
    t.close()
