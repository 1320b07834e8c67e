"""Traversing one range: check it, claim it, run it under its lease, release it; and put back a
round Redis lost from the checkpoint mirror. ``KeysetTraversal.traverse`` and the pull loop call
``run_restoring``; the chunk loop itself is ``RangeRun`` (``range_run.py``).

Guarantee: a range runs only against a round that exists in Redis and was planned over this
source; a round Redis lost is put back from the mirror (cursors at their last checkpoint, never
ahead of what was committed) and the run goes on. Without a mirror, or if the mirror never saw
the round, the loss is raised (``RoundStateLostError``), never read as "nothing left to do".
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..chunk import Processor
from ..errors import ConfigurationError, KeysetError, LeaseLostError, RoundStateLostError
from ..options import TraverseOptions
from ..pace.stream_control import Pace, Pacer, make_pacer
from ..store.cursor_store import Claim
from .claim import check_retention, claim_range, log_claim
from .context import RunContext
from .ledger import RunLedger, check_exactly_once, claim_ledger
from .range_run import RangeRun
from .split import Splitter
from .state import CommittedRange, Heartbeat, HeartbeatThread, RangeResult

log = logging.getLogger("airflow_keyset_provider")


def run_range(
    ctx: RunContext,
    round_id: str,
    range_id: int,
    processor: Processor,
    o: TraverseOptions,
    *,
    deadline: float | None = None,
    split: bool = False,
    pacer: Pacer | None = None,
    beats: HeartbeatThread | None = None,
    coalesce: int = 0,
    pull: bool = False,
) -> RangeResult:
    """Claim the range (waiting while a live owner holds it), refuse it if the source's retention
    passed its cursor, run it with a heartbeat, release the lease. Returns its counters.

    ``deadline`` (``time.monotonic()``; default: now + ``o.max_task_seconds``) ends the run at a
    chunk boundary with ``yielded == "budget"``; ``split`` lets the run split its range when an
    idle task asks (``core/run/split.py``; only pull loops pass it). ``pacer``: a started
    pacer the caller keeps across its ranges (a pull loop; it polls the same stream control
    either way); without one the range starts and stops its own. ``beats``: likewise, a running
    heartbeat thread the range attaches to (else it starts a thread of its own). ``coalesce``:
    the claim absorbs up to that many fresh ranges that follow it; ``pull``: a pull loop's claim
    (the round records it as its lineage's, ``CursorStore.held_by``)."""
    token = f"{o.owner_lineage or 'worker'}#{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    if deadline is None and o.max_task_seconds is not None:
        deadline = started + o.max_task_seconds
    check_exactly_once(ctx, o)
    claim = claim_range(ctx, round_id, range_id, token, o, coalesce, pull)
    claim, ledger = _with_ledger(ctx, round_id, range_id, token, claim, o)
    if claim.complete:
        return _already_complete(round_id, range_id, claim)
    check_retention(ctx, round_id, range_id, token, claim.cursor)
    if ctx.source.connection_name is not None:  # a DBA sees which range each connection serves
        ctx.source.connection_name.at_range(round_id, range_id)
    rng = {"lo": claim.lo, "hi": claim.hi}  # read by the claim (only this owner may split)
    log_claim(ctx, round_id, range_id, claim, rng)
    own_pacer = pacer is None
    pacer = pacer or make_pacer(ctx.store, ctx.source.engine, ctx.stop, o)
    run = RangeRun(ctx, round_id, range_id, processor, claim, rng["hi"], o, pacer)
    run.deadline, run.splitter, run.ledger = deadline, Splitter(run, split), ledger
    state = _run_leased(run, pacer, own_pacer, beats)
    return RangeResult(
        round_id,
        range_id,
        state.done,
        state.skipped,
        state.dead,
        state.complete,
        state.cursor,
        run.rows_read,
        run.chunks,
        state.stopped,
        claim.takeover,
        time.monotonic() - started,
        run.yielded == Pace.PAUSED,
        run.yielded,
        pacer.retry_after if run.yielded in (Pace.THROTTLED, Pace.UNHEALTHY) else 0.0,
        claim.absorbed,
    )


def _with_ledger(
    ctx: RunContext, round_id: str, range_id: int, token: str, claim: Claim, o: TraverseOptions
) -> tuple[Claim, RunLedger | None]:
    """With ``exactly_once``: the target's ledger step of the claim (``ledger.py``). The lease
    is released when that step fails (the target is down or the statement timed out: the next
    try claims at once instead of waiting out the lease) or finds the range complete."""
    if not o.exactly_once or claim.complete:
        return claim, None
    try:
        claim, ledger = claim_ledger(ctx, round_id, range_id, claim, o)
    except BaseException:
        with contextlib.suppress(Exception):  # a failed release expires by itself
            ctx.store.release(round_id, range_id, token)
        raise
    if claim.complete:
        ctx.store.release(round_id, range_id, token)
    return claim, ledger


def _already_complete(round_id: str, range_id: int, claim: Claim) -> RangeResult:
    log.info(
        "round %s range %d is already complete (done %d, skipped %d, dead %d)",
        round_id,
        range_id,
        claim.done,
        claim.skipped,
        claim.dead,
    )
    return RangeResult(
        round_id, range_id, claim.done, claim.skipped, claim.dead, True, claim.cursor
    )


def _run_leased(
    run: RangeRun, pacer: Pacer, own_pacer: bool = True, beats: HeartbeatThread | None = None
) -> CommittedRange:
    """``run.run`` with the heartbeat (on ``beats`` if given, else a thread of its own) and the
    pacer running (``own_pacer``: started and stopped here); the lease released whatever happens
    (a failed release expires by itself)."""
    ctx, o = run.ctx, run.o
    heart = Heartbeat(
        ctx.store, run.round_id, run.range_id, run.token, o.lease_ms, o.chunk_timeout_seconds
    )
    if beats is not None:
        beats.attach(heart)
    else:
        heart.start()
    if own_pacer:
        pacer.start()
    try:
        return run.run(heart)
    finally:
        if run.ledger is not None:
            run.ledger.close()  # roll back what no ledger step committed
        if own_pacer:
            pacer.stop()
        heart.stop()
        if beats is not None:
            beats.attach(None)
        try:
            if not run.released:  # else the completing advance released it
                ctx.store.release(run.round_id, run.range_id, run.token)
        except KeysetError:
            log.warning(
                "round %s range %d: could not release the lease; it expires by itself",
                run.round_id,
                run.range_id,
            )


#: How often a run restores a round from the mirror before it gives up.
RESTORES = 3


def check_range(ctx: RunContext, round_id: str, range_id: int) -> int:
    """The range exists, and the round was planned over this source; the round's
    ``n_ranges``."""
    info = ctx.store.round_info(round_id)
    n_ranges = int(info["n_ranges"])
    if isinstance(range_id, bool) or not isinstance(range_id, int) or not 0 <= range_id < n_ranges:
        raise ConfigurationError(
            f"round {round_id} has ranges 0..{n_ranges - 1}; got range_id {range_id!r}"
        )
    fingerprint = ctx.source.fingerprint()
    if info.get("source") != fingerprint:
        raise ConfigurationError(
            f"round {round_id} was planned over {info.get('source')}, not {fingerprint}; "
            "traverse it with the same table, key and where"
        )
    return n_ranges


def _gone_with_a_split(ctx: RunContext, round_id: str, range_id: int) -> None:
    """After a restore: a range id beyond the round's ranges was made by a split Redis lost (a
    failover to a replica that never saw it; the restore keeps Redis's partition, so its keys
    are the range it was split from again). The range is gone, not a usage error: its lease is
    lost (``LeaseLostError``), and the keys are traversed with the range that holds them."""
    n_ranges = int(ctx.store.round_info(round_id)["n_ranges"])
    if 0 <= range_id < n_ranges:
        return
    raise LeaseLostError(
        f"round {round_id} range {range_id}: Redis lost the split that made this range (a "
        f"failover to a replica that never saw it; the round has ranges 0..{n_ranges - 1} "
        "again); its keys belong to the range it was split from, which traverses them"
    )


def run_restoring(
    ctx: RunContext,
    round_id: str,
    range_id: int,
    processor: Processor,
    options: TraverseOptions,
    *,
    checked: bool = False,
    on_restore: Callable[[], None] | None = None,
    **run: Any,
) -> RangeResult:
    """``run_range`` after ``check_range`` (skipped when the caller ``checked`` the round and got
    the id from the store), restoring a round Redis lost from the mirror. ``on_restore`` is
    called after each restore, before the range runs again: a caller that keeps anything read
    from the round's state (a pull loop's finished ranges) must drop it, the restore may have
    reopened any range of the round."""
    for _ in range(RESTORES):
        try:
            if not checked:
                check_range(ctx, round_id, range_id)
            return run_range(ctx, round_id, range_id, processor, options, **run)
        except RoundStateLostError:
            if not ctx.control.restore(round_id):
                raise
            ctx.metrics.incr("state.restored", tags=ctx.tags)
            _gone_with_a_split(ctx, round_id, range_id)
            checked = False
            if on_restore is not None:
                on_restore()
    check_range(ctx, round_id, range_id)
    return run_range(ctx, round_id, range_id, processor, options, **run)


__all__ = ["RESTORES", "check_range", "run_range", "run_restoring"]
