"""One process of a scale round: ``python -m benchmarks.scale.child <command> <json args>``.

``pull``  one pull-mode task (``traverse_round``) of a planned round over ``big`` (key ``id``),
          with the no-op or the write-back processor;
``loop``  the hand-written keyset loop (``baselines.keyset_loop``'s SQL, one fenced Redis advance
          per chunk) over one slice ``(lo, hi]`` of the key;
``copy``  ``COPY (SELECT id ... WHERE id > lo AND id <= hi) TO STDOUT`` into a sink.

Each imports, connects (engine: reflects the table), prints ``ready``, starts on a stdin line,
and prints one JSON object last: start/end (monotonic), CPU seconds, rows, peak RSS (``VmHWM``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

WB_EVERY = 100  # the write-back processor writes one row in WB_EVERY (id divisible by it)


def _hwm_kb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _wait_go() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


def writeback_processor(table: str, frm: str, to: str) -> Any:
    """Guarded write-back of the chunk's keys divisible by ``WB_EVERY``: ``status`` ``frm`` ->
    ``to`` in the chunk's own transaction (``chunk.connection``, committed when it returns)."""
    from airflow_keyset_provider.core.writeback import guarded_update

    def process(chunk: Any) -> Any:
        keys = [k for k in chunk.keys if k % WB_EVERY == 0]
        if not keys:
            return None
        out = guarded_update(
            chunk.connection, table, "id", keys, values={"status": to}, expected={"status": frm}
        )
        return out.to_chunk_result()

    return process


def pull_command(a: dict[str, Any]) -> dict[str, Any]:
    from airflow_keyset_provider.core import KeysetTraversal, TraverseOptions

    wb = a.get("writeback")
    t = KeysetTraversal(
        a["pg_url"],
        table=a["table"],
        key="id",
        redis_url=a["redis_url"],
        stream=a["stream"],
        key_prefix=a["prefix"],
        target_url=a["pg_url"] if wb else None,
    )
    t.source.validate()
    processor = writeback_processor(a["table"], wb[0], wb[1]) if wb else (lambda chunk: None)
    options = TraverseOptions(chunk_size=a["chunk_size"], owner_lineage=a["lineage"])
    _wait_go()
    cpu0, start = _cpu(), time.monotonic()
    res = t.traverse_round(
        a["round_id"],
        processor,
        options=options,
        first_range=a.get("first_range"),
        split=True,
        tasks=a["tasks"],
    )
    end, cpu1 = time.monotonic(), _cpu()
    t.close()
    d = res.as_dict()
    return {
        "rows": res.rows_read,
        "chunks": res.chunks,
        "claims": len(res.ranges),
        "coalesced": d["ranges_coalesced"],
        "splits_asked": res.splits_asked,
        "splits_won": res.splits_won,
        "finished": res.finished,
        "start": start,
        "end": end,
        "cpu_s": cpu1 - cpu0,
        "hwm_kb": _hwm_kb(),
    }


def loop_command(a: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.baselines import RedisCursor, int_cursor
    from benchmarks.context import BenchContext

    ctx = BenchContext(pg_url=a["pg_url"], redis_url=a["redis_url"], prefix=a["prefix"])
    lo, hi, chunk = a["lo"], a["hi"], a["chunk_size"]
    fence = RedisCursor(ctx, int_cursor(lo))
    sql = f"SELECT id FROM {a['table']} WHERE id > %s AND id <= %s ORDER BY id LIMIT %s"
    conn = ctx.pg()
    cur = conn.cursor()
    _wait_go()
    cpu0, start = _cpu(), time.monotonic()
    rows = 0
    cursor = lo
    while True:
        cur.execute(sql, (cursor, hi, chunk))
        got = cur.fetchall()
        if not got:
            break
        cursor = got[-1][0]
        fence.advance(int_cursor(cursor), len(got))
        rows += len(got)
        if len(got) < chunk:
            break
    end, cpu1 = time.monotonic(), _cpu()
    conn.close()
    fence.close()
    return {"rows": rows, "start": start, "end": end, "cpu_s": cpu1 - cpu0, "hwm_kb": _hwm_kb()}


class _Sink:
    def __init__(self) -> None:
        self.lines = 0

    def write(self, data: Any) -> int:
        self.lines += 1
        return len(data)


def copy_command(a: dict[str, Any]) -> dict[str, Any]:
    import psycopg2
    import sqlalchemy as sa

    dsn = sa.engine.make_url(a["pg_url"]).set(drivername="postgresql")
    conn = psycopg2.connect(dsn.render_as_string(hide_password=False))
    sink = _Sink()
    sql = f"COPY (SELECT id FROM {a['table']} WHERE id > {int(a['lo'])} AND id <= {int(a['hi'])}) TO STDOUT"
    _wait_go()
    cpu0, start = _cpu(), time.monotonic()
    with conn.cursor() as cur:
        cur.copy_expert(sql, sink)
    end, cpu1 = time.monotonic(), _cpu()
    conn.close()
    return {
        "rows": sink.lines,
        "start": start,
        "end": end,
        "cpu_s": cpu1 - cpu0,
        "hwm_kb": _hwm_kb(),
    }


COMMANDS = {"pull": pull_command, "loop": loop_command, "copy": copy_command}


def main(argv: list[str]) -> int:
    command, args = argv[0], json.loads(argv[1])
    print(json.dumps(COMMANDS[command](args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
