"""``KeysetTraversal``: plan a round, traverse its ranges, close it.

The contract this class keeps (see docs/contract.md):

1. Total order: the key is unique, NOT NULL and indexed; ``plan`` refuses anything else.
2. Fixed bounds: a round is ``start < key <= end``; planning again for the same request (or for
   a stream whose chained round is still open) returns the same round unchanged.
3. Cursors move only forward, only by their current owner, only together with their counters.
4. One chunk in memory per worker (plus at most one prefetched); control state grows with ranges
   and item failures, never with rows.
5. An item failure is retried, then dead-lettered, and the cursor moves on; a dependency failure
   (``RetryableError`` or any unexpected exception) stops the chunk, backs off, and the cursor
   stays; when the budget is spent the call raises, it never reports the range complete.
6. At-least-once: after a crash at most one chunk per range is delivered again.
7. ``done`` counts items that reached a terminal state with the processor's success, ``skipped``
   terminal without the business effect, ``dead`` dead-lettered. ``done + skipped + dead`` of a
   complete round equals the number of keys in ``(start, end]`` that the source held while the
   range passed over them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import redis

from .chunk import Chunk, ChunkResult
from .control import RangeSpec, Round, RoundTotals, StreamControl, _decode
from .errors import (
    ConfigurationError,
    CursorConflictError,
    DependencyFailedError,
    KeysetError,
    LeaseHeldError,
    LeaseLostError,
    ProcessorContractError,
    RetentionError,
    RetryableError,
    RoundStateLostError,
)
from .keys import (
    MIN_KEY,
    KeyEncodingError,
    as_tuple,
    display_key,
    encode_key,
)
from .metrics import Metrics, NullMetrics
from .mirror import CheckpointMirror
from .planner import MAX_MAP_LENGTH, split
from .source import SqlSource, release
from .store import Claim, CursorStore

log = logging.getLogger("airflow_keyset_provider")

Processor = Callable[[Chunk], "ChunkResult | None"]


@dataclass(frozen=True)
class RangeResult:
    """Counters of one range (cumulative over every attempt) after a ``traverse`` call."""

    round_id: str
    range_id: int
    done: int
    skipped: int
    dead: int
    complete: bool
    cursor: str
    rows_read: int = 0  # rows read by this call (including replays)
    chunks: int = 0  # chunks committed by this call
    stopped: bool = False  # a stop was requested and honoured
    takeover: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "range_id": self.range_id, "done": self.done,
                "skipped": self.skipped, "dead": self.dead, "complete": self.complete,
                "rows_read": self.rows_read, "chunks": self.chunks, "seconds": round(self.seconds, 3)}


def _check_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigurationError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")


@dataclass
class _Progress:
    """Throttled progress lines: what a person needs at 3 a.m."""

    round_id: str
    range_id: int
    hi_label: str
    arity: int
    every_seconds: float
    estimate: int | None
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    rows: int = 0

    def tick(self, n: int, cursor: str, done: int, skipped: int, dead: int, retries: int, force: bool = False) -> None:
        self.rows += n
        now = time.monotonic()
        if not force and now - self.last < self.every_seconds:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-9)
        rate = self.rows / elapsed
        eta = ""
        if self.estimate and rate > 0 and self.rows < self.estimate:
            eta = f", ETA {dt.timedelta(seconds=int((self.estimate - self.rows) / rate))}"
        elif self.estimate is not None and self.rows >= self.estimate and not force:
            eta = ", ETA unknown (more rows than the planner estimated; ANALYZE the table)"
        log.info(
            "round %s range %d: cursor %s of %s; done %d, skipped %d, dead %d, retry %d; %d rows in %.1f s "
            "(%.0f rows/s%s)", self.round_id, self.range_id, display_key(cursor, self.arity), self.hi_label,
            done, skipped, dead, retries, self.rows, elapsed, rate, eta,
        )


class KeysetTraversal:
    """Plan, traverse and close rounds of one stream over one table.

    ``source_url`` is a SQLAlchemy URL (or Engine) of PostgreSQL or SQLite; ``key`` a column name
    or a list of them; ``stream`` names the sequence of rounds that chain by watermark (all its
    Redis keys share the hash tag ``{stream}``). Nothing is read or written until a method runs.
    """

    def __init__(
        self,
        source_url: Any,
        table: str,
        key: str | Sequence[str],
        redis_url: str | None = None,
        stream: str = "default",
        where: str | None = None,
        columns: Sequence[str] | None = None,
        *,
        redis_client: redis.Redis | None = None,
        key_prefix: str = "ks",
        settle_seconds: float = 0.0,
        commit_wait_timeout: float = 60.0,
        checkpoint_url: Any = None,
        checkpoint_seconds: float = 10.0,
        metrics: Metrics | None = None,
        retention_sql: str | None = None,
    ) -> None:
        if redis_client is None:
            if not redis_url:
                raise ConfigurationError("give redis_url (e.g. 'redis://127.0.0.1:6379/0') or redis_client")
            try:
                redis_client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=30,
                                                    health_check_interval=30)
            except ValueError as exc:
                raise ConfigurationError(f"redis_url is not valid: {exc}") from exc
        self.source = SqlSource(source_url, table, key, where=where, columns=columns,
                                settle_seconds=settle_seconds, commit_wait_timeout=commit_wait_timeout,
                                retention_sql=retention_sql)
        self.store = CursorStore(redis_client, stream, prefix=key_prefix)
        self.mirror = CheckpointMirror(checkpoint_url) if checkpoint_url is not None else None
        self.checkpoint_seconds = checkpoint_seconds
        self.metrics: Metrics = metrics or NullMetrics()
        self.tags = {"stream": stream}
        self.control = StreamControl(self.store, self.mirror)
        self.stream = stream
        self.arity = self.source.arity
        self._stop = threading.Event()

    # ---- keys --------------------------------------------------------------------------------
    def _encode_user_key(self, name: str, key: Any) -> str:
        try:
            values = as_tuple(key, self.arity)
            coerced = tuple(_coerce(v, kind, f"{name}[{i}]" if self.arity > 1 else name)
                            for i, (v, kind) in enumerate(zip(values, self.source.key_kinds, strict=True)))
            return encode_key(coerced)
        except KeyEncodingError as exc:
            raise ConfigurationError(f"{name}: {exc}") from exc

    def decode(self, encoded: str) -> Any:
        """Encoded key -> user value (scalar or tuple); ``None`` for the open lower bound."""
        return _decode(encoded, self.arity)

    # ---- planning ----------------------------------------------------------------------------
    def plan(
        self,
        max_ranges: int = 8,
        start_key: Any = None,
        end_key: Any = None,
        *,
        round_key: str | None = None,
        exact_limit: int = 500_000,
        sample_rows: int = 50_000,
    ) -> Round:
        """Fix a round ``start < key <= end`` and split it into at most ``max_ranges`` ranges.

        ``start_key`` None continues the stream: the round starts at the watermark (or below every
        key) and is the stream's *chained* round; while it is open, planning again returns it
        unchanged. ``end_key`` None takes ``max(key)`` at plan time, once every key below it has
        committed (PostgreSQL). ``round_key`` (e.g. an Airflow run id) makes the call idempotent:
        the same key always returns the same round, open or closed. Validation happens before
        anything is written; a refused plan writes nothing.
        """
        if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or not 1 <= max_ranges <= MAX_MAP_LENGTH:
            raise ConfigurationError(f"max_ranges must be an integer from 1 to {MAX_MAP_LENGTH} (Airflow's "
                                     f"max_map_length), got {max_ranges!r}")
        self.store.ping()
        self.source.validate()
        self.control.recover_stream()
        chained = start_key is None
        existing = self.store.lookup(round_key, chained)
        if existing is not None:
            log.info("stream %s: round %s already planned for this request; returning it unchanged",
                     self.stream, existing)
            return self.round(existing)
        if start_key is None:
            start = self.store.watermark() or MIN_KEY
        else:
            start = self._encode_user_key("start_key", start_key)
        if end_key is None:
            top = self.source.upper_bound()
            end = start if top is None or top < start else top
        else:
            end = self._encode_user_key("end_key", end_key)
        if end < start:
            raise ConfigurationError(
                f"start_key {display_key(start, self.arity)} is above end_key {display_key(end, self.arity)}: "
                "a round is start < key <= end"
            )
        cuts = self.source.quantile_keys(start, end, max_ranges, exact_limit, sample_rows) \
            if max_ranges > 1 and end != start else []
        bounds = split(start, end, cuts, max_ranges)
        round_id, created = self.store.create_round(
            idempotency_key=round_key, chained=chained, start=start, end=end,
            source=self.source.fingerprint(), arity=self.arity, bounds=bounds,
        )
        rnd = self.round(round_id)
        if created:
            self.control._mirror_round(round_id)
            log.info("stream %s: planned round %s (%s, %s] in %d ranges", self.stream, round_id,
                     display_key(start, self.arity), display_key(end, self.arity), len(bounds))
        return Round(**{**rnd.__dict__, "created": created})

    def round(self, round_id: str) -> Round:
        return self.control.round(round_id)

    def watermark(self) -> Any:
        """The end of the stream's contiguous completed prefix (None before the first round)."""
        return self.control.watermark()

    def range_status(self, round_id: str) -> list[dict[str, Any]]:
        return self.control.range_status(round_id)

    def retention_floor(self) -> Any:
        """Keys ``<=`` this value may be deleted from the source without harming any round."""
        return self.control.retention_floor()

    # ---- traversal ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the running ``traverse`` call to finish the chunk in hand, commit it, and return.
        The request applies to the call in progress (or the next one, if none is running)."""
        self._stop.set()

    def traverse(
        self,
        round_id: str,
        range_id: int,
        processor: Processor,
        chunk_size: int = 1000,
        lease_seconds: float = 60,
        max_chunk_attempts: int = 5,
        max_item_attempts: int = 3,
        *,
        owner_lineage: str = "",
        claim_timeout: float | None = None,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        item_retry_delay: float = 0.5,
        outage_failure_ratio: float = 0.5,
        prefetch: bool = True,
        log_every_seconds: float = 30.0,
        dead_cap: int = 1000,
        group_commit_chunks: int = 1,
        group_commit_seconds: float | None = None,
    ) -> RangeResult:
        """Process every key of one range at least once, resuming from its committed cursor.

        Waits while another live owner holds the range (up to ``claim_timeout``, default three
        leases), then takes over. ``owner_lineage`` names the logical worker (an Airflow task
        instance): a new attempt of the same lineage takes over at once, fencing the old one.
        Returns the range's cumulative counters. Raises ``DependencyFailedError`` after
        ``max_chunk_attempts`` consecutive failures of one chunk (cursor unchanged),
        ``LeaseLostError`` when another worker took the range, ``RoundStateLostError`` when Redis
        lost the round.

        Group commit (``group_commit_chunks`` > 1 and/or ``group_commit_seconds``): commit the cursor
        once per group of chunks (every N chunks, or every T seconds, whichever comes first; T alone
        groups by time only) instead of once per chunk, and always before stopping, backing off or
        retrying items. It saves a Redis round trip per chunk for tiny chunks; the replay bound after
        a crash widens from one chunk to one group.
        """
        if isinstance(group_commit_chunks, bool) or not isinstance(group_commit_chunks, int) or group_commit_chunks < 1:
            raise ConfigurationError(f"group_commit_chunks must be a positive integer, got {group_commit_chunks!r}")
        _validate_traverse_args(processor, chunk_size, lease_seconds, max_chunk_attempts, max_item_attempts)
        self.source.ensure_validated()
        args = (processor, chunk_size, lease_seconds, max_chunk_attempts, max_item_attempts, owner_lineage,
                claim_timeout, backoff_base, backoff_max, item_retry_delay, outage_failure_ratio, prefetch,
                log_every_seconds, dead_cap, group_commit_chunks, group_commit_seconds)
        try:
            return self._traverse_restoring(round_id, range_id, args)
        finally:
            self._stop.clear()  # a stop request ends this call, not the traversal object

    def _traverse_restoring(self, round_id: str, range_id: int, args: tuple) -> RangeResult:
        for _ in range(3):
            try:
                return self._traverse(round_id, range_id, *args)
            except RoundStateLostError:
                # Redis lost the round; with a mirror, put it back (cursors at their last checkpoint)
                # and go on. Without one, or if the mirror never saw it, the loss is an error.
                if not self.control.restore(round_id):
                    raise
                self.metrics.incr("state.restored", tags=self.tags)
        return self._traverse(round_id, range_id, *args)

    def _traverse(self, round_id: str, range_id: int, processor: Processor, chunk_size: int, lease_seconds: float,
                  max_chunk_attempts: int, max_item_attempts: int, owner_lineage: str, claim_timeout: float | None,
                  backoff_base: float, backoff_max: float, item_retry_delay: float, outage_failure_ratio: float,
                  prefetch: bool, log_every_seconds: float, dead_cap: int, group_chunks: int,
                  group_seconds: float | None) -> RangeResult:
        info = self.store.round_info(round_id)
        n_ranges = int(info["n_ranges"])
        if isinstance(range_id, bool) or not isinstance(range_id, int) or not 0 <= range_id < n_ranges:
            raise ConfigurationError(f"round {round_id} has ranges 0..{n_ranges - 1}; got range_id {range_id!r}")
        if info.get("source") != self.source.fingerprint():
            raise ConfigurationError(
                f"round {round_id} was planned over {info.get('source')}, not {self.source.fingerprint()}; "
                "traverse it with the same table, key and where"
            )
        lease_ms = int(lease_seconds * 1000)
        token = f"{owner_lineage or 'worker'}#{uuid.uuid4().hex[:12]}"
        claim = self._claim(round_id, range_id, token, owner_lineage, lease_ms,
                            claim_timeout if claim_timeout is not None else 3 * lease_seconds)
        rng = self.store.range(round_id, range_id)
        started = time.monotonic()
        if not claim.complete:
            self._check_retention(round_id, range_id, token, claim.cursor)
        if claim.complete:
            log.info("round %s range %d is already complete (done %d, skipped %d, dead %d)",
                     round_id, range_id, claim.done, claim.skipped, claim.dead)
            return RangeResult(round_id, range_id, claim.done, claim.skipped, claim.dead, True, claim.cursor)
        if claim.takeover:
            self.metrics.incr("lease.takeover", tags=self.tags)
            log.warning("round %s range %d: took over from a previous owner at cursor %s (that owner is "
                        "fenced; up to one chunk will be replayed)", round_id, range_id,
                        display_key(claim.cursor, self.arity))
        else:
            log.info("round %s range %d: claimed (%s, %s], resuming at cursor %s", round_id, range_id,
                     display_key(rng["lo"], self.arity), display_key(rng["hi"], self.arity),
                     display_key(claim.cursor, self.arity))
        run = _RangeRun(self, round_id, range_id, processor, claim, rng["hi"], chunk_size, lease_ms,
                        max_chunk_attempts, max_item_attempts, backoff_base, backoff_max, item_retry_delay,
                        outage_failure_ratio, prefetch, log_every_seconds, dead_cap, group_chunks, group_seconds)
        heart = _Heartbeat(self.store, round_id, range_id, token, lease_ms)
        heart.start()
        try:
            result = run.run(heart)
        finally:
            heart.stop()
            try:
                self.store.release(round_id, range_id, token)
            except KeysetError:
                log.warning("round %s range %d: could not release the lease; it expires by itself", round_id, range_id)
        return RangeResult(round_id, range_id, result.done, result.skipped, result.dead, result.complete,
                           result.cursor, run.rows_read, run.chunks, result.stopped, claim.takeover,
                           time.monotonic() - started)

    def replay_dead_letters(
        self,
        round_id: str,
        processor: Processor,
        range_id: int | None = None,
        *,
        limit: int = 10_000,
        **traverse_kwargs: Any,
    ) -> list[RangeResult]:
        """Give dead-lettered items of a round (one range, or all) another full set of attempts.

        At-least-once and fenced like any traversal: the letters go back to the range's retry set
        (refused with ``LeaseHeldError`` while a live owner holds the range), then a normal
        ``traverse`` claims the range and processes them; items that fail again are dead-lettered
        again. The cursor is not moved. Only letters still in the capped list can be replayed.
        """
        info = self.store.round_info(round_id)
        ids = range(int(info["n_ranges"])) if range_id is None else [range_id]
        results = []
        for i in ids:
            moved = self.store.requeue_dead(round_id, i, limit)
            if isinstance(moved, str):
                raise LeaseHeldError(f"round {round_id} range {i} is held by {moved}; replay it when that owner is done")
            if moved:
                log.info("round %s range %d: replaying %d dead letter(s)", round_id, i, moved)
                results.append(self.traverse(round_id, i, processor, **traverse_kwargs))
        if info["state"] == "closed" and results:
            self.store.refresh_totals(round_id)
        return results

    def _check_retention(self, round_id: str, range_id: int, token: str, cursor: str) -> None:
        """If the source may already have deleted keys this range has not read, the round is lost
        for good: mark it unrecoverable (it can never close) and stop."""
        boundary = self.source.retention_boundary()
        if boundary is None or boundary <= cursor:
            return
        reason = (f"the source's retention boundary {display_key(boundary, self.arity)} passed range {range_id}'s "
                  f"cursor {display_key(cursor, self.arity)}: keys in between may have been deleted unread")
        self.store.mark_unrecoverable(round_id, reason)
        self.store.release(round_id, range_id, token)
        log.error("round %s: %s; the round is marked unrecoverable", round_id, reason)
        raise RetentionError(
            f"round {round_id}: {reason}. It is marked unrecoverable and will never be reported complete. "
            "Keep rows above the stream's retention floor (airflow-keyset status) until rounds finish, then "
            "reset this round and plan again.")

    def _claim(self, round_id: str, range_id: int, token: str, lineage: str, lease_ms: int, timeout: float) -> Claim:
        deadline = time.monotonic() + timeout
        while True:
            res = self.store.claim(round_id, range_id, token, lineage, lease_ms)
            if isinstance(res, Claim):
                return res
            owner, ms_left = res
            if time.monotonic() + ms_left / 1000 > deadline + lease_ms / 1000:
                raise LeaseHeldError(
                    f"round {round_id} range {range_id} is held by live owner {owner} (lease renewed by "
                    f"heartbeats); gave up after {timeout:.0f} s. If that worker is gone, its lease "
                    "expires by itself; otherwise let it finish."
                )
            if time.monotonic() > deadline:
                raise LeaseHeldError(f"round {round_id} range {range_id} is still held by {owner} after {timeout:.0f} s")
            log.info("round %s range %d is held by %s for %.1f s more; waiting", round_id, range_id, owner, ms_left / 1000)
            if self._stop.wait(min(ms_left / 1000 + 0.05, max(deadline - time.monotonic(), 0.05))):
                raise LeaseHeldError(f"stop requested while waiting for round {round_id} range {range_id}")

    def close_round(self, round_id: str) -> RoundTotals:
        return self.control.close_round(round_id)

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        return self.control.dead_letters(round_id, range_id, limit)

    def close(self) -> None:
        self.source.close()


def _coerce(v: Any, kind: str, name: str) -> Any:
    """A user-supplied bound value, checked against the key column's type."""
    if kind == "int" and isinstance(v, int) and not isinstance(v, bool):
        return v
    if kind == "text" and isinstance(v, str):
        return v
    if kind == "decimal" and isinstance(v, (Decimal, int)) and not isinstance(v, bool):
        return Decimal(v)
    if kind in ("timestamp", "timestamptz") and isinstance(v, str):
        with contextlib.suppress(ValueError):
            v = dt.datetime.fromisoformat(v)
    if kind in ("timestamp", "timestamptz") and isinstance(v, dt.datetime):
        aware = v.tzinfo is not None and v.utcoffset() is not None
        if aware == (kind == "timestamptz"):
            return v
        raise ConfigurationError(
            f"{name}={v!r} is {'timezone-aware' if aware else 'naive'} but the key column is "
            f"{'timestamp with time zone: give an aware datetime (e.g. tzinfo=UTC)' if kind == 'timestamptz' else 'timestamp without time zone: give a naive datetime'}"
        )
    if kind == "date" and isinstance(v, dt.date) and not isinstance(v, dt.datetime):
        return v
    if kind == "date" and isinstance(v, str):
        try:
            return dt.date.fromisoformat(v)
        except ValueError:
            pass
    if kind == "uuid" and isinstance(v, (uuid.UUID, str)):
        try:
            return v if isinstance(v, uuid.UUID) else uuid.UUID(v)
        except ValueError:
            pass
    raise ConfigurationError(f"{name}={v!r} ({type(v).__name__}) does not fit a {kind} key column")


