"""``airflow-keyset replay-dead-letters``: run a processor again over a round's dead letters.

Redis is not a source of SQL: what the replay reads (table, key, ``where``, ``where_params``)
comes from the DAG or from the command line, never from the round's record in Redis, which is
only compared with it (the engine refuses a round planned over other rows before any letter
moves). Two ways to say it:

- ``--dag-id DAG`` (``--task-id``, ``--dag-file``): the DAG's own traverse task gives the
  processor (``@task.keyset_traverse`` functions included), the target connection,
  ``exactly_once`` and its tuning, and its plan gives the source connection, table, key,
  ``where``, columns, key prefix and Redis connection (``cli/dag_task.py``). A templated ``where``
  is not known outside a run: give it with ``--where`` (compared with the round's).
- ``--processor pkg.mod:fn`` with ``--source-url``/``--source-conn-id``, ``--table``, ``--key``
  and, if the round had one, ``--where`` (``--where-params`` as JSON); ``--target-url`` /
  ``--target-conn-id`` give the processor ``chunk.connection`` and ``--exactly-once`` its ledger.

A replay that fails puts the letters it moved and that did not reach a terminal state back in
the dead letters, as they were, and says so (exit 1).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, TextIO

import sqlalchemy as sa

from ..core.errors import ConfigurationError
from ..extras import PROVIDER_HOOKS, provider_hook
from . import render
from .commands import connect_redis
from .dag_task import DagTraverse, dag_traverse, load_dag, templated
from .exits import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, CliError


@dataclass(frozen=True)
class ReplaySource:
    """The rows a replay reads, as the DAG or the command line says (never Redis)."""

    table: str
    key: list[str]
    where: str | None
    where_params: dict[str, Any] | None
    columns: list[str] | None  # None: every column of the table

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> ReplaySource:
        missing = [f for f, v in (("--table", args.table), ("--key", args.key)) if not v]
        if missing:
            raise CliError(
                "give " + " and ".join(missing) + " (with --where if the round was planned "
                "with one), or --dag-id to take them from the DAG: a replay never takes the "
                "rows it reads from Redis",
                EXIT_USAGE,
            )
        return cls(
            table=args.table,
            key=_split(args.key),
            where=args.where or None,
            where_params=_where_params(args),
            columns=_split(args.columns) if args.columns else None,
        )

    @classmethod
    def from_dag(cls, task: DagTraverse, where_given: str | None) -> ReplaySource:
        """The DAG's source; ``where_given`` only for a templated ``where`` (its rendering)."""
        where = task.where
        if where_given is not None:
            if not templated([task.where]):
                raise CliError("--where comes from the DAG with --dag-id", EXIT_USAGE)
            where = where_given
        elif templated([task.where, task.table]):
            raise CliError(
                f"DAG {task.dag_id!r} task {task.task_id!r} has a templated table or where "
                f"({task.where!r}), rendered per run; give the round's rendered where with "
                "--where (it is compared with the round's)",
                EXIT_USAGE,
            )
        return cls(
            table=task.table,
            key=[task.key] if isinstance(task.key, str) else list(task.key),
            where=where or None,
            where_params=task.where_params,
            columns=task.columns,
        )


