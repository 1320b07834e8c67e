"""Command line: ``python -m benchmarks [--rows N] [--repeat K] [--only NAME ...] [--json]``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import metrics, report
from benchmarks.context import (
    DEFAULT_MARIADB_URL,
    DEFAULT_MYSQL_URL,
    DEFAULT_PG_URL,
    DEFAULT_REDIS_URL,
    BenchContext,
)
from benchmarks.data import drop_schema

log = logging.getLogger("benchmarks")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument(
        "--rows",
        type=int,
        default=2_000_000,
        help="rows of the main tables (default 2,000,000; "
        "the issue's figures are at 10,000,000: make bench-10m)",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="repetitions per measurement; medians are reported"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this group or metric (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the JSON document on stdout (table on stderr)"
    )
    p.add_argument("--schema", default="kbench", help="PostgreSQL schema of the benchmark tables")
    p.add_argument(
        "--drop-schema",
        action="store_true",
        help="drop the schema (and the MariaDB database of that name) at the end (default: keep)",
    )
    p.add_argument(
        "--pg-url", default=DEFAULT_PG_URL, help="SQLAlchemy URL (env KEYSET_BENCH_POSTGRES_URL)"
    )
    p.add_argument(
        "--redis-url", default=DEFAULT_REDIS_URL, help="Redis URL (env KEYSET_BENCH_REDIS_URL)"
    )
    p.add_argument(
        "--mysql-url",
        default=DEFAULT_MYSQL_URL,
        help="MariaDB/MySQL server URL, no database, for write-back (env KEYSET_BENCH_MYSQL_URL)",
    )
    p.add_argument(
        "--mariadb-url",
        default=DEFAULT_MARIADB_URL,
        help="SQLAlchemy URL of MariaDB/MySQL for the source group (env KEYSET_BENCH_MARIADB_URL)",
    )
    p.add_argument("--chunk-size", type=int, default=10_000)
    p.add_argument(
        "--io-wait-ms", type=float, default=3.0, help="wait per chunk of the I/O-bound processor"
    )
    p.add_argument(
        "--wb-rows", type=int, default=10_000, help="keys written by the write-back metrics"
    )
    p.add_argument(
        "--deco-rows",
        type=int,
        default=1_000_000,
        help="orders the decorator example cancels (group decorator_example; default 1,000,000)",
    )
    p.add_argument("--results-dir", type=Path, default=report.RESULTS_DIR)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.only = [x for item in args.only for x in item.split(",") if x]
    if args.rows < 1000 or args.repeat < 1:
        p.error("--rows must be >= 1000 and --repeat >= 1")
    return args


def run_groups(ctx: BenchContext, groups: list[str]) -> tuple[list[report.Metric], bool]:
    """Every group's rows; a group that raises becomes ``n/a`` rows carrying the error."""
    out: list[report.Metric] = []
    ok = True
    for group in groups:
        started = time.perf_counter()
        log.info("running %s", group)
        try:
            out += metrics.runner(group)(ctx)
        except Exception as exc:
            ok = False
            log.error("group %s failed:\n%s", group, traceback.format_exc())
            out += [
                report.not_available(name, group, name, "", f"error: {type(exc).__name__}: {exc}")
                for name in metrics.GROUPS[group][1]
            ]
        log.info("%s done in %.1f s", group, time.perf_counter() - started)
    return out, ok


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("benchmarks").setLevel(logging.INFO)
    try:
        groups = metrics.resolve(args.only)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    ctx = BenchContext(
        rows=args.rows,
        repeat=args.repeat,
        schema=args.schema,
        pg_url=args.pg_url,
        redis_url=args.redis_url,
        mysql_url=args.mysql_url,
        mariadb_url=args.mariadb_url,
        chunk_size=args.chunk_size,
        io_wait_ms=args.io_wait_ms,
        wb_rows=args.wb_rows,
        deco_rows=args.deco_rows,
    )
    started = time.perf_counter()
    load_at_start = list(os.getloadavg())
    try:
        results, ok = run_groups(ctx, groups)
    finally:
        ctx.cleanup_redis()
        if args.drop_schema:
            drop_schema(ctx)
            if "mariadb" in groups:
                from benchmarks.metrics.mariadb import drop_database

                drop_database(ctx)
    settings: dict[str, Any] = {
        "rows": ctx.rows,
        "small_rows": ctx.small_rows,
        "repeat": ctx.repeat,
        "chunk_size": ctx.chunk_size,
        "io_wait_ms": ctx.io_wait_ms,
        "wb_rows": ctx.wb_rows,
        "deco_rows": ctx.deco_rows,
        "ranges": ctx.ranges,
        "groups": groups,
        "loadavg_at_start": load_at_start,
    }
    doc = report.document(results, settings, time.perf_counter() - started)
    path = report.write_json(doc, args.results_dir)
    text = (
        f"{report.table(results)}\n\nnotes:\n{report.notes(results)}\n\n"
        f"{ctx.rows:,} rows, {ctx.repeat} repetitions, {doc['seconds']} s; JSON: {path}"
    )
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(text)
    return 0 if ok else 1
