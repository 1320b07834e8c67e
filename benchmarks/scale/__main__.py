"""``python -m benchmarks.scale {build,round,airflow} --rows N [--repeat K] [--no-writeback]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from benchmarks.context import DEFAULT_PG_URL, DEFAULT_REDIS_URL, BenchContext
from benchmarks.scale import run
from benchmarks.scale.data import ensure_big, table_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__)
    p.add_argument("command", choices=["build", "round", "airflow"])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=10_000)
    p.add_argument("--no-writeback", action="store_true")
    p.add_argument(
        "--parallelism", type=int, default=4, help="AIRFLOW__CORE__PARALLELISM (airflow only)"
    )
    p.add_argument(
        "--tasks",
        type=int,
        default=16,
        help="the plan's max_tasks: mapped pull tasks (airflow only)",
    )
    p.add_argument(
        "--runs", type=int, default=1, help="DAG runs on the same deployment (airflow only)"
    )
    p.add_argument("--metadata", choices=["postgres", "sqlite"], default="postgres")
    p.add_argument("--pg-url", default=DEFAULT_PG_URL)
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    ctx = BenchContext(rows=a.rows, pg_url=a.pg_url, redis_url=a.redis_url, chunk_size=a.chunk_size)
    try:
        if a.command == "build":
            built = ensure_big(ctx, a.rows)
            print(json.dumps({**built, "bytes": table_bytes(ctx, built["schema"])}, default=str))
            return 0
        if a.command == "airflow":
            from benchmarks.scale import airflow_round

            print(airflow_round.main(ctx, a.rows, a.parallelism, a.metadata, a.tasks, a.runs))
            return 0
        raw = run.measure(ctx, a.rows, a.repeat, writeback=not a.no_writeback)
        summary = run.summarize(a.rows, raw, run.reference_summary())
        path = run.write({"summary": summary, "raw": raw}, a.rows)
        print(f"{run.text(summary)}\nJSON: {path}")
    finally:
        ctx.cleanup_redis()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