def _split(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _where_params(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.where_params:
        return None
    try:
        params = json.loads(args.where_params)
    except ValueError as exc:
        raise CliError(f"--where-params is not JSON: {exc}", EXIT_USAGE) from exc
    if not isinstance(params, dict):
        raise CliError("--where-params must be a JSON object", EXIT_USAGE)
    return params


def _all_columns(engine: sa.Engine, table: str) -> list[str]:
    schema, _, name = table.rpartition(".")
    try:
        return [c["name"] for c in sa.inspect(engine).get_columns(name, schema=schema or None)]
    except sa.exc.NoSuchTableError as exc:
        raise CliError(
            f"table {table!r} does not exist in the source database", EXIT_USAGE
        ) from exc


def cmd_replay(args: argparse.Namespace, out: TextIO) -> int:
    from ..core.chunk import load_processor

    if args.dag_id:
        replay = _from_dag(args)
    else:
        if not args.processor:
            raise CliError("give --processor pkg.mod:fn, or --dag-id to use the DAG's", EXIT_USAGE)
        processor = load_processor(args.processor)
        replay = DagReplay(None, _from_flags(args), processor, {"exactly_once": args.exactly_once})
    replay.options.update(
        {
            name: value
            for name in (
                "chunk_size",
                "max_item_attempts",
                "item_retry_delay",
                "retry_budget_seconds",
            )
            if (value := getattr(args, name)) is not None
        }
    )
    try:
        rows = replay.run(
            args.round,
            args.range,
            f"airflow-keyset/replay/{args.stream}/{args.round}",  # plugins/status.py CLI_REPLAY_LINEAGE
        )
    finally:
        replay.close()
    return _report(args, out, rows)


def _from_dag(args: argparse.Namespace) -> DagReplay:
    """The traversal, processor and options of the DAG's traverse task (``dag_task.py``)."""
    for flag in ("source_url", "source_conn_id", "target_url", "target_conn_id", "table", "key",
                 "columns", "where_params"):  # fmt: skip
        if getattr(args, flag):
            raise CliError(
                f"--{flag.replace('_', '-')} comes from the DAG with --dag-id", EXIT_USAGE
            )
    prepared = DagReplay.prepare(
        args.stream,
        args.dag_id,
        task_id=args.task_id,
        dag_file=args.dag_file,
        where=args.where,
        processor=args.processor,
        redis_conn_id=args.redis_conn_id,
    )
    assert prepared.task is not None
    args.key_prefix = prepared.task.key_prefix  # where the DAG's rounds live (for the report too)
    return prepared


@dataclass
class DagReplay:
    """A replay through a DAG's own traverse task, ready to run: the traversal over the DAG's
    source (``ReplaySource.from_dag``: table, key, ``where``, columns; never Redis), the task's
    processor (decorator functions included) and its options (target connection,
    ``exactly_once``, tuning). ``airflow-keyset replay-dead-letters`` (``task`` None with
    ``--processor`` and the source flags) and the page's replay route (``plugins/replays.py``)
    both run a replay through this, and only this."""

    task: DagTraverse | None
    traversal: Any
    processor: Any
    options: dict[str, Any]

    @classmethod
    def prepare(
        cls,
        stream: str,
        dag_id: str,
        *,
        task_id: str | None = None,
        dag_file: str | None = None,
        where: str | None = None,
        processor: str | None = None,
        redis_conn_id: str | None = None,
    ) -> DagReplay:
        """Parse the DAG (``dag_file`` or the DAGs folder), find its traverse task of ``stream``
        and build the traversal; ``CliError`` (with its exit code) names what is wrong.
        ``redis_conn_id`` None: the plan's; ``where``: a templated ``where``'s rendering."""
        from ..core.chunk import load_processor
        from ..hooks.keyset import KeysetHook

        task = dag_traverse(load_dag(dag_id, dag_file), stream, task_id)
        src = ReplaySource.from_dag(task, where)
        hook = KeysetHook(
            task.source_conn_id,
            redis_conn_id or task.redis_conn_id,
            task.checkpoint_conn_id,
            task.target_conn_id,
        )
        try:
            t = hook.traversal(
                table=src.table,
                key=src.key if len(src.key) > 1 else src.key[0],
                stream=stream,
                where=src.where,
                where_params=src.where_params,
                columns=src.columns,
                key_prefix=task.key_prefix,
            )
        except ConfigurationError as exc:
            raise CliError(f"DAG {task.dag_id!r} task {task.task_id!r}: {exc}", EXIT_USAGE) from exc
        options = {**task.engine_options, "exactly_once": task.exactly_once}
        return cls(task, t, load_processor(processor or task.processor), options)

    def run(
        self, round_id: str, range_id: int | None, owner_lineage: str, **overrides: Any
    ) -> list[dict[str, Any]]:
        """``KeysetTraversal.replay_dead_letters`` with the task's processor and options
        (``overrides`` on top); each replayed range's result as a dict. Raises what the engine
        raises (``ReplayFailedError`` after putting the letters back, ``LeaseHeldError`` with
        nothing moved, ``ConfigurationError`` for a round planned over other rows)."""
        results = self.traversal.replay_dead_letters(
            round_id,
            processor=self.processor,
            range_id=range_id,
            owner_lineage=owner_lineage,
            **{**self.options, **overrides},
        )
        return [r.as_dict() for r in results]

    def close(self) -> None:
        self.traversal.close()


def _from_flags(args: argparse.Namespace) -> Any:
    """The traversal the flags describe (``--source-*``, ``--target-*``, ``--table`` ...)."""
    from ..core.sql.source import make_engine
    from ..core.traversal import KeysetTraversal

    src = ReplaySource.from_flags(args)
    client = connect_redis(args)
    engine = make_engine(_sql_engine(args, "source"))
    target = _sql_engine(args, "target") if (args.target_url or args.target_conn_id) else None
    if args.exactly_once and target is None:
        raise CliError("--exactly-once needs --target-url or --target-conn-id", EXIT_USAGE)
    columns = src.columns if src.columns is not None else _all_columns(engine, src.table)
    return KeysetTraversal(
        engine,
        src.table,
        src.key if len(src.key) > 1 else src.key[0],
        stream=args.stream,
        where=src.where,
        where_params=src.where_params,
        columns=columns,
        redis_client=client,
        key_prefix=args.key_prefix,
        target_url=target,
    )


def _report(args: argparse.Namespace, out: TextIO, rows: list[dict[str, Any]]) -> int:
    still_dead = sum(r["dead"] for r in rows)
    if args.json:
        render.emit_json(
            out,
            {
                "stream": args.stream,
                "round_id": args.round,
                "range_id": args.range,
                "ranges": rows,
                "still_dead": still_dead,
            },
        )
    else:
        con = render.console(out)
        scope = f"range {args.range}" if args.range is not None else "every range"
        if not rows:
            con.print(f"round {args.round} ({scope}): no dead letters to replay")
        for r in rows:
            con.print(
                f"round {args.round} range {r['range_id']}: replayed; now done {r['done']:,}, "
                f"skipped {r['skipped']:,}, dead {r['dead']:,}; complete {r['complete']}"
            )
    return EXIT_INCOMPLETE if still_dead else EXIT_OK


def _sql_engine(args: argparse.Namespace, role: str) -> Any:
    """A SQLAlchemy URL or engine of the source or target: ``--<role>-conn-id`` (Airflow) or
    ``--<role>-url``."""
    conn_id, url = getattr(args, f"{role}_conn_id"), getattr(args, f"{role}_url")
    if conn_id:
        try:
            from airflow.sdk import BaseHook
        except ImportError as exc:  # pragma: no cover - Airflow is a dependency
            raise CliError(f"--{role}-conn-id needs Apache Airflow: {exc}") from exc
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception as exc:
            raise CliError(f"Airflow connection {conn_id!r}: {exc}") from exc
        if conn.conn_type == "mysql":  # built from the fields: PyMySQL needs no mysql provider
            from ..hooks.mysql_url import mysql_url

            return mysql_url(conn)  # MissingExtraError names the extra of a missing driver
        if conn.conn_type in PROVIDER_HOOKS:
            provider_hook(conn.conn_type)  # MissingExtraError names the extra to install
        try:
            return conn.get_hook().get_sqlalchemy_engine()
        except Exception as exc:
            raise CliError(
                f"Airflow connection {conn_id!r} is not usable as a SQL {role}: {exc}"
            ) from exc
    if not url:
        raise CliError(f"give --{role}-url (a SQLAlchemy URL) or --{role}-conn-id", EXIT_USAGE)
    return url
