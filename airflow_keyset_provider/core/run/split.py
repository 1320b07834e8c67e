"""The owner's side of dynamic splitting: answering an idle task's request to split its range.

An idle task of a pull loop (``core/run/pull.py``) asks with ``CursorStore.request_split``; the owner
sees the request in the result of its next commit (``Advanced.split_req``) and answers it here,
right after that commit, at a chunk boundary: the group is flushed, so the committed cursor equals
``read``. With group commit that is when the group is flushed, never in the middle of a group.

Where it splits: ``at`` is a real key strictly above every key this run has read (``read`` and the
last key of a prefetched chunk, whose result is awaited and kept for the loop) and strictly below
``hi``: the median of the keys left, by row count (``SqlSource.quantile_keys``: a counting pass over
the keys left, index-only on PostgreSQL, or a block sample above ``SPLIT_EXACT_ROWS``). The store
then shrinks the range to ``(lo, at]`` and creates ``(at, old hi]`` in one Lua step, fenced by the
owner token; the run's ``hi`` (its loop bound, fetch bound and progress label) becomes ``at``. No
key the owner read or may be processing changes hands, so the ranges still partition the round.

It declines (``split(..., at=None)``: the requester reads ``'no'``) when the source estimates fewer
than ``SPLIT_MIN_CHUNKS`` chunks left (PostgreSQL's planner estimate, an exact count elsewhere),
when no key qualifies, when the range is read to its end, and always when the run was not started
by a pull loop (``split=False``): a plain ``traverse`` task ends with its range, and a pull loop
is what finds and finishes a new range whose requester died before claiming it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import redis

from ..errors import KeysetError, RoundStateLostError
from ..keys import display_key, encode_key
from ..rounds.mirror import split_marks

if TYPE_CHECKING:
    from .commits import RangeCommits

log = logging.getLogger("airflow_keyset_provider")

#: The owner declines when fewer than this many chunks of rows are left in its range.
SPLIT_MIN_CHUNKS = 2
#: Up to this many rows left, the split point is exact (one counting pass over the keys left);
#: above it, the median of a block sample (``SqlSource.quantile_keys``).
SPLIT_EXACT_ROWS = 1_000_000
SPLIT_SAMPLE_ROWS = 20_000


class Splitter:
    """Answers split requests for one ``RangeRun`` (``enabled``: the run belongs to a pull loop)."""

    def __init__(self, run: RangeCommits, enabled: bool) -> None:
        self.run, self.enabled = run, enabled
        self.splits = 0  # splits this run made

    def answer(self, requester: str) -> None:
        """Split the range for ``requester`` at this chunk boundary, or decline; a store refusal
        (lease lost: the next commit says so) is logged and left to the loop."""
        run = self.run
        at, left, why = self._choose() if self.enabled else (None, 0, "not in a pull loop")
        try:
            mirror = run.ctx.mirror is not None  # the split is marked until mirrored
            new_id = run.store.split(run.round_id, run.range_id, run.token, at, mirror=mirror)
        except RoundStateLostError:
            raise
        except (KeysetError, redis.RedisError) as exc:
            log.warning(
                "round %s range %d: could not answer the split request of %s: %s",
                run.round_id,
                run.range_id,
                requester,
                exc,
            )
            return
        if at is None:
            log.info(
                "round %s range %d: declined to split for %s (%s)",
                run.round_id,
                run.range_id,
                requester,
                why,
            )
            return
        if new_id is None:
            log.warning(
                "round %s range %d: the store refused the split at %s (lease lost or cursor "
                "moved); the range is unchanged",
                run.round_id,
                run.range_id,
                display_key(at, run.arity),
            )
            return
        self._shrink(at, new_id, left, requester)

    def _shrink(self, at: str, new_id: int, left: int, requester: str) -> None:
        """The split is committed: this run now ends at ``at``."""
        run = self.run
        old_hi, run.hi = run.hi, at
        run.progress.hi_label = display_key(at, run.arity)
        run.progress.estimate = run.progress.rows + left // 2
        self.splits += 1
        run.ctx.metrics.incr("range.split", tags=run.ctx.tags)
        self._mirror(new_id)
        log.info(
            "round %s range %d: split for %s at %s: keeps up to %s, new range %d takes (%s, %s] "
            "(about %d rows were left)",
            run.round_id,
            run.range_id,
            requester,
            display_key(at, run.arity),
            display_key(at, run.arity),
            new_id,
            display_key(at, run.arity),
            display_key(old_hi, run.arity),
            left,
        )

    def _mirror(self, new_id: int) -> None:
        """With a checkpoint mirror: the round's info (its grown ``n_ranges``), this range (its
        new ``hi``) and the new range, in one transaction of the mirror, so a round restored
        from it is still a partition; then the split's mark goes (``mirrored_split``). A mirror
        write that fails is logged, as checkpoints are; the mark stays on the range in Redis
        (the SPLIT script wrote it with the split), so every later record of this range, by this
        owner or the next, carries the new range as the split made it, unless the mirror has a
        record of it already (``CheckpointMirror``): the shrunken range alone beside the
        mirror's older record would leave the new range's keys out of a restored round."""
        run = self.run
        mirror = run.ctx.mirror
        if mirror is None:
            return
        try:
            info = run.store.round_info(run.round_id)
            docs = run.store.snapshot_ranges(run.round_id, [run.range_id])
            # this split and any earlier one of this range the mirror missed (their marks)
            splits = sorted({new_id, *split_marks(docs[0])})
            docs += run.store.snapshot_ranges(run.round_id, splits)
            # a coalescing of this range that the mirror missed goes with it (its mark)
            missed = int(docs[0].get("unmirrored") or 0)
            if missed:
                first = run.range_id + 1
                docs += run.store.snapshot_ranges(run.round_id, range(first, first + missed))
            mirror.save_round(run.ctx.stream, run.round_id, info, docs)
            run.store.mirrored_split(run.round_id, run.range_id, splits)
            if missed:
                run.store.mirrored_coalescing(run.round_id, run.range_id)
        except RoundStateLostError:
            raise
        except Exception as exc:
            log.warning(
                "round %s range %d: the checkpoint mirror did not record the split: %s",
                run.round_id,
                run.range_id,
                exc,
            )

    def _read_end(self) -> str:
        """The highest key this run has read: ``read``, or the last key of the prefetched chunk
        (awaited; the future keeps its rows for the loop). A failed prefetch read nothing."""
        run = self.run
        if run.pending is None:
            return run.read
        try:
            rows = run.pending.result()
        except Exception:
            return run.read  # the loop meets the same error and reads again from ``read``
        if not rows:
            return run.read
        return max(run.read, encode_key(tuple(rows[-1][: run.arity])))

    def _choose(self) -> tuple[str | None, int, str]:
        """``(at, rows left, why)``; ``at`` None: decline, ``why`` says why."""
        run = self.run
        if run.state.complete or run.state.cursor == run.hi:
            return None, 0, "the range is read to its end"
        base = self._read_end()
        if base >= run.hi:
            return None, 0, "the range is read to its end"
        try:
            left = run.source.estimate_rows(base, run.hi)
            if left < SPLIT_MIN_CHUNKS * run.size:
                return None, left, f"about {left} rows left, under {SPLIT_MIN_CHUNKS} chunks"
            cuts = run.source.quantile_keys(base, run.hi, 2, SPLIT_EXACT_ROWS, SPLIT_SAMPLE_ROWS)
        except Exception as exc:  # the source is a dependency: declining costs nothing
            return None, 0, f"the split point could not be read: {type(exc).__name__}: {exc}"
        at = next((c for c in cuts if base < c < run.hi), None)
        if at is None:
            return None, left, "no key strictly between what was read and hi"
        return at, left, ""


__all__ = ["SPLIT_EXACT_ROWS", "SPLIT_MIN_CHUNKS", "Splitter"]
