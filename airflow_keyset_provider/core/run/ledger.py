"""Exactly-once effects on the target database (``exactly_once=True``): the cursor's ledger row
commits in the same transaction as the processor's writes.

The timeline this module exists for (at-least-once, without it)::

    owner A: processor writes chunk (c0, c1] -> COMMIT on the target
    owner A: SIGKILL                         (the Redis advance to c1 never happens)
    owner B: claims, Redis says c0           -> (c0, c1] is written a second time

With the mode, A's transaction also moves the range's ledger row (``core/sql/ledger.py``) from
c0 to c1, fenced by A's ledger epoch (bumped by every claim) and the cursor, and only then is the Redis cursor advanced. B's claim first
bumps the row's epoch (so A, if it is only paused, finds its next ledger step fenced
and its transaction rolls back: ``LeaseLostError``), then reads the row: at c1, ahead of Redis,
so B moves Redis to c1 with the ledger's counters (a fenced advance by B) before reading a row.
A chunk whose transaction committed is never delivered again; one that did not commit left
nothing behind and is delivered again, whole.

Inside the range's transaction every processor call runs in a SAVEPOINT: rolled back when the
call raises, and when it returns a verdict that fails the chunk as a whole (failure isolation
then delivers its parts again, ``item_failures.py``); a canary probe (a key already processed)
is always rolled back. A chunk whose verdict was not recorded when the transaction commits
(the run backed off after an outage) is rolled back whole. Item retry passes (after the cursor
reached ``hi``) stay at-least-once: each call commits on its own, as without the mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from ..chunk import Chunk, ChunkResult, Processor
from ..errors import ConfigurationError, LeaseLostError
from ..keys import encode_key
from ..options import TraverseOptions
from ..sql.ledger import (
    bump_epoch,
    create_ledger,
    ledger_table,
    limit_statement_time,
    move_row,
    touch_row,
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


_created: set[tuple[int, str]] = set()  # (engine, table) pairs whose ledger table exists


def check_exactly_once(ctx: RunContext, o: TraverseOptions) -> None:
    """The mode needs a target database to commit the ledger in."""
    if o.exactly_once and ctx.target is None:
        raise ConfigurationError(
            "exactly_once=True needs a target database (KeysetTraversal(target_url=...) or "
            "TraverseRangeOperator(target_conn_id=...)): the ledger row commits in the same "
            "transaction as the processor's writes through chunk.connection"
        )


def claim_ledger(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, o: TraverseOptions
) -> tuple[Claim, RunLedger]:
    """After the Redis claim: bump the ledger row's epoch (this owner's generation), and if the row is
    ahead of Redis (a crash hit between the target's commit and the Redis advance, or Redis was
    restored from an older checkpoint), move Redis forward to it. Returns the claim as it stands
    after that and the run's ledger."""
    assert ctx.target is not None
    table = ledger_table(ctx.ledger_table)
    if (id(ctx.target), table.name) not in _created:
        create_ledger(ctx.target, table)
        _created.add((id(ctx.target), table.name))
    key = (ctx.stream, round_id, range_id)
    with ctx.target.begin() as conn:
        limit_statement_time(conn, o.lease_ms)
        row = bump_epoch(conn, table, *key, claim.cursor, (claim.done, claim.skipped))
    if row.cursor > claim.cursor:
        claim = _fast_forward(ctx, round_id, range_id, claim, row.cursor, row, o)
    elif row.cursor < claim.cursor:  # Redis moved on without the ledger (the mode was off)
        with ctx.target.begin() as conn:
            limit_statement_time(conn, o.lease_ms)
            counters = (claim.done, claim.skipped)
            move_row(conn, table, key, row.epoch, row.cursor, claim.cursor, counters)
    return claim, RunLedger(ctx, table, key, row.epoch, row.failed, o)


