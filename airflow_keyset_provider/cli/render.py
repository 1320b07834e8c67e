"""Human rendering (rich) of the status model: streams, rounds, ranges, owners.

Renders ``core.status`` records only; every number and every duration comes from there
(``format_duration`` / ``format_rate``), so the terminal says what ``--json`` and the page say.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, TextIO

from ..core.rounds.status import (
    RangeState,
    RoundStatus,
    StreamStatus,
    format_duration,
    format_rate,
    iso_ms,
)

#: The width of output that is not a terminal and names none (``COLUMNS`` unset): wide enough
#: that no table is ever cut (rich shrinks a table only to fit the width it is given).
PIPE_WIDTH = 10_000


def output_width(out: TextIO) -> int | None:
    """The width tables are laid out in: a terminal's own (rich reads it, ``COLUMNS`` too);
    elsewhere ``COLUMNS`` when set, else ``PIPE_WIDTH``: a pipe or a file gets every cell in
    full, never ``ra…`` (rows are as long as their longest cell)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if out.isatty() else PIPE_WIDTH


def console(out: TextIO) -> Any:
    from rich.console import Console

    interactive = out.isatty()
    return Console(
        file=out,
        width=output_width(out),
        no_color=not interactive,
        highlight=False,
        soft_wrap=True,
    )


def emit_json(out: TextIO, value: Any) -> None:
    json.dump(value, out, indent=2, default=str)
    out.write("\n")


def _bar(fraction: float | None) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    if fraction is None:
        grid.add_row(ProgressBar(total=None, width=12, pulse=True), "   ?")
    else:
        grid.add_row(
            ProgressBar(total=1.0, completed=fraction, width=12), f"{fraction * 100:3.0f}%"
        )
    return grid


def owner_label(owner: str, *, full: bool = False) -> str:
    """``dag/run/task/map#token`` -> ``task/map#tokpfx`` (the run is the round's); full: as is."""
    if not owner or full:
        return owner or "-"
    lineage, _, token = owner.rpartition("#")
    if not lineage:
        return owner[:24]
    tail = "/".join(lineage.split("/")[-2:])
    return f"{tail}#{token[:6]}"


def table(title: str | None = None) -> Any:
    from rich import box
    from rich.table import Table

    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )


def range_table(rnd: RoundStatus, *, title: str | None = None, wide: bool = False) -> Any:
    """One row per range. ``wide`` (the ``ranges`` command) shows bounds and chunks instead of
    rate, ETA and owner; ``owner_table`` then lists ownership."""
    t = table(title)
    cols = [
        ("range", "right"),
        ("cursor", "left"),
        ("progress", "left"),
        ("state", "left"),
        ("done", "right"),
        ("skip", "right"),
        ("dead", "right"),
        ("retry", "right"),
    ]
    if wide:
        cols[1:1] = [("(lo, hi]", "left")]
        cols += [("chunks", "right")]
    else:
        cols += [("rate", "right"), ("ETA", "right"), ("owner", "left"), ("beat", "right")]
    for name, justify in cols:
        t.add_column(name, justify=justify, no_wrap=True)
    for r in rnd.in_key_order:
        lagging = not rnd.closed and not r.complete
        cells: list[Any] = [
            str(r.range_id),
            r.cursor_label,
            _bar(r.progress),
            f"[yellow]{r.state}[/]"
            if lagging
            else (f"coalesced into {r.merged_into}" if r.merged_into is not None else str(r.state)),
            f"{r.done:,}",
            f"{r.skipped:,}",
            f"[red]{r.dead:,}[/]" if r.dead else "0",
            f"{r.retries:,}",
        ]
        if wide:
            cells[1:1] = [f"({r.lo_label}, {r.hi_label}]"]
            cells += [f"{r.chunks:,}"]
        else:
            expired = bool(r.owner) and r.lease_left_s <= 0
            cells += [
                "-" if r.complete and not r.rate else format_rate(r.rate),
                "-" if r.complete else format_duration(r.eta_s),
                ("[red]expired[/] " if expired else "") + owner_label(r.owner),
                format_duration(r.heartbeat_age_s) if r.owner else "-",
            ]
        t.add_row(*cells)
    return t


def owner_table(rnd: RoundStatus) -> Any:
    """Ranges with an owner now, or taken over before: full owner token, lease, heartbeat, takeovers."""
    t = table()
    for name in ("range", "owner", "lease left", "last beat", "takeovers"):
        t.add_column(name, no_wrap=True)
    for r in rnd.ranges:
        if r.owner or r.takeovers:
            beat = r.heartbeat_age_s
            t.add_row(
                str(r.range_id),
                owner_label(r.owner, full=True),
                format_duration(r.lease_left_s) if r.owner else "-",
                f"{format_duration(beat)} ago" if beat is not None else "-",
                str(r.takeovers),
            )
    return t


