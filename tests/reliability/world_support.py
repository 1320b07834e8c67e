"""The one-world model's machinery (``test_world_model.py``): a world is one stream over one small
table on the real servers, with workers that are real ``KeysetTraversal`` calls stepped chunk by
chunk, fault layers under their Redis, source and mirror calls, and the oracle's record.

Workers are threads, each with its own ``KeysetTraversal`` (its own Redis client through the
fault layer of ``redis_faults``, its own source and target engines). A worker runs only when the
test steps it: it stops at every *gate* (each processor call, each wait for a split answer), so
one step is one chunk (or one poll) and the interleaving is the test's, not the scheduler's.

A crash is in-process and abrupt: at the chosen point (the n-th Redis command of the worker from
now, before it is sent or after the server ran it; a source read; inside the processor before or
after its writes) the worker raises ``WorkerCrash`` (a ``BaseException``, as SIGKILL is not an
error the engine may handle), and from then on every Redis command, read, mirror write and
processor call of that worker fails: nothing it would do on the way out (commit the group,
release the lease, checkpoint) reaches a server. Its lease stays until it runs out (the model
runs it out: a 1 ms heartbeat with its token) or a new attempt of its lineage takes over.

A lagging replica is a point-in-time copy of the stream's keys (``DUMP`` at the *cut*, put back
with ``RESTORE`` at the *failover*): exactly what a replica that stopped replicating at the cut
holds when it is promoted; the workers' connections then talk to it, as after a promotion.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import sqlalchemy as sa
from redis.backoff import NoBackoff
from redis.connection import ConnectionPool
from redis.retry import Retry
from redis_faults import LOST_REPLY, FaultPlan, FaultyConnection, call_name

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.chunk import Chunk, ChunkResult
from airflow_keyset_provider.core.errors import RetryableError
from airflow_keyset_provider.core.options import TraverseOptions
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror

STEP_TIMEOUT_S = 120.0
SLOW_STEP_S = 2.0  # a step this long: the worker's stack is kept (KEYSET_MODEL_VERBOSE prints it)  # a worker that neither reaches a gate nor ends in this long is hung
# A live worker's heartbeat renews its lease every third of it, so it never loses it by
# accident; the model runs leases out itself. Short, because a worker that waits on a lock a
# parked one holds waits (its statements are bounded by the lease) that long.
LEASE_S = 10.0


class WorkerCrash(BaseException):
    """The worker's process died at an injected point."""


# --------------------------------------------------------------------------- crash points

REDIS_BEFORE, REDIS_AFTER, FETCH, PROCESSOR, AFTER_EFFECT = (
    "redis_before",
    "redis_after",
    "fetch",
    "processor",
    "after_effect",
)
CRASH_POINTS = (REDIS_BEFORE, REDIS_AFTER, FETCH, PROCESSOR, AFTER_EFFECT)


@dataclass
class CrashSwitch:
    """Where a worker dies (armed by the model), and whether it has. Only the worker's own
    thread counts commands and dies; its helper threads (heartbeat, prefetch, pacer) see a dead
    worker's calls fail as a refused connection would."""

    thread: threading.Thread | None = None
    point: str = ""
    countdown: int = 0
    dead: bool = False
    fired_at: str = ""

    def arm(self, point: str, n: int) -> None:
        self.point, self.countdown = point, max(1, n)

    def disarm(self) -> None:
        self.point, self.countdown = "", 0

    def mine(self) -> bool:
        return threading.current_thread() is self.thread

    def die(self, where: str) -> None:
        self.dead, self.fired_at, self.point = True, where, ""
        raise WorkerCrash(f"injected crash at {where}")

    def check_alive(self, what: str) -> None:
        """A call of a dead worker: the worker's thread crashes again (it is unwinding), a
        helper thread gets a refused connection."""
        if self.dead:
            if self.mine():
                raise WorkerCrash(f"dead worker: {what}")
            raise redis.ConnectionError(f"injected: the worker is dead ({what})")

    def reach(self, point: str) -> None:
        """The worker's thread passes ``point``: die here if armed for it."""
        self.check_alive(point)
        if self.point == point and self.mine():
            self.countdown -= 1
            if self.countdown <= 0:
                self.die(point)


class WorldPlan(FaultPlan):
    """``FaultPlan`` of one worker's Redis client, plus its crash switch."""

    switch: CrashSwitch

    def decide(self, args: tuple[Any, ...]) -> tuple[str | None, Callable[[], None] | None]:
        name, _ = call_name(args)
        sw = self.switch
        sw.check_alive(name)
        handshake = name in ("PING", "SCRIPT", "HELLO", "AUTH", "SELECT", "CLIENT")
        if not handshake and sw.mine() and sw.point in (REDIS_BEFORE, REDIS_AFTER):
            sw.countdown -= 1
            if sw.countdown <= 0:
                if sw.point == REDIS_BEFORE:
                    sw.die(f"{REDIS_BEFORE} {name}")
                return REDIS_AFTER, None
        return super().decide(args)


