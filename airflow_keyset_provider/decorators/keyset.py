"""``@task.keyset_traverse``: a processor written as a TaskFlow function, and a whole round as one
task group.

The decorated function is the processor: it takes a ``Chunk`` and returns ``None`` (every key
done) or a ``ChunkResult``; with ``target_conn_id`` it writes through ``chunk.connection``, a
connection in a transaction the engine commits when the function returns. The decorator's
arguments are ``TraverseRangeOperator``'s (``redis_conn_id``, ``chunk_size``, ``target_conn_id``,
``retries``, ...). Two ways to use it:

- ``cancel_stale.expand_kwargs(plan.output)`` (or ``cancel_stale(plan)``): the traverse task,
  mapped over a ``PlanRangesOperator``'s output exactly as ``TraverseRangeOperator.partial(...)
  .expand_kwargs(plan.output)`` is; then add a ``BarrierSensor``;
- ``cancel_stale.round(source_conn_id=..., table=..., key=..., ...)``: the task group
  ``plan >> traverse >> barrier`` of one round (``keyset_round``), named after the function.

Nothing about the guarantees changes: it builds the same operators.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk import BaseOperator, TaskGroup

from airflow_keyset_provider.core.chunk import PROCESSOR_ATTRIBUTE, load_processor
from airflow_keyset_provider.core.options import OPTION_NAMES, TraverseOptions
from airflow_keyset_provider.core.rounds.verify_record import DEFAULT_VERIFY_CHUNK
from airflow_keyset_provider.operators.plan import PlanRangesOperator
from airflow_keyset_provider.operators.traverse import TraverseRangeOperator
from airflow_keyset_provider.sensors.keyset import BarrierSensor

#: ``PlanRangesOperator`` arguments ``keyset_round`` takes besides the plan's required ones.
PLAN_ARGUMENTS = (
    "where",
    "where_params",
    "columns",
    "start_key",
    "end_key",
    "max_ranges",
    "max_tasks",
    "commit_wait_timeout",
    "settle_seconds",
    "new_stream",
    "verify",
    "on_verify_failure",
    "verify_keys",
)


def _check_options(traverse_kwargs: dict[str, Any]) -> None:
    """Refuse, when the DAG is parsed, a plain-number engine setting the traverse task would
    refuse when it runs (an absurd ``chunk_size``, a zero ``max_chunk_bytes``): a mapped task
    builds its operator only at run time. Templated and XCom values are checked then."""
    given = {
        k: v
        for k, v in traverse_kwargs.items()
        if k in OPTION_NAMES and (v is None or isinstance(v, (int, float)))
    }
    TraverseOptions.from_kwargs(**given)


class KeysetTraverseTask:
    """What ``@task.keyset_traverse(...)`` makes of a function (see the module docstring).

    Calling the function itself (``.function(chunk)``) runs the processor, e.g. in a test with
    ``airflow_keyset_provider.testing.run_processor``."""

    def __init__(self, function: Callable[..., Any], traverse_kwargs: dict[str, Any]) -> None:
        if "processor" in traverse_kwargs:
            raise TypeError("@task.keyset_traverse: the decorated function is the processor")
        _check_options(traverse_kwargs)
        self.function = function
        self.traverse_kwargs = traverse_kwargs
        functools.update_wrapper(self, function)
        # the engine (and ``airflow-keyset replay-dead-letters``) calls this, never the task
        setattr(self, PROCESSOR_ATTRIBUTE, function)

    def override(self, **traverse_kwargs: Any) -> KeysetTraverseTask:
        """The same processor with some operator arguments changed (``task_id``, ``retries``)."""
        return KeysetTraverseTask(self.function, {**self.traverse_kwargs, **traverse_kwargs})

    def expand_kwargs(self, ranges: Any) -> Any:
        """The traverse task mapped over a plan's output (an ``XComArg`` of range dicts)."""
        kwargs = {"task_id": self.function.__name__, **self.traverse_kwargs}
        return TraverseRangeOperator.partial(processor=self.function, **kwargs).expand_kwargs(
            ranges
        )

    def __call__(self, plan: BaseOperator | Any) -> Any:
        """``expand_kwargs`` over ``plan`` (a ``PlanRangesOperator`` or its ``.output``)."""
        return self.expand_kwargs(plan.output if isinstance(plan, BaseOperator) else plan)

    def round(self, **round_kwargs: Any) -> TaskGroup:
        """The task group ``plan >> traverse >> barrier`` of one round (``keyset_round``)."""
        return keyset_round(
            round_kwargs.pop("group_id", self.function.__name__),
            self,
            **round_kwargs,
        )