def _fast_forward(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, to: str, row: Any, o: Any
) -> Claim:
    """The fenced advance of Redis to the ledger's cursor, with the ledger's counters and the
    items that failed in the chunks Redis has not seen (keys above its cursor)."""
    failed = [(k, why) for k, why in row.failed if k > claim.cursor]
    a = ctx.store.advance(
        round_id,
        range_id,
        claim.token,
        claim.cursor,
        to,
        done=max(0, row.done - claim.done),
        skipped=max(0, row.skipped - claim.skipped),
        lease_ms=o.lease_ms,
        max_item_attempts=o.max_item_attempts,
        dead_cap=o.dead_cap,
        failed=failed,
    )
    ctx.metrics.incr("ledger.fast_forward", tags=ctx.tags)
    log.warning(
        "round %s range %d: the target's ledger is ahead of Redis (its last chunk committed, "
        "the cursor advance did not happen); moved the cursor forward to it, nothing replayed",
        round_id,
        range_id,
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
    """One owner's transaction on the target, spanning a chunk (or a group of chunks), and the
    fenced ledger step that commits it."""

    def __init__(
        self,
        ctx: RunContext,
        table: sa.Table,
        key: tuple[str, str, int],
        epoch: int,
        failed: list[tuple[str, str]],
        o: TraverseOptions,
    ) -> None:
        assert ctx.target is not None
        self.target, self.table, self.key, self.epoch = ctx.target, table, key, epoch
        self.failed = list(failed)  # the range's failed items, as the ledger row holds them
        self.timeout_ms, self.ratio = o.lease_ms, o.outage_failure_ratio
        self.conn: sa.Connection | None = None
        self.root: sa.RootTransaction | None = None
        self.chunk: _Savepoint | None = None  # the savepoint of the chunk being processed
        self.pending: list[_Savepoint] = []  # returned calls isolation may deliver again

    # -- processor calls --------------------------------------------------------------------------
    def call(self, run: RangeCommits, chunk: Chunk) -> Any:
        """One processor call in a SAVEPOINT of the range's transaction (see the module)."""
        if run.probing:  # a canary: delivered again to probe the dependency, never kept
            return self._probe(run, chunk)
        if run.state.cursor == run.hi:  # item retry passes: at-least-once, a transaction each
            with self.target.begin() as conn:
                return _call_with(run, chunk, conn)
        conn = self._open()
        first, last = (
            encode_key(tuple(v[: run.arity])) for v in (chunk.values[0], chunk.values[-1])
        )
        self._enter_chunk(conn, run.read, first, last)
        self._undo_redelivered(first, last)
        sp = conn.begin_nested()
        try:
            result = _call_with(run, chunk, conn)
        except BaseException:
            sp.rollback()
            raise
        if self._whole(result, len(chunk)):
            self.pending.append(_Savepoint(sp, first, last))  # isolation may split it
        else:
            sp.commit()
        return result

    def _probe(self, run: RangeCommits, chunk: Chunk) -> Any:
        """A call rolled back whatever it does: a SAVEPOINT of the open transaction (on SQLite
        another connection would wait for this one's write lock), else a transaction."""
        if self.conn is not None:
            sp = self.conn.begin_nested()
            try:
                return _call_with(run, chunk, self.conn)
            finally:
                sp.rollback()
        with self.target.connect() as conn, conn.begin() as probe:
            try:
                return _call_with(run, chunk, conn)
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
        for p in reversed(self.pending):
            p.sp.rollback()
        self.pending.clear()
        if self.chunk is not None:
            self.chunk.sp.rollback()
            self.chunk = None

    # -- the transaction --------------------------------------------------------------------------
    def _open(self) -> sa.Connection:
        if self.conn is not None:
            return self.conn
        conn = self.target.connect()
        self.conn, self.root = conn, conn.begin()
        if conn.dialect.name == "sqlite":  # begin the transaction with a write (see touch_row)
            limit_statement_time(conn, self.timeout_ms)
            if not touch_row(conn, self.table, self.key, self.epoch):
                self.close()
                raise self._fenced()
        return conn

    def commit(
        self, run: RangeCommits, new: str, done: int, skipped: int, failed: Any = ()
    ) -> None:
        """Before the Redis advance: move the ledger row from the committed cursor to ``new``
        with the counters, in the transaction of the chunks' writes, and commit it. A chunk in
        hand whose verdict was not recorded is rolled back first. Raises ``LeaseLostError``
        (everything rolled back) when a newer owner raised the row's epoch."""
        if self.conn is None and new == run.state.cursor:
            return  # an item retry pass: nothing of the cursor to record
        conn = self._open()
        if self.chunk is not None and self.chunk.read == run.read:
            self._rollback_chunk()  # processed but not recorded (an outage): not committed
        else:
            self._keep_chunk()
        limit_statement_time(conn, self.timeout_ms)
        history = None
        if failed:
            self.failed.extend((k, str(why)[:500]) for k, why in failed)
            history = self.failed
        s = run.state
        counters = (s.done + done, s.skipped + skipped)
        try:
            moved = move_row(
                conn, self.table, self.key, self.epoch, s.cursor, new, counters, history
            )
        except BaseException:
            self.close()
            raise
        if not moved:
            self.close()
            raise self._fenced()
        root, self.root, self.conn = self.root, None, None
        try:
            assert root is not None
            root.commit()
        finally:
            conn.close()

    def close(self) -> None:
        """Roll back what is open (the run ends: nothing uncommitted may stay)."""
        conn, self.conn, self.root = self.conn, None, None
        self.chunk, self.pending = None, []
        if conn is not None:
            try:
                conn.rollback()
            finally:
                conn.close()

    def _fenced(self) -> LeaseLostError:
        _, round_id, range_id = self.key
        return LeaseLostError(
            f"round {round_id} range {range_id}: the target's ledger row moved on (a newer owner "
            f"claimed the range after this one's epoch {self.epoch}); this try's transaction "
            "was rolled back, nothing of it committed"
        )


def _call_with(run: RangeCommits, chunk: Chunk, conn: sa.Connection) -> Any:
    chunk.connection = conn
    try:
        return run.processor(chunk)
    finally:
        chunk.connection = None


__all__ = ["RunLedger", "check_exactly_once", "claim_ledger"]
