"""Scenario: exactly-once effects under crash anywhere, stale owners and a Redis loss.

Guarantee (``exactly_once=True``): a processor that writes one row per key through
``chunk.connection`` into a table with no unique constraint leaves every key of the round
exactly once: 0 rows written twice, 0 keys missing, after any number of SIGKILLs (inside the
processor, between the target's commit and the Redis advance, after the advance, before a
read, at a random time), stale owners woken after a SIGSTOP past their lease while another
owner took the range over, and Redis losing the stream (restored from the checkpoint mirror,
which may be older than the last commit).

The control runs the same scenario without the mode: there the same faults write chunks twice
(at-least-once), and the test asserts that it saw such replays, so it can fail.

Each trial plans a fresh round of 2 ranges over 120 rows; each range is driven, one after the
other, through 1-3 disruptions (a worker that dies at a hook point or from a SIGKILL at a random
time, or one that is SIGSTOPped until its lease expired and a new owner finished the range)
and a final worker that finishes it. With some probability the parent deletes the stream's Redis
keys after a death; the next worker restores the round from the mirror.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import exactly_once_workers
import redis
import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal, RoundIncompleteError, RoundStateLostError

POINTS = ["fetch", "processor_after_effect", "advance_before", "advance_after", "timer", "stop"]
N_ROWS = 120


class XWorker(rs.Worker):
    """A worker process running ``exactly_once_workers.run_worker``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.process = rs._context().Process(
            target=exactly_once_workers.run_worker, args=(spec,), daemon=True
        )
        self.process.start()
        self.pid = self.process.pid
        self.killed = False


@dataclass
class Figures:
    trials: int = 0
    duplicates: int = 0  # rows written a second (third...) time
    missing: int = 0  # keys of the round with no row
    deaths: Counter[str] = field(default_factory=Counter)
    stale_fenced: int = 0  # woken stale owners that ended with LeaseLostError
    losses: int = 0  # Redis lost the stream
    failures: list[str] = field(default_factory=list)


