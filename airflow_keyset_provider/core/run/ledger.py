"""Exactly-once effects on the target database (``exactly_once=True``): the key interval a
chunk covered is recorded in the target's ledger in the same transaction as the processor's
writes.

The timeline this module exists for (at-least-once, without it)::

    owner A: processor writes chunk (c0, c1] -> COMMIT on the target
    owner A: SIGKILL                         (the Redis advance to c1 never happens)
    owner B: claims, Redis says c0           -> (c0, c1] is written a second time

The ledger (``core/sql/ledger.py``) is a set of committed key intervals per round, not a row per
range id: ranges change identity (a split, pull coalescing, a round restored from the mirror, a
failover to a replica that never saw a split), keys do not. Guarantee: the committed intervals
of a round are disjoint, and a key's writes commit only with the interval that holds it, so no
identity change can make a key's writes commit twice.

- **Claim.** The claim's ledger step (under the round's lock) takes a new generation, takes
  every interval that overlaps the claim's keys ``(cursor, hi]`` or ends at its cursor (an
  older owner's next step on them is fenced: its transaction rolls back, ``LeaseLostError``),
  and plans the claim's traversal around the committed intervals inside ``(cursor, hi]``.
- **Committed intervals in the middle are skipped, not refused.** The design choice: the
  traversal reads only the gaps. It reads up to the next committed interval (``bound``),
  commits what it read, then moves Redis over the interval in one fenced advance (its counters
  and its failed items added: ``RangeCommits._skip_committed``), and reads on after it. A
  claim that refused such a range, or realigned only a prefix, would either never finish a
  range whose middle another identity committed (a failover that lost a split) or write that
  middle again (the defect this replaces). Intervals at the claim's cursor are passed at the
  claim (Redis moved forward before a row is read).
- **Commit.** Before the Redis advance, the chunk's ``(expected, new]`` is recorded: under the
  round's lock, refused (everything rolled back) unless an interval of this owner's generation
  ends at ``expected`` and no other non-empty interval overlaps ``(expected, new]`` (an empty
  interval ``(k, k]``, a claim's anchor, holds no key and fences nothing); the owner's interval
  grows to ``new`` (or a new one opens, after a skipped interval).
- **Counters.** An interval keeps the owner's Redis counters at both ends, so passing one adds
  exactly what was done in it. A cursor strictly inside an interval is Redis lagging behind the
  same lineage (a restore, a lost advance): it adds what Redis has not counted. An interval that
  straddles the range's end (a coalescing the replica never saw) is counted by the range that
  holds its end, once.

Inside the range's transaction every processor call runs in a SAVEPOINT: rolled back when the
call raises, and when it returns a verdict that fails the chunk as a whole (failure isolation
then delivers its parts again, ``item_failures.py``); a canary probe (a key already processed)
is always rolled back; an attempt that ends without a verdict (a dependency failure) is rolled
back whole, so a smaller re-read of the same keys finds nothing of it. A deadlock, lock wait
timeout, serialization failure or lost connection in a call rolls the whole transaction back
(InnoDB already did) and is a dependency failure: the run rewinds to the committed cursor and
reads again.

**Item retry passes** (after the cursor reached ``hi``): a pass's calls run in one transaction,
savepoints and isolation as for a chunk, and its commit resolves the rows of the items the pass
resolved in the ledger's failed items (``'d'`` done, ``'s'`` skipped) in that transaction, so an
item's delivery commits once: a claim passing the interval hands only unresolved items to
Redis's retry set again (it counts the resolved ones), a pass first resolves from the ledger the
items another transaction already delivered (``RunLedger.resolved``: a Redis that lost the
pass's step, a lagging replica, a restore) without calling the processor, and a pass whose
items another owner resolved meanwhile is fenced (``LeaseLostError``, everything rolled back).
An item with no row (a round traversed before without the mode) stays at-least-once.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from ..chunk import Chunk, ChunkResult, Processor
from ..db_reasons import describe_exception
from ..errors import ConfigurationError, DependencyFailedError, LeaseLostError, RetryableError
from ..keys import display_key, encode_key
from ..options import TraverseOptions
from ..sql.dialects import Dialect, for_engine
from ..sql.ledger import (
    Interval,
    LedgerTables,
    add_failed,
    adopt_round,
    create_ledger,
    extend_interval,
    ledger_table,
    limit_statement_time,
    lock_round,
    open_interval,
    read_failed,
    read_intervals,
    resolve_items,
    resolved_items,
    take_intervals,
)
from ..store.cursor_store import Claim
from .state import CommittedRange

if TYPE_CHECKING:
    from .context import RunContext

log = logging.getLogger("airflow_keyset_provider")


class RangeCommits(Protocol):
    """What the ledger uses of a range's run (``commits.RangeCommits``; no import of it, so the
    run and its ledger do not import each other)."""

    arity: int
    hi: str
    read: str
    probing: bool
    processor: Processor
    state: CommittedRange


@dataclass(frozen=True)
class Skip:
    """A committed interval the traversal passes without reading: Redis moves from ``start`` to
    ``to`` adding ``done``/``skipped`` and the interval's ``failed`` items (those still waiting
    for retry). ``counted``: False when the range holding the interval's end counts it."""

    start: str
    to: str
    done: int
    skipped: int
    failed: tuple[tuple[str, str], ...] = ()
    counted: bool = True


