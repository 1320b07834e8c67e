"""A plan and its first chunk rehearsed without writing anything (``rehearse``).

The bounds are the plan's (``KeysetTraversal.plan``): the round a plan request would get back
unchanged (the stream's open chained round, or the round of this request's ``round_key``), else
``start`` from the watermark (or the durable ``record``'s, or below every key) and ``end`` from
``max(key)`` once every key below it has committed, the same checks refusing what the plan would
refuse. The ranges are cut exactly as the plan cuts them; on a large PostgreSQL table the cuts
come from a random block sample, so the plan's cut keys may differ a little from the preview's
(the round's bounds do not). Each range gets the database's row estimate
(``SqlSource.estimate_rows``: ``EXPLAIN`` on PostgreSQL and MySQL/MariaDB, no row read; an exact
count of the range on SQLite, which has no range estimate). Then the chunk query is explained
(``SqlSource.chunk_plan``), the first ``sample_chunks`` chunks of the first non-empty range are read
and timed, the processor runs on each in a rolled-back target transaction (``trial``), and the ETA follows
(``eta``).

Writes nothing: Redis is only read (``CursorStore.peek``, not ``lookup``; the checkpoint mirror only
read, what the plan would restore from it reported, never restored; no
stream record), the source only read (``EXPLAIN`` without ``ANALYZE``), the target rolled back.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..chunk import Chunk
from ..errors import ConfigurationError
from ..keys import MIN_KEY, decode_user_key, display_key, encode_key, to_json
from ..rounds import stream_key
from ..rounds.durability import round_number
from ..rounds.planner import check_max_ranges, split
from ..sql.source import materialize, release
from ..states import RoundState
from .eta import estimate
from .report import RangeEstimate, RoundPreview, SampleRead
from .trial import try_processor

if TYPE_CHECKING:
    import sqlalchemy as sa

    from ..rounds.durability import StreamRecord
    from ..rounds.mirror import CheckpointMirror
    from ..sql.source import SqlSource
    from ..store.cursor_store import CursorStore


@dataclass(frozen=True)
class PreviewRequest:
    """What the preview rehearses: the plan's arguments (``start``/``end`` encoded, None: the
    plan's defaults), and the traversal's ``processor``, ``chunk_size`` and ``workers``."""

    max_ranges: int = 8
    start: str | None = None
    end: str | None = None
    round_key: str | None = None
    exact_limit: int = 500_000
    sample_rows: int = 50_000
    record: StreamRecord | None = None
    new_stream: bool = False
    processor: Any = None
    chunk_size: int = 1000
    workers: int = 1
    sample_chunks: int = 8
    #: the stream's checkpoint mirror: what the plan would restore from it when Redis lost the
    #: stream (read only; never restored by a preview)
    mirror: CheckpointMirror | None = None


def rehearse(
    source: SqlSource,
    store: CursorStore,
    target: sa.Engine | None,
    req: PreviewRequest,
    budget: float | None,
) -> RoundPreview:
    """The preview of ``req`` (see the module docstring); ``budget`` is the stream's governor
    budget (rows per second, None: none)."""
    check_max_ranges(req.max_ranges)
    if not isinstance(req.chunk_size, int) or req.chunk_size < 1:
        raise ConfigurationError(f"chunk_size must be a positive integer, got {req.chunk_size!r}")
    if not isinstance(req.sample_chunks, int) or req.sample_chunks < 1:
        raise ConfigurationError(
            f"sample_chunks must be a positive integer, got {req.sample_chunks!r}"
        )
    if not isinstance(req.workers, int) or req.workers < 1:
        raise ConfigurationError(f"workers must be a positive integer, got {req.workers!r}")
    store.ping()
    source.validate()
    arity = source.arity
    notes: list[str] = []
    problems: list[str] = []
    chained = req.start is None
    existing = store.peek(req.round_key, chained)
    mirrored = None if existing is not None else _mirrored_round(store, req, chained)
    if mirrored is not None:
        info, docs = mirrored
        existing = info["id"]
        start, end = info["start"], info["end"]
        bounds = [(r["lo"], r["hi"]) for r in docs if r["lo"] != r["hi"]]
        notes.append(
            f"Redis has no state of round {existing} (state {info.get('state')}); the plan "
            "would restore it from the checkpoint mirror and return it unchanged"
        )
    elif existing is not None:
        info = store.round_info(existing)
        start, end = info["start"], info["end"]
        bounds = [(r["lo"], r["hi"]) for r in store.ranges(existing, int(info["n_ranges"]))]
        notes.append(
            f"the plan would return round {existing} unchanged (state {info.get('state')}): "
            "the stream's open round, or the round of this request; the estimates cover its "
            "whole key range, not only what is left of it"
        )
    else:
        stream_key.check(store, None, stream_key.fingerprint(source.key_names, source.key_kinds))
        start = _start(store, req, notes, problems)
        end = _end(source, start, req.end, arity)
        cuts = (
            source.quantile_keys(start, end, req.max_ranges, req.exact_limit, req.sample_rows)
            if req.max_ranges > 1 and end != start
            else []
        )
        bounds = split(start, end, cuts, req.max_ranges)
    ranges = [
        RangeEstimate(
            i,
            to_json(decode_user_key(lo, arity)),
            to_json(decode_user_key(hi, arity)),
            source.estimate_rows(lo, hi) if lo != hi else 0,
        )
        for i, (lo, hi) in enumerate(bounds)
    ]
    plan: dict[str, Any] | None = None
    sample: SampleRead | None = None
    chunks: list[Chunk] = []
    target_range = next((i for i, r in enumerate(ranges) if r.estimated_rows > 0), 0)
    if bounds:
        lo, hi = bounds[target_range]
        scan = source.chunk_plan(lo, hi, req.chunk_size)
        plan = scan.as_dict()
        if scan.problem:
            problems.append(scan.problem)
        sample, chunks = _read_sample(
            source, target_range, lo, hi, req.chunk_size, req.sample_chunks
        )
    trial = try_processor(req.processor, chunks, target)
    if trial.raised:
        problems.append(
            f"the processor raised on the sample ({trial.raised}): the round would retry the "
            "chunk, and fail the task when the retry budget is spent"
        )
    if trial.failed:
        problems.append(
            f"the processor failed {trial.failed} of the sample's {trial.keys} key(s); they "
            "would be retried, then dead-lettered"
        )
    redis_seconds = _redis_round_trip(store)
    total = sum(r.estimated_rows for r in ranges)
    eta = estimate(total, sample, trial, redis_seconds, len(ranges), req.workers, budget)
    return RoundPreview(
        stream=store.stream,
        table=source.qualified_name,
        key=list(source.key_names),
        start_key=to_json(decode_user_key(start, arity)),
        end_key=to_json(decode_user_key(end, arity)),
        existing_round=existing,
        ranges=ranges,
        row_estimate=source.row_estimate,
        chunk_size=req.chunk_size,
        chunk_plan=plan,
        sample=sample,
        processor=trial,
        eta=eta,
        problems=problems,
        notes=notes,
        previewed_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )


def _start(store: CursorStore, req: PreviewRequest, notes: list[str], problems: list[str]) -> str:
    """The plan's ``start``: the explicit one, else the watermark (Redis's, else the record's),
    else below every key; a stream the plan would refuse is named as a problem."""
    if req.start is not None:
        return req.start
    watermark = store.watermark()
    mirrored = _mirrored_watermark(store, req)
    if mirrored is not None and (watermark is None or mirrored > watermark):
        notes.append(
            f"Redis's watermark of stream {store.stream} is "
            f"{'missing' if watermark is None else 'behind'}; the plan would move it to the "
            "checkpoint mirror's"
        )
        return mirrored
    if watermark is not None:
        return watermark
    record = req.record
    if not store.has_state():
        if record is not None and record.watermark is not None:
            notes.append(
                f"Redis has no state of stream {store.stream}; the plan would restore its "
                f"watermark from the {record.source}"
            )
            return record.watermark
        if not req.new_stream and (record is None or not record.empty):
            problems.append(
                f"Redis has no state of stream {store.stream} and nothing says it is new: the "
                "plan would restore it from its checkpoint mirror or refuse it "
                "(StreamStateLostError); a new stream's first plan needs new_stream=True"
            )
        notes.append("a new stream: its first round starts below every key")
    return MIN_KEY


def _end(source: SqlSource, start: str, end: str | None, arity: int) -> str:
    """The plan's ``end``: ``max(key)`` once every key below it has committed, or the explicit
    one after the same wait."""
    if end is None:
        top = source.upper_bound()
        end = start if top is None or top < start else top
    else:
        source.wait_for_commit_order()
    if end < start:
        raise ConfigurationError(
            f"start_key {display_key(start, arity)} is above end_key "
            f"{display_key(end, arity)}: a round is start < key <= end"
        )
    return end


def _read_sample(
    source: SqlSource, range_id: int, lo: str, hi: str, n: int, chunks: int
) -> tuple[SampleRead, list[Chunk]]:
    """Up to ``chunks`` successive chunks from the start of ``(lo, hi]``, each read as a
    traversal reads it and timed (the connection is opened and the statement compiled by a
    one-row read first, as a running traversal has them already)."""
    release(source.fetch(lo, hi, 1))
    arity = source.arity
    out: list[Chunk] = []
    seconds, rows_read, cursor = 0.0, 0, lo
    first = last = None
    for _ in range(chunks):
        if cursor >= hi:
            break
        started = time.monotonic()
        fetched = source.fetch(cursor, hi, n)
        rows = materialize(fetched)
        seconds += time.monotonic() - started
        release(fetched)
        if not rows:
            break
        out.append(Chunk("preview", range_id, source.column_names, rows, source.key_of()))
        rows_read += len(rows)
        cursor = encode_key(tuple(rows[-1][:arity]))
        if first is None:
            first = to_json(decode_user_key(encode_key(tuple(rows[0][:arity])), arity))
        last = to_json(decode_user_key(cursor, arity))
        if len(rows) < n:
            break
    return SampleRead(range_id, rows_read, seconds, first, last, len(out)), out


def _redis_round_trip(store: CursorStore) -> float:
    """Seconds of one Redis round trip (the median of five ``PING``s): a chunk's advance."""
    times = []
    for _ in range(5):
        started = time.monotonic()
        store.ping()
        times.append(time.monotonic() - started)
    return sorted(times)[2]


