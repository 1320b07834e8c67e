"""Verification: after every range of a round is complete and before it closes, prove its effect.

A round may carry ``verify``, an SQL predicate (the DAG author's, trusted like ``where``) that no
row of the round should match once the processor did its job ("cancel stale orders": ``status =
'open' AND updated_at < now() - interval '30 days'``). ``verify_round`` scans ``(start, end]``
range by range with the traversal's bounded keyset reads (``core/sql/verify_scan.py``; the round's
``where`` applies too), counts the rows that still match and keeps the first ``max_keys`` of them.

- **verified**: no row of the round matches. This is a statement about the source when the scan
  passed over each key; a row changed after that is the next round's business.
- **failed**: ``matching`` rows still match; ``first_keys`` are the lowest of them (keys only,
  never row data). With ``on_failure="fail"`` the caller (the barrier) fails without closing.
- **repair** (``on_failure="repair"``): the rows that still match go through the round's
  processor once (one *repair pass*, range by range, in chunks of at most ``chunk_size`` keys,
  each chunk's rows read again through the round's ``where``), then the round is verified again;
  ``repaired`` counts the keys the processor reported done. With a target database each repair
  chunk is one transaction on it (``chunk.connection``), committed when the processor returns and
  rolled back when it raises, as a traversal chunk. An item the processor names failed is tried
  again up to ``max_item_attempts`` times in the pass; a ``RetryableError`` (or any other
  exception) ends the pass and propagates, nothing recorded. A repair pass is safe to run again
  (a retried barrier, a crash): it is driven by the predicate, so a key whose repair committed no
  longer matches and is not delivered again; with ``exactly_once`` no key is written twice for
  that reason, provided the processor's effect is what clears the predicate. The repair pass does
  not move cursors or counters: the round's ``done``/``skipped``/``dead`` stay those of its
  traversal, and ``repaired`` says what the pass did.
- The result is recorded in the round's hash (``verification``, JSON: counts and encoded keys,
  never row data) and read back by the one status model (``RoundStatus.verification``). The
  predicate is recorded when the round is planned (``verify``); a caller whose predicate differs
  from the recorded one is refused: the predicate that runs is always the DAG's, Redis's is only
  compared (as ``where`` is, ``KeysetTraversal._check_replay_source``).
- Pace: every scanned or repaired chunk is charged to the stream's governor (``core/pace/``) at the
  stream's ``max_rows_per_second`` when one is set, and a paused stream holds the scan (checked
  between chunks) until it is resumed or ``stop`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..chunk import Chunk, check_result
from ..errors import ConfigurationError, KeysetError
from ..keys import as_tuple, display_key, encode_key
from ..pace.governor import Governor, burst_for
from ..sql.verify_scan import scan_chunks
from .verify_record import (
    DEFAULT_VERIFY_CHUNK,
    DEFAULT_VERIFY_KEYS,
    VERIFICATION_FIELD,
    VERIFY_FIELD,
    OnVerifyFailure,
    Verification,
    VerifyState,
    check_verify_options,
)

if TYPE_CHECKING:
    import sqlalchemy as sa

    from ..sql.source import SqlSource
    from .control import StreamControl

log = logging.getLogger("airflow_keyset_provider")


@dataclass
class _Scan:
    matching: int = 0
    first_keys: list[str] = field(default_factory=list)
    rows: int = 0


class _Pacer:
    """Charges the stream's governor and holds while the stream is paused, between chunks. The
    stream's control (pause, rate) is read at most every ``poll_seconds``, as the traversal's
    pacer polls it (``TraverseOptions.control_poll_seconds``)."""

    def __init__(
        self,
        control: StreamControl,
        stop: threading.Event,
        chunk_size: int,
        poll_seconds: float = 1.0,
    ) -> None:
        self.control, self.stop, self.chunk_size = control, stop, chunk_size
        self.governor = Governor(control.store)
        self.poll_seconds = poll_seconds
        self._state: Any = None
        self._read_at = 0.0

    def _control_state(self) -> Any:
        now = time.monotonic()
        if self._state is None or now - self._read_at >= self.poll_seconds:
            self._state, self._read_at = self.control.control_state(), now
        return self._state

    def __call__(self, rows: int) -> None:
        while self._control_state().paused and not self.stop.is_set():
            self.stop.wait(self.poll_seconds)
        rate = self._control_state().max_rows_per_second
        if rate:
            wait = self.governor.charge(rows, rate, burst_for(rate, self.chunk_size))
            if wait > 0:
                self.stop.wait(wait)


class RoundVerifier:
    """Verifies (and optionally repairs) one round; see the module docstring."""

    def __init__(
        self,
        control: StreamControl,
        source: SqlSource,
        round_id: str,
        predicate: str,
        *,
        max_keys: int = DEFAULT_VERIFY_KEYS,
        chunk_size: int = DEFAULT_VERIFY_CHUNK,
        stop: threading.Event | None = None,
    ) -> None:
        check_verify_options(predicate, OnVerifyFailure.FAIL, max_keys)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigurationError(
                f"verify_chunk_size must be a positive integer, got {chunk_size!r}"
            )
        self.control, self.source, self.round_id = control, source, round_id
        self.predicate, self.max_keys, self.chunk_size = predicate, max_keys, chunk_size
        self.stop = stop or threading.Event()
        self.pace = _Pacer(control, self.stop, chunk_size)
        self.arity = source.arity

    # ---- the checks before anything runs -------------------------------------------------
    def check_round(self) -> dict[str, str]:
        """The round's hash, once the DAG's source and predicate are the recorded ones."""
        info = self.control.store.round_info(self.round_id)
        fingerprint = self.source.fingerprint()
        if info.get("source") != fingerprint:
            raise ConfigurationError(
                f"round {self.round_id} was planned over {info.get('source')}, not {fingerprint}; "
                "verify it with the table, key and where of the DAG that planned it"
            )
        recorded = info.get(VERIFY_FIELD)
        if recorded is not None and recorded != self.predicate:
            raise ConfigurationError(
                f"round {self.round_id} was planned with another verify predicate than this "
                "task's; the predicate that runs is the DAG's, and it must be the round's "
                "(plan a new round to change it)"
            )
        return info

    # ---- scan ------------------------------------------------------------------------------
    def _ranges(self) -> list[tuple[int, str, str]]:
        """The round's ranges ``(id, lo, hi)`` in key order (coalesced empty ones left out)."""
        rnd = self.control.round(self.round_id)
        spans = [(s.range_id, s.lo_encoded, s.hi_encoded) for s in rnd.ranges]
        return sorted((s for s in spans if s[1] < s[2]), key=lambda s: (s[1], s[2]))

    def scan(self) -> tuple[_Scan, float]:
        started = time.monotonic()
        found = _Scan()

        def room() -> int:  # the first keys still wanted
            return self.max_keys - len(found.first_keys)

        for _, lo, hi in self._ranges():
            for chunk in scan_chunks(self.source, self.predicate, lo, hi, self.chunk_size, room):
                found.rows += chunk.rows
                found.matching += chunk.matching
                found.first_keys.extend(chunk.matched)
                self.pace(chunk.rows)
                if self.stop.is_set():
                    raise KeysetError(f"round {self.round_id}: verification stopped on request")
        return found, time.monotonic() - started

    # ---- repair ----------------------------------------------------------------------------
    def repair(
        self,
        processor: Callable[..., Any],
        target: sa.Engine | None = None,
        max_item_attempts: int = 3,
    ) -> tuple[int, int]:
        """One repair pass (module docstring): -> (keys done, keys still failing)."""
        done = failed_total = 0
        for range_id, lo, hi in self._ranges():
            for chunk in scan_chunks(
                self.source, self.predicate, lo, hi, self.chunk_size, lambda: self.chunk_size
            ):
                self.pace(chunk.rows)
                pending = chunk.matched
                for attempt in range(1, max_item_attempts + 1):
                    if not pending:
                        break
                    ok, pending = self._repair_chunk(processor, target, range_id, pending, attempt)
                    done += ok
                failed_total += len(pending)
                if pending:
                    log.warning(
                        "round %s range %d: repair pass: %d key(s) still failing after %d "
                        "attempt(s), first %s",
                        self.round_id,
                        range_id,
                        len(pending),
                        max_item_attempts,
                        display_key(pending[0], self.arity),
                    )
        return done, failed_total

    def _repair_chunk(
        self,
        processor: Callable[..., Any],
        target: sa.Engine | None,
        range_id: int,
        keys: Sequence[str],
        attempt: int,
    ) -> tuple[int, list[str]]:
        """The processor over the rows of ``keys`` (read again through ``where``): -> (done,
        encoded keys it named failed)."""
        rows = self.source.fetch_keys(list(keys))
        if not rows:
            return 0, []
        chunk = Chunk(
            self.round_id,
            range_id,
            self.source.column_names,
            rows,
            self.source.key_of(),
            attempt=attempt,
        )
        where = f"round {self.round_id} range {range_id}'s repair chunk"
        if target is None:
            result = check_result(processor(chunk), where)
        else:
            with target.begin() as conn:
                chunk.connection = conn
                try:
                    result = check_result(processor(chunk), where)
                finally:
                    chunk.connection = None
        if result is None:
            return len(rows), []
        failed = [encode_key(as_tuple(k, self.arity)) for k in result.failed]
        return len(rows) - len(failed) - len(result.skipped), failed

    # ---- the whole step --------------------------------------------------------------------
    def run(
        self,
        on_failure: str = OnVerifyFailure.FAIL,
        processor: Callable[..., Any] | None = None,
        target: sa.Engine | None = None,
        max_item_attempts: int = 3,
    ) -> Verification:
        """Verify (and with ``on_failure="repair"`` repair once and verify again); record and
        return the result. Refuses a source or predicate that is not the round's."""
        check_verify_options(self.predicate, on_failure, self.max_keys)
        if on_failure == OnVerifyFailure.REPAIR and processor is None:
            raise ConfigurationError(
                "on_verify_failure='repair' needs the round's processor (the barrier's processor=)"
            )
        self.check_round()
        found, seconds = self.scan()
        repaired: int | None = None
        repair_failed = 0
        if found.matching and on_failure == OnVerifyFailure.REPAIR:
            assert processor is not None
            log.warning(
                "round %s: %d row(s) still match the verify predicate (first key %s); one "
                "repair pass through the processor",
                self.round_id,
                found.matching,
                display_key(found.first_keys[0], self.arity),
            )
            repaired, repair_failed = self.repair(processor, target, max_item_attempts)
            found, seconds = self.scan()
        result = Verification(
            state=VerifyState.FAILED if found.matching else VerifyState.VERIFIED,
            matching=found.matching,
            first_keys=tuple(found.first_keys),
            repaired=repaired,
            repair_failed=repair_failed,
            rows_scanned=found.rows,
            seconds=seconds,
            checked_ms=self.control.store.server_time_ms(),
            arity=self.arity,
        )
        self.control.store.set_round_field(self.round_id, VERIFICATION_FIELD, result.as_record())
        log.info(
            "round %s: verification %s (%.1f s, %.0f rows/s)",
            self.round_id,
            result.describe(),
            seconds,
            found.rows / seconds if seconds > 0 else 0.0,
        )
        return result


__all__ = [
    "DEFAULT_VERIFY_CHUNK",
    "DEFAULT_VERIFY_KEYS",
    "VERIFICATION_FIELD",
    "VERIFY_FIELD",
    "OnVerifyFailure",
    "RoundVerifier",
    "Verification",
    "VerifyState",
    "check_verify_options",
]