def _validate_traverse_args(processor: Any, chunk_size: Any, lease_seconds: Any, max_chunk_attempts: Any,
                            max_item_attempts: Any) -> None:
    if not callable(processor):
        raise ConfigurationError(f"processor must be callable (chunk) -> ChunkResult | None, got {processor!r}")
    for name, value in (("chunk_size", chunk_size), ("max_chunk_attempts", max_chunk_attempts),
                        ("max_item_attempts", max_item_attempts)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    _check_positive("lease_seconds", lease_seconds)
    if lease_seconds < 1:
        raise ConfigurationError(f"lease_seconds must be at least 1 (heartbeats renew it every third), got {lease_seconds!r}")


class _Heartbeat(threading.Thread):
    """Renews the lease every third of it. If the store says the token no longer owns the range,
    ``lost`` is set and the loop stops before its next side effect."""

    def __init__(self, store: CursorStore, round_id: str, range_id: int, token: str, lease_ms: int) -> None:
        super().__init__(name=f"keyset-heartbeat-{round_id}-{range_id}", daemon=True)
        self.store, self.round_id, self.range_id, self.token, self.lease_ms = store, round_id, range_id, token, lease_ms
        self.lost = threading.Event()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.lease_ms / 3000):
            try:
                if not self.store.heartbeat(self.round_id, self.range_id, self.token, self.lease_ms):
                    log.error("round %s range %d: lease lost (another worker owns the range); stopping",
                              self.round_id, self.range_id)
                    self.lost.set()
                    return
            except (KeysetError, redis.RedisError) as exc:  # keep trying; the fence protects the cursor
                log.warning("round %s range %d: heartbeat failed: %s", self.round_id, self.range_id, exc)

    def stop(self) -> None:
        self._halt.set()


