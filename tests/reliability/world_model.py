"""The one world: its servers (``Servers``, one set per test session), its configuration
(``WorldConfig``, drawn per world), its state as the model knows it and the oracle (``World``).
The rules that drive it are ``test_world_model.py``; the workers and fault layers are
``world_support.py``.

The oracle, one for every rule:

- **effects**: a table on the target with no unique constraint (``model_effects``) holds one row
  per key per processor call that committed. With ``exactly_once`` no key of a round ever has two
  (checked after every step); without it, the rows beyond the first, summed over the world, stay
  within one chunk (one group: ``group_commit_chunks`` chunks of at most the largest chunk size)
  per range per fault that may replay (a crash, a stalled owner taken over, a reply lost past
  redis-py's retries, a Redis loss or a failover, per range that was open then).
- **coverage**: a round closes only covered: every key present (and matching ``where``) from its
  plan to its close has an effect in that round, or is dead-lettered because it is poisoned; no
  effect lies outside ``(start, end]``; a dead letter is always a poisoned key.
- **counters**: a closed round's ``dead`` is its dead letters, ``done`` lies between the stable
  keys it delivered and every key it delivered.
- **no silent empty round, no silent restart**: a chained plan starts at the model's watermark
  and ends at the largest key present; a stream whose Redis state is gone without a mirror is
  refused (an error), never planned again from below every key.
- **liveness**: once the faults stop, every round still in Redis closes.
- **verification**: before each close, a complete round's verification (``id % 3 = 0``) counts
  exactly the present keys of ``(start, end]`` it matches and lists the lowest of them.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _services
import redis
import redis_servers
import sqlalchemy as sa
from sqlalchemy.pool import NullPool
from world_support import (
    CRASH_POINTS,
    LEASE_S,
    LOST_REPLY,
    Ended,
    MirrorFaults,
    Worker,
    create_effects,
    delete_prefix,
    dependency_outage,
    dump_prefix,
    effect_counts,
    expire_lease,
    restore_prefix,
    write_effects,
)

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.chunk import Chunk, ChunkResult
from airflow_keyset_provider.core.errors import KeysetError, StreamStateLostError
from airflow_keyset_provider.core.keys import MIN_KEY, decode_key, encode_key
from airflow_keyset_provider.core.options import TraverseOptions
from airflow_keyset_provider.core.rounds.durability import PlannedRound, StreamRecord

TARGETS = ("postgresql", "sqlite", "mariadb")
MAX_LIVE = 6  # live (parked) workers per world
#: What a world's fault schedule fires (``World.fire``): each kind a fixed number of times per
#: world at steps drawn from the world's seed, whatever rules Hypothesis draws (its rule choice is
#: far from uniform: a long run once drew no crash, failover or lost reply at all). A dependency
#: outage and a pause toggle (on, then off at a later firing); a failover needs a cut before it.
FAULT_KINDS = (
    "crash",
    "stall",
    "retry lineage",
    "lost reply",
    "lost reply (surfaced)",
    "redis loss",
    "replica cut",
    "failover",
    "mirror outage",
    "dependency outage",
    "poison",
    "pause",
)


#: Work the schedule also does (twice as often as each fault), so the faults that act on workers
#: find some: in a world whose drawn rules start no worker (a long run had one that drew only
#: ``declare_new_stream``), a crash, stall or lost reply would wait for ever.
WORK_KINDS = ("plan", "start worker", "step workers")


def fault_schedule(rng: random.Random, steps: int, per_kind: int) -> dict[int, list[str]]:
    """Step -> the fault (and work) kinds due then: every fault kind ``per_kind`` times, every
    work kind twice that, at uniformly drawn steps (a toggle's 'off' after its 'on'; a failover
    after a cut)."""
    out: dict[int, list[str]] = {}
    last = max(steps - 1, 2)
    for kind in FAULT_KINDS + WORK_KINDS:
        for _ in range(per_kind * (2 if kind in WORK_KINDS else 1)):
            at = rng.randint(1, last)
            out.setdefault(at, []).append(kind)
            if kind in ("dependency outage", "pause", "replica cut"):
                then = "failover" if kind == "replica cut" else kind
                out.setdefault(min(at + rng.randint(1, 12), last), []).append(then)
    return out


class ModelViolation(AssertionError):
    """The oracle saw a guarantee broken."""


class Tainted(Exception):
    """A tolerated known defect happened; the world is judged no further."""


#: Defects the model finds on main that other branches fix (issue 27): id -> where it is fixed.
KNOWN_DEFECTS = {
    "silent-restart": "issue 27 item 10, branch durable",
    # found 2026-12-02 (seed 9, world we473d5bafa, step 119): a range whose next chunk held only
    # bad items and that had no committed key of its own to probe with was taken for an outage on
    # every try; the canary now comes from the round's other ranges
    "no-canary-outage": "fixed: core/run/item_failures.py takes canaries from the round's other ranges",
}
#: what a worker's error says when isolation found no canary and no part that succeeded
NO_CANARY = "no key that succeeded before was there to probe with"
TOLERATED = {d.strip() for d in os.environ.get("KEYSET_MODEL_TOLERATE", "").split(",") if d.strip()}


# --------------------------------------------------------------------------- servers


class Servers:
    """The session's servers: a throwaway PostgreSQL database for the sources (so a plan's wait
    for in-flight transactions sees only the model's), a schema of ``test`` for the PostgreSQL
    target and the mirror, a MariaDB database for the MariaDB target, a directory for SQLite
    targets, and a throwaway ``redis-server`` (a Redis loss may then delete freely)."""

    def __init__(self, pg_url: str) -> None:
        self.tag = uuid.uuid4().hex[:10]
        self.pg_admin = sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        with self.pg_admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "ksm_{self.tag}"')
        self.source_url = (
            sa.engine.make_url(pg_url)
            .set(database=f"ksm_{self.tag}")
            .render_as_string(hide_password=False)
        )
        self.source = sa.create_engine(self.source_url, isolation_level="AUTOCOMMIT")
        with self.pg_admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "ksmt_{self.tag}"')
        # the PostgreSQL target and the mirror: a database of their own too, so a worker parked
        # inside its transaction never holds up a plan of another test (or of the model)
        self.pg_target_url = (
            sa.engine.make_url(pg_url)
            .set(database=f"ksmt_{self.tag}")
            .render_as_string(hide_password=False)
        )
        self.redis_url, self._stop_redis = redis_servers.start_redis()
        self.redis = redis.Redis.from_url(self.redis_url)
        self.tmp = Path(tempfile.mkdtemp(prefix="keyset-world-"))
        self.mariadb_url: str | None = None
        self.targets: dict[str, sa.Engine] = {}
        self.mirror = sa.create_engine(self.pg_target_url, pool_size=10)

    def mariadb(self) -> str:
        if self.mariadb_url is None:
            base = _services.mariadb_url_or_skip()
            admin = sa.create_engine(base, poolclass=NullPool)
            with admin.begin() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE `ksm_{self.tag}` CHARACTER SET utf8mb4")
            admin.dispose()
            self.mariadb_url = (
                sa.engine.make_url(base)
                .set(database=f"ksm_{self.tag}")
                .render_as_string(hide_password=False)
            )
        return self.mariadb_url

    def target_url(self, kind: str, world: str) -> str:
        if kind == "postgresql":
            return self.pg_target_url
        if kind == "mariadb":
            return self.mariadb()
        # a short lock wait: a worker parked at a gate may hold the write lock for long
        return f"sqlite:///{self.tmp / f'{world}.db'}?timeout=0.2"

    def effects_engine(self, kind: str, url: str) -> sa.Engine:
        key = url if kind == "sqlite" else kind
        if key not in self.targets:
            self.targets[key] = sa.create_engine(url, poolclass=NullPool)
            create_effects(self.targets[key])
        return self.targets[key]

    def stop(self) -> None:
        for e in self.targets.values():
            e.dispose()
        self.source.dispose()
        self.mirror.dispose()
        with contextlib.suppress(Exception):
            self.redis.close()
        self._stop_redis()
        with self.pg_admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "ksm_{self.tag}" WITH (FORCE)')
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "ksmt_{self.tag}" WITH (FORCE)')
        self.pg_admin.dispose()
        if self.mariadb_url is not None:
            admin = sa.create_engine(_services.mariadb_url_or_skip(), poolclass=NullPool)
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `ksm_{self.tag}`")
            admin.dispose()


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class WorldConfig:
    """What a world is made of (drawn once per world by the model's ``initialize`` rule)."""

    keys: int = 120
    target: str = "postgresql"
    exactly_once: bool = False
    mirror: bool = True
    where: bool = False
    chunk: int = 8
    group: int = 1
    adaptive: bool = False
    prefetch: bool = True
    max_ranges: int = 4
    tasks: int = 2
    poison: float = 0.02
    record: bool = False  # Airflow's asset state records the stream (durable by default)

    @property
    def max_chunk(self) -> int:
        return 2 * self.chunk if self.adaptive else self.chunk

    def options(self, lineage: str) -> TraverseOptions:
        return TraverseOptions(
            chunk_size=self.chunk,
            lease_seconds=LEASE_S,
            chunk_timeout=3600,  # a parked worker is not hung: the model stalls workers itself
            claim_timeout=0,
            backoff_base=0.001,
            backoff_max=0.002,
            item_retry_delay=0.0,
            max_chunk_attempts=3,
            max_item_attempts=3,
            log_every_seconds=3600,
            group_commit_chunks=self.group,
            exactly_once=self.exactly_once,
            prefetch=self.prefetch,
            control_poll_seconds=0.01,
            target_chunk_seconds=0.0005 if self.adaptive else None,
            min_chunk_size=1,
            max_chunk_size=self.max_chunk,
            owner_lineage=lineage,
        )


# --------------------------------------------------------------------------- the model's state


@dataclass
class KeyLife:
    """When a key was present (and matched ``where``), in model steps."""

    born: int
    gone: int | None = None

    def stable(self, a: int, b: int) -> bool:
        return self.born <= a and (self.gone is None or self.gone > b)


@dataclass
class ModelRound:
    round_id: str
    start: int  # 0: below every key
    end: int
    chained: bool
    planned: int
    gen: int = 0  # Redis generation: a loss without a mirror hands the round ids out again
    closed: int | None = None
    lost: bool = False  # Redis lost it without a mirror: it can only be refused from now on
    rebase: bool = False  # the explicit re-plan after a loss: its close sets a missing watermark
    reopened: bool = False  # closed, then open again (a failover without a mirror went back)
    close_raised: bool = False  # a close raised on a mirror outage: Redis may have closed it

    @property
    def key(self) -> str:
        """The round as the effects table names it."""
        return f"g{self.gen}:{self.round_id}"


@dataclass
class CutState:
    """The model's record at a replica cut (a failover without a mirror goes back to it)."""

    n_rounds: int
    states: list[tuple[int | None, bool]]  # (closed, lost) per round then
    watermark: int
    flags: tuple[bool, bool, bool, bool]  # no_watermark, refused, lost_unmirrored, plan_pending


@dataclass
class Faults:
    """Faults fired in a world (reported; the replay budget is computed from them)."""

    counts: Counter[str] = field(default_factory=Counter)
    replay_events: int = 0  # ranges that may replay one group (crash, stall, loss per open range)
    unbounded: list[str] = field(default_factory=list)  # faults whose replay has no bound


# --------------------------------------------------------------------------- the world


@dataclass
class _PreviewWorker:
    """What ``write_effects`` reads of a worker, for the preview's processor."""

    round_key: str = "preview"
    name: str = "preview"


class World:
    """One stream over one table, its workers and the model's record of both."""

    def __init__(self, servers: Servers, cfg: WorldConfig, rng: random.Random) -> None:
        self.servers, self.cfg, self.rng = servers, cfg, rng
        self.name = f"w{uuid.uuid4().hex[:10]}"
        self.table = f"items_{self.name}"
        self.prefix = f"ksm{self.name}"
        self.redis_url = servers.redis_url
        self.redis = servers.redis
        self.target_url = servers.target_url(cfg.target, self.name)
        self.effects_db = servers.effects_engine(cfg.target, self.target_url)
        self.mirror_engine = servers.mirror
        self.mirror_faults = MirrorFaults()
        self.step = 0
        self.keys: dict[int, KeyLife] = {}
        self.poison: set[int] = set()  # fails alone, every time: dead-lettered
        self.bombs: set[int] = set()  # fails the whole chunk it is in: isolation finds it
        self.flaky: set[int] = set()  # fails its first attempt in each round only
        self.flaky_seen: set[tuple[str, int]] = set()
        self.outage = False
        self.paused = False
        self.rounds: list[ModelRound] = []
        self.watermark = 0
        self.plan_pending = False  # a chained plan raised on a mirror outage: its retry returns it
        self.refused = False  # the stream was refused after a loss: no more chained plans
        self.workers: list[Worker] = []
        self.faults = Faults()
        self.snapshot: dict[bytes, tuple[bytes, int]] | None = None
        self.at_cut: CutState | None = None
        self.regressions = 0  # failovers without a mirror
        self.regressed_starts: set[int] = set()  # where a chained plan may start after one
        self.lost_unmirrored = False
        self.gen = 0
        self.attempted: dict[str, set[int]] = {}  # keys handed to the processor, per round
        self.canaries = 0  # single-key calls of a key already processed (isolation's canary)
        self.violations: list[str] = []
        self.tainted = False
        self.no_watermark = False  # Redis lost the watermark (no mirror) and none is back yet
        self.n_workers = 0
        self._setup_table()
        self.admin = self.traversal(redis.Redis.from_url(self.redis_url))

    # -- set-up ---------------------------------------------------------------------------
    def _setup_table(self) -> None:
        n, rng = self.cfg.keys, self.rng
        ids = [2 * i for i in range(1, n + 1)]  # even: odd keys are inserted into the gaps
        with self.servers.source.connect() as conn:
            conn.exec_driver_sql(
                f'CREATE TABLE "{self.table}" (id bigint PRIMARY KEY, grp int NOT NULL)'
            )
            conn.execute(
                sa.text(f'INSERT INTO "{self.table}" (id, grp) VALUES (:i, :g)'),
                [{"i": i, "g": rng.randrange(5)} for i in ids],
            )
        for i in ids:
            self.keys[i] = KeyLife(0)
            r = rng.random()
            if r < self.cfg.poison:
                self.poison.add(i)
            elif r < 1.5 * self.cfg.poison:
                self.bombs.add(i)
            elif r < 3 * self.cfg.poison:
                self.flaky.add(i)

    def traversal(self, client: redis.Redis) -> KeysetTraversal:
        t = KeysetTraversal(
            self.servers.source_url,
            table=self.table,
            key="id",
            stream=self.name,
            where="grp < 5" if self.cfg.where else None,
            redis_client=client,
            key_prefix=self.prefix,
            target_url=self.target_url,
            checkpoint_seconds=0.0,
        )
        if self.cfg.mirror:
            from world_support import CrashSwitch, WorldMirror

            m = WorldMirror(self.mirror_engine, self.mirror_faults, CrashSwitch())
            t.mirror = t.control.mirror = m
        return t

    def close(self) -> None:
        for w in self.workers:
            if w.live:
                w.switch.dead = True  # its thread, if started, unwinds at its next call
                with contextlib.suppress(Exception):
                    w._go.release()
                if w.thread.ident is not None:
                    w.thread.join(30)  # its helper threads stop with it: then close its clients
                w.close()
        self.admin.close()
        with contextlib.suppress(Exception):
            delete_prefix(self.redis, self.prefix)
        with self.servers.source.connect() as conn:
            conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{self.table}"')

    # -- the processor ------------------------------------------------------------------------
    def process(self, w: Worker, chunk: Chunk) -> ChunkResult:
        if self.outage:
            raise dependency_outage()
        keys = [int(k) for k in chunk.keys]
        if len(keys) > 1 and any(k in self.bombs for k in keys):
            raise ValueError("a bad row fails the whole chunk")
        failed: dict[Any, str] = {}
        for k in keys:
            if k in self.poison or k in self.bombs:
                failed[k] = "poisoned item"
            elif k in self.flaky and (chunk.round_id, k) not in self.flaky_seen:
                self.flaky_seen.add((chunk.round_id, k))
                failed[k] = "flaky item, first attempt"
        ok = [k for k in keys if k not in failed]
        seen = self.attempted.setdefault(w.round_key, set())
        if len(keys) == 1 and keys[0] in seen:
            self.faults.counts["canary (a processed key again, isolating a chunk)"] += 1
            self.canaries += 1
        seen.update(ok)
        write_effects(chunk, self.name, w, ok)
        w.switch.reach("after_effect")
        return ChunkResult(failed=failed)

    # -- rows -----------------------------------------------------------------------------------
    def present(self) -> list[int]:
        return sorted(k for k, life in self.keys.items() if life.gone is None)

    def insert(self, gap: bool, pick: int) -> None:
        """A new row: above every key (a later round's), or into a gap of the key space."""
        present = self.present()
        if gap and present:
            k = present[pick % len(present)] - 1
            if k <= 0 or k in self.keys:
                return
        else:
            k = max(self.keys, default=0) + 2
        with self.servers.source.connect() as conn:
            conn.execute(sa.text(f'INSERT INTO "{self.table}" (id, grp) VALUES (:i, 0)'), {"i": k})
        self.keys[k] = KeyLife(self.step)
        self.faults.counts["row inserted"] += 1

    def remove(self, pick: int, move: bool) -> None:
        """Delete a row, or (with ``where``) move it out of the filter."""
        present = self.present()
        if not present:
            return
        k = present[pick % len(present)]
        sql = (
            f'UPDATE "{self.table}" SET grp = 9 WHERE id = :i'
            if move and self.cfg.where
            else f'DELETE FROM "{self.table}" WHERE id = :i'
        )
        with self.servers.source.connect() as conn:
            conn.execute(sa.text(sql), {"i": k})
        self.keys[k].gone = self.step
        self.faults.counts[
            "row moved out of where" if move and self.cfg.where else "row deleted"
        ] += 1

    # -- plans ----------------------------------------------------------------------------------
    def expected_end(self, start: int) -> int:
        above = [k for k in self.present() if k > start]
        return max(above) if above else start

    def record(self) -> StreamRecord | None:
        """What Airflow's asset state of the stream holds (the barrier records each close, the
        plan each chained round), in worlds that run under Airflow (``cfg.record``)."""
        if not self.cfg.record:
            return None
        chained = [r for r in self.rounds if r.chained]
        closed = [r for r in chained if r.closed is not None]
        last = max(closed, key=lambda r: r.closed or 0, default=None)
        newest = chained[-1] if chained else None
        return StreamRecord(
            "the model's asset state",
            watermark=enc(self.watermark) if last is not None else None,
            last_round=last.round_id if last is not None else None,
            planned=PlannedRound(newest.round_id, enc(newest.start), enc(newest.end))
            if newest is not None
            else None,
        )

    def expect_refusal(self) -> bool:
        """After Redis lost the stream without a mirror, a chained plan restores it only from
        Airflow's record, and only when the stream's newest chained round was closed."""
        if not (self.lost_unmirrored or self.refused):
            return False
        newest = [r for r in self.rounds if r.chained][-1:]
        restorable = self.cfg.record and (not newest or newest[0].closed is not None)
        return not restorable

    def plan_chained(self, new_stream: bool = False) -> None:
        """A chained plan (``new_stream``: the caller declares the stream new, as the first plan
        of every world does and as a person may after a refusal: it starts below every key)."""
        if self.regressed_starts and not new_stream:
            self._plan_after_regression()
            return
        expect_refusal = self.expect_refusal() and not new_stream
        failed_before = self.mirror_faults.failed
        try:
            rnd = self.admin.plan(
                max_ranges=self.cfg.max_ranges, new_stream=new_stream, record=self.record()
            )
        except Exception as exc:
            if self.mirror_faults.failed > failed_before:
                # the plan's mirror write failed: the plan raised, its retry returns the round
                self.faults.counts["plan failed: mirror outage"] += 1
                self.plan_pending = True
                return
            if isinstance(exc, StreamStateLostError) and (
                expect_refusal or self.mirror_faults.failed
            ):
                self.refused = True
                self.faults.counts["plan refused after a loss"] += 1
                return
            self.fail(f"a chained plan failed: {type(exc).__name__}: {exc}")
            return
        start, end = _dec(rnd.start_encoded), _dec(rnd.end_encoded)
        if expect_refusal and rnd.created:
            self.known(
                "silent-restart",
                f"silent restart: Redis lost the stream (no mirror) and the next plan started a "
                f"round ({start}, {end}] instead of refusing (the model's watermark is "
                f"{self.watermark})",
            )
            return
        if new_stream:
            self.watermark, self.refused, self.lost_unmirrored = 0, False, False
            for r in self.rounds:
                if r.closed is None:
                    r.lost = True  # a new stream: the old one's open rounds are abandoned
        elif self.refused or self.lost_unmirrored:
            self.faults.counts["stream restored from the durable record"] += 1
            self.refused = self.lost_unmirrored = False
        open_chained = [r for r in self.rounds if r.chained and r.closed is None and not r.lost]
        if open_chained and rnd.created and open_chained[-1].close_raised:
            # its close raised on a mirror outage after Redis closed it: the plan went on from
            # its end; the close's retry (the barrier's) returns its totals
            old = open_chained[-1]
            self.close_round(old)
            if old.closed is None:  # the retry raised on the mirror again: closed in Redis
                old.closed, self.watermark, self.no_watermark = self.step, old.end, False
            self.faults.counts["chained plan after a close that raised"] += 1
            open_chained = [r for r in open_chained if r.closed is None]
        if open_chained:
            if rnd.round_id != open_chained[-1].round_id or rnd.created:
                self.fail(f"a chained plan while {open_chained[-1]} is open returned {rnd}")
            return
        pending, self.plan_pending = self.plan_pending, False
        if not rnd.created and not pending:
            self.fail(
                f"a chained plan with no open chained round returned an old one: {rnd} (the "
                f"model's rounds: {self.rounds})"
            )
        if start != self.watermark:
            self.fail(
                f"silent restart: a chained plan started at {start}, the watermark is "
                f"{self.watermark}"
            )
        if rnd.created and end != self.expected_end(start):
            self.fail(
                f"the chained plan ends at {end}, the largest key present is "
                f"{self.expected_end(start)} (a silent empty or short round)"
            )
        self.rounds.append(ModelRound(rnd.round_id, start, end, True, self.step, self.gen))

    def _plan_after_regression(self) -> None:
        """The first chained plan after a failover without a mirror (``_regress``)."""
        try:
            rnd = self.admin.plan(max_ranges=self.cfg.max_ranges, record=self.record())
        except StreamStateLostError:
            self.refused = True
            self.faults.counts["plan refused after a failover (no mirror)"] += 1
            return
        except Exception as exc:
            self.fail(f"a chained plan after a failover failed: {type(exc).__name__}: {exc}")
            return
        start, end = _dec(rnd.start_encoded), _dec(rnd.end_encoded)
        open_chained = [r for r in self.open_rounds() if r.chained]
        if not rnd.created:
            if rnd.round_id not in {r.round_id for r in open_chained}:
                self.fail(
                    f"a chained plan after a failover returned {rnd}, not a chained round the "
                    f"replica has open ({open_chained})"
                )
            return
        if start not in self.regressed_starts:
            self.fail(
                f"a chained plan after a failover started at {start}: neither the replica's "
                f"watermark nor the record's ({sorted(self.regressed_starts)})"
            )
        if end != self.expected_end(start):
            self.fail(f"the chained plan after a failover ends at {end}, not at the largest key")
        for r in open_chained:
            r.chained = False  # the replica has no open chained round: they close as explicit
        self.regressed_starts.add(start)
        self.watermark = start
        self.no_watermark = self.refused = self.lost_unmirrored = False
        self.rounds.append(ModelRound(rnd.round_id, start, end, True, self.step, self.gen))

    def plan_explicit(self, a: int, b: int) -> None:
        """A round with explicit bounds over keys already present (a re-run of a slice)."""
        present = self.present()
        if not present:
            return
        lo, hi = sorted((present[a % len(present)], present[b % len(present)]))
        failed_before = self.mirror_faults.failed
        # the re-plan a loss's refusal names: Redis has no state of the stream (no mirror)
        rebase = (self.lost_unmirrored or self.refused) and not self.cfg.mirror
        rebase = rebase and not self.admin.store.has_state()
        try:
            rnd = self.admin.plan(max_ranges=self.cfg.max_ranges, start_key=lo - 1, end_key=hi)
        except Exception as exc:
            if self.mirror_faults.failed > failed_before:
                self.faults.counts["plan failed: mirror outage"] += 1
                return
            self.fail(f"an explicit plan ({lo - 1}, {hi}] failed: {type(exc).__name__}: {exc}")
            return
        if (_dec(rnd.start_encoded), _dec(rnd.end_encoded)) != (lo - 1, hi) or not rnd.created:
            self.fail(f"an explicit plan ({lo - 1}, {hi}] returned {rnd}")
        self.rounds.append(
            ModelRound(rnd.round_id, lo - 1, hi, False, self.step, self.gen, rebase=rebase)
        )

    def preview(self) -> None:
        """A preview of the next chained round (issue 31), its processor writing the world's
        effects through ``chunk.connection``: it writes nothing. The stream's own Redis keys
        (watermark, key, counter, open and chained rounds, run keys, control) keep their values
        and no key appears or disappears (a round's hashes may move under a worker's heartbeat:
        only their names are compared); the source rows and the world's effects are unchanged.
        What it names: an open chained round is the round the preview returns; else a new round
        starting at the model's watermark."""
        stream_keys = [
            getattr(self.admin.store, k)
            for k in (
                "watermark_key", "key_fingerprint_key", "seq_key", "open_key", "chained_key",
                "by_key_key", "ahead_key", "control_key",
            )
        ]  # fmt: skip

        def state() -> tuple[Any, ...]:
            names = set(self.redis.scan_iter(match=f"{self.prefix}:*", count=1000))
            values = {k: self.redis.dump(k) for k in stream_keys}
            with self.servers.source.connect() as conn:
                rows = conn.exec_driver_sql(f'SELECT count(*), sum(id * grp) FROM "{self.table}"')
                source = tuple(rows.one())
            with self.effects_db.connect() as conn:
                effects = conn.execute(
                    sa.text("SELECT count(*) FROM model_effects WHERE w = :w"), {"w": self.name}
                ).scalar()
            return names, values, source, effects

        probe = _PreviewWorker()

        def processor(chunk: Chunk) -> ChunkResult:
            write_effects(chunk, self.name, probe, [int(k) for k in chunk.keys])  # type: ignore[arg-type]
            return ChunkResult()

        before = state()
        try:
            pv = self.admin.preview(
                self.cfg.max_ranges, processor=processor, chunk_size=5, record=self.record()
            )
        except Exception as exc:  # what a plan would refuse now, or a server the world cut
            self.faults.counts[f"preview refused: {type(exc).__name__}"] += 1
            pv = None
        after = state()
        if after != before:
            self.fail(f"a preview wrote: before {before[1:]}, after {after[1:]}")
        if pv is None:
            return
        self.faults.counts["preview"] += 1
        open_chained = [r for r in self.rounds if r.chained and r.closed is None and not r.lost]
        if open_chained and not self.lost_unmirrored and not self.refused:
            if pv.existing_round != open_chained[-1].round_id:
                self.fail(f"a preview while {open_chained[-1]} is open named {pv.existing_round}")
        elif pv.existing_round is None and not (
            self.lost_unmirrored or self.refused or self.plan_pending or self.no_watermark
        ):
            start = 0 if pv.start_key is None else int(pv.start_key)
            if start != self.watermark:
                self.fail(f"a preview starts at {start}, the watermark is {self.watermark}")

    def open_rounds(self) -> list[ModelRound]:
        return [r for r in self.rounds if r.closed is None and not r.lost]

    # -- workers --------------------------------------------------------------------------------
    def start_worker(
        self, rnd: ModelRound, pull: bool, range_pick: int, lineage: str = ""
    ) -> Worker | None:
        """A new task try on the round (None when the world has ``MAX_LIVE`` live workers:
        each holds database connections, and the servers are shared)."""
        if len(self.live_workers()) >= MAX_LIVE:
            return None
        self.n_workers += 1
        name = f"x{self.n_workers}"
        lineage = lineage or f"L{self.n_workers}"
        try:
            n_ranges = int(self.admin.store.round_info(rnd.round_id)["n_ranges"])
        except Exception:
            n_ranges = 1
        w = Worker(
            self,
            name,
            lineage,
            rnd,
            "pull" if pull else "range",
            range_pick % max(n_ranges, 1),
            self.cfg.options(lineage),
            self.cfg.tasks,
        )
        self.workers.append(w)
        self.step_worker(w)
        return w

    def live_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.live]

    def step_worker(self, w: Worker) -> None:
        began, gate = time.monotonic(), w.at_gate
        ended = w.step()
        took = time.monotonic() - began
        if took > 1.0:  # slow steps are reported (the model's figures), never asserted
            self.faults.counts[f"slow step (>1 s) after {gate or 'start'}"] += 1
            if os.environ.get("KEYSET_MODEL_VERBOSE"):
                print(f"slow step {took:.1f}s: {w.name} {w.mode} from {gate!r} to {w.at_gate!r}")
                print("\n".join(w.slow_stacks[-1:]))
        if ended is not None:
            self.judge_end(w, ended)

    def judge_end(self, w: Worker, e: Ended) -> None:
        """A worker's end: a crash is a fault; an error must be one the faults explain."""
        if e.status == "crashed":
            self.faults.counts["crash: " + (w.switch.fired_at.split(" ")[0] or "dead")] += 1
            self.faults.replay_events += 1
            return
        if e.status != "error":
            return
        name = e.error.split(":", 1)[0]
        self.faults.counts[f"worker error: {name}"] += 1
        if name == "LeaseLostError":  # fenced: the chunk it had in hand is the taker's again
            self.faults.replay_events += 1
        explained = {
            "LeaseHeldError",  # claim_timeout=0: a live owner holds the range
            "LeaseLostError",  # its lease was run out and another took over
            "DependencyFailedError",  # the dependency outage outlasted max_chunk_attempts
        }
        if self.lost_unmirrored:
            explained |= {"RoundStateLostError", "RoundNotFoundError", "StreamNotFoundError"}
        if self.faults.counts["lost reply (surfaced)"]:
            explained |= {"ConnectionError", "StoreUnavailableError"}
        if self.faults.counts["failover"] or self.faults.counts["redis loss"]:
            explained |= {"CursorConflictError"}
        if self.regressions:
            explained |= {"CursorConflictError", "RoundStateLostError", "RoundNotFoundError"}
        if self.mirror_faults.failed:
            explained |= {"RoundStateLostError"}
        if name not in explained:
            self.fail(
                f"worker {w.name} ({w.mode}) ended with an unexplained error: {e.error}\n{e.result}"
            )

    # -- faults ---------------------------------------------------------------------------------
    def fire(self, kind: str, rng: random.Random) -> bool:
        """Fire one fault of ``kind`` (``FAULT_KINDS``) with arguments drawn from ``rng`` (the
        world's fault schedule). False when it had nothing to act on (no live worker, no crashed
        lineage, no replica cut): the schedule tries it again at the next step."""
        live = self.live_workers()
        pick = rng.randrange(1 << 16)
        if kind in ("crash", "stall", "lost reply", "lost reply (surfaced)") and not live:
            return False
        if kind == "crash":
            self.crash(live[pick % len(live)], rng.choice(CRASH_POINTS), rng.randint(1, 8))
        elif kind == "stall":
            self.stall(live[pick % len(live)])
        elif kind in ("lost reply", "lost reply (surfaced)"):
            self.lose_reply(live[pick % len(live)], kind.endswith("(surfaced)"))
        elif kind == "retry lineage":
            dead = [x for x in self.workers if x.ended is not None and x.ended.status == "crashed"]
            rounds = {r.round_id: r for r in self.open_rounds()}
            dead = [x for x in dead if x.round_id in rounds]
            if not dead:
                return False
            x = dead[pick % len(dead)]
            self.start_worker(rounds[x.round_id], x.mode == "pull", x.range_id, x.lineage)
        elif kind == "redis loss":
            self.redis_loss()
        elif kind == "replica cut":
            self.cut()
        elif kind == "failover":
            if self.snapshot is None:
                return False
            self.failover()
        elif kind == "mirror outage":
            if not self.cfg.mirror:
                return False
            self.mirror_outage(rng.randint(1, 4))
        elif kind == "dependency outage":
            self.set_outage(not self.outage)
        elif kind == "poison":
            self.poison_key(pick)
        elif kind == "pause":
            self.pause(not self.paused)
        elif kind == "plan":
            self.plan_chained()
        elif kind == "start worker":
            rounds = self.open_rounds()
            if not rounds:
                return False
            self.start_worker(rounds[pick % len(rounds)], rng.random() < 0.5, pick)
        elif kind == "step workers":
            for w in live:
                self.step_worker(w)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return True

    def crash(self, w: Worker, point: str, n: int) -> None:
        """Arm a crash: the worker dies when it next passes the point (the n-th time), in this
        step or a later one."""
        w.switch.arm(point, n)
        self.faults.counts["crash armed"] += 1
        self.step_worker(w)

    def stall(self, w: Worker) -> None:
        """The worker stops beating (a pause past its lease): its ranges' leases run out; it
        goes on when stepped, and its next commit must be refused if another took over."""
        for token in w.tokens:
            lineage_ranges = self._ranges_owned_by(token)
            for round_id, rid in lineage_ranges:
                expire_lease(self.redis, self.admin, round_id, rid)
                self.faults.counts["lease run out (stalled owner)"] += 1
                self.faults.replay_events += 1

    def _ranges_owned_by(self, token: str) -> list[tuple[str, int]]:
        out = []
        for r in self.open_rounds():
            for b in self._briefs(r.round_id):
                if b.owner == token and b.state != "complete":
                    out.append((r.round_id, b.range_id))
        return out

    def _briefs(self, round_id: str) -> list[Any]:
        try:
            return list(self.admin.store.range_briefs(round_id))
        except Exception:
            return []

    def expire_dead(self) -> int:
        """Run out the leases of ranges whose owner is no live worker (crashed ones)."""
        live = set().union(*(w.tokens for w in self.live_workers()))
        n = 0
        for r in self.open_rounds():
            for b in self._briefs(r.round_id):
                if b.owner and b.owner not in live and b.lease_ms_left > 0:
                    expire_lease(self.redis, self.admin, r.round_id, b.range_id)
                    n += 1
        self.faults.counts["lease run out (dead owner)"] += n
        return n

    def lose_reply(self, w: Worker, surfaced: bool) -> None:
        """The next script call of the worker runs on the server and its reply is lost: redis-py
        sends it again on a new connection (or, ``surfaced``, every retry loses it too)."""
        w.plan.fail(
            LOST_REPLY,
            command="EVALSHA",
            times=4 if surfaced else 1,
            where=lambda _: w.switch.mine(),
        )
        self.faults.counts["lost reply (surfaced)" if surfaced else "lost reply"] += 1
        if surfaced:
            self.faults.replay_events += 1

    def redis_loss(self) -> None:
        """Redis loses every key of the stream (a restart without persistence, a FLUSHALL)."""
        open_ranges = self._open_ranges()
        delete_prefix(self.redis, self.prefix)
        self.faults.counts["redis loss"] += 1
        if self.cfg.mirror:
            self._replay_allowance(open_ranges, "redis loss")
        else:
            self.lost_unmirrored = self.no_watermark = True
            self.gen += 1
            for r in self.rounds:
                if r.closed is None:
                    r.lost = True

    def _open_ranges(self) -> int:
        return sum(
            1 for r in self.open_rounds() for b in self._briefs(r.round_id) if b.state != "complete"
        )

    def _replay_allowance(self, open_ranges: int, what: str) -> None:
        if self.mirror_faults.failed:
            self.faults.unbounded.append(f"{what} after a mirror outage")
        self.faults.replay_events += max(open_ranges, 1) + self.cfg.max_ranges

    def cut(self) -> None:
        """The replica stops replicating here (it has everything acknowledged so far)."""
        self.snapshot = dump_prefix(self.redis, self.prefix)
        self.at_cut = CutState(
            len(self.rounds),
            [(r.closed, r.lost) for r in self.rounds],
            self.watermark,
            (self.no_watermark, self.refused, self.lost_unmirrored, self.plan_pending),
        )
        self.faults.counts["replica cut"] += 1

    def failover(self) -> None:
        """The lagging replica is promoted: Redis goes back to the cut."""
        if self.snapshot is None or self.at_cut is None:
            return
        open_ranges = self._open_ranges()
        restore_prefix(self.redis, self.prefix, self.snapshot)
        self.snapshot = None
        if self.cfg.mirror:
            self.faults.counts["failover"] += 1
            self._replay_allowance(open_ranges, "failover")
            return
        self._regress(self.at_cut)

    def _regress(self, cut: CutState) -> None:
        """A failover with no mirror: nothing outside Redis can tell the promoted replica is
        older than what was committed (docs/howto-redis.md, "Failover with a lagging replica";
        ``core/rounds/durability.py``: a record's watermark and round counter still move Redis's
        forward). What the engine promises then, and the model judges:

        - the stream goes back to the cut as a whole: rounds planned since are unknown to Redis
          (their workers fail with an error naming the loss; their ids are handed out again, so
          the model's effects of a new round are told apart by generation), rounds closed since
          are open again and close again, covered;
        - the next chained plan starts at the replica's watermark or (a record) at the record's,
          returns the round the replica has open, or is refused (``StreamStateLostError``),
          never below the replica's watermark;
        - keys committed after the cut are delivered again: no replay bound without a mirror
          (reported as unbounded), but with ``exactly_once`` none twice (the target's ledger);
        - every round still in Redis closes once the faults stop."""
        self.faults.counts["failover (no mirror)"] += 1
        self.faults.unbounded.append("failover without a mirror")
        self.regressed_starts |= {cut.watermark, self.watermark}
        for i, r in enumerate(self.rounds):
            if i < cut.n_rounds:
                was_closed = r.closed
                r.closed, r.lost = cut.states[i]
                if was_closed is not None and r.closed is None:
                    r.reopened = True
            elif r.closed is None:
                r.lost = True
        self.watermark = cut.watermark
        self.no_watermark, self.refused, self.lost_unmirrored, self.plan_pending = cut.flags
        self.regressions += 1
        self.gen += 1

    def mirror_outage(self, n: int) -> None:
        if self.cfg.mirror:
            self.mirror_faults.fail_next += n
            self.faults.counts["mirror outage (writes)"] += n

    def set_outage(self, on: bool) -> None:
        if on and not self.outage:
            self.faults.counts["dependency outage"] += 1
        self.outage = on

    def pause(self, on: bool) -> None:
        self.paused = on
        try:
            if on:
                self.admin.pause("model", "model")
                self.faults.counts["pause"] += 1
            else:
                self.admin.resume()
        except KeysetError as exc:
            if not self.lost_unmirrored:
                self.fail(f"pause/resume failed: {exc}")

    def poison_key(self, pick: int) -> None:
        present = self.present()
        if present:
            self.poison.add(present[pick % len(present)])
            self.faults.counts["item poisoned"] += 1

    # -- closing --------------------------------------------------------------------------------
    def verify_round(self, r: ModelRound) -> None:
        """Verification (issue 31) before a close, judged by the model's own rows: the processor
        writes its effects elsewhere, so the source changes only by the world's inserts, deletes
        and moves, and ``id % 3 = 0`` matches exactly the present keys of ``(start, end]``
        divisible by 3. A round not complete, lost or hit by a fault is not judged."""
        try:
            v = self.admin.verify_round(r.round_id, "id % 3 = 0", max_keys=5, chunk_size=7)
        except (KeysetError, redis.RedisError, sa.exc.SQLAlchemyError):
            return
        want = [k for k in self.present() if r.start < k <= r.end and k % 3 == 0]
        if v.matching != len(want) or [int(k) for k in v.key_labels] != want[:5]:
            self.fail(
                f"round {r}: verification {v.describe()}, the model has {want[:5]} of {len(want)}"
            )
        self.faults.counts["round verified"] += 1

    def close_round(self, r: ModelRound, must: bool = False) -> None:
        self.verify_round(r)
        failed_before = self.mirror_faults.failed
        try:
            totals = self.admin.close_round(r.round_id)
        except Exception as exc:
            if self.mirror_faults.failed > failed_before and not must:
                # Redis may have closed it (the mirror write after the close failed): a chained
                # plan before the close's retry may then find no open chained round
                self.faults.counts["close failed: mirror outage"] += 1
                r.close_raised = True
                return
            if must:
                ends = [
                    f"{w.name} {w.mode}: {w.ended.status} {w.ended.error[:300]} "
                    f"{str(w.ended.result)[:600]}"
                    for w in self.workers[-4:]
                    if w.round_id == r.round_id and w.ended is not None
                ]
                message = (
                    f"round {r} did not close once the faults stopped: {exc!r}; "
                    f"its last workers: {ends}"
                )
                if any(NO_CANARY in e for e in ends):
                    self.known("no-canary-outage", message)
                self.fail(message)
            if not isinstance(exc, KeysetError):
                self.fail(f"closing round {r} failed: {exc!r}")
            return
        already = r.closed is not None
        if not already:
            r.closed = self.step
            self.check_closed(r, totals)
            if r.chained:
                self.watermark, self.no_watermark = r.end, False
                if self.regressions:
                    self.regressed_starts.add(r.end)
            elif r.rebase and self.no_watermark:
                # the stream's new base (a record's watermark still moves Redis's forward)
                self.watermark = max(self.watermark, r.end) if self.cfg.record else r.end
                self.no_watermark = self.refused = self.lost_unmirrored = False
                self.faults.counts["stream re-based on an explicit re-plan"] += 1

    def ends(self, r: ModelRound) -> list[str]:
        return [w.ended.error[:300] for w in self.workers if w.round_id == r.round_id and w.ended]

    def check_closed(self, r: ModelRound, totals: Any) -> None:
        effects = effect_counts(self.effects_db, self.name).get(r.key, Counter())
        dead = self.dead_letters(r.round_id)
        stable = [
            k
            for k, life in self.keys.items()
            if r.start < k <= r.end and life.stable(r.planned, self.step)
        ]
        bad = self.poison | self.bombs
        missing = [k for k in stable if effects[k] == 0 and k not in dead]
        if missing:
            self.fail(
                f"round {r.round_id} ({r.start}, {r.end}] closed without {len(missing)} key(s): {missing[:10]}"
            )
        outside = [k for k in effects if not r.start < k <= r.end]
        if outside:
            self.fail(f"round {r.round_id}: effects outside its bounds: {outside[:10]}")
        wrong_dead = [k for k in dead if k not in bad]
        if wrong_dead:
            self.fail(
                f"round {r.round_id}: keys dead-lettered that never failed: {wrong_dead[:10]}"
            )
        delivered_bad = [k for k in effects if k in bad and k not in dead]
        if [k for k in delivered_bad if k in self.bombs]:
            self.fail(f"round {r.round_id}: a poisoned row had an effect: {delivered_bad[:10]}")
        if totals.dead != len(dead):
            self.fail(f"round {r.round_id}: dead {totals.dead}, {len(dead)} dead letters")
        # a key delivered, then (its commit lost with Redis, or its cursor gone back) delivered
        # again after it was poisoned, is dead-lettered: counted dead, not done
        stable_delivered = sum(1 for k in stable if effects[k] > 0 and k not in dead)
        if not stable_delivered <= totals.done <= len(effects):
            self.fail(
                f"round {r.round_id}: done {totals.done}, delivered {len(effects)} distinct keys "
                f"of which {stable_delivered} were present throughout"
            )
        if r.reopened or self.regressions:
            return  # a failover without a mirror: the record may have moved the watermark past
        if r.chained and totals.watermark is not None and int(totals.watermark) != r.end:
            self.fail(f"round {r.round_id} closed with watermark {totals.watermark}, end {r.end}")

    def dead_letters(self, round_id: str) -> set[int]:
        out: set[int] = set()
        n = int(self.admin.store.round_info(round_id)["n_ranges"])
        for i in range(n):
            for letter in self.admin.dead_letters(round_id, i, limit=10_000):
                out.add(int(letter["key"]))
        return out

    # -- invariants -----------------------------------------------------------------------------
    def check_exactly_once(self) -> None:
        if not self.cfg.exactly_once:
            return
        for rnd, counts in effect_counts(self.effects_db, self.name).items():
            twice = sorted(k for k, n in counts.items() if n > 1)
            if twice:
                message = (
                    f"exactly_once: round {rnd}: {len(twice)} key(s) written more than once "
                    f"(e.g. {[(k, counts[k]) for k in twice[:8]]}; {self.duplicates()})"
                )
                self.fail(message)

    def replay(self) -> tuple[int, int]:
        """(keys delivered again, the budget: one group of the largest chunk per event)."""
        extra = sum(
            n - 1 for c in effect_counts(self.effects_db, self.name).values() for n in c.values()
        )
        budget = self.faults.replay_events * self.cfg.group * self.cfg.max_chunk
        return extra, budget + self.canaries

    def check_replay(self) -> None:
        if self.cfg.exactly_once:
            return
        extra, budget = self.replay()
        self.faults.counts["keys delivered again"] += extra
        if extra > budget and not self.faults.unbounded:
            self.fail(
                f"{extra} key deliveries beyond the first, more than one group per range per "
                f"fault allows ({self.faults.replay_events} event(s) x {self.cfg.group} chunk(s) "
                f"x {self.cfg.max_chunk} keys + {self.canaries} canaries = {budget}); e.g. {self.duplicates()}"
            )

    def duplicates(self, n: int = 6) -> list[str]:
        """A few keys delivered more than once: round, key, range and worker of each effect."""
        with self.effects_db.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT e.rnd, e.k, e.rid, e.worker FROM model_effects e JOIN (SELECT rnd, k "
                    "FROM model_effects WHERE w = :w GROUP BY rnd, k HAVING count(*) > 1) d "
                    "ON d.rnd = e.rnd AND d.k = e.k WHERE e.w = :w ORDER BY e.rnd, e.k"
                ),
                {"w": self.name},
            ).all()
        out: dict[tuple[str, int], list[str]] = {}
        for rnd, k, rid, worker in rows:
            out.setdefault((rnd, int(k)), []).append(f"{worker}/range {rid}")
        return [f"{rnd} key {k}: {', '.join(v)}" for (rnd, k), v in list(out.items())[:n]]

    def known(self, defect: str, message: str) -> None:
        """A violation that a known defect explains (``KNOWN_DEFECTS``). It fails the world like
        any other, unless ``KEYSET_MODEL_TOLERATE`` names the defect (to look past it for new
        ones): then the world is counted as tainted, loudly, and judged no further."""
        if defect in TOLERATED:
            self.faults.counts[f"KNOWN DEFECT {defect} (tolerated)"] += 1
            self.tainted = True
            raise Tainted(message)
        self.fail(f"[known defect {defect}: {KNOWN_DEFECTS[defect]}] {message}")

    def fail(self, message: str) -> None:
        self.violations.append(f"step {self.step}: {message}")
        raise ModelViolation(f"world {self.name} {self.cfg}: {message}")

    # -- the end: faults stop, everything finishes ------------------------------------------
    def drive(self) -> None:
        """No more faults: every live worker runs to its end, dead owners' leases run out, then
        fresh pull workers finish every round still in Redis, and every one closes."""
        self.outage = False
        self.mirror_faults.fail_next = 0
        self.pause(False)
        for w in self.workers:
            w.switch.disarm()
            w.plan.rules.clear()
        self.expire_dead()
        for _ in range(100_000):  # every live worker one step in turn, until all ended
            live = self.live_workers()
            if not live:
                break
            for w in live:
                if w.at_gate.startswith("split"):
                    self.expire_dead()  # a dead owner never answers: its lease runs out
                self.step_worker(w)
        for _ in range(4):
            self.expire_dead()
            for r in self.open_rounds():
                w = self.start_worker(r, True, 0)
                while w is not None and w.live:
                    self.step_worker(w)
                self.close_round(r)
            if not self.open_rounds():
                break
        for r in self.open_rounds():
            self.close_round(r, must=True)
        self.check_exactly_once()
        self.check_replay()


def _dec(encoded: str) -> int:
    return 0 if encoded == MIN_KEY else int(decode_key(encoded)[0])


def enc(k: int) -> str:
    return MIN_KEY if k == 0 else encode_key([k])
