"""Shared machinery of the reliability suite: modes (from ``tests/modes.py``), the results registry,
worker processes, the cursor watcher and the coverage check that every scenario ends with.

Short mode (default) keeps the whole suite within about three minutes on two cores; long mode
(``KEYSET_RELIABILITY_LONG=1``) runs thousands of trials where a trial is cheap.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from modes import LONG as LONG
from modes import MODE as MODE
from modes import trials as trials

from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.store.cursor_store import CursorStore


@dataclass
class TrialContext:
    """What one scenario's trials share: the database, Redis, the key prefix, a scratch directory
    and the encoded keys the table holds (the coverage check's reference)."""

    engine: sa.Engine
    url: str
    redis_url: str
    prefix: str
    tmp_path: Path
    keys: list[str]


# --------------------------------------------------------------------------- results registry


@dataclass
class ScenarioResult:
    """One line of the summary table. ``max_replay`` is in chunks per crash (or per stale owner)."""

    scenario: str
    trials: int = 0
    keys_lost: int = 0
    max_replay: int = 0
    counter_errors: int = 0
    notes: list[str] = field(default_factory=list)


RESULTS: dict[str, ScenarioResult] = {}
_LOCK = threading.Lock()


def record(
    scenario: str,
    *,
    trials: int = 0,
    keys_lost: int = 0,
    max_replay: int = 0,
    counter_errors: int = 0,
    note: str | None = None,
) -> None:
    """Add a test's figures to its scenario's line (several tests may share one scenario).
    Tests call this *before* asserting, so a failing run still shows what it measured."""
    with _LOCK:
        r = RESULTS.setdefault(scenario, ScenarioResult(scenario))
        r.trials += trials
        r.keys_lost += keys_lost
        r.max_replay = max(r.max_replay, max_replay)
        r.counter_errors += counter_errors
        if note:
            r.notes.append(note)


def summary_lines() -> list[str]:
    head = ["scenario", "trials", "keys lost", "max replay (chunks)", "counter errors", "notes"]
    rows = [
        [
            r.scenario,
            str(r.trials),
            str(r.keys_lost),
            str(r.max_replay),
            str(r.counter_errors),
            "; ".join(r.notes),
        ]
        for r in sorted(RESULTS.values(), key=lambda r: r.scenario)
    ]
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


# --------------------------------------------------------------------------- worker processes

_CTX: Any = None
_PRELOAD = [
    "airflow_keyset_provider.core",
    "airflow_keyset_provider.core.traversal",
    "sqlalchemy",
    "sqlalchemy.dialects.postgresql.psycopg2",
    "psycopg2",
    "psycopg2.extras",
    "redis",
]


def _context() -> Any:
    """Worker processes fork from a clean fork server that has the engine imported already:
    each worker is a fresh process (no inherited threads, connections or locks of the test)
    that starts in milliseconds. ``KEYSET_RELIABILITY_START_METHOD=spawn`` starts every worker
    from a new interpreter instead."""
    global _CTX
    if _CTX is None:
        method = os.environ.get("KEYSET_RELIABILITY_START_METHOD", "forkserver")
        _CTX = multiprocessing.get_context(method)
        if method == "forkserver":
            # Python 3.11's fork server ignores the parent's sys.path, so preload what is
            # importable from site-packages; the small test module itself imports per worker.
            _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


class Worker:
    """A running worker process and the file its outcome lands in."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import reliability_workers

        self.spec = spec
        self.process = _context().Process(
            target=reliability_workers.run_worker, args=(spec,), daemon=True
        )
        self.process.start()
        self.pid: int = self.process.pid
        self.killed = False

    def kill(self) -> None:
        if self.process.is_alive():
            self.killed = True
            self.process.kill()

    def join(self, timeout: float = 120.0) -> int | None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
            raise AssertionError(
                f"worker {self.spec['worker']} (pid {self.pid}) hung for {timeout} s"
            )
        return self.process.exitcode

    @property
    def outcome(self) -> dict[str, Any] | None:
        path = Path(self.spec["result_path"])
        return json.loads(path.read_text()) if path.exists() else None

    @property
    def crashed(self) -> bool:
        """The worker died without reporting. Every worker that returns writes an outcome, so no
        outcome means it died; the exit code alone is not trusted: when the fork server cannot
        deliver a child's status, multiprocessing reports 255 for a process that was SIGKILLed."""
        return self.process.exitcode is not None and self.outcome is None


# --------------------------------------------------------------------------- side effects


def create_effects_table(engine: sa.Engine) -> None:
    from reliability_workers import EFFECTS_DDL

    with engine.begin() as conn:
        conn.execute(sa.text(EFFECTS_DDL))


def encoded_keys(engine: sa.Engine, table: str, key: str | Sequence[str]) -> list[str]:
    """Every key of ``table``, encoded (so it compares like cursors), in order."""
    cols = [key] if isinstance(key, str) else list(key)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(f"SELECT {', '.join(cols)} FROM {table} ORDER BY {', '.join(cols)}")
        )
        return [encode_key(tuple(r)) for r in rows]


