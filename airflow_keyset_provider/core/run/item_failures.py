"""Item failures versus dependency failures: isolating a chunk that failed as a whole, and the
item retry passes at the end of a range.

The rule (docs/contract.md, "Item failures and dependency failures"):

- A ``RetryableError`` from any processor call is a dependency failure (an outage): the cursor
  stays, nothing is recorded, the chunk is read again after a backoff.
- A chunk fails *as a whole* when the processor raises anything else, or names more than
  ``outage_failure_ratio`` of its items (and at least two) as failed. Before that is blamed on the
  dependency, the chunk is isolated:

  1. Canary: one key already processed successfully (the last one this try saw succeed, with its
     row as delivered then if it no longer matches ``where``; else the highest of the range's first
     ``chunk_size`` committed keys that neither waits for retry nor is dead; else the same from
     the round's other ranges, nearest first; never a key outside the round's bounds) is
     processed alone again (at-least-once allows it). If it
     fails, the next such key is (its row may have gone bad since it succeeded), up to
     ``CANARIES`` keys; if every one fails, the dependency is down: an outage.
  2. If the canary succeeded and the processor named the failed items, they are item failures as
     named. If it raised, or there was no canary, the chunk is bisected: each half is processed
     on its own, a half that fails as a whole is halved again, down to single items. A part that
     does not fail as a whole gives its verdict as usual; a single item that fails as a whole
     fails alone, with the error as its reason.
  3. If some probe succeeded (the canary or a part), the dependency is up: the items that failed
     alone are item failures (retried, then dead-lettered) and the cursor moves on. If none did,
     it is an outage.

Bounds, per attempt of an ``n``-item chunk: the canaries are at most ``CANARIES`` calls (one
when the first succeeds); bisection makes at most
``2n - 2`` calls over ``ceil(log2 n)`` levels, each item delivered at most once per level. Until
a probe has succeeded, bisection gives up (outage) after ``2 ceil(log2 n) + 1`` parts that failed
as a whole, so a real outage without a canary costs that many calls at most.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..chunk import Chunk, ChunkResult
from ..db_reasons import describe_exception
from ..errors import KeysetError, ProcessorContractError, RetryableError
from ..keys import as_tuple, display_key, encode_key
from ..sql.source import materialize, release
from .state import Heartbeat

if TYPE_CHECKING:
    from .commits import RangeCommits

log = logging.getLogger("airflow_keyset_provider")

#: At most this many canaries per isolation: a canary that fails may be a row that went bad since
#: it succeeded, so another key that succeeded before is probed before blaming the dependency.
CANARIES = 3


class IsolationStopped(Exception):
    """A stop was requested while a chunk was being isolated; nothing of the chunk is recorded."""


@dataclass
class Probe:
    """One processor call during isolation: its verdict, and whether it failed as a whole."""

    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    whole: bool = False  # failed as a whole: raised, or too many items failed
    error: str = ""  # what it raised (no per-item verdict), "" when it returned


@dataclass
class Parts:
    """Verdicts gathered while bisecting."""

    proven: bool  # some probe succeeded: the dependency is up
    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    misses: int = 0  # parts that failed as a whole before ``proven``

    def take(self, probe: Probe, size: int) -> None:
        self.failed.update(probe.failed)
        self.skipped.extend(probe.skipped)
        self.proven = self.proven or len(probe.failed) < size


class ItemFailures:
    """Failure isolation and item retry passes of one ``RangeRun``."""

    def __init__(self, run: RangeCommits) -> None:
        self.run = run
        self.last_good: str | None = None  # the last key this try saw succeed
        self.last_good_row: tuple | None = None  # its row, as it was delivered then
        self._lo: str | None = None

    # -- one chunk --------------------------------------------------------------------------------
    def process(self, rows: Sequence[tuple], attempt: int) -> tuple[dict[str, str], list[str]]:
        """The verdict on ``rows``: ``(failed key -> reason, skipped keys)``, encoded. Raises
        ``RetryableError`` when the dependency failed (nothing of the chunk may be recorded)."""
        first = self._probe(rows, attempt)
        if not first.whole:
            return first.failed, first.skipped
        return self._isolate(materialize(rows), first, attempt)

    def note_done(self, rows: Sequence[tuple], last: str, bad: set[str]) -> None:
        """Remember the last key of ``rows`` that succeeded (not in ``bad``): the next canary."""
        if not bad:
            self.last_good, self.last_good_row = last, tuple(rows[-1])
            return
        arity = self.run.arity
        for row in reversed(rows):
            enc = encode_key(tuple(row[:arity]))
            if enc not in bad:
                self.last_good, self.last_good_row = enc, tuple(row)
                return

    def interpret(self, chunk: Chunk, result: Any) -> tuple[dict[str, str], list[str]]:
        """-> (failed encoded key -> reason, skipped encoded keys), checked against the chunk."""
        if result is None:
            return {}, []
        if not isinstance(result, ChunkResult):
            raise ProcessorContractError(
                f"processor returned {type(result).__name__}; it must return ChunkResult or None. "
                f"Nothing of round {self.run.round_id} range {self.run.range_id} was committed."
            )
        if not result.failed and not result.skipped:
            return {}, []
        index = {_norm(k): encode_key(as_tuple(k, self.run.arity)) for k in chunk.keys}

        def encoded(k: Any, field_name: str) -> str:
            enc = index.get(_norm(k))
            if enc is None:
                raise ProcessorContractError(
                    f"ChunkResult.{field_name} names key {k!r}, which is not in the chunk"
                )
            return enc

        failed = {encoded(k, "failed"): str(reason) for k, reason in result.failed.items()}
        skipped = {encoded(k, "skipped") for k in result.skipped}
        return failed, sorted(skipped - failed.keys())

    def _probe(self, rows: Sequence[tuple], attempt: int) -> Probe:
        run = self.run
        chunk = Chunk(
            run.round_id, run.range_id, run.source.column_names, rows, run.key_of, attempt
        )
        try:
            result = run.call_processor(chunk)
        except KeysetError:
            raise  # RetryableError (an outage) and the engine's own errors
        except Exception as exc:
            return Probe(whole=True, error=describe_exception(exc))  # no row data (db_reasons)
        failed, skipped = self.interpret(chunk, result)
        n = len(rows)
        whole = len(failed) >= 2 and len(failed) > run.o.outage_failure_ratio * n
        return Probe(failed, skipped, whole)

    def _isolate(
        self, rows: list[tuple], first: Probe, attempt: int
    ) -> tuple[dict[str, str], list[str]]:
        why = first.error or next(iter(first.failed.values()))
        what = f"{len(rows)} items failed as a whole (first: {why})"
        canary = self._canary(attempt + 1)
        if canary is False:
            raise RetryableError(f"{what}, and the canary, a key that succeeded before, failed too")
        if canary and not first.error:
            self._log_isolated(rows, first.failed, "the canary succeeded")
            return first.failed, first.skipped
        parts = self._bisect(rows, first, attempt + 1, proven=bool(canary))
        if not parts.proven:
            raise RetryableError(
                f"{what}; no part of the chunk succeeded alone and no key that succeeded before "
                "was there to probe with"
            )
        self._log_isolated(rows, parts.failed, "bisected")
        return parts.failed, parts.skipped

    def _bisect(self, rows: list[tuple], first: Probe, attempt: int, proven: bool) -> Parts:
        """Halve the parts that fail as a whole down to single items (depth first)."""
        parts = Parts(proven)
        if len(rows) == 1:
            parts.failed.update(self._alone(rows, first))
            return parts
        budget = 2 * math.ceil(math.log2(len(rows))) + 1
        stack = _halves(rows)[::-1]
        while stack:
            self.run._check_lease(self.run.heart, "lease lost while isolating a chunk")
            if self.run.ctx.stop.is_set():
                raise IsolationStopped
            part = stack.pop()
            probe = self._probe(part, attempt)
            if not probe.whole or (parts.proven and not probe.error):
                parts.take(probe, len(part))
                continue
            if not parts.proven:
                parts.misses += 1
                if parts.misses >= budget:
                    return parts
            if len(part) == 1:
                parts.failed.update(self._alone(part, probe))
            else:
                stack.extend(_halves(part)[::-1])
        return parts

    def _alone(self, part: Sequence[tuple], probe: Probe) -> dict[str, str]:
        """The item failure of a single item that failed as a whole."""
        if not probe.error:
            return probe.failed
        return {encode_key(tuple(part[0][: self.run.arity])): probe.error}

    def _canary(self, attempt: int) -> bool | None:
        """Process a key known to succeed alone: True if it did, False if it failed, None when
        there is no such key (or it is gone).

        The canary is read again (its current values); when it no longer matches ``where`` (a
        processor that moves each row out of the filter: ``UPDATE ... SET status = 'DONE'``)
        the last key this try saw succeed is probed with its row as it was delivered then. The
        probe re-processes a row the processor accepted before, which at-least-once allows (the
        processor is idempotent anyway); the row is never re-read without ``where``.

        A canary that fails may be a row that changed since it succeeded (rows are mutable, only
        keys are not): its failure is its own, not the dependency's. So up to ``CANARIES`` keys
        are probed, each another key that succeeded before; the dependency is down only when
        every one fails (an outage costs ``CANARIES`` canary calls per attempt, not one)."""
        tried: set[str] = set()
        failed = False
        for key in self._canary_keys():
            if key in tried:
                continue
            tried.add(key)
            ok = self._probe_canary(key, attempt)
            if ok:
                return True
            if ok is False:
                failed = True
                if len(tried) >= CANARIES:
                    break
        return False if failed else None

    def _probe_canary(self, key: str, attempt: int) -> bool | None:
        rows: Sequence[tuple] = self.run.source.fetch_keys([key])
        if not rows and key == self.last_good and self.last_good_row is not None:
            rows = [self.last_good_row]
        if not rows:
            if key == self.last_good:
                self.last_good = self.last_good_row = None
            return None
        self.run.probing = True  # exactly_once rolls a canary's writes back (run/ledger.py)
        try:
            probe = self._probe(rows, attempt)
        finally:
            self.run.probing = False
        ok = not probe.whole and not probe.failed
        log.info(
            "round %s range %d: canary %s %s",
            self.run.round_id,
            self.run.range_id,
            display_key(key, self.run.arity),
            "succeeded: the dependency is up" if ok else "failed",
        )
        if not ok and key == self.last_good:
            self.last_good = self.last_good_row = None  # the next isolation starts elsewhere
        return ok

    def _canary_keys(self) -> Iterator[str]:
        """Canary candidates, best first, read lazily (the next source is read only when every
        candidate before it failed or was gone): the last key this try saw succeed; the range's
        own committed keys (a resumed try, or that one failed); then the committed keys of the
        round's other ranges, nearest in key order first. Each range gives at most
        ``chunk_size`` keys that neither wait for retry nor are dead, highest first. Every such
        key was processed successfully before and lies inside the round's bounds, so probing it
        again is what at-least-once allows; a range whose keys so far all failed is told apart
        from an outage by another range's. Keys of earlier rounds are never probed: a processor
        may rely on every key it is handed in round ``r`` being inside ``r``'s bounds."""
        run = self.run
        if self.last_good is not None:
            yield self.last_good
        if self._lo is None:
            self._lo = run.store.range(run.round_id, run.range_id)["lo"]
        yield from self._good_keys(run.range_id, self._lo, run.state.cursor)
        for rng in self._other_ranges():
            yield from self._good_keys(int(rng["range_id"]), rng["lo"], rng["cursor"])

    def _other_ranges(self) -> list[dict[str, str]]:
        """The round's other ranges with committed keys, nearest to this one (in key order)
        first; none when the round's state cannot be read whole (a lost range)."""
        run = self.run
        try:
            ranges = sorted(run.store.ranges(run.round_id), key=lambda r: r["lo"])
        except KeysetError:
            return []
        at = next((i for i, r in enumerate(ranges) if r["range_id"] == str(run.range_id)), -1)
        nearest = sorted(range(len(ranges)), key=lambda i: (abs(i - at), i))
        return [ranges[i] for i in nearest if i != at and ranges[i]["cursor"] != ranges[i]["lo"]]

    def _good_keys(self, range_id: int, lo: str, cursor: str) -> list[str]:
        """Up to ``chunk_size`` keys of ``(lo, cursor]`` (committed: processed) present now that
        neither wait for retry nor are dead in range ``range_id``, highest first (encoded keys
        sort in key order)."""
        run = self.run
        if cursor == lo:
            return []  # nothing committed yet
        rows = run.source.fetch(lo, cursor, run.o.chunk_size)
        keys = [encode_key(tuple(r[: run.arity])) for r in materialize(rows)]
        release(rows)
        if not keys:
            return []
        waiting = run.store.retry_states(run.round_id, range_id, keys)
        dead = {d["key"] for d in run.store.dead_letters(run.round_id, range_id, run.o.dead_cap)}
        good = [k for k, w in zip(keys, waiting, strict=True) if w is None and k not in dead]
        return good[::-1]

    def _log_isolated(self, rows: Sequence[tuple], failed: dict[str, str], how: str) -> None:
        log.warning(
            "round %s range %d: a chunk of %d items failed as a whole; %s, so the dependency is "
            "up: %d item(s) failed on their own and are recorded as item failures",
            self.run.round_id,
            self.run.range_id,
            len(rows),
            how,
            len(failed),
        )

    # -- item retry passes ------------------------------------------------------------------------
    def drain(self, heart: Heartbeat) -> bool:
        """Items that failed on their own get further attempts once the cursor reached ``hi``;
        after ``max_item_attempts`` they are dead-lettered. The range completes when none is
        left. Returns True when a stop request ended the passes (every wait is interruptible),
        or the pacer did, as between the main loop's chunks: before each pass the stream's pause,
        throttle, health and the time budget are consulted (``RangeRun._pace``; the run then
        commits, releases and returns ``yielded``, the items still waiting for retry), and a
        pause seen while waiting for a pass ends the wait."""
        run, stop = self.run, self.run.ctx.stop
        attempt, passes = 0, 0
        while run.state.retries > 0 and not run.state.complete:
            run._check_lease(heart, "lease lost during retries")
            if stop.is_set():
                return True
            entries = run.store.retry_entries(run.round_id, run.range_id, run.o.chunk_size)
            if not entries:
                break
            passes += 1
            first_attempts = min(e[1] for e in entries)
            delay = min(run.o.backoff_max, run.o.item_retry_delay * 2 ** (first_attempts - 1))
            if self._wait(delay) or not run._pace():
                return True
            try:
                rows, failed, skipped, elsewhere = self._retry_pass(entries, passes + 1)
            except IsolationStopped:
                return True
            except RetryableError as exc:
                attempt += 1
                run._backoff(attempt, "the processor's dependency (item retry pass)", exc)
                continue
            except KeysetError:
                raise
            except Exception as exc:
                attempt += 1
                run._backoff(attempt, "an item retry pass", exc)
                continue
            attempt = 0
            try:
                self._commit_pass(passes, entries, rows, failed, skipped, elsewhere)
            except RetryableError as exc:  # exactly_once: the ledger step lost its transaction
                attempt += 1
                run._backoff(attempt, "the target's ledger step (item retry pass)", exc)
        return False

    def _wait(self, seconds: float) -> bool:
        """Wait before a retry pass: True when a stop request ended it. It also ends (False)
        once the pacer has seen a pause (looked at every ``control_poll_seconds``), for
        ``RangeRun._pace`` to say so."""
        run = self.run
        paused = run.pacer.watch.paused if run.pacer is not None else None
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if run.ctx.stop.wait(min(left, run.o.control_poll_seconds)):
                return True
            if paused is not None and paused.is_set():
                return False
        return run.ctx.stop.is_set()

    def _commit_pass(
        self,
        passes: int,
        entries: Sequence[tuple[str, int, str]],
        rows: Sequence[tuple],
        failed: dict[str, str],
        skipped: list[str],
        elsewhere: dict[str, str],
    ) -> None:
        run = self.run
        resolved = _resolutions(entries, rows, failed, skipped, run.arity, elsewhere)
        run._commit(run.state.cursor, 0, 0, resolved=resolved, failed=sorted(failed.items()))
        log.info(
            "round %s range %d: item retry pass %d: %d resolved, %d still failing, %d dead so far",
            run.round_id,
            run.range_id,
            passes,
            len(resolved),
            len(failed),
            run.state.dead,
        )

    def _retry_pass(
        self, entries: Sequence[tuple[str, int, str]], attempt: int
    ) -> tuple[Sequence[tuple], dict[str, str], list[str], dict[str, str]]:
        """Read the failed items again and hand them to the processor as one chunk, isolated like
        any chunk when it fails as a whole. The verdict is the isolation's: items that fail alone
        while a probe succeeds (the canary, or a part) failed on their own and use up an attempt,
        whatever their error says (a text that changes at every attempt, a request id in it, is
        still the item's failure); when no probe succeeds it is an outage and no attempt is used.
        With ``exactly_once``, the items the ledger says another transaction already delivered
        (``elsewhere``: item -> ``'d'``/``'s'``) are resolved so, without a call."""
        keys = [e[0] for e in entries]
        ledger = self.run.ledger
        elsewhere = ledger.resolved(keys) if ledger is not None else {}
        keys = [k for k in keys if k not in elsewhere]
        rows = self.run.source.fetch_keys(keys) if keys else []
        if not rows:
            return rows, {}, [], elsewhere
        failed, skipped = self.process(rows, attempt)
        return rows, failed, skipped, elsewhere


def _resolutions(
    entries: Sequence[tuple[str, int, str]],
    rows: Sequence[tuple],
    failed: dict[str, str],
    skipped: list[str],
    arity: int,
    elsewhere: dict[str, str],
) -> list[tuple[str, str]]:
    """Retried items that reached a terminal state: ``"d"`` done, ``"s"`` skipped. A row that
    is gone (deleted, no longer matches ``where``) reached a terminal state too: skipped. An
    item another transaction delivered (``elsewhere``) has the state the ledger recorded."""
    present = {encode_key(tuple(r[:arity])) for r in rows}
    skip = set(skipped)
    return [
        (enc, elsewhere.get(enc) or ("s" if enc in skip or enc not in present else "d"))
        for enc, _, _ in entries
        if enc not in failed
    ]


def _norm(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _halves(rows: list[tuple]) -> list[list[tuple]]:
    mid = len(rows) // 2
    return [rows[:mid], rows[mid:]]


__all__ = ["IsolationStopped", "ItemFailures"]