class WorldConnection(FaultyConnection):
    """``FaultyConnection`` that also kills its worker after the server ran a command."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self._fault == REDIS_AFTER:
            self._fault = None
            super(FaultyConnection, self).read_response(*args, **kwargs)  # the server ran it
            self.disconnect()
            self.fault_plan.switch.die(REDIS_AFTER)  # type: ignore[union-attr]
        return super().read_response(*args, **kwargs)


def world_client(url: str, plan: WorldPlan) -> redis.Redis:
    pool = ConnectionPool.from_url(
        url, connection_class=WorldConnection, fault_plan=plan, retry=Retry(NoBackoff(), 3)
    )
    return redis.Redis(connection_pool=pool)


@dataclass
class MirrorFaults:
    """The mirror outage, shared by every worker's mirror (``CheckpointMirror.bounded`` copies
    the mirror object, so the state lives here)."""

    fail_next: int = 0
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> bool:
        with self.lock:
            if self.fail_next > 0:
                self.fail_next -= 1
                self.failed += 1
                return True
            return False


class WorldMirror(CheckpointMirror):
    """The real mirror on the real table; its writes fail during an outage (as a refused
    connection would) and when its worker is dead."""

    def __init__(self, engine: sa.Engine, faults: MirrorFaults, switch: CrashSwitch) -> None:
        super().__init__(engine)
        self.faults, self.switch = faults, switch

    def _write(self) -> None:
        self.switch.check_alive("mirror write")
        if self.faults.take():
            raise ConnectionError("injected mirror outage")

    def save_round(self, *args: Any, **kwargs: Any) -> None:
        self._write()
        super().save_round(*args, **kwargs)

    def save_range(self, *args: Any, **kwargs: Any) -> None:
        self._write()
        super().save_range(*args, **kwargs)

    def save_watermark(self, *args: Any, **kwargs: Any) -> None:
        self._write()
        super().save_watermark(*args, **kwargs)


# --------------------------------------------------------------------------- workers


@dataclass
class Ended:
    status: str  # "finished", "returned", "crashed", "error"
    error: str = ""
    result: Any = None


class Worker:
    """One task try: ``traverse`` of one range (``mode="range"``) or ``traverse_round`` (pull),
    in a thread that runs only between the model's steps."""

    def __init__(
        self,
        world: Any,
        name: str,
        lineage: str,
        rnd: Any,
        mode: str,
        range_id: int,
        options: TraverseOptions,
        tasks: int,
    ) -> None:
        self.world, self.name, self.lineage = world, name, lineage
        self.round_id, self.mode, self.range_id = rnd.round_id, mode, range_id
        self.round_key = rnd.key  # the round as the effects table names it
        self.options, self.tasks = options, tasks
        self.switch = CrashSwitch()
        self.plan = WorldPlan()
        self.plan.switch = self.switch
        self.tokens: set[str] = set()
        self.ended: Ended | None = None
        self.at_gate = ""
        self.slow_stacks: list[str] = []  # where the worker was when a step took long
        self._go = threading.Semaphore(0)
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._main, name=f"world-{name}", daemon=True)
        self.switch.thread = self.thread
        self.t = world.traversal(world_client(world.redis_url, self.plan))
        if world.cfg.mirror:
            m = WorldMirror(world.mirror_engine, world.mirror_faults, self.switch)
            self.t.mirror = self.t.control.mirror = m
        self._hook()

    def _hook(self) -> None:
        store, source, sw = self.t.store, self.t.source, self.switch
        real_claim, real_answer, real_fetch = store.claim, store.split_answer, source.fetch
        real_request = store.request_split

        def claim(round_id: str, range_id: int, token: str, *a: Any, **kw: Any) -> Any:
            self.tokens.add(token)
            return real_claim(round_id, range_id, token, *a, **kw)

        def split_answer(*a: Any, **kw: Any) -> Any:
            answer = real_answer(*a, **kw)
            if answer is None and sw.mine():
                self.gate("split answer")  # the owner answers when the model steps it
            return answer

        def request_split(*a: Any, **kw: Any) -> Any:
            answer = real_request(*a, **kw)
            if answer == "busy" and sw.mine():
                self.gate("split busy")  # another task's request is pending: it waits
            return answer

        def fetch(*a: Any, **kw: Any) -> Any:
            sw.reach(FETCH)
            return real_fetch(*a, **kw)

        store.claim, store.split_answer, source.fetch = claim, split_answer, fetch  # type: ignore[method-assign]
        store.request_split = request_split  # type: ignore[method-assign]

    # -- the thread ------------------------------------------------------------------------
    def gate(self, what: str) -> None:
        self._events.put(("gate", what))
        self._go.acquire()

    def _main(self) -> None:
        try:
            if self.mode == "pull":
                res: Any = self.t.traverse_round(
                    self.round_id, self.processor, options=self.options, tasks=self.tasks
                )
                status = "finished" if res.finished else "returned"
            else:
                res = self.t.traverse(
                    self.round_id, self.range_id, self.processor, options=self.options
                )
                status = "finished" if res.complete else "returned"
            end = Ended(status, result=res)
        except WorkerCrash as exc:
            end = Ended("crashed", str(exc))
        except Exception as exc:
            end = Ended("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        self._events.put(("end", end))

    def processor(self, chunk: Chunk) -> ChunkResult:
        self.gate("chunk")
        self.switch.reach(PROCESSOR)
        return self.world.process(self, chunk)

    # -- the model's side ------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.ended is None

    def step(self) -> Ended | None:
        """Let the worker run to its next gate (or its end); None while it lives."""
        if self.ended is not None:
            return self.ended
        if self.thread.ident is None:
            self.thread.start()
        else:
            self._go.release()
        try:
            try:
                kind, value = self._events.get(timeout=SLOW_STEP_S)
            except queue.Empty:
                self.slow_stacks.append(self.stack())
                kind, value = self._events.get(timeout=STEP_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.name} hung for {STEP_TIMEOUT_S} s after its gate {self.at_gate!r}"
            ) from None
        if kind == "gate":
            self.at_gate = value
            return None
        self.ended = value
        self.thread.join(STEP_TIMEOUT_S)
        self.close()
        return self.ended

    def stack(self) -> str:
        """Where the worker's thread is now (for a step that is slow)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.t.close()
        with contextlib.suppress(Exception):
            self.t.store.client.close()


# --------------------------------------------------------------------------- effects


EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS model_effects (w VARCHAR(40) NOT NULL, rnd VARCHAR(80) NOT NULL, "
    "k BIGINT NOT NULL, rid INTEGER NOT NULL, worker VARCHAR(40) NOT NULL)"
)  # no unique constraint: every processor effect that committed is a row


def create_effects(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(EFFECTS_DDL))


def effect_counts(engine: sa.Engine, world: str) -> dict[str, Counter[int]]:
    """Committed effects of a world: round id -> key -> count."""
    out: dict[str, Counter[int]] = {}
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT rnd, k, count(*) FROM model_effects WHERE w = :w GROUP BY rnd, k"),
            {"w": world},
        )
        for rnd, k, n in rows:
            out.setdefault(rnd, Counter())[int(k)] = int(n)
    return out


def write_effects(chunk: Chunk, world: str, worker: Worker, keys: list[int]) -> None:
    if keys:
        chunk.connection.execute(
            sa.text(
                "INSERT INTO model_effects (w, rnd, k, rid, worker) VALUES (:w, :r, :k, :i, :x)"
            ),
            [
                {"w": world, "r": worker.round_key, "k": k, "i": chunk.range_id, "x": worker.name}
                for k in keys
            ],
        )


def dependency_outage() -> RetryableError:
    return RetryableError("injected dependency outage")


# --------------------------------------------------------------------------- Redis state


def dump_prefix(client: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes, int]]:
    """Every key of the world (``<prefix>:...``): value (DUMP) and TTL in ms (0: none)."""
    out = {}
    for k in client.scan_iter(match=f"{prefix}:*", count=1000):
        v = client.dump(k)
        if v is not None:
            ttl = client.pttl(k)
            out[k] = (v, max(int(ttl), 0) if ttl and ttl > 0 else 0)
    return out


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    return len(keys)


def restore_prefix(client: redis.Redis, prefix: str, snap: dict[bytes, tuple[bytes, int]]) -> None:
    """The world's keys become exactly ``snap`` (the promoted replica's copy)."""
    delete_prefix(client, prefix)
    for k, (v, ttl) in snap.items():
        client.restore(k, ttl, v, replace=True)


def expire_lease(client: redis.Redis, t: KeysetTraversal, round_id: str, range_id: int) -> bool:
    """Run out the lease of the range's current owner (its last heartbeat a 1 ms lease), as if
    it stopped beating long ago; True if it had an owner."""
    owner = client.hget(t.store.range_key(round_id, range_id), "owner")
    if not owner:
        return False
    t.store.heartbeat(round_id, range_id, owner.decode(), 1)
    time.sleep(0.003)
    return True


__all__ = [
    "CRASH_POINTS",
    "LEASE_S",
    "LOST_REPLY",
    "Ended",
    "MirrorFaults",
    "Worker",
    "WorkerCrash",
    "create_effects",
    "delete_prefix",
    "dependency_outage",
    "dump_prefix",
    "effect_counts",
    "expire_lease",
    "restore_prefix",
    "write_effects",
]