@dataclass
class EffectRow:
    id: int
    k: str
    range_id: int
    pid: int
    worker: str
    batch: str
    ok: bool


def effects(engine: sa.Engine, round_id: str) -> list[EffectRow]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, k, range_id, pid, worker, batch, ok FROM effects "
                "WHERE round_id = :r ORDER BY id"
            ),
            {"r": round_id},
        )
        return [EffectRow(*r) for r in rows]


@dataclass
class ReplayReport:
    """Replays of one range, read from the side-effects record.

    A *replayed batch* is a processor call that successfully processed at least one key that an
    earlier call had already processed successfully. ``per_worker`` counts them per worker run.
    """

    duplicates: int  # successful deliveries beyond the first, summed over keys
    per_worker: dict[str, int]
    replayed_keys: set[str]

    @property
    def max_batches(self) -> int:
        return max(self.per_worker.values(), default=0)


def replay_report(rows: Iterable[EffectRow]) -> ReplayReport:
    seen: set[str] = set()
    batches: dict[str, list[EffectRow]] = defaultdict(list)
    order: list[str] = []
    for r in rows:
        if not r.ok:
            continue
        if r.batch not in batches:
            order.append(r.batch)
        batches[r.batch].append(r)
    per_worker: dict[str, int] = defaultdict(int)
    duplicates = 0
    replayed: set[str] = set()
    for b in order:
        rs = batches[b]
        again = [r.k for r in rs if r.k in seen]
        if again:
            per_worker[rs[0].worker] += 1
            duplicates += len(again)
            replayed.update(again)
        seen.update(r.k for r in rs)
    return ReplayReport(duplicates, dict(per_worker), replayed)


# --------------------------------------------------------------------------- cursor watcher