def _pct(fraction: float | None) -> str:
    return "?" if fraction is None else f"{fraction * 100:.1f}%"


def render_round(con: Any, rnd: RoundStatus, *, wide: bool = False) -> None:
    head = (
        f"[bold]round {rnd.round_id}[/] ({rnd.start_label}, {rnd.end_label}]  {rnd.state}"
        f"{'  chained' if rnd.chained else ''}"
        f"{'  key ' + rnd.round_key if rnd.round_key else ''}  planned {rnd.created_at or '-'}"
    )
    if rnd.closed_at:
        head += f"  closed {rnd.closed_at}"
    con.print(head)
    eta = rnd.eta_s is not None and not rnd.closed
    con.print(
        f"  {rnd.ranges_complete}/{rnd.n_ranges} ranges complete"
        + (f" ({rnd.ranges_merged:,} coalesced)" if rnd.ranges_merged else "")
        + f", {_pct(rnd.progress)} of key space; "
        f"done {rnd.done:,}, skipped {rnd.skipped:,}, dead {rnd.dead:,}, retry {rnd.retries:,}; "
        f"rate {format_rate(rnd.rate)}"
        + (f" ({rnd.rate_basis})" if rnd.rate_basis else "")
        + (f", ETA {format_duration(rnd.eta_s)}" if eta else "")
    )
    if rnd.verification_text is not None:
        from rich.markup import escape

        con.print(f"  verify: {escape(rnd.verification_text)}")
    con.print(range_table(rnd, wide=wide))
    if wide and any(r.owner or r.takeovers for r in rnd.ranges):
        con.print(owner_table(rnd))


def render_lagging(con: Any, rnd: RoundStatus) -> None:
    """The ``ranges`` command's list of unfinished ranges of an open round."""
    lagging = [r for r in rnd.ranges if r.state != RangeState.COMPLETE]
    if lagging and not rnd.closed:
        con.print("lagging:")
        for r in lagging:
            con.print(f"  {r.describe()}")


def render_stream(con: Any, snap: StreamStatus) -> None:
    con.print(
        f"[bold]stream {snap.stream}[/] (prefix {snap.key_prefix})  watermark "
        f"{snap.watermark_label or '-'}  retention floor {snap.retention_floor_label or '-'}  "
        f"open rounds {len(snap.open_rounds)}  planned {snap.rounds_planned}"
    )
    line = control_line(snap)
    if line:
        con.print(f"  {line}")
    if not snap.rounds:
        con.print("  no open rounds")
    for rnd in snap.rounds:
        render_round(con, rnd)


def control_line(snap: StreamStatus) -> str:
    """``PAUSED (reason) since ...; throttled to R rows/s`` or "" when neither."""
    c = snap.control
    parts = []
    if c.paused:
        since = iso_ms(c.paused_at_ms) or "?"
        by = f" by {c.paused_by}" if c.paused_by else ""
        parts.append(f"[bold red]PAUSED[/]{by} since {since}: {c.reason or 'no reason given'}")
    if c.max_rows_per_second is not None:
        parts.append(f"throttled to {c.max_rows_per_second:,.0f} rows/s (shared by every task)")
    return "; ".join(parts)


def render_streams(
    con: Any, streams: Sequence[StreamStatus], prefix: str, redis_label: str = ""
) -> None:
    """The streams table; ``redis_label`` (which Redis was read, password redacted) is named
    when there is none."""
    if not streams:
        in_redis = f" in Redis {redis_label}" if redis_label else ""
        con.print(f"no streams under key prefix {prefix!r}{in_redis}")
        return
    t = table()
    for c in ("stream", "watermark", "retention floor", "open rounds", "planned"):
        t.add_column(c, no_wrap=True)
    for s in streams:
        t.add_row(
            s.stream,
            s.watermark_label or "-",
            s.retention_floor_label or "-",
            ", ".join(s.open_rounds) or "-",
            str(s.rounds_planned),
        )
    con.print(t)


def watch_view(snap: StreamStatus, every: float) -> Any:
    """One ``--watch`` frame: a header line and a range table per round."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [
        Text(
            f"stream {snap.stream}  watermark {snap.watermark_label or '-'}  "
            f"retention floor {snap.retention_floor_label or '-'}  "
            f"(every {every:g} s, Ctrl-C to stop)"
        )
    ]
    for rnd in snap.rounds:
        title = (
            f"round {rnd.round_id} ({rnd.start_label}, {rnd.end_label}] {rnd.state}  "
            f"{_pct(rnd.progress)}  rate {format_rate(rnd.rate)}  ETA {format_duration(rnd.eta_s)}"
        )
        parts.append(range_table(rnd, title=title))
    if not snap.rounds:
        parts.append(Text("no open rounds"))
    return Group(*parts)
