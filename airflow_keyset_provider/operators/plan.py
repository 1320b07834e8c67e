"""``PlanRangesOperator``: fix a round of a stream and split it into ranges for the mapped
``TraverseRangeOperator`` (``airflow_keyset_provider.operators.traverse``).

Retrying or clearing the plan task returns the same round with the same ranges: the round is keyed
by ``<dag_id>/<run_id>/<task_id>``. See ``airflow_keyset_provider.operators.keyset`` for the DAG
shape and the guarantees of both operators.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context, conf

from airflow_keyset_provider.common import (
    ROUND_ID_XCOM_KEY,
    ROUND_XCOM_KEY,
    airflow_errors,
    check_names,
    configured_key_prefix,
    key_label,
    run_key,
)
from airflow_keyset_provider.core import ConfigurationError, KeysetTraversal, Round
from airflow_keyset_provider.core.keys import coerce_bound, from_tuple, parse_bound, to_json
from airflow_keyset_provider.core.rounds.control import RangeSpec
from airflow_keyset_provider.core.rounds.plan_answer import first_answer
from airflow_keyset_provider.core.rounds.planner import MAX_RANGES
from airflow_keyset_provider.core.rounds.verify_record import (
    DEFAULT_VERIFY_KEYS,
    check_verify_options,
)
from airflow_keyset_provider.core.run.pull import first_positions
from airflow_keyset_provider.durable_record import asset_name, read_record, record_planned
from airflow_keyset_provider.hooks.keyset import KeysetHook
from airflow_keyset_provider.links import KeysetRoundLink

AIRFLOW_DEFAULT_MAX_MAP_LENGTH = 1024  # Airflow's default [core] max_map_length
_LOGGED_RANGES = 64  # the plan task logs the first ranges, then how many more


def first_ranges(rnd: Round, max_tasks: int) -> list[RangeSpec]:
    """Pull mode: the first range of each task (at most ``max_tasks``, at most one per range),
    spread evenly over the key order: task ``k`` of ``n`` starts ``k/n`` of the way in and,
    coalescing, claims its share of the round, then each pulls whatever is left."""
    ordered = sorted(rnd.ranges, key=lambda spec: spec.lo_encoded)
    return [ordered[i] for i in first_positions(len(ordered), max_tasks)]


def pull_tasks(
    rnd: Round,
    max_tasks: int,
    common: dict[str, Any],
    firsts: list[RangeSpec] | None = None,
) -> list[dict[str, Any]]:
    """Pull mode: one dict per task, for the tasks' first ranges ``firsts`` (default:
    ``first_ranges`` of ``rnd`` as it is now; the operator passes the round's recorded first
    answer, ``core/rounds/plan_answer.py``)."""
    specs = first_ranges(rnd, max_tasks) if firsts is None else firsts
    return [
        {
            "round_id": rnd.round_id,
            "range_id": spec.range_id,
            "lo": to_json(spec.lo),
            "hi": to_json(spec.hi),
            "pull": True,
            "worker": k,
            "workers": len(specs),
            **common,
        }
        for k, spec in enumerate(specs)
    ]


def _max_map_length() -> int:
    """Airflow's configured ``[core] max_map_length`` (read when called, so a raised setting
    raises the limit), capped by the engine's ``MAX_RANGES``."""
    configured = conf.getint("core", "max_map_length", fallback=AIRFLOW_DEFAULT_MAX_MAP_LENGTH)
    return min(configured, MAX_RANGES)


