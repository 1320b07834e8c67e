"""Work that must run in a fresh process: ``python -m benchmarks.child <command> <json args>``.

``round``  plan a round and traverse all its ranges in this process; print peak RSS.
``range``  traverse one range of an already planned round, starting when the parent writes a
           line to stdin (so several children start together); print start/end and CPU times.
``pull``   one pull-mode task (``traverse_round``) of an already planned round, started the same
           way; print start/end, CPU times, ranges run and splits.

Each prints one JSON object as its last stdout line.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _traversal(a: dict[str, Any]) -> Any:
    from airflow_keyset_provider.core import KeysetTraversal

    return KeysetTraversal(
        a["pg_url"],
        table=a["table"],
        key=a["key"],
        redis_url=a["redis_url"],
        stream=a["stream"],
        key_prefix=a["prefix"],
    )


def round_command(a: dict[str, Any]) -> dict[str, Any]:
    t = _traversal(a)
    rss_start = _status_kb("VmRSS")
    rnd = t.plan(max_ranges=a["ranges"], start_key=a["start"], end_key=a["end"])
    rows = 0
    started = time.perf_counter()
    for spec in rnd.ranges:
        res = t.traverse(
            rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=a["chunk_size"]
        )
        if not res.complete:
            raise RuntimeError(f"range {spec.range_id} incomplete: {res}")
        rows += res.rows_read
    seconds = time.perf_counter() - started
    totals = t.close_round(rnd.round_id)
    t.close()
    return {
        "rows": rows,
        "done": totals.done,
        "seconds": seconds,
        "round_id": rnd.round_id,
        "rss_before_kb": rss_start,
        "vm_hwm_kb": _status_kb("VmHWM"),
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def range_command(a: dict[str, Any]) -> dict[str, Any]:
    t = _traversal(a)
    t.source.validate()  # catalog reflection before the start line, as a warm worker would have
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, start = _cpu(), time.monotonic()
    res = t.traverse(
        a["round_id"],
        a["range_id"],
        lambda chunk: None,
        chunk_size=a["chunk_size"],
        **a.get("options", {}),
    )
    end, cpu1 = time.monotonic(), _cpu()
    t.close()
    return {
        "rows": res.rows_read,
        "complete": res.complete,
        "start": start,
        "end": end,
        "cpu_s": cpu1 - cpu0,
    }


def _processor(spec: dict[str, Any]) -> Any:
    """``{}``: a no-op. ``{"row_s": s, "slow_lo": lo, "slow_hi": hi, "factor": f}``: sleep ``s``
    per row, ``f * s`` per row whose key is in ``(lo, hi]`` (one sleep per chunk)."""
    if not spec:
        return lambda chunk: None
    row_s, lo, hi = spec["row_s"], spec["slow_lo"], spec["slow_hi"]
    slow_s = row_s * spec["factor"]

    def process(chunk: Any) -> None:
        keys = chunk.keys
        slow = sum(1 for k in keys if lo < k <= hi)
        time.sleep(slow * slow_s + (len(keys) - slow) * row_s)

    return process


def pull_command(a: dict[str, Any]) -> dict[str, Any]:
    from airflow_keyset_provider.core import TraverseOptions

    t = _traversal(a)
    t.source.validate()
    processor = _processor(a.get("processor") or {})
    options = TraverseOptions(chunk_size=a["chunk_size"], owner_lineage=a["lineage"])
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, start = _cpu(), time.monotonic()
    res = t.traverse_round(
        a["round_id"],
        processor,
        options=options,
        first_range=a.get("first_range"),
        split=a["split"],
        tasks=a.get("tasks"),
    )
    end, cpu1 = time.monotonic(), _cpu()
    t.close()
    return {
        "rows": res.rows_read,
        "ranges": len(res.ranges),
        "splits_asked": res.splits_asked,
        "splits_won": res.splits_won,
        "finished": res.finished,
        "start": start,
        "end": end,
        "cpu_s": cpu1 - cpu0,
    }


COMMANDS = {"round": round_command, "range": range_command, "pull": pull_command}


def main(argv: list[str]) -> int:
    command, args = argv[0], json.loads(argv[1])
    print(json.dumps(COMMANDS[command](args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
