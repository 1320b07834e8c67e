"""``PlanRangesOperator`` and ``TraverseRangeOperator``: thin Airflow adapters over ``KeysetTraversal``.

A round is planned once per DAG run and plan task, then every range becomes one mapped task::

    plan = PlanRangesOperator(task_id="plan", source_conn_id="events_db", table="im_events", key="seq")
    traverse = TraverseRangeOperator.partial(
        task_id="traverse", processor=redispatch, retries=3,
    ).expand_kwargs(plan.output)
    barrier = BarrierSensor(task_id="barrier", plan_task_id="plan")
    plan >> traverse >> barrier

Guarantees (on top of the engine's, see ``airflow_keyset_provider.core.traversal``):

- Retrying or clearing the plan task returns the same round with the same ranges: the round is
  keyed by ``<dag_id>/<run_id>/<task_id>``.
- Every try of a mapped range resumes from the range's committed cursor in Redis. The owner
  lineage ``<dag_id>/<run_id>/<task_id>/<map_index>`` lets a new try take the range over at once
  and fences the previous try, so at most one chunk is delivered again.
- A try succeeds only if its range is complete; a stopped or failed traversal fails the try, so
  Airflow's retry continues it. Configuration errors (bad key, missing or wrong connection, bad
  argument) and a lost round fail the task at once, without retries, with the engine's message.
- The Airflow pool slot is taken before the task runs, so ``pool=`` bounds how many ranges are
  claimed at the same time.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any

from airflow.sdk import BaseOperator, Context, conf
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_keyset_provider.core import (
    ConfigurationError,
    KeysetTraversal,
    ProcessorContractError,
    RetentionError,
    RoundStateLostError,
    load_processor,
)
from airflow_keyset_provider.core.keys import to_json
from airflow_keyset_provider.core.planner import MAX_MAP_LENGTH
from airflow_keyset_provider.hooks.keyset import KeysetHook

#: Context variable set by ``TraverseRangeOperator.execute``; the default ``map_index_template``
#: renders it, e.g. ``range 3 (1000, 2000]``.
RANGE_LABEL_CONTEXT_KEY = "keyset_range_label"
DEFAULT_MAP_INDEX_TEMPLATE = "{{ " + RANGE_LABEL_CONTEXT_KEY + " }}"
#: XCom key under which ``PlanRangesOperator`` pushes the round's id (the return value holds the
#: ranges) and, under ``ROUND_XCOM_KEY``, where to find the round (stream, key prefix, bounds).
ROUND_ID_XCOM_KEY = "round_id"
ROUND_XCOM_KEY = "keyset_round"

_INT_RE = re.compile(r"^[+-]?\d+$")


@contextlib.contextmanager
def airflow_errors() -> Iterator[None]:
    """Turn engine errors that no retry can fix into ``AirflowFailException`` (fail now, no
    retries); everything else propagates and is retried by Airflow as usual."""
    try:
        yield
    except (ConfigurationError, ProcessorContractError, RoundStateLostError, RetentionError) as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc



def key_label(value: Any) -> str:
    """``None`` -> ``-inf``, ``[a, b]`` -> ``(a, b)``, else ``str``; matches the engine's labels."""
    if value is None:
        return "-inf"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(str(to_json(v)) for v in value) + ")"
    return str(to_json(value))


def _parse_bound(value: Any) -> Any:
    """A rendered ``start_key``/``end_key``: native values pass through; a string that is JSON
    (``"[\\"2024-01-01T00:00:00+00:00\\", 0]"``, ``"1000"``) is decoded; ``""``/``"None"`` mean None.
    Other strings (ISO timestamps, text keys) are passed on for the engine to check."""
    if not isinstance(value, str):
        return list(value) if isinstance(value, tuple) else value
    text = value.strip()
    if text in ("", "None", "null"):
        return None
    if text[0] in "[\"":
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(f"bound {value!r} looks like JSON but does not parse: {exc}") from exc
    return value