def _is_count(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit


def _check_max_ranges(max_ranges: Any, max_tasks: Any = None) -> None:
    """One task per range (``max_tasks`` None): the ranges must fit Airflow's mapping. Pull mode:
    the tasks must fit it, the ranges only the engine's ``MAX_RANGES``."""
    limit = _max_map_length()
    if max_tasks is None:
        if not _is_count(max_ranges, limit):
            raise ConfigurationError(
                f"max_ranges must be an integer from 1 to {limit} (Airflow's [core] "
                "max_map_length caps how many mapped tasks one task may expand to; raise it, "
                "e.g. AIRFLOW__CORE__MAX_MAP_LENGTH, or set max_tasks to run many ranges over "
                f"fewer tasks, up to the engine's {MAX_RANGES} ranges), got {max_ranges!r}"
            )
        return
    if not _is_count(max_tasks, limit):
        raise ConfigurationError(
            f"max_tasks must be None (one task per range) or an integer from 1 to {limit} "
            f"(Airflow's [core] max_map_length), got {max_tasks!r}"
        )
    if not _is_count(max_ranges, MAX_RANGES):
        raise ConfigurationError(
            f"max_ranges must be an integer from 1 to {MAX_RANGES} (the engine's limit on "
            f"ranges per round), got {max_ranges!r}"
        )


def refuse_chained_backfill(context: Context, start_key: Any, dag_id: str, stream: str) -> None:
    """A backfill run of a chained stream (no ``start_key``) is refused before anything is
    planned: it would reuse the stream's open round or start at today's watermark, never the
    run's data interval, so it would do nothing or the wrong keys and still be green. Raised as
    ``AirflowFailException`` (no retry: a retry cannot fix it) naming the fix."""
    if start_key is not None:
        return
    run_type = getattr(context.get("dag_run"), "run_type", None)
    if str(getattr(run_type, "value", run_type)) != "backfill":
        return
    from airflow.sdk.exceptions import AirflowFailException

    raise AirflowFailException(
        f"DAG {dag_id!r} stream {stream!r}: this is a backfill run, but the plan has no "
        "start_key, so its round continues the stream from its watermark (or is the open round "
        "already planned), not this run's data interval: the backfill would do nothing for "
        "its dates. Give the plan explicit bounds from the data interval, e.g. "
        "start_key='{{ data_interval_start }}', end_key='{{ data_interval_end }}' for a "
        "timestamp key (docs/howto-backfills.md), or backfill with a DAG that has them."
    )


def _typed_bound(t: KeysetTraversal, name: str, value: Any) -> Any:
    """A rendered bound read against the key columns (``"1000"`` -> ``1000`` for an integer key)."""
    if value is None:
        return None
    return from_tuple(coerce_bound(name, value, t.source.key_kinds, from_text=True), t.arity)


class PlanRangesOperator(BaseOperator):
    """Fix a round ``start < key <= end`` of ``table`` and split it into at most ``max_ranges``.

    Returns one dict per range, ready for ``TraverseRangeOperator.partial(...).expand_kwargs``:
    ``round_id``, ``range_id``, ``lo``, ``hi`` (JSON renderings of the bounds, for display) and the
    source description (``source_conn_id``, ``table``, ``key``, ``stream``, ``where``, ``columns``,
    ``key_prefix``), so the mapped task needs only the processor and its tuning in ``partial()``.
    With ``max_tasks`` (pull mode) it returns at most ``max_tasks`` dicts, one per task, with
    ``pull=True``, ``worker``/``workers`` (the task's slot and the number of tasks) and the task's
    first range as ``range_id``/``lo``/``hi``; the ranges are not tied to tasks.
    Pushes the round id under XCom key ``round_id`` (and ``keyset_round``: stream, key prefix,
    bounds) for ``BarrierSensor``.

    ``start_key`` None continues the stream at its watermark (rounds chain night after night;
    while the stream's chained round is still open, this returns that round so it gets finished
    first). ``end_key`` None takes the largest key at plan time, once every smaller key has
    committed. Bounds may be templates: a rendered string is decoded as JSON when it looks like
    JSON (``[..]`` for composite keys), integer strings become integers for integer keys, and ISO
    8601 strings are accepted for timestamp and date columns. With
    ``render_template_as_native_obj=True`` native values (lists, datetimes) pass through.

    Running the task again for the same DAG run (retry, clear) returns the same round and the same
    dicts, also after the round ran (pull mode: the first answer is recorded in the round, as
    claims coalesce and split its ranges).

    :param source_conn_id: Airflow connection of the source database.
    :param table: table to traverse, ``name`` or ``schema.name`` (templated).
    :param key: key column, or a list of columns for a composite key; unique, NOT NULL, indexed
        (templated).
    :param redis_conn_id: Airflow ``redis`` connection of the cursor store.
    :param stream: the sequence of rounds that chain by watermark; None: the DAG id (templated).
    :param where: SQL predicate restricting the rows, evaluated when each chunk is read
        (templated). Trusted SQL, like the DAG file: never render it from run conf or user input;
        put varying values in ``where_params``.
    :param where_params: values bound into ``where`` (``:name`` placeholders), never spliced into
        the SQL.
    :param columns: extra columns the processor needs in ``chunk.rows`` (templated).
    :param start_key: lower bound, exclusive; None: the stream's watermark (templated).
    :param end_key: upper bound, inclusive; None: ``max(key)`` once every smaller key has committed
        (templated).
    :param max_ranges: at most this many ranges. With ``max_tasks`` None (one mapped task per
        range), 1 to Airflow's configured ``[core] max_map_length`` (1024 by default; raising it
        raises this limit); with ``max_tasks``, up to the engine's 100,000. Fewer keys than
        ranges give fewer ranges.
    :param max_tasks: pull mode: return at most this many dicts (1 to ``[core] max_map_length``),
        each for one traverse task that works through the round's ranges until none is left,
        splitting stragglers (``TraverseRangeOperator`` with ``pull=True``). None (the default):
        one dict, and one mapped task, per range.
    :param key_prefix: prefix of every Redis key of the traversal; default ``[keyset]
        key_prefix`` of the Airflow configuration (``ks`` unless set), the prefix the UI page reads.
    :param commit_wait_timeout: PostgreSQL: seconds to wait for transactions open when ``max(key)``
        was read (``CommitOrderTimeoutError`` after).
    :param settle_seconds: other sources: seconds to wait after reading ``max(key)``.
    :param checkpoint_conn_id: a ``postgres``/``sqlite``/``mysql`` connection for the durable checkpoint
        mirror; passed on to the traverse tasks and the barrier.
    :param new_stream: when Redis has no state of the stream, start it below every key whatever
        Airflow's records say (a stream declared new; logged as such). By default a stream Redis
        lost is restored from the asset state of ``keyset://<stream>`` (the barrier records each
        close there; this task declares the asset as an inlet) or refused with
        ``StreamStateLostError`` naming the choices; a stream Airflow never planned is new
        (``core/rounds/durability.py``). Remove it once the stream has run.
    :param verify: an SQL predicate no row of the round should match once it is processed (e.g.
        ``"status = 'open'"``), checked by the ``BarrierSensor`` after every range is complete and
        before the round closes (``core/rounds/verification.py``): it counts the rows of the round
        (and of ``where``) that still match and lists the first ``verify_keys``. Trusted SQL,
        like ``where`` (templated); recorded with the round and compared, never run from Redis.
    :param on_verify_failure: ``"fail"`` (default): the barrier fails with the count and the
        keys, the round stays open; ``"repair"``: the matching rows go once through the
        barrier's ``processor``, then the round is verified again (still failing: fail).
    :param verify_keys: how many matching keys a failed verification lists (default 20).
    """

    template_fields: Sequence[str] = (
        "table",
        "key",
        "where",
        "columns",
        "start_key",
        "end_key",
        "stream",
        "verify",
    )
    ui_color = "#d8e6f3"
    operator_extra_links = (KeysetRoundLink(),)

    def __init__(
        self,
        *,
        source_conn_id: str,
        table: str,
        key: str | Sequence[str],
        redis_conn_id: str = "redis_default",
        stream: str | None = None,
        where: str | None = None,
        where_params: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        start_key: Any = None,
        end_key: Any = None,
        max_ranges: int = 16,
        max_tasks: int | None = None,
        key_prefix: str | None = None,
        commit_wait_timeout: float = 60.0,
        settle_seconds: float = 0.0,
        checkpoint_conn_id: str | None = None,
        new_stream: bool = False,
        verify: str | None = None,
        on_verify_failure: str = "fail",
        verify_keys: int = DEFAULT_VERIFY_KEYS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_max_ranges(max_ranges, max_tasks)
        check_verify_options(verify, on_verify_failure, verify_keys)
        self.verify, self.on_verify_failure, self.verify_keys = (
            verify,
            on_verify_failure,
            verify_keys,
        )
        self.new_stream = new_stream
        self._declare_stream_asset(stream)
        self.checkpoint_conn_id = checkpoint_conn_id
        self.source_conn_id = source_conn_id
        self.table = table
        self.key = key
        self.redis_conn_id = redis_conn_id
        self.stream = stream
        self.where = where
        self.where_params = where_params
        self.columns = columns
        self.start_key = start_key
        self.end_key = end_key
        self.max_ranges = max_ranges
        self.max_tasks = max_tasks
        self.key_prefix = key_prefix if key_prefix is not None else configured_key_prefix()
        check_names(stream=stream, key_prefix=self.key_prefix)
        self.commit_wait_timeout = commit_wait_timeout
        self.settle_seconds = settle_seconds

    def _declare_stream_asset(self, stream: str | None) -> None:
        """Add ``keyset://<stream>`` to the inlets when the stream is known at parse time, so
        Airflow registers the asset whose state store is the stream's durable record
        (``airflow_keyset_provider.durable_record``)."""
        name = stream if stream is not None else (self.dag_id if self.has_dag() else None)
        if not isinstance(name, str) or not name or "{{" in name:
            return
        asset = Asset(asset_name(name))
        if not any(isinstance(i, Asset) and i.name == asset.name for i in self.inlets):
            self.inlets = [*self.inlets, asset]

    def execute(self, context: Context) -> list[dict[str, Any]]:
        stream = self.stream or self.dag_id
        refuse_chained_backfill(context, self.start_key, self.dag_id, stream)
        key = list(self.key) if not isinstance(self.key, str) else self.key
        columns = list(self.columns) if self.columns is not None else None
        rnd, firsts, planned_by = self._plan_round(context, stream, key, columns)
        self._log_round(stream, rnd, planned_by, run_key(context))
        common = {
            "source_conn_id": self.source_conn_id,
            "table": self.table,
            "key": key,
            "stream": stream,
            "where": self.where,
            "where_params": self.where_params,
            "columns": columns,
            "key_prefix": self.key_prefix,
            "checkpoint_conn_id": self.checkpoint_conn_id,
        }
        self._push_round(context, stream, rnd, planned_by, common)
        if self.max_tasks is not None:
            return pull_tasks(rnd, self.max_tasks, common, firsts)
        return [
            {
                "round_id": rnd.round_id,
                "range_id": spec.range_id,
                "lo": to_json(spec.lo),
                "hi": to_json(spec.hi),
                **common,
            }
            for spec in rnd.ranges
        ]

    def _plan_round(
        self, context: Context, stream: str, key: str | list[str], columns: list[str] | None
    ) -> tuple[Round, list[RangeSpec] | None, str | None]:
        """The round of this DAG run and plan task: planned now, or the one planned before (the
        round key is the task's ``<dag_id>/<run_id>/<task_id>``); in pull mode also the tasks'
        first ranges as the round's first plan answered them (``core/rounds/plan_answer.py``:
        claims coalesce and split ranges as the round runs, the answer stays); and the round key
        of the plan that created a reused round (None when this call created it)."""
        with airflow_errors():
            _check_max_ranges(self.max_ranges, self.max_tasks)
            hook = KeysetHook(self.source_conn_id, self.redis_conn_id, self.checkpoint_conn_id)
            t = hook.traversal(
                table=self.table,
                key=key,
                stream=stream,
                where=self.where,
                where_params=self.where_params,
                columns=columns,
                key_prefix=self.key_prefix,
                commit_wait_timeout=self.commit_wait_timeout,
                settle_seconds=self.settle_seconds,
            )
            try:
                start, end = parse_bound(self.start_key), parse_bound(self.end_key)
                if start is not None or end is not None:
                    t.source.validate()  # the key columns' types, to read rendered bounds
                    start = _typed_bound(t, "start_key", start)
                    end = _typed_bound(t, "end_key", end)
                record = read_record(stream, t)
                rnd = t.plan(
                    self.max_ranges,
                    start,
                    end,
                    round_key=run_key(context),
                    new_stream=self.new_stream,
                    record=record,
                    verify=self.verify,
                )
                if start is None and record is not None:
                    record_planned(stream, rnd)  # before the task succeeds: else it raises
                planned_by = None
                if not rnd.created:
                    planned_by = t.store.round_info(rnd.round_id).get("round_key") or None
                tasks = self.max_tasks
                if tasks is None:  # one range per task: no claim coalesces, no range splits
                    return rnd, None, planned_by
                firsts = first_answer(
                    t.control, rnd.round_id, f"pull:{tasks}", lambda r: first_ranges(r, tasks)
                )
                return rnd, firsts, planned_by
            finally:
                t.close()

    def _log_round(self, stream: str, rnd: Round, planned_by: str | None, this_run: str) -> None:
        how = (
            "planned"
            if rnd.created
            else "reused (already planned for this run, or the stream's open round)"
        )
        self.log.info(
            "stream %s: round %s (%s, %s] %s, %d range(s):",
            stream,
            rnd.round_id,
            key_label(rnd.start_key),
            key_label(rnd.end_key),
            how,
            len(rnd.ranges),
        )
        for spec in rnd.ranges[:_LOGGED_RANGES]:
            self.log.info("  %s", spec.label)
        if len(rnd.ranges) > _LOGGED_RANGES:
            self.log.info("  ... and %d more", len(rnd.ranges) - _LOGGED_RANGES)
        if planned_by and planned_by != this_run:
            self.log.warning(
                "stream %s: round %s is the stream's open round, planned by %s, not by this run "
                "(%s): this run continues it, with its bounds, and plans nothing of its own. "
                "Expected after that run failed; if it is still running, both runs share the "
                "round's ranges (one owner per range at a time): give a chained DAG "
                "max_active_runs=1, and a backfill explicit bounds (docs/howto-backfills.md).",
                stream,
                rnd.round_id,
                planned_by,
                this_run,
            )

    def _push_round(
        self,
        context: Context,
        stream: str,
        rnd: Round,
        planned_by: str | None,
        source: dict[str, Any],
    ) -> None:
        """XComs for ``BarrierSensor``: the round id, and the round's stream, prefix and bounds;
        ``planned_by``: the round key (``<dag_id>/<run_id>/<task_id>``) of the plan that created
        the round, when this plan reused it (None when this plan created it). With ``verify``
        also the verification's settings and the source description (``source``) it reads."""
        ti = context["ti"]
        ti.xcom_push(key=ROUND_ID_XCOM_KEY, value=rnd.round_id)
        ti.xcom_push(
            key=ROUND_XCOM_KEY,
            value={
                "round_id": rnd.round_id,
                "stream": stream,
                "key_prefix": self.key_prefix,
                "checkpoint_conn_id": self.checkpoint_conn_id,
                "start_key": to_json(rnd.start_key),
                "end_key": to_json(rnd.end_key),
                "ranges": len(rnd.ranges),
                "planned_by": planned_by,
                **(
                    {}
                    if self.verify is None
                    else {
                        "verify": self.verify,
                        "on_verify_failure": self.on_verify_failure,
                        "verify_keys": self.verify_keys,
                        "source": source,
                    }
                ),
            },
        )

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the traversed table as the input dataset (``airflow_keyset_provider.
        lineage``); None when the OpenLineage provider is not installed."""
        from airflow_keyset_provider.lineage import table_lineage

        return table_lineage(self.source_conn_id, self.table)


__all__ = ["AIRFLOW_DEFAULT_MAX_MAP_LENGTH", "PlanRangesOperator"]