#: The ledger tables known to exist, per target engine. Keyed by the engine itself (weakly), not by
#: ``id()``: a discarded engine's id is reused by a new one, which would then skip the creation.
_created: weakref.WeakKeyDictionary[sa.Engine, set[str]] = weakref.WeakKeyDictionary()


def check_exactly_once(ctx: RunContext, o: TraverseOptions) -> None:
    """The mode needs a target database to commit the ledger in."""
    if o.exactly_once and ctx.target is None:
        raise ConfigurationError(
            "exactly_once=True needs a target database (KeysetTraversal(target_url=...) or "
            "TraverseRangeOperator(target_conn_id=...)): the ledger row commits in the same "
            "transaction as the processor's writes through chunk.connection"
        )


def plan_skips(
    intervals: list[Interval], cursor: str, hi: str, counters: tuple[int, int]
) -> list[Skip]:
    """The committed intervals a claim at ``cursor`` of ``(., hi]`` passes, in key order, with
    what each adds to the range's counters (see the module: lagging Redis, straddling
    intervals)."""
    skips = []
    for r in intervals:
        if r.empty or not (r.lo < hi and r.hi > cursor):
            continue
        start, to = max(r.lo, cursor), min(r.hi, hi)
        counted = to == r.hi
        if not counted:  # straddles the range's end: the range holding r.hi counts it
            done = skipped = 0
        elif r.lo < cursor:  # Redis lags behind the lineage that wrote r
            done = max(0, r.done - max(counters[0], r.base_done))
            skipped = max(0, r.skipped - max(counters[1], r.base_skipped))
        else:
            done, skipped = r.done - r.base_done, r.skipped - r.base_skipped
        skips.append(Skip(start, to, done, skipped, counted=counted))
    return skips


def _with_failed(s: Skip, failed: list[tuple[str, str, str | None]]) -> Skip:
    """The skip with its interval's failed items: those still waiting for retry go to Redis's
    retry set; those a retry call resolved (delivered, their writes committed) add to its
    counters when it counts the interval (they were counted by a Redis this claim no longer
    sees: a restore, a lagging replica)."""
    inside = [f for f in failed if s.start < f[0] <= s.to]
    waiting = tuple((k, r) for k, r, v in inside if v is None)
    if not s.counted:
        return replace(s, failed=waiting)
    done = sum(1 for f in inside if f[2] == "d")
    skipped = sum(1 for f in inside if f[2] == "s")
    return replace(s, failed=waiting, done=s.done + done, skipped=s.skipped + skipped)


