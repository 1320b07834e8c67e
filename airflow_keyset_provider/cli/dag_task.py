"""The traverse task of a DAG, as ``replay-dead-letters --dag-id`` needs it.

A replay runs the round's dead letters through what the DAG itself says: the processor, the
target connection and ``exactly_once`` of its traverse task (``TraverseRangeOperator``, mapped or
not, which ``@task.keyset_traverse`` builds too), and the source (connection, table, key,
``where``, ``where_params``, columns, stream, key prefix, Redis connection) of the
``PlanRangesOperator`` upstream of it. Nothing of it comes from Redis: the round's record there
is only compared with it (``KeysetTraversal.replay_dead_letters`` refuses a round planned over
other rows). The DAG is parsed from ``--dag-file`` (a file or folder) or Airflow's
``[core] dags_folder``, as the DAG processor would (its import errors are reported).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .exits import EXIT_NOT_FOUND, EXIT_USAGE, CliError


@dataclass(frozen=True)
class DagTraverse:
    """What one traverse task of a DAG (and its plan) says about the round it traverses."""

    dag_id: str
    task_id: str
    processor: Any
    source_conn_id: str
    redis_conn_id: str
    target_conn_id: str | None
    checkpoint_conn_id: str | None
    exactly_once: bool
    table: str
    key: str | list[str]
    where: str | None
    where_params: dict[str, Any] | None
    columns: list[str] | None
    stream: str
    key_prefix: str
    engine_options: dict[str, Any]  # the task's chunk_size, max_item_attempts, ...


def load_dag(dag_id: str, dag_file: str | None) -> Any:
    """The DAG ``dag_id`` parsed from ``dag_file`` (a file or a folder) or the DAGs folder."""
    try:
        from airflow import settings
        from airflow.dag_processing.dagbag import DagBag
    except ImportError as exc:  # pragma: no cover - Airflow is a dependency
        raise CliError(f"--dag-id needs Apache Airflow: {exc}") from exc
    folder = dag_file or settings.DAGS_FOLDER
    if not Path(folder).exists():
        raise CliError(f"--dag-file {folder!r} does not exist", EXIT_USAGE)
    bag = DagBag(dag_folder=folder)
    dag = bag.dags.get(dag_id)
    if dag is None:
        errors = "".join(f"\n  {path}: {err.strip().splitlines()[-1]}" for path, err in
                         bag.import_errors.items())  # fmt: skip
        known = ", ".join(sorted(bag.dags)) or "none"
        raise CliError(
            f"no DAG {dag_id!r} in {folder} (DAGs found: {known})"
            + (f"; files that failed to import:{errors}" if errors else "")
            + "; give the file with --dag-file",
            EXIT_NOT_FOUND,
        )
    return dag


def _operator_class(task: Any) -> type:
    return getattr(task, "operator_class", type(task))


def _argument(task: Any, name: str, default: Any = None) -> Any:
    """An argument of a task as the DAG file gave it: ``partial()``'s for a mapped task."""
    partial = getattr(task, "partial_kwargs", None)
    if isinstance(partial, dict):
        return partial.get(name, default)
    return getattr(task, name, default)


def traverse_tasks(dag: Any) -> list[Any]:
    from ..operators.traverse import TraverseRangeOperator

    return [
        t for t in dag.tasks if issubclass(_operator_class(t), TraverseRangeOperator)
    ]  # fmt: skip


def _plan_of(dag: Any, task: Any) -> Any:
    from ..operators.plan import PlanRangesOperator

    plans = [
        dag.get_task(up)
        for up in sorted(task.upstream_task_ids)
        if isinstance(dag.get_task(up), PlanRangesOperator)
    ]
    if len(plans) != 1:
        raise CliError(
            f"DAG {dag.dag_id!r} task {task.task_id!r}: expected one PlanRangesOperator upstream, "
            f"found {len(plans)}; replay with --processor and the source flags instead",
            EXIT_USAGE,
        )
    return plans[0]


def dag_traverse(dag: Any, stream: str, task_id: str | None) -> DagTraverse:
    """The traverse task of ``dag`` that traverses ``stream`` (``task_id`` when given)."""
    from ..operators.traverse import _ENGINE_KNOBS

    candidates = traverse_tasks(dag)
    if task_id is not None:
        candidates = [t for t in candidates if t.task_id == task_id]
    found = []
    for task in candidates:
        plan = _plan_of(dag, task)
        if (plan.stream or dag.dag_id) == stream:
            found.append((task, plan))
    if len(found) != 1:
        names = ", ".join(t.task_id for t in traverse_tasks(dag)) or "none"
        what = "no" if not found else "more than one"
        raise CliError(
            f"DAG {dag.dag_id!r} has {what} traverse task of stream {stream!r}"
            + (f" with task id {task_id!r}" if task_id else "")
            + f" (traverse tasks: {names}); name one with --task-id",
            EXIT_NOT_FOUND if not found else EXIT_USAGE,
        )
    task, plan = found[0]
    engine_options = {
        name: _argument(task, name)
        for name in _ENGINE_KNOBS
        if name not in ("exactly_once", "prefetch") and _argument(task, name) is not None
    }
    return DagTraverse(
        dag_id=dag.dag_id,
        task_id=task.task_id,
        processor=_argument(task, "processor"),
        source_conn_id=plan.source_conn_id,
        redis_conn_id=plan.redis_conn_id,
        target_conn_id=_argument(task, "target_conn_id"),
        checkpoint_conn_id=plan.checkpoint_conn_id,
        exactly_once=bool(_argument(task, "exactly_once", False)),
        table=plan.table,
        key=plan.key if isinstance(plan.key, str) else list(plan.key),
        where=plan.where,
        where_params=plan.where_params,
        columns=list(plan.columns) if plan.columns is not None else None,
        stream=stream,
        key_prefix=plan.key_prefix,
        engine_options=engine_options,
    )


def templated(values: Sequence[Any]) -> bool:
    """Whether a value of the DAG is a Jinja template (rendered per run, not known here)."""
    return any(isinstance(v, str) and ("{{" in v or "{%" in v) for v in values)