class CursorWatcher(threading.Thread):
    """Polls every range's cursor of a round and remembers any step backwards (or past ``hi``).

    Independent of the engine's own checks: it reads the Redis hashes directly, every few ms.
    """

    def __init__(
        self,
        redis_url: str,
        store: CursorStore,
        round_id: str,
        n_ranges: int,
        interval: float = 0.003,
    ) -> None:
        super().__init__(daemon=True, name=f"cursor-watcher-{round_id}")
        self.client = redis.Redis.from_url(redis_url)
        self.keys = [store.range_key(round_id, i) for i in range(n_ranges)]
        self.interval = interval
        self.last: list[str | None] = [None] * n_ranges
        self.violations: list[str] = []
        self.samples = 0
        self._halt = threading.Event()

    def poll(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in self.keys:
            pipe.hmget(k, "cursor", "hi")
        for i, (cur, hi) in enumerate(pipe.execute()):
            if cur is None:
                continue
            c, h = cur.decode(), hi.decode()
            if self.last[i] is not None and c < self.last[i]:  # type: ignore[operator]
                self.violations.append(f"range {i}: cursor moved backwards {self.last[i]} -> {c}")
            if c > h:
                self.violations.append(f"range {i}: cursor {c} passed hi {h}")
            self.last[i] = c
        self.samples += 1

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.poll()

    def __enter__(self) -> CursorWatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(5)
        self.poll()
        self.client.close()


# --------------------------------------------------------------------------- coverage


@dataclass
class Coverage:
    """Every key of the round against the side-effects record and the counters."""

    lost: list[str]
    counter_errors: list[str]
    outside: list[str]


def check_round(
    engine: sa.Engine,
    store: CursorStore,
    round_id: str,
    keys: Sequence[str],
    expect_dead: Iterable[str] = (),
    expect_skipped: Iterable[str] = (),
) -> Coverage:
    """Compare a finished round with the source keys it covers and the effects record.

    ``keys``: the encoded keys the source held in the round (static during the round).
    Checks, per range: cursor == hi and state complete; done + skipped + dead == keys in the
    range; done == distinct keys processed successfully; no effect outside the round.
    """
    dead, skipped = set(expect_dead), set(expect_skipped)
    info = store.round_info(round_id)
    ranges = store.ranges(round_id)
    rows = effects(engine, round_id)
    ok_by_range: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        if r.ok:
            ok_by_range[r.range_id].add(r.k)
    lost: list[str] = []
    errors: list[str] = []
    outside = [r.k for r in rows if not info["start"] < r.k <= info["end"]]
    for rng in ranges:
        i = int(rng["range_id"])
        lo, hi = rng["lo"], rng["hi"]
        inside = [k for k in keys if lo < k <= hi]
        processed = ok_by_range[i]
        lost += [k for k in inside if k not in processed and k not in dead and k not in skipped]
        wrong_range = [k for k in processed if not lo < k <= hi]
        if wrong_range:
            errors.append(f"range {i}: {len(wrong_range)} key(s) processed outside (lo, hi]")
        if rng["cursor"] != hi or rng["state"] != "complete":
            errors.append(
                f"range {i}: cursor {rng['cursor']} state {rng['state']}, expected hi {hi} complete"
            )
        d, s, x = int(rng["done"]), int(rng["skipped"]), int(rng["dead"])
        exp_dead = len([k for k in inside if k in dead])
        exp_skipped = len([k for k in inside if k in skipped and k not in dead])
        if d + s + x != len(inside):
            errors.append(f"range {i}: done {d} + skipped {s} + dead {x} != {len(inside)} keys")
        if d != len(processed - dead - skipped):
            errors.append(
                f"range {i}: done {d} != {len(processed - dead - skipped)} distinct keys processed"
            )
        if x != exp_dead or s != exp_skipped:
            errors.append(f"range {i}: dead {x} skipped {s}, expected {exp_dead} and {exp_skipped}")
    return Coverage(lost, errors, outside)


def wait_for(
    predicate: Any, timeout: float = 30.0, interval: float = 0.005, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Tally:
    """What a scenario's trials found, summed; becomes one contribution to the summary table."""

    trials: int = 0
    lost: int = 0
    max_replay: int = 0
    counter_errors: int = 0
    failures: list[str] = field(default_factory=list)

    def check(self, label: str, cov: Coverage, watcher: CursorWatcher | None = None) -> None:
        """Count a finished round's coverage and cursor watch; remember what went wrong."""
        regressions = watcher.violations if watcher is not None else []
        self.lost += len(cov.lost)
        self.counter_errors += len(cov.counter_errors) + len(regressions)
        self.failures += [f"{label}: key {k} lost" for k in cov.lost[:5]]
        self.failures += [f"{label}: {e}" for e in cov.counter_errors + regressions]
        self.failures += [f"{label}: effect outside the round: {k}" for k in cov.outside[:5]]

    def replay(self, chunks: int) -> None:
        self.max_replay = max(self.max_replay, chunks)

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def record(self, scenario: str, note: str | None = None) -> None:
        record(
            scenario,
            trials=self.trials,
            keys_lost=self.lost,
            max_replay=self.max_replay,
            counter_errors=self.counter_errors,
            note=note,
        )

    def verdict(self, seed: int | None = None) -> str:
        head = f"seed {seed}: " if seed is not None else ""
        return head + f"{len(self.failures)} problem(s):\n" + "\n".join(self.failures[:20])