def _coerce_bound(t: KeysetTraversal, name: str, value: Any) -> Any:
    """Rendered templates are strings: turn ``"1000"`` into ``1000`` for integer key columns and
    ``"1.5"`` into ``Decimal`` for numeric ones. Other types are checked by the engine."""
    value = _parse_bound(value)
    if value is None:
        return None
    parts = list(value) if isinstance(value, list) else [value]
    if len(parts) != t.arity:
        raise ConfigurationError(
            f"{name}={value!r} has {len(parts)} part(s); the key {t.source.key_names} has {t.arity}"
        )
    kinds = t.source.key_kinds
    out = []
    for part, kind in zip(parts, kinds, strict=True):
        if isinstance(part, str) and kind == "int" and _INT_RE.match(part.strip()):
            part = int(part)
        elif isinstance(part, (str, int)) and not isinstance(part, bool) and kind == "decimal":
            try:
                part = Decimal(str(part).strip())
            except ArithmeticError as exc:
                raise ConfigurationError(f"{name}: {part!r} is not a number") from exc
        out.append(part)
    return tuple(out) if t.arity > 1 else out[0]


def _max_map_length() -> int:
    return min(conf.getint("core", "max_map_length", fallback=MAX_MAP_LENGTH), MAX_MAP_LENGTH)


def _check_max_ranges(max_ranges: Any) -> None:
    limit = _max_map_length()
    if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or not 1 <= max_ranges <= limit:
        raise ConfigurationError(
            f"max_ranges must be an integer from 1 to {limit} (Airflow's [core] max_map_length "
            f"caps how many mapped tasks one task may expand to), got {max_ranges!r}"
        )


def _run_key(context: Context) -> str:
    ti = context["ti"]
    suffix = f"/{ti.map_index}" if getattr(ti, "map_index", -1) not in (-1, None) else ""
    return f"{ti.dag_id}/{ti.run_id}/{ti.task_id}{suffix}"


