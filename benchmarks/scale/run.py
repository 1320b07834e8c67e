"""``python -m benchmarks.scale round --rows N``: build or reuse the table, run the round, report.

Variants are interleaved per repetition (loop, copy, noop, few), then one write-back round per
repetition. Prints a table of ratios against the same run's baselines and the targets of issue
#22, and writes ``benchmarks/results/scale-<N>-<stamp>.json``; the RSS check compares with the
newest ``scale-10000000-*.json`` when there is one (the 10M run).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks import procs
from benchmarks.context import BenchContext
from benchmarks.report import RESULTS_DIR
from benchmarks.scale import round as sr
from benchmarks.scale.data import ensure_big, table_bytes

PLAN_BUDGET_S = 2.0
REDIS_BUDGET = 1_000_000
RSS_BUDGET_MB = 10.0
REFERENCE_ROWS = 10_000_000


def measure(
    ctx: BenchContext,
    rows: int,
    repeat: int,
    writeback: bool = True,
    shape: tuple[int, int, int] = (sr.TASKS, sr.MANY, sr.FEW),
) -> dict[str, Any]:
    """Every variant ``repeat`` times, interleaved; the raw figures of each run.

    ``shape``: (tasks, ranges of the round, ranges of the few-range round)."""
    tasks, many, few = shape
    built = ensure_big(ctx, rows)
    table, schema = built["table"], built["schema"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("loop", "copy", "noop", "few", "wb")}
    for _ in range(repeat):
        runs["loop"].append(sr.baseline(ctx, table, rows, "loop", tasks))
        runs["copy"].append(sr.baseline(ctx, table, rows, "copy", tasks))
        runs["noop"].append(sr.engine_round(ctx, table, rows, many, None, tasks))
        runs["few"].append(sr.engine_round(ctx, table, rows, few, None, tasks))
        if writeback:
            frm, to = sr.flip_status(ctx, schema)
            runs["wb"].append(sr.engine_round(ctx, table, rows, many, (frm, to), tasks))
            sr.record_status(ctx, schema, to)
    return {
        "built": built,
        "bytes": table_bytes(ctx, schema),
        "runs": runs,
        "shape": {"tasks": tasks, "ranges": many, "few": few},
    }


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(rows: int, raw: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """Ratios, costs and verdicts from the raw figures."""
    runs, shape = raw["runs"], raw["shape"]
    span = shape["ranges"] - shape["few"]
    t = {k: _med(v, "seconds") for k, v in runs.items() if v}
    noop = runs["noop"]
    hwm = max(max(r["hwm_mb"]) for r in noop + runs["wb"])
    redis = {s: max(r["redis_bytes"][s] for r in noop + runs["wb"]) for s in noop[0]["redis_bytes"]}
    s: dict[str, Any] = {
        "rows": rows,
        "tasks": shape["tasks"],
        "ranges": shape["ranges"],
        "cpus": procs.cpus(),
        "seconds": t,
        "rows_per_s": {k: rows / v for k, v in t.items()},
        "noop_vs_loop": t["loop"] / t["noop"],
        "noop_vs_copy": t["copy"] / t["noop"],
        "plan_s": max(r["plan_s"] for r in noop + runs["wb"]),
        "plan_s_few": max(r["plan_s"] for r in runs["few"]),
        "peak_rss_mb_per_task": hwm,
        "redis_bytes": redis,
        "redis_commands_per_range": _med(noop, "redis_commands") / shape["ranges"],
        "claims": _med(noop, "claims"),
        "coalesced": _med(noop, "coalesced"),
        "splits_won": _med(noop, "splits_won"),
        "splits_asked": _med(noop, "splits_asked"),
        "wall_us_per_row": t["few"] / rows * 1e6,
        "client_cpu_us_per_row": _med(runs["few"], "client_cpu_s") / rows * 1e6,
        "wall_ms_per_range": (t["noop"] - t["few"]) / span * 1000,
        "client_cpu_ms_per_range": (_med(noop, "client_cpu_s") - _med(runs["few"], "client_cpu_s"))
        / span
        * 1000,
        "table_bytes": raw["bytes"],
        "build_seconds": raw["built"]["seconds"],
        "loadavg": list(os.getloadavg()),
    }
    if runs["wb"]:
        written = runs["wb"][0]["written"]
        s["writeback_rows"] = written
        s["writeback_us_per_written_row"] = (t["wb"] - t["noop"]) / written * 1e6
    s["rss_reference_mb"] = reference["peak_rss_mb_per_task"] if reference else None
    s["verdicts"] = verdicts(s)
    return s


def verdicts(s: dict[str, Any]) -> dict[str, bool | None]:
    ref = s["rss_reference_mb"]
    return {
        "plan <= 2 s": s["plan_s"] <= PLAN_BUDGET_S,
        "RSS within 10 MB of the 10M run": None
        if ref is None
        else s["peak_rss_mb_per_task"] <= ref + RSS_BUDGET_MB,
        "Redis <= 1 MB": max(s["redis_bytes"].values()) <= REDIS_BUDGET,
        "no-op >= 1.0x hand loop": s["noop_vs_loop"] >= 1.0,
        "no-op >= 0.85x COPY": s["noop_vs_copy"] >= 0.85,
    }


def reference_summary(directory: Path = RESULTS_DIR) -> dict[str, Any] | None:
    found = sorted(directory.glob(f"scale-{REFERENCE_ROWS}-*.json"))
    return json.loads(found[-1].read_text())["summary"] if found else None


def write(doc: dict[str, Any], rows: int, directory: Path = RESULTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = directory / f"scale-{rows}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def text(s: dict[str, Any]) -> str:
    """The printed report."""
    t, r = s["seconds"], s["rows_per_s"]
    lines = [
        f"{s['rows']:,} rows, {s['tasks']} tasks on {s['cpus']} CPUs, load {s['loadavg'][0]:.1f}",
        *(f"  {k:<9} {t[k]:8.2f} s  {r[k] / 1e6:6.2f}M rows/s" for k in t),
        f"  no-op vs hand loop   {s['noop_vs_loop']:.2f}x (>= 1.00x)",
        f"  no-op vs COPY        {s['noop_vs_copy']:.2f}x (>= 0.85x)",
        f"  plan (4,096 ranges)  {s['plan_s']:.3f} s (<= 2 s); 16 ranges {s['plan_s_few']:.3f} s",
        f"  peak RSS per task    {s['peak_rss_mb_per_task']:.1f} MB "
        f"(10M run: {s['rss_reference_mb']})",
        f"  Redis bytes          {s['redis_bytes']} (<= 1,000,000)",
        f"  Redis commands/range {s['redis_commands_per_range']:.1f} (machine-wide upper bound)",
        f"  claims {s['claims']:.0f}, coalesced {s['coalesced']:.0f}, splits won "
        f"{s['splits_won']:.0f} of {s['splits_asked']:.0f} asked",
        f"  per row {s['wall_us_per_row']:.3f} us wall, {s['client_cpu_us_per_row']:.3f} us "
        f"client CPU; per range {s['wall_ms_per_range']:.2f} ms wall, "
        f"{s['client_cpu_ms_per_range']:.2f} ms client CPU",
    ]
    if "writeback_rows" in s:
        lines.append(
            f"  write-back: {s['writeback_rows']:,} rows written, "
            f"{s['writeback_us_per_written_row']:.1f} us of makespan per written row"
        )
    lines += [
        f"  [{'ok' if v else ('n/a' if v is None else 'MISS')}] {k}"
        for k, v in s["verdicts"].items()
    ]
    return "\n".join(lines)
