"""Redis failover to a lagging replica, for the reliability suite: a throwaway primary and its
replica on loopback (``tests/redis_servers.py``), and one trial of a stream's rounds through it.

How the replica lags, without timing: at the trial's *cut* event the test waits (``WAIT 1``) until
the replica has every write the primary acknowledged so far, then promotes the replica
(``REPLICAOF NO ONE``). From then on the primary goes on acknowledging the round's writes, which
the replica never gets: exactly the writes a replica that lagged would miss. At the *kill* event
(the cut or later) the primary is killed (SIGKILL) and the clients move to the promoted replica (a
new client URL), as they would after a sentinel or an operator promoted it.

A trial (``run_trial``) is one driver that plays an Airflow deployment: for each of a few chained
rounds (each with an idempotency key, as a DAG run's), plan, traverse in pull mode, close. Every
chunk, plan and close is an event; the failover happens at two random events. After the kill the
driver starts over on the promoted replica, each plan idempotent, as the DAG runs would be
retried. What it measures: keys never delivered, deliveries beyond the first (replays), rounds
closed twice (a second ``closed_ms``), watermarks that went backwards, runs that ended with an
error (by name) and rounds not closed at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis_servers

from airflow_keyset_provider.core import KeysetTraversal, TraverseOptions

SYNC_TIMEOUT_S = 20


class ReplicaPair:
    """A primary and its replica, both throwaway ``redis-server`` processes stopped by PID."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="keyset-failover-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self.p_port, p = redis_servers._start_one(
                ["--repl-diskless-sync-delay", "0"], self.workdir
            )
            self.procs.append(p)
            self.r_port, r = redis_servers._start_one(
                ["--replicaof", "127.0.0.1", str(self.p_port)], self.workdir
            )
            self.procs.append(r)
            self._wait_link()
        except BaseException:
            self.stop()
            raise
        self.primary_url = f"redis://127.0.0.1:{self.p_port}/0"
        self.replica_url = f"redis://127.0.0.1:{self.r_port}/0"
        self.lagging = False
        self.killed = False

    def _wait_link(self) -> None:
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        r = redis.Redis(port=self.r_port)
        while r.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync with its primary")
            time.sleep(0.05)
        r.close()

    def lag(self) -> None:
        """The replica has every write acknowledged so far (``WAIT``), then stops replicating:
        it is promoted now and misses every write the primary acknowledges from here on."""
        p = redis.Redis(port=self.p_port)
        acked = p.execute_command("WAIT", 1, SYNC_TIMEOUT_S * 1000)
        p.close()
        if int(acked) != 1:
            raise RuntimeError(f"WAIT: {acked} replicas acknowledged, expected 1")
        r = redis.Redis(port=self.r_port)
        r.execute_command("REPLICAOF", "NO", "ONE")
        r.close()
        self.lagging = True

    def kill_primary(self) -> None:
        """SIGKILL the primary (its unreplicated writes are gone with it)."""
        os.kill(self.procs[0].pid, signal.SIGKILL)
        self.procs[0].wait(10)
        self.killed = True

    def stop(self) -> None:
        for proc in self.procs:
            redis_servers._stop(proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


class Failover(BaseException):
    """Raised through the driver at the kill event: its process lost its Redis."""


@dataclass
class Events:
    """Counts the driver's events; lags the replica at ``cut`` and kills the primary at ``kill``."""

    pair: ReplicaPair
    cut: int
    kill: int
    n: int = 0

    def __call__(self) -> None:
        self.n += 1
        if self.pair.killed:
            return
        if self.n == self.cut:
            self.pair.lag()
        if self.n == self.kill:
            self.pair.kill_primary()
            raise Failover()


@dataclass
class Outcome:
    """What one trial measured (see the module docstring)."""

    keys: int
    events: int = 0
    lost: int = 0
    replays: int = 0
    double_closes: int = 0
    watermark_back: int = 0
    errors: list[str] = field(default_factory=list)
    unclosed: int = 0
    watermark_short: bool = False  # the final watermark is not the last round's end

    @property
    def safe(self) -> bool:
        bad = self.lost or self.double_closes or self.watermark_back or self.unclosed
        return not (bad or self.watermark_short or self.errors)


@dataclass
class Trial:
    """One failover trial over the ``events`` table's keys ``1..n_keys``."""

    url: str
    stream: str
    n_keys: int
    rounds: int = 3
    ranges: int = 3
    chunk: int = 20
    seen: Counter[int] = field(default_factory=Counter)
    closes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    watermarks: list[str] = field(default_factory=list)

    def ends(self) -> list[int]:
        return [self.n_keys * (i + 1) // self.rounds for i in range(self.rounds)]

    def events_estimate(self) -> int:
        """Events of a trial without failover (chunks, plus one plan and one close per round;
        the empty read that ends a range is not an event)."""
        return -(-self.n_keys // self.chunk) + 2 * self.rounds + self.ranges * self.rounds

    def drive(self, redis_url: str, event: Callable[[], None]) -> None:
        """Plan, traverse and close every round (each plan idempotent by its key)."""
        t = KeysetTraversal(
            self.url,
            table="events",
            key="seq",
            redis_url=redis_url,
            stream=self.stream,
            key_prefix="fo",
            checkpoint_url=self.url,
        )
        t.checkpoint_seconds = 0

        def proc(chunk: Any) -> None:
            self.seen.update(chunk.keys)
            event()

        try:
            for i, end in enumerate(self.ends()):
                event()
                rnd = t.plan(
                    max_ranges=self.ranges, end_key=end, round_key=f"run{i}", new_stream=True
                )
                if rnd.state == "closed":
                    continue
                options = TraverseOptions(chunk_size=self.chunk, owner_lineage=f"w{i}")
                res = t.traverse_round(rnd.round_id, proc, options=options)
                if not res.finished:
                    raise RuntimeError(f"round {rnd.round_id}: traverse_round did not finish")
                event()
                t.close_round(rnd.round_id)
                self.closes[rnd.round_id].add(t.store.round_info(rnd.round_id)["closed_ms"])
                self.watermarks.append(t.store.watermark() or "")
        finally:
            with contextlib.suppress(Exception):
                t.close()
            if t.mirror is not None:
                t.mirror.engine.dispose()  # no pool left open per trial

    def finish(self, redis_url: str, out: Outcome) -> None:
        """What is left of the stream on the promoted replica: every round closed?"""
        t = KeysetTraversal(
            self.url,
            table="events",
            key="seq",
            redis_url=redis_url,
            stream=self.stream,
            key_prefix="fo",
            checkpoint_url=self.url,
        )
        try:
            for i in range(self.rounds):
                rid = t.store.lookup(f"run{i}", chained=False)
                if rid is None or t.store.round_state(rid) != "closed":
                    out.unclosed += 1
            if t.store.watermark() != t.source.encode([self.ends()[-1]]):
                out.watermark_short = True
        finally:
            t.close()
            if t.mirror is not None:
                t.mirror.engine.dispose()


def run_trial(url: str, stream: str, n_keys: int, rng: random.Random) -> Outcome:
    """One trial: 2-4 chained rounds of 1-4 ranges, chunks of 10-40 keys; the replica cut off at
    a random event and the primary killed at the same or a later one."""
    trial = Trial(
        url,
        stream,
        n_keys,
        rounds=rng.randint(2, 4),
        ranges=rng.randint(1, 4),
        chunk=rng.choice([10, 20, 40]),
    )
    total = trial.events_estimate()
    cut = rng.randint(1, total)
    kill = min(cut + rng.randint(0, total // 2), total)
    pair = ReplicaPair()
    out = Outcome(keys=n_keys)
    try:
        events = Events(pair, cut, kill)
        with contextlib.suppress(Failover):
            trial.drive(pair.primary_url, events)
        if not pair.killed:  # the run ended before the kill event: kill now
            if not pair.lagging:
                pair.lag()
            pair.kill_primary()
        out.events = events.n
        try:
            trial.drive(pair.replica_url, lambda: None)
        except Exception as exc:
            out.errors.append(type(exc).__name__)
        with contextlib.suppress(Exception):
            trial.finish(pair.replica_url, out)
    finally:
        pair.stop()
    out.lost = sum(1 for k in range(1, n_keys + 1) if not trial.seen[k])
    out.replays = sum(trial.seen.values()) - (n_keys - out.lost)
    out.double_closes = sum(len(v) - 1 for v in trial.closes.values() if len(v) > 1)
    out.watermark_back = sum(
        1 for a, b in zip(trial.watermarks, trial.watermarks[1:], strict=False) if b < a
    )
    return out
