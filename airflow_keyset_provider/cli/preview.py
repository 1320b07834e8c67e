"""``airflow-keyset preview``: what the stream's next round would be and do, writing nothing.

The source, table, key and filter come from the command line (as for ``replay-dead-letters``
without ``--dag-id``); ``--processor`` with ``--target-url``/``--target-conn-id`` runs the
processor on the sample inside a target transaction that is rolled back
(``KeysetTraversal.preview``). Redis is only read. Exit 0 when the preview found no problem,
3 when it lists one (a full scan, keys the processor failed, a processor that raised, a stream
the plan would refuse).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from ..core.keys import coerce_bound, from_tuple, parse_bound
from ..core.preview.render import text_lines
from . import render
from .arguments import STREAM_ARG
from .commands import connect_redis
from .exits import EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, CliError
from .replay import ReplaySource, _all_columns, _sql_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "stream", metavar="STREAM", type=STREAM_ARG, help="the stream (a DAG's id by default)"
    )
    g = p.add_argument_group("what the round reads")
    g.add_argument("--source-url", default=None, help="SQLAlchemy URL of the source database")
    g.add_argument(
        "--source-conn-id", default=None, help="Airflow connection of the source (imports Airflow)"
    )
    g.add_argument("--table", default=None, help="table ('schema.table' allowed)")
    g.add_argument("--key", default=None, help="key column(s), comma-separated")
    g.add_argument("--where", default=None, help="the plan's where filter")
    g.add_argument("--where-params", default=None, help="the where's parameters, a JSON object")
    g.add_argument(
        "--columns",
        default=None,
        help="columns the processor needs, comma-separated (default: every column of the table)",
    )
    g.add_argument(
        "--start-key", default=None, help="exclusive lower bound (JSON; default: the watermark)"
    )
    g.add_argument(
        "--end-key", default=None, help="inclusive upper bound (JSON; default: max(key))"
    )
    g.add_argument("--max-ranges", type=int, default=16, help="the plan's max_ranges (default 16)")
    g.add_argument(
        "--new-stream", action="store_true", help="the stream is new (its first plan says so too)"
    )
    g = p.add_argument_group("what the round does")
    g.add_argument("--processor", default=None, metavar="pkg.mod:fn", help="the processor to try")
    g.add_argument(
        "--target-url",
        default=None,
        help="SQLAlchemy URL of the database the processor writes to (rolled back)",
    )
    g.add_argument("--target-conn-id", default=None, help="Airflow connection of that database")
    g.add_argument("--chunk-size", type=int, default=1000, help="keys per chunk (default 1000)")
    g.add_argument(
        "--workers", type=int, default=1, help="traverse tasks running at once, for the ETA"
    )
    g.add_argument(
        "--sample-chunks", type=int, default=8, help="chunks read (and processed) as the sample"
    )


def _bound(t: Any, name: str, raw: str | None) -> Any:
    value = parse_bound(raw)
    if value is None:
        return None
    return from_tuple(coerce_bound(name, value, t.source.key_kinds, from_text=True), t.arity)


def cmd_preview(args: argparse.Namespace, out: TextIO) -> int:
    from ..core.chunk import load_processor
    from ..core.sql.source import make_engine
    from ..core.traversal import KeysetTraversal

    if not (args.source_url or args.source_conn_id):
        raise CliError("give --source-url or --source-conn-id", EXIT_USAGE)
    src = ReplaySource.from_flags(args)
    engine = make_engine(_sql_engine(args, "source"))
    target = _sql_engine(args, "target") if (args.target_url or args.target_conn_id) else None
    processor = load_processor(args.processor) if args.processor else None
    columns = src.columns if src.columns is not None else _all_columns(engine, src.table)
    t = KeysetTraversal(
        engine,
        src.table,
        src.key if len(src.key) > 1 else src.key[0],
        stream=args.stream,
        where=src.where,
        where_params=src.where_params,
        columns=columns,
        redis_client=connect_redis(args),
        key_prefix=args.key_prefix,
        target_url=target,
    )
    try:
        t.source.validate()
        preview = t.preview(
            args.max_ranges,
            _bound(t, "start_key", args.start_key),
            _bound(t, "end_key", args.end_key),
            processor=processor,
            chunk_size=args.chunk_size,
            workers=args.workers,
            sample_chunks=args.sample_chunks,
            new_stream=args.new_stream,
        )
    finally:
        t.close()
        engine.dispose()
    doc = preview.as_dict()
    if args.json:
        render.emit_json(out, doc)
    else:
        con = render.console(out)
        for line in text_lines(doc):
            con.print(line, markup=False, highlight=False)
    return EXIT_INCOMPLETE if doc["problems"] else EXIT_OK