def claim_ledger(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, o: TraverseOptions
) -> tuple[Claim, RunLedger]:
    """After the Redis claim: the ledger step of the claim (a new generation, the intervals of
    ``(cursor, hi]`` taken, the traversal planned around them, the owner's interval opened at
    the first key to read), then Redis moved over the committed intervals at the cursor.
    Returns the claim as it stands after that and the run's ledger. A lock wait, deadlock,
    serialization failure or lost connection in the ledger step (the dialect's transient errors,
    as for a chunk) is a dependency failure: ``DependencyFailedError``, nothing committed."""
    assert ctx.target is not None
    try:
        return _claim_ledger(ctx, round_id, range_id, claim, o)
    except Exception as exc:
        if not _transient(for_engine(ctx.target.dialect), exc):
            raise
        raise DependencyFailedError(
            f"round {round_id} range {range_id}: the claim's step in the target's ledger failed "
            f"({describe_exception(exc)}: a lock wait, deadlock or lost connection); nothing "
            f"was committed, the lease is released and the cursor stays at "
            f"{display_key(claim.cursor, ctx.arity)}. An Airflow retry (or a new traverse) "
            "claims it again; if it recurs, look for a long transaction holding the target's "
            "lock (on SQLite, any other writer)."
        ) from exc


def _claim_ledger(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, o: TraverseOptions
) -> tuple[Claim, RunLedger]:
    assert ctx.target is not None
    tables = ledger_table(ctx.ledger_table)
    known = _created.setdefault(ctx.target, set())
    if tables.intervals.name not in known:
        create_ledger(ctx.target, tables)
        known.add(tables.intervals.name)
    t, key = tables.intervals, (ctx.stream, round_id)
    counters = (claim.done, claim.skipped)
    planned = ctx.store.round_info(round_id).get("created_ms", "")
    with ctx.target.begin() as conn:
        limit_statement_time(conn, o.lease_ms)
        epoch = lock_round(conn, t, *key, bump=True)
        adopted = adopt_round(conn, tables, key, planned)
        if adopted == "older":
            raise LeaseLostError(
                f"round {round_id} range {range_id}: the target's ledger belongs to a round "
                f"{round_id} planned later than the one this Redis holds (planned at "
                f"{planned} ms): this Redis is stale (a replica that lost the newer plan); "
                "nothing was claimed on the target"
            )
        if adopted == "dropped":
            log.warning(
                "round %s of stream %s: the target's ledger held an earlier round of the same id "
                "(Redis lost the stream and handed the id out again); its intervals are not this "
                "round's and were dropped",
                round_id,
                ctx.stream,
            )
        rows = read_intervals(conn, t, *key)
        taken = [r for r in rows if r.lo < claim.hi and r.hi >= claim.cursor]
        take_intervals(conn, t, [r.seg for r in taken], key, epoch)
        skips = plan_skips(taken, claim.cursor, claim.hi, counters)
        if skips:
            failed = read_failed(conn, tables.failed, key, claim.cursor, claim.hi)
            skips = [_with_failed(s, failed) for s in skips]
        lead = []
        pos = claim.cursor
        while skips and skips[0].start == pos:
            lead.append(skips.pop(0))
            pos = lead[-1].to
        at = (counters[0] + sum(s.done for s in lead), counters[1] + sum(s.skipped for s in lead))
        resumed = any(r.hi == pos and (r.done, r.skipped) == at for r in taken)
        if pos < claim.hi and not resumed:  # the interval this owner's commits grow
            seg = max((r.seg for r in rows), default=0) + 1
            open_interval(conn, t, key, seg, range_id, epoch, pos, pos, at, at)
    if lead:
        claim = _fast_forward(ctx, round_id, range_id, claim, lead, o)
    return claim, RunLedger(ctx, tables, key, range_id, epoch, skips, o)