@dataclass
class Trial:
    env: dict[str, Any]
    tmp_path: Path
    rng: random.Random
    figures: Figures
    t: KeysetTraversal
    redis_client: redis.Redis
    n: int = 0

    def spec(self, range_id: int, lineage: str, **kw: Any) -> dict[str, Any]:
        self.n += 1
        return dict(
            self.env,
            range_id=range_id,
            lineage=lineage,
            worker=f"{lineage}/w{self.n}",
            result_path=str(self.tmp_path / f"{self.env['stream']}-{self.n}.json"),
            **{"lease_seconds": 30, **kw},
        )

    def drive(self, range_id: int) -> None:
        r, lineage = self.rng, f"{self.env['stream']}/range{range_id}"
        for _ in range(r.randint(1, 3)):
            point = r.choice(POINTS)
            if point == "stop":
                self._stale_owner(range_id)
                return  # the new owner finished the range
            crash = None if point == "timer" else {"point": point, "nth": r.randint(1, 8)}
            w = XWorker(self.spec(range_id, lineage, crash=crash))
            if point == "timer":
                time.sleep(r.uniform(0.0, 0.2))
                w.kill()
            w.join()
            if not w.crashed:
                self._check_outcome(w, "complete")
                return
            self.figures.deaths[point] += 1
            if self.env["mirror"] and r.random() < 0.25:
                self._lose_redis()
        self._check_outcome(XWorker(self.spec(range_id, lineage)), "complete")

    def _stale_owner(self, range_id: int) -> None:
        """A (lease 1 s) is SIGSTOPped mid-run; B takes over once the lease expired and
        finishes; then A wakes up and must be fenced (or had finished before the stop)."""
        a = XWorker(self.spec(range_id, f"A{self.n}", sleep_per_chunk=0.05, lease_seconds=1))
        time.sleep(self.rng.uniform(0.05, 0.4))
        try:
            os.kill(a.pid, signal.SIGSTOP)
        except ProcessLookupError:  # A had finished the range already
            self._check_outcome(a, "complete")
            return
        try:
            rs.wait_for(lambda: self._lease_left(range_id) == 0, what="A's lease to expire")
            b = XWorker(self.spec(range_id, f"B{self.n}"))
            with contextlib.suppress(AssertionError):  # B may wait for A's ledger row lock
                rs.wait_for(lambda: not b.process.is_alive(), timeout=5.0, what="B")
        finally:
            with contextlib.suppress(ProcessLookupError):  # A had exited before the stop landed
                os.kill(a.pid, signal.SIGCONT)
        self._check_outcome(b, "complete")
        a.join()
        out = a.outcome or {}
        if out.get("status") == "lease_lost":
            self.figures.stale_fenced += 1
        elif out.get("status") != "complete":
            self.figures.failures.append(f"stale owner A ended with {out}")
        self.figures.deaths["stop"] += 1

    def _lease_left(self, range_id: int) -> float:
        """The range's lease left; 0 while Redis has lost the round (A was stopped before its
        claim restored the round from the mirror: it holds no lease, B restores and claims)."""
        try:
            return float(self.t.range_status(self.env["round_id"])[range_id]["lease_left_s"])
        except RoundStateLostError:
            return 0.0

    def _lose_redis(self) -> None:
        prefix = f"{self.env['key_prefix']}:{{{self.env['stream']}}}"
        keys = list(self.redis_client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            self.redis_client.delete(*keys)
            self.figures.losses += 1

    def _check_outcome(self, w: XWorker, want: str) -> None:
        """``w`` must end with ``want``. A worker the shared server refused a connection to
        ("too many clients", other suites run on it too) is started again, up to 3 times."""
        for _ in range(3):
            w.join()
            out = w.outcome or {}
            if "too many clients" not in str(out.get("error", "")):
                break
            w = XWorker(dict(w.spec, result_path=w.spec["result_path"] + ".again"))
        if out.get("status") != want:
            self.figures.failures.append(f"{w.spec['worker']}: {out}")


#: Trials per planned round (planning waits for the database's in-flight transactions, which on
#: a shared server costs seconds): a trial drives two ranges of its batch's round.
BATCH = 8


def _run_trials(
    exactly_once: bool,
    trials: int,
    pg_engine: sa.Engine,
    pg_schema_url: str,
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
) -> tuple[Figures, int]:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
        ids = sorted(rng.sample(range(1, N_ROWS * BATCH * 4), N_ROWS * BATCH))
        c.execute(sa.text("INSERT INTO items VALUES (:i, 'p')"), [{"i": i} for i in ids])
        c.execute(sa.text(exactly_once_workers.EFFECTS_DDL))
    figures = Figures()
    client = redis.Redis.from_url(redis_url)
    for batch in range(-(-trials // BATCH)):
        with pg_engine.begin() as c:
            c.execute(sa.text("TRUNCATE xeffects"))
        stream = f"xo-{int(exactly_once)}-{batch}"
        mirror = batch % 2 == 0
        t = KeysetTraversal(
            pg_schema_url,
            table="items",
            key="id",
            redis_url=redis_url,
            stream=stream,
            key_prefix=key_prefix,
            checkpoint_url=pg_schema_url if mirror else None,
        )
        n = min(BATCH, trials - batch * BATCH)
        rnd = t.plan(max_ranges=2 * BATCH, end_key=ids[-1], new_stream=True)
        for trial in range(n):
            env = {
                "db_url": pg_schema_url,
                "redis_url": redis_url,
                "key_prefix": key_prefix,
                "stream": stream,
                "round_id": rnd.round_id,
                "chunk_size": rng.choice([7, 10, 16]),
                "exactly_once": exactly_once,
                "mirror": mirror,
                "checkpoint_seconds": rng.choice([0.0, 0.05, 1.0]),
            }
            tr = Trial(env, tmp_path, rng, figures, t, client, n=trial * 100)
            for r in rnd.ranges[2 * trial : 2 * trial + 2]:
                tr.drive(r.range_id)
            figures.trials += 1
        # The final worker of every range: a Redis loss of a later trial restored the ranges of
        # earlier ones from the mirror, maybe behind their end (and ranges no trial drove).
        for r in rnd.ranges:
            _check(Trial(env, tmp_path, rng, figures, t, client, n=10_000 + r.range_id), r)
        with pg_engine.connect() as c:
            written = Counter(r[0] for r in c.execute(sa.text("SELECT k FROM xeffects")))
        figures.duplicates += sum(k - 1 for k in written.values() if k > 1)
        figures.missing += sum(1 for i in ids if i not in written)
        try:
            totals = t.close_round(rnd.round_id)
            if (totals.done, totals.skipped, totals.dead) != (len(ids), 0, 0):
                figures.failures.append(f"batch {batch}: round totals {totals.as_dict()}")
        except RoundIncompleteError as exc:
            figures.failures.append(f"batch {batch}: {exc}")
        t.close()
        if figures.failures:
            break
    client.close()
    return figures, seed


def _check(tr: Trial, r: Any) -> None:
    """A worker that must finish the range (at once, if it is complete)."""
    tr._check_outcome(XWorker(tr.spec(r.range_id, f"rest{r.range_id}")), "complete")


def _note(f: Figures) -> str:
    deaths = ", ".join(f"{p} {n}" for p, n in sorted(f.deaths.items()))
    return (
        f"{f.duplicates} rows written twice, {f.missing} keys missing; disruptions: {deaths}; "
        f"{f.stale_fenced} stale owners fenced, {f.losses} Redis losses restored from the mirror"
    )


def test_exactly_once_under_crash_anywhere(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    f, seed = _run_trials(
        True, rs.trials(6, 1000), pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path
    )
    rs.record(
        "exactly-once effects (exactly_once=True)",
        trials=f.trials,
        keys_lost=f.missing,
        max_replay=f.duplicates,
        counter_errors=len(f.failures),
        note=_note(f),
    )
    assert not f.failures, f"seed {seed}: {f.failures[:3]}"
    assert f.missing == 0 and f.duplicates == 0, f"seed {seed}: {_note(f)}"
    assert sum(f.deaths.values()) > 0


def test_the_control_replays_without_the_mode(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    f, seed = _run_trials(
        False, rs.trials(4, 200), pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path
    )
    rs.record(
        "exactly-once control (at-least-once)",
        trials=f.trials,
        keys_lost=f.missing,
        counter_errors=len(f.failures),
        note=_note(f),
    )
    assert not f.failures, f"seed {seed}: {f.failures[:3]}"
    assert f.missing == 0
    assert f.duplicates > 0, "the control saw no replay: the scenario cannot tell the modes apart"
