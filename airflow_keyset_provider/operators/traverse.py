"""``TraverseRangeOperator``: process one range of a planned round, resuming from its Redis cursor.

Every try of a mapped range resumes from the range's committed cursor; the owner lineage
``<dag_id>/<run_id>/<task_id>/<map_index>`` lets a new try take the range over at once and fences
the previous try. Waits outside the worker slot (paused stream, range held by a live owner, rows/s
budget, unhealthy source) defer to ``KeysetResumeTrigger``. The task state store entry
``keyset_range`` mirrors the range's committed cursor and counters (Redis stays the authority).
See ``airflow_keyset_provider.operators.keyset`` for the DAG shape and all guarantees.

A try of one range lives here; its siblings hold the parts around it: ``traverse_state`` the
mirror in the task state store, ``traverse_waits`` the wording and the trigger of a deferral,
``traverse_pull`` pull mode. The parameter reference in the class docstring is most of this
module's length.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException

from airflow_keyset_provider.common import (
    DEFAULT_MAP_INDEX_TEMPLATE,
    RANGE_LABEL_CONTEXT_KEY,
    airflow_errors,
    compact_key,
    run_key,
    supervisor_watch,
)
from airflow_keyset_provider.core import (
    ConfigurationError,
    KeysetTraversal,
    LeaseHeldError,
    RangeResult,
    RoundPullResult,
    load_processor,
)
from airflow_keyset_provider.core.options import TraverseOptions
from airflow_keyset_provider.core.run.range_run import BUDGET
from airflow_keyset_provider.hooks.keyset import KeysetHook
from airflow_keyset_provider.links import KeysetRoundLink
from airflow_keyset_provider.operators.traverse_pull import (
    pull_budget,
    pull_label,
    report_pull,
    run_pull,
)
from airflow_keyset_provider.operators.traverse_state import (
    RANGE_STATE_KEY,
    checked_state_store_seconds,
    mirror_final_range_state,
    range_state_mirror,
)
from airflow_keyset_provider.operators.traverse_task import RangeTask
from airflow_keyset_provider.operators.traverse_timeout import execution_budget, timed_out
from airflow_keyset_provider.operators.traverse_waits import log_yield, resume_trigger
from airflow_keyset_provider.triggers.keyset import ResumeEvent

#: The operator's arguments that are ``TraverseOptions`` fields of the same name and meaning.
_ENGINE_KNOBS = (
    "chunk_size",
    "lease_seconds",
    "max_chunk_attempts",
    "max_item_attempts",
    "chunk_timeout",
    "log_every_seconds",
    "prefetch",
    "group_commit_chunks",
    "group_commit_seconds",
    "control_poll_seconds",
    "health_poll_seconds",
    "target_chunk_seconds",
    "min_chunk_size",
    "max_chunk_size",
    "exactly_once",
)


def _traverse_options(arguments: Mapping[str, Any]) -> TraverseOptions:
    """The engine's options from the operator's arguments (``arguments``: ``__init__``'s, by
    name): the ``_ENGINE_KNOBS`` as given; ``defer_after_seconds`` is the engine's
    ``yield_after_seconds`` and the default ``claim_timeout``; ``max_task_seconds`` defaults to
    an hour in pull mode (``pull_budget``). A bad setting fails the task at once
    (``AirflowFailException``), naming it."""
    defer_after_seconds = arguments["defer_after_seconds"]
    claim_timeout = arguments["claim_timeout"]
    resume_poll_seconds = arguments["resume_poll_seconds"]
    max_task_seconds = pull_budget(arguments["pull"], arguments["max_task_seconds"])
    with airflow_errors():
        options = TraverseOptions(
            **{name: arguments[name] for name in _ENGINE_KNOBS},
            max_task_seconds=max_task_seconds,
            yield_after_seconds=defer_after_seconds,
            health_checks=tuple(arguments["health_checks"]),
            claim_timeout=defer_after_seconds if claim_timeout is None else claim_timeout,
        )
        if not resume_poll_seconds > 0:
            raise ConfigurationError(
                f"resume_poll_seconds must be a positive number, got {resume_poll_seconds!r}"
            )
    return options


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
    ``execution_timeout`` becomes a time budget that ends a chunk boundary before Airflow's alarm
    (``traverse_timeout``): the try then fails as timed out with everything it processed
    committed.

    The task never waits in its worker slot for something outside it: when the stream is paused
    (``airflow-keyset pause``), when its range is held by another live owner for longer than
    ``defer_after_seconds``, or when the stream's shared budget (``max_rows_per_second``) would
    make it wait longer than that, it commits the chunk in hand, releases its lease and **defers**
    to ``KeysetResumeTrigger`` (the triggerer polls every ``resume_poll_seconds``); it then
    resumes from the range's cursor in a fresh worker slot, in the same try.
    Progress lines (cursor, counters, rows/s, ETA) come from the ``airflow_keyset_provider`` logger.

    **Pull mode** (``pull=True`` in the plan's output with ``max_tasks``): the task works through
    the round instead of one range (``operators.traverse_pull``) and returns what it did (ranges,
    rows read, splits); it succeeds when nothing is left for it to claim, rescue or split.

    :param round_id: the round, from the plan's output (templated).
    :param range_id: the range, from the plan's output (templated).
    :param processor: ``(Chunk) -> ChunkResult | None``, a callable or
        ``"package.module:function"``.
    :param source_conn_id: from the plan's output.
    :param table: from the plan's output (templated).
    :param key: from the plan's output.
    :param lo: from the plan's output; display only (the bounds used are the round's).
    :param hi: from the plan's output; display only.
    :param stream: from the plan's output; None: the DAG id (templated).
    :param where: from the plan's output (templated).
    :param where_params: from the plan's output.
    :param columns: from the plan's output.
    :param redis_conn_id: Airflow ``redis`` connection of the cursor store (set it in
        ``partial()``).
    :param key_prefix: from the plan's output.
    :param chunk_size: see ``TraverseOptions.chunk_size``.
    :param lease_seconds: see ``TraverseOptions.lease_seconds``.
    :param max_chunk_attempts: see ``TraverseOptions.max_chunk_attempts``.
    :param max_item_attempts: see ``TraverseOptions.max_item_attempts``.
    :param claim_timeout: see ``TraverseOptions.claim_timeout``.
    :param chunk_timeout: see ``TraverseOptions.chunk_timeout``.
    :param log_every_seconds: see ``TraverseOptions.log_every_seconds``.
    :param prefetch: see ``TraverseOptions.prefetch``.
    :param group_commit_chunks: see ``TraverseOptions.group_commit_chunks``.
    :param group_commit_seconds: see ``TraverseOptions.group_commit_seconds``.
    :param checkpoint_conn_id: from the plan's output: the durable checkpoint mirror.
    :param target_conn_id: a ``postgres``, ``sqlite`` or ``mysql`` connection of the database the processor
        writes to. Each processor call then gets ``chunk.connection``: a SQLAlchemy connection in
        a transaction the engine begins for that call, commits when the processor returns (its
        ``ChunkResult`` included) and rolls back when it raises. Bound parameters stay out of
        the logs. The processor never commits; the write-back helpers take the connection as is.
    :param exactly_once: needs ``target_conn_id``: see ``TraverseOptions.exactly_once``. The
        processor's writes through ``chunk.connection`` commit with their key interval in the
        round's ledger on the target (table ``keyset_ledger``), so a crashed try never makes
        them twice.
    :param state_store_seconds: mirror the committed cursor and counters into the task state
        store at most this often (and once when the try ends); None: never.
    :param control_poll_seconds: see ``TraverseOptions.control_poll_seconds``.
    :param defer_after_seconds: a wait longer than this (throttled, or the range held by another
        live owner) defers the task instead of holding its worker slot.
    :param resume_poll_seconds: how often the deferred task's trigger checks whether it may go on.
    :param health_checks: see ``TraverseOptions.health_checks``.
    :param health_poll_seconds: see ``TraverseOptions.health_poll_seconds``.
    :param target_chunk_seconds: see ``TraverseOptions.target_chunk_seconds``.
    :param min_chunk_size: see ``TraverseOptions.min_chunk_size``.
    :param max_chunk_size: see ``TraverseOptions.max_chunk_size``.
    :param pull: from the plan's output with ``max_tasks``: work through the round's ranges
        (``operators.traverse_pull``) instead of one range; ``range_id`` is then the first one.
    :param worker: from the plan's output in pull mode: this task's slot (0-based), for its label.
    :param workers: from the plan's output in pull mode: how many tasks pull the round.
    :param max_task_seconds: see ``TraverseOptions.max_task_seconds``; None: 3600 s in pull mode,
        no budget for a one-range task. Past it the task commits, releases and defers briefly.
    :param split_stragglers: pull mode: once nothing is left to claim, ask the running range with
        the most work left to split and take the new half (False: end the task instead).
    """

    template_fields: Sequence[str] = ("round_id", "range_id", "stream", "table", "where")
    ui_color = "#e3f0d8"
    operator_extra_links = (KeysetRoundLink(),)

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
        where_params: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        redis_conn_id: str = "redis_default",
        key_prefix: str = "ks",
        chunk_size: int = 1000,
        lease_seconds: float = 60,
        max_chunk_attempts: int = 5,
        max_item_attempts: int = 3,
        claim_timeout: float | None = None,
        chunk_timeout: float | None = None,
        log_every_seconds: float = 30.0,
        prefetch: bool = True,
        group_commit_chunks: int = 1,
        group_commit_seconds: float | None = None,
        checkpoint_conn_id: str | None = None,
        target_conn_id: str | None = None,
        exactly_once: bool = False,
        state_store_seconds: float | None = 5.0,
        control_poll_seconds: float = 1.0,
        defer_after_seconds: float = 5.0,
        resume_poll_seconds: float = 5.0,
        health_checks: Sequence[Any] = (),
        health_poll_seconds: float = 5.0,
        target_chunk_seconds: float | None = None,
        min_chunk_size: int = 10,
        max_chunk_size: int = 100_000,
        pull: bool = False,
        worker: int | None = None,
        workers: int | None = None,
        max_task_seconds: float | None = None,
        split_stragglers: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("map_index_template") is None:  # unmapping passes None explicitly
            kwargs["map_index_template"] = DEFAULT_MAP_INDEX_TEMPLATE
        super().__init__(**kwargs)
        self.round_id, self.range_id, self.processor = round_id, range_id, processor
        self.source_conn_id, self.table, self.key = source_conn_id, table, key
        self.lo, self.hi, self.stream = lo, hi, stream
        self.where, self.where_params, self.columns = where, where_params, columns
        self.redis_conn_id, self.key_prefix = redis_conn_id, key_prefix
        self.options = _traverse_options(locals())  # the tuning arguments, checked now
        self.checkpoint_conn_id = checkpoint_conn_id
        self.target_conn_id = target_conn_id
        self.state_store_seconds = checked_state_store_seconds(state_store_seconds)
        self.defer_after_seconds = defer_after_seconds
        self.resume_poll_seconds = resume_poll_seconds
        self.pull, self.worker, self.workers = bool(pull), worker, workers
        self.split_stragglers = split_stragglers
        self._traversal: KeysetTraversal | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        started = time.monotonic()  # Airflow's execution_timeout counts from about here
        range_id = (
            int(self.range_id)
            if isinstance(self.range_id, str) and self.range_id.isdigit()
            else self.range_id
        )
        label = (
            pull_label(self._task())
            if self.pull
            else f"range {range_id} ({compact_key(self.lo)}, {compact_key(self.hi)}]"
        )
        context[RANGE_LABEL_CONTEXT_KEY] = label  # type: ignore[literal-required]
        if not context.get("map_index_template"):
            # A mapped task's context carries the partial()'s template, which lacks our default.
            context["map_index_template"] = self.map_index_template or DEFAULT_MAP_INDEX_TEMPLATE
        budget, by_timeout = execution_budget(
            self.options.max_task_seconds, self.execution_timeout, started
        )
        lineage = run_key(context)
        stream = self.stream or self.dag_id
        self.log.info(
            "round %s %s: try %s, owner lineage %s",
            self.round_id,
            label,
            getattr(context["ti"], "try_number", "?"),
            lineage,
        )
        res = self._traverse_range(context, stream, range_id, lineage, budget, by_timeout)
        if res.yielded == BUDGET and by_timeout and self.execution_timeout is not None:
            where = (
                f"encoded cursor {res.cursor}" if isinstance(res, RangeResult) else "every range"
            )
            raise timed_out(f"round {self.round_id} {label}", self.execution_timeout, where)
        if res.yielded:
            self._defer(stream, range_id, res.yielded, res.retry_after)
        if isinstance(res, RoundPullResult):
            return report_pull(self._task(), res)
        return self._report(res)

    def _make_traversal(self, stream: str) -> KeysetTraversal:
        """The engine over this task's source, store, mirror and target connections."""
        hook = KeysetHook(
            self.source_conn_id, self.redis_conn_id, self.checkpoint_conn_id, self.target_conn_id
        )
        return hook.traversal(
            table=self.table,
            key=list(self.key) if not isinstance(self.key, str) else self.key,
            stream=stream,
            where=self.where,
            where_params=self.where_params,
            columns=self.columns,
            key_prefix=self.key_prefix,
        )

    def _traverse_range(
        self,
        context: Context,
        stream: str,
        range_id: int,
        lineage: str,
        budget: float | None,
        by_timeout: bool,
    ) -> RangeResult | RoundPullResult:
        """One traversal from the committed cursor within ``budget`` s (``traverse_timeout``);
        defers (``NoReturn``) when a live owner holds the range. The task state store gets the
        range's final state whatever happens."""
        with airflow_errors():
            processor = load_processor(self.processor)
            t = self._traversal = self._make_traversal(stream)
            task = self._task()
            mirror = range_state_mirror(task, context, t, range_id, stream)
            # An orphan of a dead supervisor stops within one chunk (core/run/supervision.py).
            watch = supervisor_watch(t.request_stop, f"round {self.round_id} range {range_id}")
            try:
                options = dataclasses.replace(
                    self.options, owner_lineage=lineage, max_task_seconds=budget
                )
                res: RangeResult | RoundPullResult
                try:
                    watch.start()
                    if self.pull:
                        res = run_pull(task, t, watch.guard(processor), options, range_id)
                    else:
                        res = t.traverse(
                            self.round_id,
                            range_id,
                            watch.guard(processor),
                            options=options,
                            on_progress=mirror,
                            progress_every_seconds=self.state_store_seconds or 0.0,
                        )
                except LeaseHeldError as exc:
                    if t.stop_requested or watch.died:
                        raise
                    self.log.info("%s; deferring until the lease is free", exc)
                    self._defer(stream, range_id, "lease")
                if res.yielded and not (by_timeout and res.yielded == BUDGET):
                    log_yield(task, t, res.yielded, res.retry_after)
            finally:
                watch.stop()
                self._traversal = None
                mirror_final_range_state(task, mirror, t, range_id)
                t.close()
        return res

    def _task(self) -> RangeTask:
        """This try as its helpers see it (``operators/traverse_task.py``), after templating."""
        return RangeTask(
            round_id=str(self.round_id),
            log=self.log,
            lo=self.lo,
            hi=self.hi,
            pull=self.pull,
            worker=self.worker,
            workers=self.workers,
            split_stragglers=self.split_stragglers,
            state_store_seconds=self.state_store_seconds,
            redis_conn_id=self.redis_conn_id,
            key_prefix=self.key_prefix,
            resume_poll_seconds=self.resume_poll_seconds,
            max_task_seconds=self.options.max_task_seconds,
        )

    def _report(self, res: RangeResult) -> dict[str, Any]:
        """Log the try's outcome; the range's counters if it is complete, else fail the try (its
        cursor is committed, so Airflow's retry resumes from there)."""
        result = res.as_dict()
        rate = res.rows_read / res.seconds if res.seconds > 0 else 0.0
        self.log.info(
            "round %s range %s: %s; done %d, skipped %d, dead %d; this try read %d rows in %d "
            "chunks, %.1f s (%.0f rows/s)%s",
            res.round_id,
            res.range_id,
            "complete" if res.complete else f"stopped at cursor {res.cursor!r}",
            res.done,
            res.skipped,
            res.dead,
            res.rows_read,
            res.chunks,
            res.seconds,
            rate,
            ", took over from a previous try" if res.takeover else "",
        )
        if res.dead:
            self.log.warning(
                "round %s range %s has %d dead-lettered item(s); inspect them before closing "
                "the round",
                res.round_id,
                res.range_id,
                res.dead,
            )
        if res.stopped or not res.complete:
            raise AirflowException(
                f"round {res.round_id} range {res.range_id} is not complete (stopped on request); "
                "its cursor is committed and the next try resumes from there"
            )
        return result

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the traversed table as the input dataset (``airflow_keyset_provider.
        lineage``); None when the OpenLineage provider is not installed."""
        from airflow_keyset_provider.lineage import table_lineage

        return table_lineage(self.source_conn_id, self.table)

    def _defer(self, stream: str, range_id: int, why: str, retry_after: float = 0.0) -> NoReturn:
        self.defer(
            trigger=resume_trigger(self._task(), stream, range_id, why, retry_after),
            method_name="execute_resume",
        )

    def execute_resume(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        """Back from ``KeysetResumeTrigger``: traverse again from the range's cursor."""
        if event and event.get("status") == ResumeEvent.ERROR.value:
            raise AirflowException(
                f"round {self.round_id} range {self.range_id}: cannot resume: {event['message']}"
            )
        self.log.info("resuming after waiting (%s)", (event or {}).get("wait_for", "?"))
        return self.execute(context)

    def on_kill(self) -> None:
        t = self._traversal
        if t is not None:
            self.log.info(
                "kill requested: finishing the chunk in hand, committing it, releasing the lease"
            )
            t.request_stop()


__all__ = ["RANGE_STATE_KEY", "TraverseRangeOperator"]