@dataclass
class _State:
    cursor: str
    done: int
    skipped: int
    dead: int
    retries: int
    complete: bool = False
    stopped: bool = False


@dataclass
class _Group:
    """Outcomes of processed chunks not yet committed (group commit)."""

    chunks: int = 0
    done: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    def add(self, done: int, skipped: int, failed: Any) -> None:
        if not self.chunks:
            self.since = time.monotonic()
        self.chunks += 1
        self.done += done
        self.skipped += skipped
        self.failed.extend(failed)

    def reset(self) -> None:
        self.chunks = self.done = self.skipped = 0
        self.failed = []


class _RangeRun:
    """One claimed range, from its cursor to ``hi``, then the item-retry passes."""

    def __init__(self, t: KeysetTraversal, round_id: str, range_id: int, processor: Processor, claim: Claim,
                 hi: str, chunk_size: int, lease_ms: int, max_chunk_attempts: int, max_item_attempts: int,
                 backoff_base: float, backoff_max: float, item_retry_delay: float, outage_ratio: float,
                 prefetch: bool, log_every: float, dead_cap: int, group_chunks: int = 1,
                 group_seconds: float | None = None) -> None:
        self.t, self.store, self.source = t, t.store, t.source
        self.round_id, self.range_id, self.processor, self.token = round_id, range_id, processor, claim.token
        self.hi, self.n, self.lease_ms = hi, chunk_size, lease_ms
        self.max_chunk_attempts, self.max_item_attempts = max_chunk_attempts, max_item_attempts
        self.backoff_base, self.backoff_max, self.item_retry_delay = backoff_base, backoff_max, item_retry_delay
        self.outage_ratio, self.prefetch, self.dead_cap = outage_ratio, prefetch, dead_cap
        self.group_chunks, self.group_seconds = group_chunks, group_seconds
        self.state = _State(claim.cursor, claim.done, claim.skipped, claim.dead, claim.retries)
        self.key_of = self.source.key_of()
        self.arity = self.source.arity
        self.rows_read = 0
        self.chunks = 0
        self.last_checkpoint = time.monotonic()
        estimate = None
        try:
            estimate = self.source.estimate_rows(claim.cursor, hi) if claim.cursor != hi else 0
        except Exception:  # an estimate is a nicety; never fail the range for it
            log.debug("no row estimate for the ETA", exc_info=True)
        self.progress = _Progress(round_id, range_id, display_key(hi, self.arity), self.arity, log_every, estimate)

    # -- helpers --
    def _backoff(self, attempt: int, what: str, exc: BaseException) -> None:
        self.t.metrics.incr("dependency.failure", tags=self.t.tags)
        if attempt >= self.max_chunk_attempts:
            raise DependencyFailedError(
                f"round {self.round_id} range {self.range_id}: {what} failed {attempt} times in a row "
                f"(last: {type(exc).__name__}: {exc}); the cursor stays at "
                f"{display_key(self.state.cursor, self.arity)}, nothing was skipped. An Airflow retry "
                "(or a new traverse) resumes from there."
            ) from exc
        delay = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        log.warning("round %s range %d: %s failed (attempt %d/%d): %s: %s; cursor stays at %s, retrying in %.2f s",
                    self.round_id, self.range_id, what, attempt, self.max_chunk_attempts, type(exc).__name__,
                    exc, display_key(self.state.cursor, self.arity), delay)
        time.sleep(delay)

    def _commit(self, new: str, done: int, skipped: int, resolved: Sequence[tuple[str, str]] = (),
                failed: Sequence[tuple[str, str]] = ()) -> None:
        metrics, tags = self.t.metrics, self.t.tags
        started = time.perf_counter()
        try:
            a = self.store.advance(self.round_id, self.range_id, self.token, self.state.cursor, new, done=done,
                                   skipped=skipped, lease_ms=self.lease_ms, max_item_attempts=self.max_item_attempts,
                                   dead_cap=self.dead_cap, resolved=resolved, failed=failed)
        except (LeaseLostError, CursorConflictError):
            metrics.incr("advance.refused", tags=tags)
            raise
        metrics.timing("chunk.commit", (time.perf_counter() - started) * 1000, tags=tags)
        metrics.incr("chunks", tags=tags)
        for name, delta in (("rows.done", a.done - self.state.done), ("rows.skipped", a.skipped - self.state.skipped),
                            ("rows.dead", a.dead - self.state.dead)):
            if delta:
                metrics.incr(name, delta, tags=tags)
        newly_dead = a.dead - self.state.dead
        self.state = _State(a.cursor, a.done, a.skipped, a.dead, a.retries, a.complete)
        self.chunks += 1
        self.checkpoint(force=a.complete)
        if newly_dead:
            log.error("round %s range %d: %d item(s) dead-lettered after %d attempts (see dead letters)",
                      self.round_id, self.range_id, newly_dead, self.max_item_attempts)

    def checkpoint(self, force: bool = False) -> None:
        """Mirror the committed state durably, at most every ``checkpoint_seconds``."""
        mirror = self.t.mirror
        if mirror is None or (not force and time.monotonic() - self.last_checkpoint < self.t.checkpoint_seconds):
            return
        self.last_checkpoint = time.monotonic()
        try:
            mirror.save_range(self.t.stream, self.round_id, self.range_id,
                              self.store.snapshot_range(self.round_id, self.range_id))
        except RoundStateLostError:
            raise
        except Exception as exc:  # the mirror is a safety net; its outage must not stop the range
            log.warning("round %s range %d: checkpoint mirror write failed: %s", self.round_id, self.range_id, exc)

    def _interpret(self, chunk: Chunk, result: Any) -> tuple[dict[str, str], list[str]]:
        """-> (failed encoded key -> reason, skipped encoded keys), checked against the chunk."""
        if result is None:
            return {}, []
        if not isinstance(result, ChunkResult):
            raise ProcessorContractError(
                f"processor returned {type(result).__name__}; it must return ChunkResult or None. Nothing "
                f"of round {self.round_id} range {self.range_id} was committed.")
        if not result.failed and not result.skipped:
            return {}, []
        index = {self._norm(k): encode_key(as_tuple(k, self.arity)) for k in chunk.keys}
        failed: dict[str, str] = {}
        for k, reason in result.failed.items():
            enc = index.get(self._norm(k))
            if enc is None:
                raise ProcessorContractError(f"ChunkResult.failed names key {k!r}, which is not in the chunk")
            failed[enc] = str(reason)
        skipped = []
        for k in result.skipped:
            enc = index.get(self._norm(k))
            if enc is None:
                raise ProcessorContractError(f"ChunkResult.skipped names key {k!r}, which is not in the chunk")
            if enc not in failed:
                skipped.append(enc)
        return failed, sorted(set(skipped))

    def _norm(self, k: Any) -> Any:
        return tuple(k) if isinstance(k, list) else k

    # -- main loop --
    def run(self, heart: _Heartbeat) -> _State:
        pool = ThreadPoolExecutor(1, thread_name_prefix="keyset-prefetch") if self.prefetch else None
        pending: Future[Sequence[tuple]] | None = None
        attempt = 0
        # ``read`` is how far this worker has processed; the committed cursor (``state.cursor``)
        # catches up at every flush. With group commit off (the default) they never differ
        # between chunks, so a crash replays at most one chunk; with it, at most one group.
        read = self.state.cursor
        group = _Group()

        def flush() -> None:
            if group.chunks:
                self._commit(read, group.done, group.skipped, failed=sorted(group.failed))
                group.reset()

        try:
            while read != self.hi:
                if heart.lost.is_set():
                    raise LeaseLostError(f"round {self.round_id} range {self.range_id}: lease lost; stopping")
                if self.t._stop.is_set():
                    flush()
                    log.info("round %s range %d: stop requested; committed through %s", self.round_id,
                             self.range_id, display_key(self.state.cursor, self.arity))
                    self.state.stopped = True
                    self.checkpoint(force=True)
                    return self.state
                try:
                    rows = pending.result() if pending is not None else self.source.fetch(read, self.hi, self.n)
                except Exception as exc:  # the source is a dependency too
                    pending = None
                    flush()
                    attempt += 1
                    self.source.reset()
                    self._backoff(attempt, "reading the chunk", exc)
                    continue
                pending = None
                if not rows:
                    flush()
                    self._commit(self.hi, 0, 0)
                    break
                self.rows_read += len(rows)
                last = encode_key(tuple(rows[-1][: self.arity]))
                if pool is not None and last < self.hi:
                    pending = pool.submit(self.source.fetch, last, self.hi, self.n)
                chunk = Chunk(self.round_id, self.range_id, self.source.column_names, rows, self.key_of, attempt + 1)
                try:
                    started = time.perf_counter()
                    result = self.processor(chunk)
                    self.t.metrics.timing("chunk.process", (time.perf_counter() - started) * 1000, tags=self.t.tags)
                    failed, skipped = self._interpret(chunk, result)
                    if len(failed) >= 2 and len(failed) > self.outage_ratio * len(rows):
                        raise RetryableError(
                            f"{len(failed)} of {len(rows)} items failed, more than outage_failure_ratio="
                            f"{self.outage_ratio}; treating it as a dependency failure, not as bad items "
                            f"(first: {next(iter(failed.values()))})")
                except Exception as exc:
                    # RetryableError, or anything unexpected, is a dependency failure: the cursor
                    # stays and the chunk is read again. The engine's own errors are not.
                    if isinstance(exc, KeysetError) and not isinstance(exc, RetryableError):
                        raise
                    release(rows)
                    pending = self._drop(pending)
                    flush()
                    attempt += 1
                    what = "the processor's dependency" if isinstance(exc, RetryableError) else "the processor"
                    self._backoff(attempt, what, exc)
                    continue
                attempt = 0
                if heart.lost.is_set():
                    raise LeaseLostError(f"round {self.round_id} range {self.range_id}: lease lost; chunk not committed")
                for enc, reason in failed.items():
                    log.warning("round %s range %d: item %s failed: %s", self.round_id, self.range_id,
                                display_key(enc, self.arity), reason)
                group.add(len(rows) - len(failed) - len(skipped), len(skipped), failed.items())
                release(rows)
                read = last
                # a chunk limit of 1 with a time limit means "by time only"
                by_count = self.group_chunks > 1 or self.group_seconds is None
                if (by_count and group.chunks >= self.group_chunks) or (
                        self.group_seconds is not None and time.monotonic() - group.since >= self.group_seconds):
                    flush()
                self.progress.tick(len(rows), read, self.state.done + group.done, self.state.skipped + group.skipped,
                                   self.state.dead, self.state.retries)
            flush()
            self._drain_retries(heart)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self.progress.tick(0, self.state.cursor, self.state.done, self.state.skipped, self.state.dead,
                           self.state.retries, force=True)
        self.checkpoint(force=True)
        return self.state

    def _drop(self, pending: Future[Sequence[tuple]] | None) -> Future[Sequence[tuple]] | None:
        """Discard a prefetched chunk: after a failure the same chunk is read again."""
        if pending is not None:
            pending.cancel()
            try:
                release(pending.result())
            except Exception:
                log.debug("prefetch discarded", exc_info=True)
        return None

    def _drain_retries(self, heart: _Heartbeat) -> None:
        """Items that failed on their own get further attempts once the cursor reached ``hi``;
        after ``max_item_attempts`` they are dead-lettered. The range completes when none is left."""
        attempt, passes = 0, 0
        while self.state.retries > 0 and not self.state.complete:
            if heart.lost.is_set():
                raise LeaseLostError(f"round {self.round_id} range {self.range_id}: lease lost during retries")
            entries = self.store.retry_entries(self.round_id, self.range_id, self.n)
            if not entries:
                break
            passes += 1
            time.sleep(min(self.backoff_max, self.item_retry_delay * 2 ** (min(e[1] for e in entries) - 1)))
            try:
                rows = self.source.fetch_keys([e[0] for e in entries])
                chunk = Chunk(self.round_id, self.range_id, self.source.column_names, rows, self.key_of, passes + 1)
                failed, skipped = self._interpret(chunk, self.processor(chunk)) if rows else ({}, [])
                self._check_pass_outage(entries, failed)
            except RetryableError as exc:
                attempt += 1
                self._backoff(attempt, "the processor's dependency (item retry pass)", exc)
                continue
            except KeysetError:
                raise
            except Exception as exc:
                attempt += 1
                self._backoff(attempt, "an item retry pass", exc)
                continue
            attempt = 0
            present = {encode_key(tuple(r[: self.arity])) for r in rows}
            skip = set(skipped)
            resolved = []
            for enc, _, _ in entries:
                if enc in failed:
                    continue
                # a row that is gone (deleted, no longer matches where) reached a terminal state: skipped
                resolved.append((enc, "s" if enc in skip or enc not in present else "d"))
            self._commit(self.state.cursor, 0, 0, resolved=resolved, failed=sorted(failed.items()))
            log.info("round %s range %d: item retry pass %d: %d resolved, %d still failing, %d dead so far",
                     self.round_id, self.range_id, passes, len(resolved), len(failed), self.state.dead)


    def _check_pass_outage(self, entries: Sequence[tuple[str, int, str]], failed: dict[str, str]) -> None:
        """A retry pass where (nearly) every item failed, and failed for a reason other than the one
        it failed with before, is a dependency failure: it must not use up the items' attempts. Items
        that are bad on their own keep failing for their own reasons and are still dead-lettered.
        Dead letters being replayed are left out: a replay is an explicit retry, its verdicts count."""
        before = {enc: err for enc, _, err in entries if not err.startswith("replay of: ")}
        failed = {enc: why for enc, why in failed.items() if enc in before}
        if len(failed) < 2 or len(failed) <= self.outage_ratio * len(before):
            return
        changed = sum(1 for enc, why in failed.items() if _stored(why) != before[enc])
        if changed * 2 > len(failed):
            raise RetryableError(
                f"{len(failed)} of {len(before)} items failed again in a retry pass, {changed} of them for a new "
                f"reason (first: {next(iter(failed.values()))}); treating it as a dependency failure")


def _stored(reason: str) -> str:
    """An error reason as the store keeps it."""
    return reason.replace("\n", " ")[:500]


def load_processor(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable, or ``"package.module:function"`` (also ``package.module.function``)."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigurationError(f"processor must be a callable or 'package.module:function', got {ref!r}")
    import importlib

    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, _, attr = ref.rpartition(".")
    if not module_name or not attr:
        raise ConfigurationError(f"processor {ref!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"processor {ref!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigurationError(f"processor {ref!r}: module {module_name!r} has no callable {attr!r}")
    return fn


__all__ = ["KeysetTraversal", "RangeResult", "RangeSpec", "Round", "RoundTotals", "load_processor"]