def _fast_forward(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, lead: list[Skip], o: Any
) -> Claim:
    """The fenced advance of Redis over the committed intervals at its cursor, with their
    counters and the items that failed in them."""
    a = ctx.store.advance(
        round_id,
        range_id,
        claim.token,
        claim.cursor,
        lead[-1].to,
        done=sum(s.done for s in lead),
        skipped=sum(s.skipped for s in lead),
        lease_ms=o.lease_ms,
        max_item_attempts=o.max_item_attempts,
        dead_cap=o.dead_cap,
        failed=[f for s in lead for f in s.failed],
    )
    ctx.metrics.incr("ledger.fast_forward", tags=ctx.tags)
    log.warning(
        "round %s range %d: the target's ledger has (%s, %s] committed, ahead of Redis (a "
        "chunk committed whose cursor advance did not happen, or Redis was restored or failed "
        "over); moved the cursor forward over it, nothing replayed",
        round_id,
        range_id,
        display_key(claim.cursor, ctx.arity),
        display_key(lead[-1].to, ctx.arity),
    )
    return replace(
        claim,
        cursor=a.cursor,
        done=a.done,
        skipped=a.skipped,
        dead=a.dead,
        retries=a.retries,
        complete=a.complete,
    )


@dataclass
class _Savepoint:
    sp: sa.NestedTransaction
    first: str  # the call's first and last keys (encoded)
    last: str
    read: str = ""  # for the chunk's savepoint: the run's ``read`` when the chunk began


