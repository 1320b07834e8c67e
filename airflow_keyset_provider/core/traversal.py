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

import logging
import threading
from collections.abc import Sequence
from typing import Any

import redis
import sqlalchemy as sa

from .chunk import Processor, as_processor, load_processor
from .errors import ConfigurationError, KeysetError, ReplayFailedError
from .keys import MIN_KEY, KeyEncodingError, coerce_bound, decode_user_key, display_key, encode_key
from .metrics import Metrics, NullMetrics
from .options import DEFAULT_CHUNK_BYTES, TraverseOptions, call_options
from .pace.stream_control import ControlState, probe_timeout
from .preview.rehearsal import PreviewRequest, rehearse
from .preview.report import RoundPreview
from .rounds import stream_key
from .rounds.control import RangeSpec, Round, RoundTotals, StreamControl
from .rounds.durability import StreamRecord, rebases, settle_stream
from .rounds.mirror import CheckpointMirror
from .rounds.planner import check_max_ranges, split
from .rounds.status import RangeStatus, RoundState
from .rounds.verification import (
    DEFAULT_VERIFY_CHUNK,
    DEFAULT_VERIFY_KEYS,
    VERIFY_FIELD,
    OnVerifyFailure,
    RoundVerifier,
    Verification,
    check_verify_options,
)
from .run.context import RunContext
from .run.pull import PullLoop, RoundPullResult
from .run.state import ProgressCallback, ProgressHook, RangeResult
from .run.traverse import run_restoring
from .sql.ledger import LEDGER_TABLE
from .sql.naming import ConnectionName, name_connections
from .sql.source import SqlSource
from .sql.target import make_target_engine
from .store.cursor_store import CursorStore, connect_redis

log = logging.getLogger("airflow_keyset_provider")


