"""``airflow-keyset replay-dead-letters``: run a processor again over a round's dead letters.

What the traversal reads comes from the round itself: its hash in Redis keeps the source it was
planned over (``table``, ``key``, ``where``, ``where_params``, ``dialect``), so the command needs
only the database (``--source-url`` or ``--source-conn-id``) and the processor. ``--table``,
``--key`` and ``--where`` override the stored values; the engine still refuses a traversal whose
source differs from the round's, so an override can only say the same thing differently (e.g. a
key column list) or fail loudly. The round does not store the extra columns its processor was
given: without ``--columns`` the rows carry every column of the table (rows are mappings, so a
processor that reads a subset by name gets what it read before).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, TextIO

import sqlalchemy as sa

from ..core.rounds.control import StreamControl
from ..core.store.cursor_store import CursorStore
from ..extras import PROVIDER_HOOKS, provider_hook
from . import render
from .commands import connect_redis
from .exits import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, CliError


@dataclass(frozen=True)
class ReplaySource:
    """The source a replay traverses: the round's stored spec, then the flags over it."""

    table: str
    key: list[str]
    where: str | None
    where_params: dict[str, Any] | None
    dialect: str | None
    columns: list[str] | None  # None: every column of the table

    @classmethod
    def resolve(cls, stored: Any, args: argparse.Namespace) -> ReplaySource:
        """``stored`` is the round's ``source`` (a dict; a string or None from a round whose
        spec cannot be read); each flag given wins over the stored value."""
        spec = stored if isinstance(stored, dict) else {}
        table = args.table or spec.get("table")
        key = _split(args.key) if args.key else spec.get("key")
        if not table or not key:
            missing = [f for f, v in (("--table", table), ("--key", key)) if not v]
            raise CliError(
                f"round {args.round} does not record its source ({stored!r}); give "
                + " and ".join(missing),
                EXIT_USAGE,
            )
        where = args.where if args.where is not None else spec.get("where")
        return cls(
            table=str(table),
            key=[str(k) for k in ([key] if isinstance(key, str) else key)],
            where=where or None,
            where_params=spec.get("where_params") if args.where is None else None,
            dialect=spec.get("dialect"),
            columns=_split(args.columns) if args.columns else None,
        )


def _split(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _stored_source(args: argparse.Namespace, client: Any) -> Any:
    """The round's stored ``source`` (parsed JSON; None when the round has none). Raises the
    engine's ``RoundNotFoundError`` / ``RoundStateLostError`` for an unknown or lost round."""
    ctl = StreamControl(CursorStore(client, args.stream, prefix=args.key_prefix))
    ctl.require_stream()
    raw = ctl.store.round_info(args.round).get("source")
    return _parsed(raw) if raw else None


def _all_columns(engine: sa.Engine, table: str) -> list[str]:
    schema, _, name = table.rpartition(".")
    try:
        return [c["name"] for c in sa.inspect(engine).get_columns(name, schema=schema or None)]
    except sa.exc.NoSuchTableError as exc:
        raise CliError(
            f"table {table!r} does not exist in the source database", EXIT_USAGE
        ) from exc


def cmd_replay(args: argparse.Namespace, out: TextIO) -> int:
    from ..core.sql.source import make_engine
    from ..core.traversal import KeysetTraversal, load_processor

    processor = load_processor(args.processor)
    client = connect_redis(args)
    src = ReplaySource.resolve(_stored_source(args, client), args)
    engine = make_engine(_source_engine(args))
    if src.dialect and engine.dialect.name != src.dialect:
        raise CliError(
            f"round {args.round} was planned over a {src.dialect} table; the source given is "
            f"{engine.dialect.name}",
            EXIT_USAGE,
        )
    columns = src.columns if src.columns is not None else _all_columns(engine, src.table)
    t = KeysetTraversal(
        engine,
        src.table,
        src.key if len(src.key) > 1 else src.key[0],
        stream=args.stream,
        where=src.where,
        where_params=src.where_params,
        columns=columns,
        redis_client=client,
        key_prefix=args.key_prefix,
    )
    try:
        _refuse_other_rows(t, args)
        results = t.replay_dead_letters(
            args.round,
            processor=processor,
            range_id=args.range,
            chunk_size=args.chunk_size,
            max_item_attempts=args.max_item_attempts,
            item_retry_delay=args.item_retry_delay,
            owner_lineage=f"airflow-keyset/replay/{args.stream}/{args.round}",
        )
    finally:
        t.close()
        engine.dispose()
    return _report(args, out, [r.as_dict() for r in results])


def _refuse_other_rows(t: Any, args: argparse.Namespace) -> None:
    """Refuse, before anything is written, a source that is not the round's. The engine checks
    too, but only when it traverses: by then ``replay_dead_letters`` has moved the first range's
    letters back into its retry set, where they would wait for the next traversal."""
    raw = t.store.round_info(args.round).get("source")
    if raw and _parsed(raw) != _parsed(t.source.fingerprint()):
        raise CliError(
            f"round {args.round} was planned over {raw}, not {t.source.fingerprint()}; replay it "
            "with the same table, key and where (drop the overrides to use the round's own)",
            EXIT_USAGE,
        )


def _parsed(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


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


def _source_engine(args: argparse.Namespace) -> Any:
    """A SQLAlchemy URL or engine of the source: ``--source-conn-id`` (Airflow) or
    ``--source-url``."""
    if args.source_conn_id:
        try:
            from airflow.sdk import BaseHook
        except ImportError as exc:  # pragma: no cover - Airflow is a dependency
            raise CliError(f"--source-conn-id needs Apache Airflow: {exc}") from exc
        try:
            conn = BaseHook.get_connection(args.source_conn_id)
        except Exception as exc:
            raise CliError(f"Airflow connection {args.source_conn_id!r}: {exc}") from exc
        if conn.conn_type == "mysql":  # built from the fields: PyMySQL needs no mysql provider
            from ..hooks.mysql_url import mysql_url

            return mysql_url(conn)  # MissingExtraError names the extra of a missing driver
        if conn.conn_type in PROVIDER_HOOKS:
            provider_hook(conn.conn_type)  # MissingExtraError names the extra to install
        try:
            return conn.get_hook().get_sqlalchemy_engine()
        except Exception as exc:
            raise CliError(
                f"Airflow connection {args.source_conn_id!r} is not usable as a SQL source: {exc}"
            ) from exc
    if not args.source_url:
        raise CliError("give --source-url (a SQLAlchemy URL) or --source-conn-id", EXIT_USAGE)
    return args.source_url