def _mirrored_round(
    store: CursorStore, req: PreviewRequest, chained: bool
) -> tuple[dict[str, str], list[dict[str, Any]]] | None:
    """The round the plan would restore from the checkpoint mirror and return (Redis lost it):
    the round of this request's key, or the stream's open chained round; read only."""
    mirror = req.mirror
    if mirror is None or not mirror.exists():
        return None

    def wanted(info: dict[str, str]) -> bool:
        if req.round_key and info.get("round_key") == req.round_key:
            return True
        return chained and info.get("chained") == "1" and info.get("state") != RoundState.CLOSED

    candidates = sorted(
        (i for i in mirror.rounds(store.stream) if wanted(i)), key=lambda i: -round_number(i["id"])
    )  # Redis is asked only about these (the mirror holds every round the stream ever had)
    found = next((i for i in candidates if store.round_state(i["id"]) is None), None)
    if (
        found is None
    ):  # none, or Redis has it: the plan's lookup would have found it by its pointers
        return None
    return mirror.load_round(store.stream, found["id"])


def _mirrored_watermark(store: CursorStore, req: PreviewRequest) -> str | None:
    """The checkpoint mirror's watermark (the plan moves Redis's forward to it); read only."""
    mirror = req.mirror
    if mirror is None or not mirror.exists():
        return None
    return mirror.load_watermark(store.stream)
