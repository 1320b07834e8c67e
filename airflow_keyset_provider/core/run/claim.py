"""Claiming a range: wait while a live owner holds it, refuse it when the source's retention
passed its cursor, log who took it from where. ``run_range`` (``core/run/range_run.py``) calls these."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import LeaseHeldError, RetentionError
from ..keys import display_key
from ..options import TraverseOptions
from ..store.cursor_store import Claim

if TYPE_CHECKING:
    from .context import RunContext

log = logging.getLogger("airflow_keyset_provider")


def claim_range(
    ctx: RunContext,
    round_id: str,
    range_id: int,
    token: str,
    o: TraverseOptions,
    coalesce: int = 0,
    pull: bool = False,
) -> Claim:
    """Claim the range; while a live owner holds it, wait (on the traversal's stop event) until
    its lease runs out, up to ``claim_timeout``. ``coalesce``: absorb up to that many fresh
    ranges that follow it (``CursorStore.claim``; pull mode), mirrored at once. ``pull``: a
    pulling task's claim (recorded as its lineage's)."""
    timeout, lease_ms = o.claim_timeout_seconds, o.lease_ms
    deadline = time.monotonic() + timeout
    while True:
        res = ctx.store.claim(
            round_id,
            range_id,
            token,
            o.owner_lineage,
            lease_ms,
            coalesce,
            pull=pull,
            mirror=ctx.mirror is not None,
        )
        if isinstance(res, Claim):
            if res.absorbed:
                mirror_coalesced(ctx, round_id, range_id, res.absorbed)
            return res
        owner, ms_left = res.owner, res.ms_left
        if time.monotonic() + ms_left / 1000 > deadline + lease_ms / 1000:
            raise LeaseHeldError(
                f"round {round_id} range {range_id} is held by live owner {owner} (lease "
                f"renewed by heartbeats); gave up after {timeout:.0f} s. If that worker is "
                "gone, its lease expires by itself; otherwise let it finish."
            )
        if time.monotonic() > deadline:
            raise LeaseHeldError(
                f"round {round_id} range {range_id} is still held by {owner} after {timeout:.0f} s"
            )
        log.info(
            "round %s range %d is held by %s for %.1f s more; waiting",
            round_id,
            range_id,
            owner,
            ms_left / 1000,
        )
        if ctx.stop.wait(min(ms_left / 1000 + 0.05, max(deadline - time.monotonic(), 0.05))):
            raise LeaseHeldError(
                f"stop requested while waiting for round {round_id} range {range_id}"
            )


def mirror_coalesced(ctx: RunContext, round_id: str, range_id: int, absorbed: int) -> None:
    """With a checkpoint mirror: the claimed range (its new ``hi``) and the ranges it absorbed
    (now empty and complete) in one transaction of the mirror, so a round restored from it is
    still a partition. A failed mirror write is logged, as checkpoints are; the range keeps its
    ``unmirrored`` mark in Redis (written by the claim), so until the mirror has the run, every
    checkpoint and split record of this range, by this owner or a later one, carries the
    absorbed ranges too (the host with its new ``hi`` alone, beside the mirror's fresh copies
    of the ranges it absorbed, would overlap them)."""
    if ctx.mirror is None:
        return
    try:
        info = ctx.store.round_info(round_id)
        ids = range(range_id, range_id + absorbed + 1)
        ctx.mirror.save_round(ctx.stream, round_id, info, ctx.store.snapshot_ranges(round_id, ids))
        ctx.store.mirrored_coalescing(round_id, range_id)
    except Exception as exc:  # the mirror is a safety net; its outage must not stop the range
        log.warning(
            "round %s range %d: the checkpoint mirror did not record the coalescing of ranges "
            "%d..%d: %s",
            round_id,
            range_id,
            range_id + 1,
            range_id + absorbed,
            exc,
        )


def check_retention(ctx: RunContext, round_id: str, range_id: int, token: str, cursor: str) -> None:
    """If the source may already have deleted keys this range has not read, the round is lost
    for good: mark it unrecoverable (it can never close) and stop."""
    boundary = ctx.source.retention_boundary()
    if boundary is None or boundary <= cursor:
        return
    reason = (
        f"the source's retention boundary {display_key(boundary, ctx.arity)} passed range "
        f"{range_id}'s cursor {display_key(cursor, ctx.arity)}: keys in between may have "
        "been deleted unread"
    )
    if not ctx.store.mark_unrecoverable(round_id, reason):
        log.warning("round %s: already closed or gone; not marked unrecoverable", round_id)
    ctx.store.release(round_id, range_id, token)
    log.error("round %s: %s; the round is marked unrecoverable", round_id, reason)
    raise RetentionError(
        f"round {round_id}: {reason}. It is marked unrecoverable and will never be reported "
        "complete. Keep rows above the stream's retention floor (airflow-keyset status) until "
        "rounds finish, then reset this round and plan again."
    )


def log_claim(
    ctx: RunContext, round_id: str, range_id: int, claim: Claim, rng: dict[str, Any]
) -> None:
    if claim.takeover:
        ctx.metrics.incr("lease.takeover", tags=ctx.tags)
        log.warning(
            "round %s range %d: took over from a previous owner at cursor %s (that owner is "
            "fenced; up to one chunk will be replayed)",
            round_id,
            range_id,
            display_key(claim.cursor, ctx.arity),
        )
    else:
        log.info(
            "round %s range %d: claimed (%s, %s]%s, resuming at cursor %s",
            round_id,
            range_id,
            display_key(rng["lo"], ctx.arity),
            display_key(rng["hi"], ctx.arity),
            f" (ranges {range_id + 1}..{range_id + claim.absorbed} coalesced into it)"
            if claim.absorbed
            else "",
            display_key(claim.cursor, ctx.arity),
        )


__all__ = ["check_retention", "claim_range", "log_claim", "mirror_coalesced"]