class PlanRangesOperator(BaseOperator):
    """Fix a round ``start < key <= end`` of ``table`` and split it into at most ``max_ranges``.

    Returns one dict per range, ready for ``TraverseRangeOperator.partial(...).expand_kwargs``:
    ``round_id``, ``range_id``, ``lo``, ``hi`` (JSON renderings of the bounds, for display) and the
    source description (``source_conn_id``, ``table``, ``key``, ``stream``, ``where``, ``columns``,
    ``key_prefix``), so the mapped task needs only the processor and its tuning in ``partial()``.
    Pushes the round id under XCom key ``round_id`` (and ``keyset_round``: stream, key prefix,
    bounds) for ``BarrierSensor``.

    ``start_key`` None continues the stream at its watermark (rounds chain night after night;
    while the stream's chained round is still open, this returns that round so it gets finished
    first). ``end_key`` None takes the largest key at plan time, once every smaller key has
    committed. Bounds may be templates: a rendered string is decoded as JSON when it looks like
    JSON (``[..]`` for composite keys), integer strings become integers for integer keys, and ISO
    8601 strings are accepted for timestamp and date columns. With
    ``render_template_as_native_obj=True`` native values (lists, datetimes) pass through.

    Running the task again for the same DAG run (retry, clear) returns the same round, unchanged.
    """

    template_fields: Sequence[str] = ("table", "key", "where", "columns", "start_key", "end_key", "stream")
    ui_color = "#d8e6f3"

    def __init__(
        self,
        *,
        source_conn_id: str,
        table: str,
        key: str | Sequence[str],
        redis_conn_id: str = "redis_default",
        stream: str | None = None,
        where: str | None = None,
        columns: Sequence[str] | None = None,
        start_key: Any = None,
        end_key: Any = None,
        max_ranges: int = 16,
        key_prefix: str = "ks",
        commit_wait_timeout: float = 60.0,
        settle_seconds: float = 0.0,
        checkpoint_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_max_ranges(max_ranges)
        self.checkpoint_conn_id = checkpoint_conn_id
        self.source_conn_id = source_conn_id
        self.table = table
        self.key = key
        self.redis_conn_id = redis_conn_id
        self.stream = stream
        self.where = where
        self.columns = columns
        self.start_key = start_key
        self.end_key = end_key
        self.max_ranges = max_ranges
        self.key_prefix = key_prefix
        self.commit_wait_timeout = commit_wait_timeout
        self.settle_seconds = settle_seconds

    def execute(self, context: Context) -> list[dict[str, Any]]:
        stream = self.stream or self.dag_id
        key = list(self.key) if not isinstance(self.key, str) else self.key
        columns = list(self.columns) if self.columns is not None else None
        with airflow_errors():
            _check_max_ranges(self.max_ranges)
            hook = KeysetHook(self.source_conn_id, self.redis_conn_id, self.checkpoint_conn_id)
            t = hook.traversal(table=self.table, key=key, stream=stream, where=self.where, columns=columns,
                               key_prefix=self.key_prefix, commit_wait_timeout=self.commit_wait_timeout,
                               settle_seconds=self.settle_seconds)
            try:
                start, end = _parse_bound(self.start_key), _parse_bound(self.end_key)
                if start is not None or end is not None:
                    t.source.validate()  # the key columns' types, to read rendered bounds
                    start = _coerce_bound(t, "start_key", start)
                    end = _coerce_bound(t, "end_key", end)
                rnd = t.plan(self.max_ranges, start, end, round_key=_run_key(context))
            finally:
                t.close()
        how = "planned" if rnd.created else "reused (already planned for this run, or the stream's open round)"
        self.log.info("stream %s: round %s (%s, %s] %s, %d range(s):", stream, rnd.round_id,
                      key_label(to_json(rnd.start_key)), key_label(to_json(rnd.end_key)), how, len(rnd.ranges))
        for spec in rnd.ranges:
            self.log.info("  %s", spec.label)
        common = {"source_conn_id": self.source_conn_id, "table": self.table, "key": key, "stream": stream,
                  "where": self.where, "columns": columns, "key_prefix": self.key_prefix,
                  "checkpoint_conn_id": self.checkpoint_conn_id}
        ti = context["ti"]
        ti.xcom_push(key=ROUND_ID_XCOM_KEY, value=rnd.round_id)
        ti.xcom_push(key=ROUND_XCOM_KEY, value={
            "round_id": rnd.round_id, "stream": stream, "key_prefix": self.key_prefix,
            "checkpoint_conn_id": self.checkpoint_conn_id, "start_key": to_json(rnd.start_key), "end_key": to_json(rnd.end_key), "ranges": len(rnd.ranges),
        })
        return [{"round_id": rnd.round_id, "range_id": spec.range_id, "lo": to_json(spec.lo),
                 "hi": to_json(spec.hi), **common} for spec in rnd.ranges]


class TraverseRangeOperator(BaseOperator):
    """Process every key of one range of a planned round, resuming from its Redis cursor.

    Meant to be mapped over ``PlanRangesOperator``'s output with ``expand_kwargs``: the plan's dicts
    supply ``round_id``, ``range_id``, ``lo``/``hi`` (display only: the bounds used are the
    round's, read from Redis) and the source description; ``partial()`` supplies the
    ``processor`` (a callable ``(Chunk) -> ChunkResult | None`` or ``"package.module:function"``),
    ``redis_conn_id``, the tuning knobs and Airflow's ``retries``/``pool``.

    Returns the range's cumulative counters (``done``, ``skipped``, ``dead``, ``complete``, plus
    this try's ``rows_read``/``chunks``/``seconds``). Fails the try if the range is not complete
    (dependency kept failing, lease lost, kill requested): the next try resumes from the cursor.
    ``on_kill`` asks the traversal to commit the chunk in hand, release the lease and return.
    Progress lines (cursor, counters, rows/s, ETA) come from the ``airflow_keyset_provider`` logger.
    """

    template_fields: Sequence[str] = ("round_id", "range_id", "stream", "table", "where")
    ui_color = "#e3f0d8"

    def __init__(
        self,
        *,
        round_id: str,
        range_id: int,
        processor: Callable[..., Any] | str,
        source_conn_id: str,
        table: str,
        key: str | Sequence[str],
        lo: Any = None,
        hi: Any = None,
        stream: str | None = None,
        where: str | None = None,
        columns: Sequence[str] | None = None,
        redis_conn_id: str = "redis_default",
        key_prefix: str = "ks",
        chunk_size: int = 1000,
        lease_seconds: float = 60,
        max_chunk_attempts: int = 5,
        max_item_attempts: int = 3,
        claim_timeout: float | None = None,
        log_every_seconds: float = 30.0,
        prefetch: bool = True,
        group_commit_chunks: int = 1,
        group_commit_seconds: float | None = None,
        checkpoint_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("map_index_template") is None:  # unmapping passes None explicitly
            kwargs["map_index_template"] = DEFAULT_MAP_INDEX_TEMPLATE
        super().__init__(**kwargs)
        self.round_id = round_id
        self.range_id = range_id
        self.processor = processor
        self.source_conn_id = source_conn_id
        self.table = table
        self.key = key
        self.lo = lo
        self.hi = hi
        self.stream = stream
        self.where = where
        self.columns = columns
        self.redis_conn_id = redis_conn_id
        self.key_prefix = key_prefix
        self.chunk_size = chunk_size
        self.lease_seconds = lease_seconds
        self.max_chunk_attempts = max_chunk_attempts
        self.max_item_attempts = max_item_attempts
        self.claim_timeout = claim_timeout
        self.log_every_seconds = log_every_seconds
        self.prefetch = prefetch
        self.group_commit_chunks = group_commit_chunks
        self.group_commit_seconds = group_commit_seconds
        self.checkpoint_conn_id = checkpoint_conn_id
        self._traversal: KeysetTraversal | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        range_id = int(self.range_id) if isinstance(self.range_id, str) and self.range_id.isdigit() else self.range_id
        context[RANGE_LABEL_CONTEXT_KEY] = f"range {range_id} ({key_label(self.lo)}, {key_label(self.hi)}]"  # type: ignore[literal-required]
        if not context.get("map_index_template"):
            # A mapped task's context carries the partial()'s template, which lacks our default.
            context["map_index_template"] = self.map_index_template or DEFAULT_MAP_INDEX_TEMPLATE
        ti = context["ti"]
        lineage = _run_key(context)
        stream = self.stream or self.dag_id
        key = list(self.key) if not isinstance(self.key, str) else self.key
        self.log.info("round %s %s: try %s, owner lineage %s", self.round_id,
                      context[RANGE_LABEL_CONTEXT_KEY], getattr(ti, "try_number", "?"), lineage)  # type: ignore[literal-required]
        with airflow_errors():
            processor = load_processor(self.processor)
            hook = KeysetHook(self.source_conn_id, self.redis_conn_id, self.checkpoint_conn_id)
            t = hook.traversal(table=self.table, key=key, stream=stream, where=self.where,
                               columns=self.columns, key_prefix=self.key_prefix)
            self._traversal = t
            try:
                res = t.traverse(
                    self.round_id, range_id, processor, chunk_size=self.chunk_size,
                    lease_seconds=self.lease_seconds, max_chunk_attempts=self.max_chunk_attempts,
                    max_item_attempts=self.max_item_attempts, owner_lineage=lineage,
                    claim_timeout=self.claim_timeout, log_every_seconds=self.log_every_seconds,
                    prefetch=self.prefetch, group_commit_chunks=self.group_commit_chunks,
                    group_commit_seconds=self.group_commit_seconds,
                )
            finally:
                self._traversal = None
                t.close()
        result = res.as_dict()
        rate = res.rows_read / res.seconds if res.seconds > 0 else 0.0
        self.log.info(
            "round %s range %s: %s; done %d, skipped %d, dead %d; this try read %d rows in %d chunks, "
            "%.1f s (%.0f rows/s)%s", res.round_id, res.range_id,
            "complete" if res.complete else f"stopped at cursor {res.cursor!r}", res.done, res.skipped, res.dead,
            res.rows_read, res.chunks, res.seconds, rate, ", took over from a previous try" if res.takeover else "",
        )
        if res.dead:
            self.log.warning("round %s range %s has %d dead-lettered item(s); inspect them before closing "
                             "the round", res.round_id, res.range_id, res.dead)
        if res.stopped or not res.complete:
            raise AirflowException(
                f"round {res.round_id} range {res.range_id} is not complete (stopped on request); its cursor "
                "is committed and the next try resumes from there"
            )
        return result

    def on_kill(self) -> None:
        t = self._traversal
        if t is not None:
            self.log.info("kill requested: finishing the chunk in hand, committing it, releasing the lease")
            t.request_stop()


__all__ = [
    "DEFAULT_MAP_INDEX_TEMPLATE",
    "RANGE_LABEL_CONTEXT_KEY",
    "ROUND_ID_XCOM_KEY",
    "ROUND_XCOM_KEY",
    "PlanRangesOperator",
    "TraverseRangeOperator",
    "airflow_errors",
    "key_label",
]