class KeysetTraversal:
    """Plan, traverse and close rounds of one stream over one table.

    ``source_url`` is a SQLAlchemy URL (or Engine) of PostgreSQL or SQLite; ``key`` a column name
    or a list of them; ``stream`` names the sequence of rounds that chain by watermark (all its
    Redis keys share the hash tag ``{stream}``). Nothing is read or written until a method runs.
    ``target_url`` (a URL or Engine of the database the processor writes to) gives every processor
    call a transaction of its own as ``chunk.connection``, committed when the processor returns
    and rolled back when it raises. With ``exactly_once=True`` (a traverse option) each chunk's
    key interval in the round's ledger (``ledger_table`` on the target) commits with those writes (``core/run/ledger.py``).
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
        target_url: Any = None,
        ledger_table: str = LEDGER_TABLE,
        metrics: Metrics | None = None,
        retention_sql: str | None = None,
        where_params: dict[str, Any] | None = None,
        allow_unverified_eviction_policy: bool = False,
    ) -> None:
        if redis_client is None:
            if not redis_url:
                raise ConfigurationError(
                    "give redis_url (e.g. 'redis://127.0.0.1:6379/0') or redis_client"
                )
            redis_client = connect_redis(redis_url)
        name = ConnectionName(stream)  # what every connection of this traversal is called
        self.source = SqlSource(
            source_url,
            table,
            key,
            where=where,
            where_params=where_params,
            columns=columns,
            settle_seconds=settle_seconds,
            commit_wait_timeout=commit_wait_timeout,
            retention_sql=retention_sql,
            connection_name=name,
        )
        self.store = CursorStore(
            redis_client,
            stream,
            prefix=key_prefix,
            allow_unverified_eviction_policy=allow_unverified_eviction_policy,
        )
        self.mirror = CheckpointMirror(checkpoint_url) if checkpoint_url is not None else None
        if self.mirror is not None and not isinstance(checkpoint_url, sa.Engine):
            name_connections(self.mirror.engine, name)
        self.checkpoint_seconds = checkpoint_seconds
        self._target_url = target_url
        self.target = make_target_engine(target_url, name) if target_url is not None else None
        self.ledger_table = ledger_table  # exactly_once's table on the target
        self.metrics: Metrics = metrics or NullMetrics()
        self.tags = {"stream": stream}
        self.control = StreamControl(self.store, self.mirror)
        self.stream = stream
        self.arity = self.source.arity
        self._stop = threading.Event()

    # ---- keys --------------------------------------------------------------------------------
    def _encode_user_key(self, name: str, key: Any) -> str:
        try:
            return encode_key(coerce_bound(name, key, self.source.key_kinds))
        except KeyEncodingError as exc:
            raise ConfigurationError(f"{name}: {exc}") from exc

    def decode(self, encoded: str) -> Any:
        """Encoded key -> user value (scalar or tuple); ``None`` for the open lower bound."""
        return decode_user_key(encoded, self.arity)

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
        new_stream: bool = False,
        record: StreamRecord | None = None,
        verify: str | None = None,
    ) -> Round:
        """Fix a round ``start < key <= end`` and split it into at most ``max_ranges`` ranges.

        ``start_key`` None continues the stream: the round starts at the watermark (or below every
        key) and is the stream's *chained* round; while it is open, planning again returns it
        unchanged. ``end_key`` None takes ``max(key)`` at plan time, once every key below it has
        committed (PostgreSQL). ``round_key`` (e.g. an Airflow run id) makes the call idempotent:
        the same key always returns the same round, open or closed. Validation happens before
        anything is written; a refused plan writes nothing. A stream whose key columns or their
        types changed since its watermark was written is refused (``core/rounds/stream_key.py``).

        Durable by default (``core/rounds/durability.py``): a chained plan of a stream that Redis
        has no state of is restored (from the checkpoint mirror, or from ``record``: what a
        durable store outside Redis, such as Airflow's asset state, knows of the stream) or
        refused with ``StreamStateLostError`` naming the choices, never started again below every
        key without a word. ``new_stream=True`` says the stream is new: with no state in Redis
        its first round starts below every key (logged as a new stream). A record that saw
        nothing of the stream makes it new too; without a mirror or a record, the first plan of
        a stream needs ``new_stream=True``.

        ``verify`` (an SQL predicate no row of the round should match once it is processed) is
        recorded with the round when it is created, for ``verify_round`` to compare with
        (``core/rounds/verification.py``); it is never run from the record.
        """
        check_max_ranges(max_ranges)
        check_verify_options(verify)
        self.store.ping()
        self.store.check_eviction_policy()
        self.source.validate()
        self.control.recover_stream()
        chained = start_key is None
        rebase = rebases(self.store, record, chained=chained, new_stream=new_stream)
        settle_stream(
            self.store,
            record,
            chained=chained,
            new_stream=new_stream,
            arity=self.arity,
            mirrored=self.mirror is not None,
            answered=self.store.lookup(round_key, chained) is not None,
        )
        key = stream_key.fingerprint(self.source.key_names, self.source.key_kinds)
        stream_key.check(self.store, self.mirror, key)  # a foreign watermark never plans a round
        existing = self.store.lookup(round_key, chained)
        if existing is not None:
            log.info(
                "stream %s: round %s already planned for this request; returning it unchanged",
                self.stream,
                existing,
            )
            return self.round(existing)
        start, end = self._round_bounds(start_key, end_key)
        bounds = self._range_bounds(start, end, max_ranges, exact_limit, sample_rows)
        stream_key.record(self.store, self.mirror, key)
        round_id, created = self.store.create_round(
            idempotency_key=round_key,
            chained=chained,
            start=start,
            end=end,
            source=self.source.fingerprint(),
            arity=self.arity,
            bounds=bounds,
            rebase=rebase,
        )
        if created and verify is not None:
            self.store.set_round_field(round_id, VERIFY_FIELD, verify)
        if created and start == MIN_KEY and bounds:
            floor = self.source.lowest_key()  # progress of a range from -inf: status only
            if floor is not None:
                self.store.set_round_field(round_id, "floor", floor)
        rnd = self.round(round_id)
        if created:
            self.control._mirror_round(round_id)
            log.info(
                "stream %s: planned round %s (%s, %s] in %d ranges",
                self.stream,
                round_id,
                display_key(start, self.arity),
                display_key(end, self.arity),
                len(bounds),
            )
        return Round(**{**rnd.__dict__, "created": created})

    def _round_bounds(self, start_key: Any, end_key: Any) -> tuple[str, str]:
        """The encoded ``(start, end]`` of a new round: ``start`` defaults to the watermark,
        ``end`` to ``max(key)`` once every key below it has committed."""
        if start_key is None:
            start = self.store.watermark() or MIN_KEY
        else:
            start = self._encode_user_key("start_key", start_key)
        if end_key is None:
            top = self.source.upper_bound()
            end = start if top is None or top < start else top
        else:
            end = self._encode_user_key("end_key", end_key)
            # keys below an explicit end may still be in flight, exactly as below max(key)
            self.source.wait_for_commit_order()
        if end < start:
            raise ConfigurationError(
                f"start_key {display_key(start, self.arity)} is above end_key "
                f"{display_key(end, self.arity)}: a round is start < key <= end"
            )
        return start, end

    def _range_bounds(
        self, start: str, end: str, max_ranges: int, exact_limit: int, sample_rows: int
    ) -> list[tuple[str, str]]:
        """The new round's ranges: ``(start, end]`` cut at row-count quantiles of the source (one
        range when ``max_ranges`` is 1 or the round is empty)."""
        cuts = (
            self.source.quantile_keys(start, end, max_ranges, exact_limit, sample_rows)
            if max_ranges > 1 and end != start
            else []
        )
        return split(start, end, cuts, max_ranges)

    # ---- preview -----------------------------------------------------------------------------
    def preview(
        self,
        max_ranges: int = 8,
        start_key: Any = None,
        end_key: Any = None,
        *,
        processor: Processor | None = None,
        chunk_size: int = 1000,
        workers: int = 1,
        sample_chunks: int = 8,
        round_key: str | None = None,
        exact_limit: int = 500_000,
        sample_rows: int = 50_000,
        new_stream: bool = False,
        record: StreamRecord | None = None,
    ) -> RoundPreview:
        """What ``plan`` (same arguments) and a traversal with ``processor`` and ``chunk_size``
        would do, without writing anything (``core/preview/``).

        Returns the bounds the plan would fix (or the round it would return unchanged), its
        ranges with the database's row estimates, the chunk query's plan (an index range scan
        confirmed; a full scan is listed in ``problems``), the first ``sample_chunks`` chunks read
        and timed, the processor's verdict on them (applied / not applied / failed with reasons) in a target
        transaction that is rolled back (the processor runs only with ``target_url``), and the
        round's ETA with ``workers`` tasks under the stream's governor budget. Refuses what the
        plan would refuse (the key, the bounds). Nothing is written to the source, the target or
        Redis: what the processor writes through ``chunk.connection`` is rolled back; a write it
        makes elsewhere (another connection, another system) is not, so preview a processor
        that writes only through ``chunk.connection``.
        """
        if start_key is not None or end_key is not None:
            self.source.ensure_validated()  # the key columns' types, to read the bounds
        start = None if start_key is None else self._encode_user_key("start_key", start_key)
        end = None if end_key is None else self._encode_user_key("end_key", end_key)
        request = PreviewRequest(
            max_ranges=max_ranges,
            start=start,
            end=end,
            round_key=round_key,
            exact_limit=exact_limit,
            sample_rows=sample_rows,
            record=record,
            new_stream=new_stream,
            processor=None if processor is None else as_processor(processor),
            chunk_size=chunk_size,
            workers=workers,
            sample_chunks=sample_chunks,
            mirror=self.mirror,
        )
        budget = self.control.control_state().max_rows_per_second
        return rehearse(self.source, self.store, self.target, request, budget)

    def round(self, round_id: str) -> Round:
        return self.control.round(round_id)

    def watermark(self) -> Any:
        """The end of the stream's contiguous completed prefix (None before the first round)."""
        return self.control.watermark()

    def range_status(self, round_id: str) -> list[RangeStatus]:
        return self.control.range_status(round_id)

    def retention_floor(self) -> Any:
        """Keys ``<=`` this value may be deleted from the source without harming any round."""
        return self.control.retention_floor()

    # ---- pause, resume, throttle ---------------------------------------------------------------
    def pause(self, reason: str = "", by: str = "") -> ControlState:
        """Pause the stream: every running ``traverse`` of it (any worker) commits the chunk in
        hand, releases its lease and returns ``paused=True`` within ``control_poll_seconds``."""
        return self.control.pause(reason, by)

    def resume(self) -> bool:
        """Lift a pause (True if the stream was paused); traversals continue from the cursors."""
        return self.control.resume()

    def throttle(self, max_rows_per_second: float | None) -> ControlState:
        """Share a rows-per-second budget between every task of the stream (None: no limit)."""
        return self.control.throttle(max_rows_per_second)

    # ---- traversal ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask the running ``traverse`` call to finish the chunk in hand, commit it, and return.
        The request applies to the call in progress (or the next one, if none is running)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """``request_stop`` was called and the call it applies to has not returned yet."""
        return self._stop.is_set()

    def traverse(
        self,
        round_id: str,
        range_id: int,
        processor: Processor,
        chunk_size: int = 1000,
        lease_seconds: float = 60,
        max_chunk_attempts: int | None = None,
        max_item_attempts: int = 3,
        *,
        retry_budget_seconds: float = 90.0,
        owner_lineage: str = "",
        claim_timeout: float | None = None,
        chunk_timeout: float | None = None,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        item_retry_delay: float = 0.5,
        outage_failure_ratio: float = 0.5,
        prefetch: bool = True,
        log_every_seconds: float = 30.0,
        dead_cap: int = 1000,
        group_commit_chunks: int = 1,
        group_commit_seconds: float | None = None,
        exactly_once: bool = False,
        options: TraverseOptions | None = None,
        on_progress: ProgressCallback | None = None,
        progress_every_seconds: float = 5.0,
        max_chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    ) -> RangeResult:
        """Process every key of one range at least once, resuming from its committed cursor.

        Waits while another live owner holds the range (up to ``claim_timeout``, default three
        leases), then takes over. ``owner_lineage`` names the logical worker (an Airflow task
        instance): a new attempt of the same lineage takes over at once, fencing the old one.
        Returns the range's cumulative counters. Raises ``DependencyFailedError`` after
        ``retry_budget_seconds`` (90 s) of consecutive failures of one chunk, or
        ``max_chunk_attempts`` of them when set (cursor unchanged),
        ``LeaseLostError`` when another worker took the range (or a processor call ran past
        ``chunk_timeout``, so this try gave the range up), ``RoundStateLostError`` when Redis
        lost the round. ``request_stop`` ends every wait (backoff, retry passes) at once: the call
        commits what it processed and returns with ``stopped=True``.

        The settings are ``TraverseOptions``' fields (documented there), given as keywords or as
        one ``options`` object (then leave the keywords at their defaults). Group commit
        (``group_commit_chunks`` > 1 and/or ``group_commit_seconds``) commits the cursor once per
        group of chunks; the replay bound after a crash widens from one chunk to one group.
        """
        settings = call_options(locals(), options)  # the keywords above, or options=
        processor = as_processor(processor)
        if not isinstance(progress_every_seconds, (int, float)) or progress_every_seconds < 0:
            raise ConfigurationError(
                "progress_every_seconds must be a non-negative number, "
                f"got {progress_every_seconds!r}"
            )
        self.source.ensure_validated()
        ctx = self._context(ProgressHook(on_progress, progress_every_seconds), settings)
        try:
            return run_restoring(ctx, round_id, range_id, processor, settings)
        finally:
            self._stop.clear()  # a stop request ends this call, not the traversal object

    def traverse_round(
        self,
        round_id: str,
        processor: Processor,
        *,
        options: TraverseOptions | None = None,
        first_range: int | None = None,
        split: bool = True,
        tasks: int | None = None,
    ) -> RoundPullResult:
        """Pull mode: work through the round's ranges until nothing is left for this call.

        Resumes the ranges ``options.owner_lineage`` holds or last held, then ``first_range``,
        then claims unclaimed ranges one after the other, then rescues ranges with no live owner,
        then (``split``) asks the running range with the most work left to split at its next
        chunk boundary and claims the new range (``core/run/pull.py``). Each range is claimed and
        committed exactly as by ``traverse`` (fenced; a held range is skipped, not waited for).
        ``tasks``: how many tasks share the round (the plan's ``workers``); with it, a claim
        coalesces fresh ranges that follow into the claimed one, a share of the round at a time,
        so many small ranges cost about what few large ones do (``core/run/pull.py``).
        Returns with ``finished`` when nothing is left to claim, rescue or split, or early with
        ``yielded`` (``"budget"`` after ``options.max_task_seconds``, or the pacer's reasons)
        or ``stopped``; raises what ``traverse`` raises for the range in hand.
        """
        processor = as_processor(processor)
        self.source.ensure_validated()
        o = options or TraverseOptions()
        loop = PullLoop(self._context(None, o), round_id, processor, o, first_range, split, tasks)
        try:
            return loop.run()
        finally:
            self._stop.clear()  # a stop request ends this call, not the traversal object

    def _context(
        self, progress: ProgressHook | None = None, options: TraverseOptions | None = None
    ) -> RunContext:
        """What one call's runs need (``core/run/context.py``): built per call, so the stop signal
        and the progress hook are this call's, and the mirror's statements are bounded by this
        call's ``chunk_timeout`` and lease (``probe_timeout``)."""
        mirror = self.mirror
        if mirror is not None and options is not None:
            mirror = mirror.bounded(probe_timeout(options))
        return RunContext(
            source=self.source,
            store=self.store,
            control=self.control,
            mirror=mirror,
            metrics=self.metrics,
            stop=self._stop,
            progress=progress or ProgressHook(),
            checkpoint_seconds=self.checkpoint_seconds,
            target=self.target,
            ledger_table=self.ledger_table,
        )

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
        again. The cursor is not moved. Every letter is kept, so every one can be replayed.

        The round must have been planned over this traversal's source (table, key, ``where``,
        ``where_params``): checked before anything moves, so Redis never decides which rows are
        read. A range whose retries an earlier replay left pending (that process died) is
        traversed too. A replay that fails puts the letters it moved and that did not reach a
        terminal state back in the dead letters, as they were, and raises ``ReplayFailedError``
        (saying how many went back) from the cause.
        """
        processor = as_processor(processor)
        info = self.store.round_info(round_id)
        self._check_replay_source(round_id, info)
        ids = range(int(info["n_ranges"])) if range_id is None else [range_id]
        pending = {  # retries an earlier replay left: only they are left of the range
            int(r["range_id"])
            for r in self.store.ranges(round_id)
            if int(r["retries"]) and r.get("cursor", r.get("hi")) == r.get("hi")
        }
        results = []
        for i in ids:
            moved, letters = self.store.take_dead(round_id, i, limit)  # LeaseHeldError if held
            if not moved and i not in pending:
                continue
            log.info("round %s range %d: replaying %d dead letter(s)", round_id, i, moved)
            try:
                results.append(self.traverse(round_id, i, processor, **traverse_kwargs))
            except Exception as exc:
                raise self._replay_failed(round_id, i, letters, moved, exc) from exc
        if info["state"] == RoundState.CLOSED and results:
            self.store.refresh_totals(round_id)
        return results

    def _check_replay_source(self, round_id: str, info: dict[str, str]) -> None:
        """Refuse, before any letter moves, a source that is not the round's (``traverse``
        checks too, but only after the letters went back to the retry set)."""
        fingerprint = self.source.fingerprint()
        if info.get("source") != fingerprint:
            raise ConfigurationError(
                f"round {round_id} was planned over {info.get('source')}, not {fingerprint}; "
                "replay it with the table, key and where of the DAG that planned it"
            )

    def _replay_failed(
        self, round_id: str, range_id: int, letters: list[str], moved: int, exc: Exception
    ) -> ReplayFailedError:
        """Put back what a failed replay of one range moved; the error that says so."""
        try:
            back = self.store.restore_dead(round_id, range_id, letters)
            where = f"{back} of the {moved} letter(s) it moved are dead letters again, as they were"
        except KeysetError as restore_exc:
            where = (
                f"its {moved} letter(s) stay in the range's retry set ({restore_exc}); the next "
                "traverse or replay of the range processes them"
            )
        if moved and not letters:
            where = "its letters stay in the range's retry set; the next replay processes them"
        state = self.store.round_info(round_id)["state"]
        if state == RoundState.CLOSED:
            self.store.refresh_totals(round_id)
        log.error("round %s range %d: the replay failed; %s", round_id, range_id, where)
        return ReplayFailedError(
            f"round {round_id} range {range_id}: the replay failed ({type(exc).__name__}: {exc}); "
            f"{where}. Fix the cause and run the replay again."
        )

    def verify_round(
        self,
        round_id: str,
        predicate: str,
        *,
        on_failure: str = OnVerifyFailure.FAIL,
        processor: Processor | None = None,
        max_keys: int = DEFAULT_VERIFY_KEYS,
        chunk_size: int = DEFAULT_VERIFY_CHUNK,
        max_item_attempts: int = 3,
    ) -> Verification:
        """Verify a round whose ranges are complete, before it closes: count the rows of
        ``(start, end]`` (and ``where``) that still match ``predicate``, keep the first
        ``max_keys`` keys; with ``on_failure="repair"`` send the matching rows through
        ``processor`` once (in the target's transaction, as a traversal chunk) and verify again.
        The result is recorded in the round (the status model's ``verification``) and returned;
        a ``failed`` result leaves deciding to the caller (the barrier fails without closing).
        Refused (``ConfigurationError``) when the source or predicate is not the round's, and
        while a range is not complete (``core/rounds/verification.py``)."""
        check = self.control.check_round(round_id)
        if not check.complete:
            raise ConfigurationError(
                f"round {round_id} has {len(check.lagging)} range(s) not complete; verify it "
                "once every range is complete (the barrier does)"
            )
        verifier = RoundVerifier(
            self.control,
            self.source,
            round_id,
            predicate,
            max_keys=max_keys,
            chunk_size=chunk_size,
            stop=self._stop,
        )
        try:
            return verifier.run(
                on_failure,
                None if processor is None else as_processor(processor),
                self.target,
                max_item_attempts,
            )
        finally:
            self._stop.clear()

    def close_round(self, round_id: str) -> RoundTotals:
        return self.control.close_round(round_id)

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        return self.control.dead_letters(round_id, range_id, limit)

    def close(self) -> None:
        self.source.close()
        if self.target is not None and not isinstance(self._target_url, sa.Engine):
            self.target.dispose()  # ours: made from a URL (a caller's Engine stays the caller's)


__all__ = [
    "KeysetTraversal",
    "ProgressCallback",
    "ProgressHook",
    "RangeResult",
    "RangeSpec",
    "Round",
    "RoundPreview",
    "RoundPullResult",
    "RoundTotals",
    "StreamRecord",
    "TraverseOptions",
    "load_processor",
]