class RunLedger:
    """One owner's transaction on the target, spanning a chunk (or a group of chunks), the
    fenced ledger step that commits it, and the committed intervals the traversal skips."""

    def __init__(
        self,
        ctx: RunContext,
        tables: LedgerTables,
        key: tuple[str, str],
        range_id: int,
        epoch: int,
        skips: list[Skip],
        o: TraverseOptions,
    ) -> None:
        assert ctx.target is not None
        self.target, self.tables, self.key, self.epoch = ctx.target, tables, key, epoch
        self.range_id, self.skips, self.arity = range_id, list(skips), ctx.arity
        self.timeout_ms, self.ratio = o.lease_ms, o.outage_failure_ratio
        self.dialect = for_engine(ctx.target.dialect)
        self.conn: sa.Connection | None = None
        self.root: sa.RootTransaction | None = None
        self.chunk: _Savepoint | None = None  # the savepoint of the chunk being processed
        self.pending: list[_Savepoint] = []  # returned calls isolation may deliver again
        self.lost = False  # the transaction was lost (deadlock...): the run must rewind
        self.elsewhere: set[str] = set()  # retry items another transaction delivered

    # -- committed intervals the traversal passes -------------------------------------------------
    def bound(self, read: str, hi: str) -> str:
        """How far the traversal may read from ``read``: the next committed interval, or ``hi``."""
        for s in self.skips:
            if s.start >= read:
                return min(s.start, hi)
        return hi

    def due(self, read: str, hi: str) -> Skip | None:
        """The committed interval starting at ``read`` (clipped to ``hi``, which a split may
        have lowered since the claim: the part above it is the new range's), or None."""
        self.skips = [s for s in self.skips if s.start < hi and s.to > read]
        if not self.skips or self.skips[0].start != read:
            return None
        s = self.skips.pop(0)
        if s.to > hi:  # the range holding the interval's end counts it
            s = Skip(s.start, hi, 0, 0, tuple(f for f in s.failed if f[0] <= hi), counted=False)
        return s

    # -- processor calls --------------------------------------------------------------------------
    def call(self, run: RangeCommits, chunk: Chunk) -> Any:
        """One processor call in a SAVEPOINT of the range's transaction (see the module)."""
        if run.probing:  # a canary: delivered again to probe the dependency, never kept
            return self._probe(run, chunk)
        conn = self._open()
        first, last = (
            encode_key(tuple(v[: run.arity])) for v in (chunk.values[0], chunk.values[-1])
        )
        self._enter_chunk(conn, run.read, first, last)
        self._undo_redelivered(first, last)
        sp = conn.begin_nested()
        result = self._guarded(run, chunk, conn, sp)
        if self._whole(result, len(chunk)):
            self.pending.append(_Savepoint(sp, first, last))  # isolation may split it
        else:
            sp.commit()
        return result

    def _guarded(self, run: RangeCommits, chunk: Chunk, conn: sa.Connection, sp: Any) -> Any:
        """The call; when it raises, its savepoint is rolled back. An error that lost the
        transaction (a deadlock, a lock wait timeout, a serialization failure, a lost
        connection), or a savepoint that can no longer be rolled back to, rolls everything
        back and is a dependency failure (``RetryableError``; ``lost`` tells the run)."""
        try:
            return _call_with(run, chunk, conn)
        except BaseException as exc:
            transient = self.transient(exc)
            if sp is None:  # a transaction of its own: rolled back by its context
                if transient:
                    raise RetryableError(
                        f"the target failed ({type(exc).__name__}: {exc})"
                    ) from exc
                raise
            if not transient and _rolled_back(sp):
                raise
            self.close()
            self.lost = True
            raise RetryableError(
                f"the target's transaction was lost ({type(exc).__name__}: {exc}); everything "
                "this try had not committed was rolled back and is read again"
            ) from exc

    def resolved(self, items: list[str]) -> dict[str, str]:
        """Of a retry pass's ``items``, those the ledger says some transaction already delivered:
        item -> ``'d'`` (done) or ``'s'`` (skipped). A retry pass resolves them without a call."""
        failed = self.tables.failed
        try:
            with self.target.begin() as conn:
                limit_statement_time(conn, self.timeout_ms)
                rows = resolved_items(conn, failed, self.key, items, lock=False)
        except Exception as exc:
            if self.transient(exc):
                raise RetryableError(
                    f"the target's ledger could not be read ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        done = {k: v for k, v in rows.items() if v is not None}
        self.elsewhere = set(done)
        return done

    def transient(self, exc: BaseException) -> bool:
        """A deadlock, lock or statement timeout, serialization failure or lost connection."""
        return _transient(self.dialect, exc)

    def _probe(self, run: RangeCommits, chunk: Chunk) -> Any:
        """A call rolled back whatever it does: a SAVEPOINT of the open transaction (on SQLite
        another connection would wait for this one's write lock), else a transaction."""
        if self.conn is not None:
            sp = self.conn.begin_nested()
            result = self._guarded(run, chunk, self.conn, sp)
            sp.rollback()
            return result
        with self.target.connect() as conn, conn.begin() as probe:
            try:
                return self._guarded(run, chunk, conn, None)
            finally:
                probe.rollback()

    def _enter_chunk(self, conn: sa.Connection, read: str, first: str, last: str) -> None:
        """A call on a new chunk (the previous one was recorded: ``read`` moved) keeps what came
        before and opens the chunk's savepoint; a call on the same rows again after a failure
        (not a part of them) rolls the chunk's earlier calls back first."""
        c = self.chunk
        if c is not None and c.read == read:
            inside = c.first <= first and last <= c.last and (first, last) != (c.first, c.last)
            if inside:
                return  # isolation: a part of the chunk in hand
            self._rollback_chunk()
        elif c is not None:
            self._keep_chunk()
        self.chunk = _Savepoint(conn.begin_nested(), first, last, read)

    def drop_attempt(self) -> bool:
        """The chunk's attempt ended without a verdict (a dependency failure, a stop during
        isolation): roll back everything it wrote, so that the next attempt (a smaller chunk,
        other rows) starts clean. True when the whole transaction was lost (the run rewinds
        its uncommitted group)."""
        if self.chunk is not None and self.conn is not None:
            try:
                self._rollback_chunk()
            except sa.exc.DBAPIError:
                self.close()
                self.lost = True
        lost, self.lost = self.lost, False
        return lost

    def _undo_redelivered(self, first: str, last: str) -> None:
        """Isolation delivers parts of a call that failed as a whole by returning: undo it."""
        for i in range(len(self.pending) - 1, -1, -1):
            p = self.pending[i]
            if p.first <= first and last <= p.last:
                for q in reversed(self.pending[i:]):
                    q.sp.rollback()
                del self.pending[i:]
                return

    def _whole(self, result: Any, n: int) -> bool:
        """The verdict fails the chunk as a whole (``item_failures``' rule)."""
        if not isinstance(result, ChunkResult):
            return False
        failed = len(result.failed)
        return failed >= 2 and failed > self.ratio * n

    def _keep_chunk(self) -> None:
        for p in reversed(self.pending):
            p.sp.commit()
        self.pending.clear()
        if self.chunk is not None:
            self.chunk.sp.commit()
            self.chunk = None

    def _rollback_chunk(self) -> None:
        pending, chunk = self.pending, self.chunk
        self.pending, self.chunk = [], None
        for p in reversed(pending):
            p.sp.rollback()
        if chunk is not None:
            chunk.sp.rollback()

    # -- the transaction --------------------------------------------------------------------------
    def _open(self) -> sa.Connection:
        if self.conn is not None:
            return self.conn
        conn = self.target.connect()
        self.conn, self.root = conn, conn.begin()
        if conn.dialect.name == "sqlite":  # begin the transaction with a write (the round's
            limit_statement_time(conn, self.timeout_ms)  # lock; a SAVEPOINT's release before
            lock_round(conn, self.tables.intervals, *self.key, bump=False)  # it would commit)
        return conn

    def commit(
        self,
        run: RangeCommits,
        new: str,
        done: int,
        skipped: int,
        failed: Any = (),
        resolved: Any = (),
    ) -> None:
        """Before the Redis advance: record ``(committed cursor, new]`` with the counters, in
        the transaction of the chunks' writes, and commit it; after an item retry pass (the
        cursor at ``hi``), the pass's ``resolved`` items instead. A chunk in hand whose verdict
        was not recorded is rolled back first. Raises ``LeaseLostError`` (everything rolled
        back) when a newer owner took the interval or another identity committed keys inside
        it, or another transaction resolved an item of the pass."""
        retry_pass = run.state.cursor == run.hi
        if self.conn is None and (retry_pass or new == run.state.cursor):
            return  # nothing was called (every item resolved elsewhere, or gone)
        conn = self._open()
        if self.chunk is not None and self.chunk.read == run.read and not retry_pass:
            self._rollback_chunk()  # processed but not recorded (an outage): not committed
        else:
            self._keep_chunk()
        try:
            limit_statement_time(conn, self.timeout_ms)
            if retry_pass:
                self._resolve(conn, dict(resolved))
            else:
                self._record(conn, run.state, new, (done, skipped), failed)
        except BaseException as exc:
            self.close()
            if self.transient(exc):
                raise RetryableError(
                    f"the target's ledger step failed ({type(exc).__name__}: {exc}); the "
                    "chunks' writes were rolled back and are read again"
                ) from exc
            raise
        root, self.root, self.conn = self.root, None, None
        try:
            assert root is not None
            root.commit()
        finally:
            conn.close()

    def _record(
        self, conn: sa.Connection, s: CommittedRange, new: str, add: tuple[int, int], failed: Any
    ) -> None:
        """The fenced ledger step of a commit (see the module)."""
        t, expected = self.tables.intervals, s.cursor
        lock_round(conn, t, *self.key, bump=False)
        rows = read_intervals(conn, t, *self.key)
        at = [r for r in rows if r.hi == expected]
        # A newer claim whose keys reach this cursor took every interval ending here, this
        # owner's too; an interval of another range merely ending here is no takeover.
        if not any(r.epoch == self.epoch for r in at):
            raise self._fenced(expected, new)
        # An empty interval (k, k] holds no key: a claim's anchor, no commit. It never fences
        # (its owner may be gone for good: a range a failover lost); if that owner commits
        # keys here later, its own commit meets this one's interval and is refused.
        overlap = [r for r in rows if not r.empty and r.lo < new and r.hi > expected]
        if overlap:
            raise self._fenced(expected, new, overlap[0])
        counters = (s.done + add[0], s.skipped + add[1])
        mine = [
            r for r in at if r.epoch == self.epoch and (r.done, r.skipped) == (s.done, s.skipped)
        ]
        if mine:
            moved = extend_interval(
                conn, t, self.key, mine[0].seg, self.epoch, expected, new, counters
            )
            if not moved:
                raise self._fenced(expected, new)
        else:  # after a skipped interval: this owner's next interval
            seg = max(r.seg for r in rows) + 1
            open_interval(
                conn,
                t,
                self.key,
                seg,
                self.range_id,
                self.epoch,
                expected,
                new,
                (s.done, s.skipped),
                counters,
            )
        add_failed(conn, self.tables.failed, self.key, [(k, str(why)[:500]) for k, why in failed])

    def _resolve(self, conn: sa.Connection, resolved: dict[str, str]) -> None:
        """The fenced ledger step of an item retry pass: its resolved items' rows (locking reads)
        must still be unresolved, then they are resolved (items with no row stay unrecorded)."""
        mine = {k: v for k, v in resolved.items() if k not in self.elsewhere}
        failed = self.tables.failed
        rows = resolved_items(conn, failed, self.key, sorted(mine), lock=True)
        gone = sorted(k for k in mine if rows.get(k) is not None)
        if gone:
            _, round_id = self.key
            raise LeaseLostError(
                f"round {round_id} range {self.range_id}: the target's ledger moved on (item(s) "
                f"{', '.join(display_key(k, self.arity) for k in gone[:5])} of this retry pass "
                "were delivered by another owner meanwhile); this pass's transaction was rolled "
                "back, nothing of it committed"
            )
        resolve_items(conn, failed, self.key, mine)

    def close(self) -> None:
        """Roll back what is open (the run ends: nothing uncommitted may stay)."""
        conn, self.conn, self.root = self.conn, None, None
        self.chunk, self.pending = None, []
        if conn is not None:
            try:
                conn.rollback()
            except sa.exc.DBAPIError:
                log.debug("rollback of a lost transaction", exc_info=True)
            finally:
                conn.close()

    def _fenced(self, expected: str, new: str, other: Interval | None = None) -> LeaseLostError:
        _, round_id = self.key
        span = f"({display_key(expected, self.arity)}, {display_key(new, self.arity)}]"
        why = (
            f"keys ({display_key(other.lo, self.arity)}, {display_key(other.hi, self.arity)}] "
            f"inside {span} were committed by another owner (range {other.range_id})"
            if other is not None
            else f"a newer owner claimed {span} after this one's generation {self.epoch}"
        )
        return LeaseLostError(
            f"round {round_id} range {self.range_id}: the target's ledger moved on ({why}); "
            "this try's transaction was rolled back, nothing of it committed"
        )


def _transient(dialect: Dialect | None, exc: BaseException) -> bool:
    """The dialect classifies ``exc`` as transient (a deadlock, a lock or statement timeout, a
    serialization failure, a lost connection: ``classify_row_error`` says ``"retry"``)."""
    if dialect is None or not isinstance(exc, Exception):
        return False
    return dialect.classify_row_error(exc) == "retry"


def _rolled_back(sp: Any) -> bool:
    """Roll back to the savepoint; False when the server no longer has it (InnoDB rolled the
    whole transaction back on a deadlock: ``SAVEPOINT ... does not exist``)."""
    try:
        sp.rollback()
    except sa.exc.DBAPIError:
        return False
    return True


def _call_with(run: RangeCommits, chunk: Chunk, conn: sa.Connection) -> Any:
    chunk.connection = conn
    try:
        return run.processor(chunk)
    finally:
        chunk.connection = None


__all__ = ["RunLedger", "Skip", "check_exactly_once", "claim_ledger", "plan_skips"]