def keyset_traverse_task(
    python_callable: Callable[..., Any] | None = None, **traverse_kwargs: Any
) -> Any:
    """``@task.keyset_traverse`` / ``@task.keyset_traverse(...)``: see the module docstring."""
    if python_callable is not None:
        return KeysetTraverseTask(python_callable, traverse_kwargs)
    return lambda fn: KeysetTraverseTask(fn, traverse_kwargs)


def keyset_round(
    group_id: str,
    processor: KeysetTraverseTask | Callable[..., Any] | str,
    *,
    source_conn_id: str,
    table: str,
    key: str | Sequence[str],
    redis_conn_id: str = "redis_default",
    stream: str | None = None,
    key_prefix: str | None = None,
    checkpoint_conn_id: str | None = None,
    outlets: Sequence[Any] = (),
    max_dead_letters: int | None = None,
    deferrable: bool = True,
    **kwargs: Any,
) -> TaskGroup:
    """One round as a task group: ``PlanRangesOperator`` (``plan``) >> ``TraverseRangeOperator``
    mapped over its output (``traverse``) >> a deferrable ``BarrierSensor`` (``barrier``, with
    ``outlets``). ``kwargs`` named in ``PLAN_ARGUMENTS`` go to the plan, the others to the
    traverse task (``chunk_size``, ``target_conn_id``, ``retries``, ...). ``stream`` defaults to
    the DAG id, as for the operators; give one per round if a DAG has several.

    ``verify="<SQL predicate>"`` makes the barrier verify the round before it closes (no row of
    the round still matches it); ``on_verify_failure="repair"`` sends the rows that still match
    once through this processor (with the traverse task's ``target_conn_id`` and
    ``max_item_attempts``), ``"fail"`` (default) fails the barrier with their count and keys;
    ``verify_keys`` how many keys it lists (``BarrierSensor``, ``core/rounds/verification.py``)."""
    plan_kwargs = {k: kwargs.pop(k) for k in PLAN_ARGUMENTS if k in kwargs}
    verify_chunk_size = kwargs.pop("verify_chunk_size", DEFAULT_VERIFY_CHUNK)
    traverse = (
        processor
        if isinstance(processor, KeysetTraverseTask)
        else KeysetTraverseTask(load_processor(processor), {})
    ).override(task_id="traverse", redis_conn_id=redis_conn_id, **kwargs)  # the rest: plan's output
    with TaskGroup(group_id=group_id) as group:
        plan = PlanRangesOperator(
            task_id="plan",
            source_conn_id=source_conn_id,
            table=table,
            key=key,
            stream=stream,
            checkpoint_conn_id=checkpoint_conn_id,
            redis_conn_id=redis_conn_id,
            key_prefix=key_prefix,
            **plan_kwargs,
        )
        barrier = BarrierSensor(
            task_id="barrier",
            plan_task_id=plan.task_id,
            redis_conn_id=redis_conn_id,
            checkpoint_conn_id=checkpoint_conn_id,
            max_dead_letters=max_dead_letters,
            deferrable=deferrable,
            outlets=list(outlets),
            processor=traverse.function,
            target_conn_id=traverse.traverse_kwargs.get("target_conn_id"),
            verify_chunk_size=verify_chunk_size,
            max_item_attempts=traverse.traverse_kwargs.get("max_item_attempts", 3),
        )
        plan >> traverse(plan) >> barrier
    return group


__all__ = ["PLAN_ARGUMENTS", "KeysetTraverseTask", "keyset_round", "keyset_traverse_task"]
