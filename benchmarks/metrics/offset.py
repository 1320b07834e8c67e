"""Target 9: why keyset paging, not OFFSET: a full-traversal estimate at 10M rows.

A 10k-row page is read at a few depths of ``seq`` with ``ORDER BY seq OFFSET d LIMIT n`` and
with the engine's keyset read (``SqlSource.fetch``, the statement ``traverse`` runs). OFFSET
time is fitted as ``a + b * depth`` (it walks ``depth`` index entries); a full traversal of
``R`` rows is ``sum over pages`` of that, against ``pages * median keyset page``. The verdict
uses ``R = max(N, 10M)``, extrapolating the fit beyond the measured depths when N < 10M (the
details also give the estimate at N).
"""

from __future__ import annotations

from airflow_keyset_provider.core.keys import encode_key
from benchmarks import baselines, project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Stopwatch, median

TARGET_ROWS = 10_000_000


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def offset_cost(depths: list[int], seconds: list[float]) -> tuple[float, float]:
    """Fitted ``(a, b)``; a slope below zero is noise (tiny tables) and is taken as zero."""
    a, b = fit_line([float(d) for d in depths], seconds)
    return (a, b) if b >= 0 else (median(seconds), 0.0)


def full_offset_seconds(a: float, b: float, rows: int, page: int) -> float:
    pages = -(-rows // page)
    return pages * a + b * page * pages * (pages - 1) / 2


def run(ctx: BenchContext) -> list[Metric]:
    table = ensure_table(ctx, "seq")
    page = ctx.chunk_size
    depths = sorted({0, ctx.rows // 4, ctx.rows // 2, 3 * ctx.rows // 4, max(ctx.rows - page, 0)})
    t = project.traversal(ctx, table, "seq", "offset")
    t.source.validate()
    hi = encode_key((ctx.rows,))
    conn = ctx.pg()
    off_times: dict[int, float] = {}
    key_times: dict[int, float] = {}
    try:
        cur = conn.cursor()
        for d in depths:
            offs, keys = [], []
            for _ in range(ctx.repeat):
                offs.append(baselines.offset_page(cur, table, d, page))
                with Stopwatch() as sw:
                    got = t.source.fetch(encode_key((d,)), hi, page)
                keys.append(sw.seconds)
                if got and got[0][0] != d + 1:
                    raise RuntimeError(f"keyset page at depth {d} starts at {got[0][0]}")
            off_times[d], key_times[d] = median(offs), median(keys)
    finally:
        conn.close()
        t.close()
    a, b = offset_cost(depths, [off_times[d] for d in depths])
    keyset_page = median(list(key_times.values()))
    rows = max(ctx.rows, TARGET_ROWS)
    offset_total = full_offset_seconds(a, b, rows, page)
    keyset_total = -(-rows // page) * keyset_page
    at_n = full_offset_seconds(a, b, ctx.rows, page) / (-(-ctx.rows // page) * keyset_page)
    note = (
        f"full traversal of {rows:,} rows: OFFSET ~{offset_total:,.0f} s vs keyset ~{keyset_total:.1f} s; "
        f"page at depth {depths[-1]:,}: OFFSET {off_times[depths[-1]] * 1000:.0f} ms, keyset "
        f"{key_times[depths[-1]] * 1000:.1f} ms; estimate at N: {at_n:.0f}x"
        + ("" if ctx.rows >= TARGET_ROWS else f" (10M extrapolated from depths <= {depths[-1]:,})")
    )
    return [
        Metric(
            "keyset_vs_offset",
            "offset",
            "full traversal estimate: OFFSET paging vs keyset (engine)",
            keyset_total,
            offset_total,
            "s",
            offset_total / keyset_total,
            ">= 50x (at 10M)",
            offset_total / keyset_total >= 50,
            note,
            {
                "depths": depths,
                "offset_page_s": off_times,
                "keyset_page_s": key_times,
                "fit": [a, b],
                "ratio_at_n": at_n,
                "estimated_rows": rows,
            },
        )
    ]
