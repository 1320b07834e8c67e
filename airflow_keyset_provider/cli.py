"""``airflow-keyset``: watch and operate keyset traversals from a terminal or a script.

Reads the control state in Redis only (no database, no Airflow) for ``status``, ``ranges``,
``dead-letters`` and ``reset-round``; ``replay-dead-letters`` also needs the source table.
Airflow is imported only when a ``--*-conn-id`` option asks for an Airflow connection.

Guarantees:

- Read commands never write to Redis.
- ``reset-round`` deletes one round's control state (ranges, cursors, retry sets, dead letters)
  and nothing else: it never moves a watermark. It refuses without ``--yes``, and refuses while a
  live owner holds one of the round's ranges unless ``--force`` is given.
- Every command has a human rendering (tables, progress bars) and a ``--json`` rendering with the
  same facts; exit codes are listed in ``EXIT_CODES`` and in ``--help``.

Progress is measured in *key space*: a range's fraction is where its cursor sits between ``lo``
and ``hi`` (first key column that differs, interpolated numerically). Ranges are balanced by row
count, so the round's fraction is the mean of its ranges'. Rates and ETAs come from two readings
``--sample`` seconds apart (or from successive ``--watch`` refreshes); without them only the
round's average rate since it was planned is shown.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any, TextIO

import redis

from .core.control import StreamControl, describe_range
from .core.errors import (
    ConfigurationError,
    KeysetError,
    LeaseHeldError,
    RoundNotFoundError,
    RoundStateLostError,
    StoreUnavailableError,
)
from .core.keys import MIN_KEY, decode_key, display_key, to_json
from .core.store import CursorStore

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_KEY_PREFIX = "ks"

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_LOST = 4
EXIT_NOT_FOUND = 5
EXIT_REFUSED = 6

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_ERROR: "error: Redis unreachable, bad source or processor, unexpected failure",
    EXIT_USAGE: "usage: bad or missing arguments (including reset-round without --yes)",
    EXIT_INCOMPLETE: "round incomplete: --check found unfinished ranges, or a replay left dead letters",
    EXIT_LOST: "round state lost: Redis no longer has the round (flushed, evicted, restarted)",
    EXIT_NOT_FOUND: "not found: no such stream or round under this key prefix",
    EXIT_REFUSED: "refused: a live owner holds a range (reset-round without --force, replay), or "
                  "the operation is not available in this version",
}


class CliError(Exception):
    """An error with the exit code the CLI reports for it."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------
# Connections
# --------------------------------------------------------------------------------------------


def connect_redis(args: argparse.Namespace) -> Any:
    """A Redis client from ``--redis-conn-id`` (Airflow connection, imported lazily),
    ``--cluster`` + ``--redis-url`` (``redis.RedisCluster``) or ``--redis-url``."""
    if args.redis_conn_id:
        try:
            from airflow.providers.redis.hooks.redis import RedisHook
        except ImportError as exc:  # pragma: no cover - the provider is a dependency
            raise CliError(f"--redis-conn-id needs apache-airflow-providers-redis: {exc}") from exc
        try:
            return RedisHook(redis_conn_id=args.redis_conn_id).get_conn()
        except Exception as exc:
            raise CliError(f"Airflow connection {args.redis_conn_id!r} is not usable: {exc}") from exc
    url = args.redis_url
    try:
        if args.cluster:
            return redis.RedisCluster.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    except (ValueError, redis.RedisError) as exc:
        raise CliError(f"--redis-url {_redact(url)!r} is not usable: {exc}", EXIT_USAGE) from exc


def _redact(url: str) -> str:
    """The URL without its password (for messages)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    cred, _, host = rest.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else url


def _where(args: argparse.Namespace) -> str:
    if args.redis_conn_id:
        return f"Airflow connection {args.redis_conn_id!r}"
    return _redact(args.redis_url)


def _control(client: Any, stream: str, prefix: str) -> StreamControl:
    try:
        return StreamControl(CursorStore(client, stream, prefix=prefix))
    except ConfigurationError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc


def _require_stream(ctl: StreamControl) -> None:
    """A stream with no keys at all is either a typo or a Redis that lost everything."""
    store = ctl.store
    if store.client.exists(f"{store.base}:seq", store.watermark_key) == 0:
        prefix = store.base.split(":{", 1)[0]
        raise CliError(
            f"stream {ctl.stream!r} has no state under key prefix {prefix!r}: check the stream name and "
            "--key-prefix (list streams with `airflow-keyset status`). If the name is right, Redis "
            "lost the stream's state (flushed, evicted or restarted without persistence).",
            EXIT_NOT_FOUND,
        )


# --------------------------------------------------------------------------------------------
# Reading state into JSON-safe snapshots
# --------------------------------------------------------------------------------------------



def _iso_ms(ms: Any) -> str | None:
    try:
        n = int(ms)
    except (TypeError, ValueError):
        return None
    if n <= 0:
        return None
    return dt.datetime.fromtimestamp(n / 1000, tz=dt.UTC).isoformat(timespec="seconds")


def _number(v: Any) -> float | None:
    """A numeric position for one key component (None when it has no useful one)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, Decimal)):
        return float(v)
    if isinstance(v, dt.datetime):
        if v.tzinfo is None:
            return (v - dt.datetime(1970, 1, 1)).total_seconds()
        return v.timestamp()
    if isinstance(v, dt.date):
        return float(v.toordinal())
    if isinstance(v, uuid.UUID):
        return float(v.int)
    if isinstance(v, str):  # first 8 bytes as a big-endian number: coarse, but monotonic
        return float(int.from_bytes(v.encode("utf-8")[:8].ljust(8, b"\0"), "big"))
    return None


def _axis(lo_enc: str, hi_enc: str) -> tuple[int, float | None, float] | None:
    """(component index, lo position or None for -inf, hi position) of the first key column
    where ``lo`` and ``hi`` differ; None when no numeric axis exists."""
    hi = decode_key(hi_enc)
    lo = decode_key(lo_enc) if lo_enc != MIN_KEY else None
    for i, h in enumerate(hi):
        if lo is not None and i < len(lo) and lo[i] == h:
            continue
        hp = _number(h)
        lp = _number(lo[i]) if lo is not None and i < len(lo) else None
        if hp is None or (lo is not None and lp is None):
            return None
        return i, lp, hp
    return None


def _position(axis: tuple[int, float | None, float] | None, enc: str) -> float | None:
    if axis is None or enc == MIN_KEY:
        return None
    values = decode_key(enc)
    return _number(values[axis[0]]) if axis[0] < len(values) else None


def range_fraction(r: dict[str, Any]) -> float | None:
    """Key-space progress of one range in [0, 1] (None when it cannot be derived)."""
    if r["state"] == "complete" or r["cursor_encoded"] == r["hi_encoded"]:
        return 1.0
    if r["cursor_encoded"] == r["lo_encoded"]:
        return 0.0
    axis = _axis(r["lo_encoded"], r["hi_encoded"])
    pos = _position(axis, r["cursor_encoded"])
    if axis is None or axis[1] is None or pos is None or axis[2] <= axis[1]:
        return None
    return min(max((pos - axis[1]) / (axis[2] - axis[1]), 0.0), 0.999)


def _range_row(r: dict[str, Any], timing: dict[str, str]) -> dict[str, Any]:
    items = r["done"] + r["skipped"] + r["dead"]
    return {
        "range_id": r["range_id"], "state": r["state"],
        "lo": to_json(r["lo"]), "hi": to_json(r["hi"]), "cursor": to_json(r["cursor"]),
        "lo_label": r["lo_label"], "hi_label": r["hi_label"], "cursor_label": r["cursor_label"],
        "lo_encoded": r["lo_encoded"], "hi_encoded": r["hi_encoded"], "cursor_encoded": r["cursor_encoded"],
        "owner": r["owner"], "lease_left_s": round(r["lease_left_s"], 1),
        "heartbeat_age_s": None if r["heartbeat_age_s"] is None else round(r["heartbeat_age_s"], 1),
        "claimed_at": _iso_ms(timing.get("claimed_ms")), "completed_at": _iso_ms(timing.get("completed_ms")),
        "done": r["done"], "skipped": r["skipped"], "dead": r["dead"], "items": items,
        "retries": r["retries"], "takeovers": r["takeovers"], "chunks": r["chunks"],
        "progress": range_fraction(r), "rate": None, "eta_s": None,
    }


def _timings(ctl: StreamControl, round_id: str, n: int) -> list[dict[str, str]]:
    pipe = ctl.store.client.pipeline(transaction=False)
    for i in range(n):
        pipe.hmget(ctl.store.range_key(round_id, i), "claimed_ms", "completed_ms", "heartbeat_ms")
    out = []
    for vals in pipe.execute():
        out.append({k: (v.decode() if isinstance(v, bytes) else v) or "0"
                    for k, v in zip(("claimed_ms", "completed_ms", "heartbeat_ms"), vals, strict=True)})
    return out


def round_snapshot(ctl: StreamControl, round_id: str) -> dict[str, Any]:
    """Everything about one round, JSON-safe: bounds, state, totals, per-range rows."""
    info = ctl.store.round_info(round_id)
    arity = int(info.get("arity", "1"))
    status = ctl.range_status(round_id)
    timing = _timings(ctl, round_id, len(status))
    ranges = [_range_row(r, t) for r, t in zip(status, timing, strict=True)]
    fractions = [r["progress"] for r in ranges]
    progress = sum(fractions) / len(fractions) if fractions and None not in fractions else None
    items = sum(r["items"] for r in ranges)
    created_ms = int(info.get("created_ms", "0") or 0)
    last_ms = max([int(t["heartbeat_ms"]) for t in timing] + [int(t["completed_ms"]) for t in timing] + [0])
    if info["state"] == "closed":
        last_ms = int(info.get("closed_ms", "0") or 0) or last_ms
    elapsed = (last_ms - created_ms) / 1000 if created_ms and last_ms > created_ms else None
    rate = items / elapsed if elapsed and items else None
    eta = None  # only from two readings (apply_rates): an average over idle time would mislead
    return {
        "stream": ctl.stream, "round_id": round_id, "state": info["state"],
        "chained": info.get("chained") == "1", "round_key": info.get("round_key") or None,
        "created_at": _iso_ms(created_ms), "closed_at": _iso_ms(info.get("closed_ms")),
        "start_key": to_json(_decode(info["start"], arity)), "end_key": to_json(_decode(info["end"], arity)),
        "start_label": display_key(info["start"], arity), "end_label": display_key(info["end"], arity),
        "start_encoded": info["start"], "end_encoded": info["end"],
        "source": _source(info.get("source")),
        "n_ranges": len(ranges), "ranges_complete": sum(r["state"] == "complete" for r in ranges),
        "done": sum(r["done"] for r in ranges), "skipped": sum(r["skipped"] for r in ranges),
        "dead": sum(r["dead"] for r in ranges), "retries": sum(r["retries"] for r in ranges),
        "items": items, "progress": 1.0 if info["state"] == "closed" else progress,
        "rate": rate, "eta_s": eta, "rate_basis": "average since planned" if rate is not None else None,
        "ranges": ranges,
    }


def _source(raw: str | None) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw


def _decode(enc: str, arity: int) -> Any:
    if enc == MIN_KEY:
        return None
    values = decode_key(enc)
    return values[0] if arity == 1 else values


def apply_rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> None:
    """Fill ``rate`` (items/s) and ``eta_s`` of ``after`` from two readings ``seconds`` apart.
    ETA = distance left to ``hi`` in key space / key-space velocity (needs no lower bound)."""
    if seconds <= 0 or before.get("round_id") != after.get("round_id"):
        return
    old = {r["range_id"]: r for r in before["ranges"]}
    total_rate, etas = 0.0, []
    for r in after["ranges"]:
        o = old.get(r["range_id"])
        if o is None:
            continue
        r["rate"] = max(r["items"] - o["items"], 0) / seconds
        total_rate += r["rate"]
        if r["state"] == "complete":
            r["eta_s"] = 0.0
            continue
        axis = _axis(r["lo_encoded"], r["hi_encoded"])
        p0, p1 = _position(axis, o["cursor_encoded"]), _position(axis, r["cursor_encoded"])
        if axis is not None and p0 is not None and p1 is not None and p1 > p0:
            r["eta_s"] = (axis[2] - p1) / ((p1 - p0) / seconds)
            etas.append(r["eta_s"])
    after["rate"] = total_rate
    after["rate_basis"] = f"sampled over {seconds:g} s"
    running = [r for r in after["ranges"] if r["state"] != "complete"]
    after["eta_s"] = max(etas) if running and len(etas) == len(running) else (0.0 if not running else None)


def _label(value: Any) -> str:
    """A decoded key as the engine's logs show it: ``-inf``, ``42``, ``(2024-01-01T00:00:00+00:00, 7)``."""
    if value is None:
        return "-inf"
    if isinstance(value, tuple):
        return "(" + ", ".join(str(to_json(v)) for v in value) + ")"
    return str(to_json(value))


def stream_snapshot(ctl: StreamControl, round_id: str | None = None) -> dict[str, Any]:
    """The stream's watermark, retention floor and its open rounds (or the one asked for)."""
    _require_stream(ctl)
    open_ids = ctl.open_rounds()
    open_rounds = [round_snapshot(ctl, rid) for rid in open_ids]
    if round_id is None:
        rounds = open_rounds
    else:
        known = [r for r in open_rounds if r["round_id"] == round_id]
        rounds = known or [round_snapshot(ctl, round_id)]
    arity = _stream_arity(ctl, rounds or open_rounds)
    wm = ctl.store.watermark()
    floor = ctl.retention_floor()  # the engine's definition, shared with the UI and the docs
    seq = ctl.store.client.get(f"{ctl.store.base}:seq")
    return {
        "stream": ctl.stream, "key_prefix": ctl.store.base.split(":{", 1)[0],
        "watermark": to_json(_decode(wm, arity)) if wm else None,
        "watermark_label": display_key(wm, arity) if wm else None,
        "retention_floor": to_json(floor),
        "retention_floor_label": _label(floor) if floor is not None else None,
        "rounds_planned": int(seq) if seq else 0,
        "open_rounds": open_ids,
        "rounds": rounds,
    }


def _stream_arity(ctl: StreamControl, rounds: Sequence[dict[str, Any]]) -> int:
    for r in rounds:
        return len(decode_key(r["end_encoded"])) or 1
    wm = ctl.store.watermark()
    return len(decode_key(wm)) or 1 if wm else 1


def list_streams(client: Any, prefix: str) -> list[dict[str, Any]]:
    """Every stream under ``prefix``, found with SCAN (never KEYS) on ``:watermark``, ``:open``
    and ``:seq`` keys."""
    names: set[str] = set()
    for suffix in ("watermark", "open", "seq"):
        for k in client.scan_iter(match=f"{prefix}:{{*}}:{suffix}", count=1000):
            key = k.decode() if isinstance(k, bytes) else k
            inner = key[len(prefix) + 2 : -(len(suffix) + 2)]
            if key.startswith(f"{prefix}:{{") and key.endswith(f"}}:{suffix}") and inner:
                names.add(inner)
    out = []
    for name in sorted(names):
        try:
            ctl = StreamControl(CursorStore(client, name, prefix=prefix))
        except ConfigurationError:
            continue  # not one of ours
        snap = stream_snapshot(ctl)
        snap.pop("rounds")
        out.append(snap)
    return out


# --------------------------------------------------------------------------------------------
# Human rendering (rich)
# --------------------------------------------------------------------------------------------


def _console(out: TextIO) -> Any:
    from rich.console import Console

    interactive = out.isatty()
    return Console(file=out, width=None if interactive else 140, no_color=not interactive,
                   highlight=False, soft_wrap=True)


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    if rate >= 10_000:
        return f"{rate / 1000:,.0f}k/s"
    return f"{rate:,.0f}/s" if rate >= 10 else f"{rate:.1f}/s"


def _bar(fraction: float | None) -> Any:
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    if fraction is None:
        grid.add_row(ProgressBar(total=None, width=12, pulse=True), "   ?")
    else:
        grid.add_row(ProgressBar(total=1.0, completed=fraction, width=12), f"{fraction * 100:3.0f}%")
    return grid


def _owner(owner: str, *, full: bool = False) -> str:
    """``dag/run/task/map#token`` -> ``task/map#tokpfx`` (the run is the round's); full: as is."""
    if not owner or full:
        return owner or "-"
    lineage, _, token = owner.rpartition("#")
    if not lineage:
        return owner[:24]
    tail = "/".join(lineage.split("/")[-2:])
    return f"{tail}#{token[:6]}"


def range_table(rnd: dict[str, Any], *, title: str | None = None, wide: bool = False) -> Any:
    """One row per range. ``wide`` (the ``ranges`` command) shows bounds and chunks instead of
    rate, ETA and owner; ``owner_table`` then lists ownership."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    cols = [("range", "right"), ("cursor", "left"), ("progress", "left"), ("state", "left"),
            ("done", "right"), ("skip", "right"), ("dead", "right"), ("retry", "right")]
    if wide:
        cols[1:1] = [("(lo, hi]", "left")]
        cols += [("chunks", "right")]
    else:
        cols += [("rate", "right"), ("ETA", "right"), ("owner", "left"), ("beat", "right")]
    for name, justify in cols:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rnd["ranges"]:
        lagging = rnd["state"] != "closed" and r["state"] != "complete"
        cells = [str(r["range_id"]), r["cursor_label"], _bar(r["progress"]),
                 f"[yellow]{r['state']}[/]" if lagging else r["state"],
                 f"{r['done']:,}", f"{r['skipped']:,}", f"[red]{r['dead']:,}[/]" if r["dead"] else "0",
                 f"{r['retries']:,}"]
        if wide:
            cells[1:1] = [f"({r['lo_label']}, {r['hi_label']}]"]
            cells += [f"{r['chunks']:,}"]
        else:
            done_now = r["state"] == "complete" and not r["rate"]
            expired = bool(r["owner"]) and r["lease_left_s"] <= 0
            cells += ["-" if done_now else _rate(r["rate"]), "-" if r["state"] == "complete" else _dur(r["eta_s"]),
                      ("[red]expired[/] " if expired else "") + _owner(r["owner"]),
                      _dur(r["heartbeat_age_s"]) if r["owner"] else "-"]
        t.add_row(*cells)
    return t


def owner_table(rnd: dict[str, Any]) -> Any:
    """Ranges with an owner now, or taken over before: full owner token, lease, heartbeat, takeovers."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("range", "owner", "lease left", "last beat", "takeovers"):
        t.add_column(name, no_wrap=True)
    for r in rnd["ranges"]:
        if r["owner"] or r["takeovers"]:
            t.add_row(str(r["range_id"]), _owner(r["owner"], full=True),
                      _dur(r["lease_left_s"]) if r["owner"] else "-",
                      f"{_dur(r['heartbeat_age_s'])} ago" if r["heartbeat_age_s"] is not None else "-",
                      str(r["takeovers"]))
    return t


def render_round(console: Any, rnd: dict[str, Any], *, wide: bool = False) -> None:
    head = (f"[bold]round {rnd['round_id']}[/] ({rnd['start_label']}, {rnd['end_label']}]  {rnd['state']}"
            f"{'  chained' if rnd['chained'] else ''}"
            f"{'  key ' + rnd['round_key'] if rnd['round_key'] else ''}  planned {rnd['created_at'] or '-'}")
    if rnd["closed_at"]:
        head += f"  closed {rnd['closed_at']}"
    console.print(head)
    pct = "?" if rnd["progress"] is None else f"{rnd['progress'] * 100:.1f}%"
    console.print(
        f"  {rnd['ranges_complete']}/{rnd['n_ranges']} ranges complete, {pct} of key space; "
        f"done {rnd['done']:,}, skipped {rnd['skipped']:,}, dead {rnd['dead']:,}, retry {rnd['retries']:,}; "
        f"rate {_rate(rnd['rate'])}" + (f" ({rnd['rate_basis']})" if rnd["rate_basis"] else "")
        + (f", ETA {_dur(rnd['eta_s'])}" if rnd["eta_s"] is not None and rnd["state"] != "closed" else "")
    )
    console.print(range_table(rnd, wide=wide))
    if wide and any(r["owner"] or r["takeovers"] for r in rnd["ranges"]):
        console.print(owner_table(rnd))


def render_stream(console: Any, snap: dict[str, Any]) -> None:
    console.print(
        f"[bold]stream {snap['stream']}[/] (prefix {snap['key_prefix']})  watermark "
        f"{snap['watermark_label'] or '-'}  retention floor {snap['retention_floor_label'] or '-'}  "
        f"open rounds {len(snap['open_rounds'])}  planned {snap['rounds_planned']}"
    )
    if not snap["rounds"]:
        console.print("  no open rounds")
    for rnd in snap["rounds"]:
        render_round(console, rnd)


def render_streams(console: Any, streams: Sequence[dict[str, Any]], prefix: str) -> None:
    from rich.table import Table

    if not streams:
        console.print(f"no streams under key prefix {prefix!r}")
        return
    from rich import box

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in ("stream", "watermark", "retention floor", "open rounds", "planned"):
        t.add_column(c, no_wrap=True)
    for s in streams:
        t.add_row(s["stream"], s["watermark_label"] or "-", s["retention_floor_label"] or "-",
                  ", ".join(s["open_rounds"]) or "-", str(s["rounds_planned"]))
    console.print(t)


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _emit_json(out: TextIO, value: Any) -> None:
    json.dump(value, out, indent=2, default=str)
    out.write("\n")


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    client = connect_redis(args)
    if not args.stream:
        if args.round:
            raise CliError("--round needs a STREAM", EXIT_USAGE)
        streams = list_streams(client, args.key_prefix)
        if args.json:
            _emit_json(out, {"key_prefix": args.key_prefix, "streams": streams})
        else:
            render_streams(_console(out), streams, args.key_prefix)
        return EXIT_OK
    ctl = _control(client, args.stream, args.key_prefix)
    if args.watch:
        return _watch(ctl, args, out)
    snap = stream_snapshot(ctl, args.round)
    if args.sample > 0:
        time.sleep(args.sample)
        later = stream_snapshot(ctl, args.round)
        for before in snap["rounds"]:
            for after in later["rounds"]:
                apply_rates(before, after, args.sample)
        snap = later
    if args.json:
        _emit_json(out, snap)
    else:
        render_stream(_console(out), snap)
    return _check_exit(args, snap["rounds"])


def _check_exit(args: argparse.Namespace, rounds: Sequence[dict[str, Any]]) -> int:
    if getattr(args, "check", False) and any(
            r["state"] != "closed" and r["ranges_complete"] < r["n_ranges"] for r in rounds):
        return EXIT_INCOMPLETE
    return EXIT_OK


def _readings(ctl: StreamControl, args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Snapshots every ``--watch`` seconds, rates and ETAs from the previous one; stops after
    ``--count`` readings, or with ``--until-closed`` when no shown round is open."""
    previous, taken, n = None, time.monotonic(), 0
    while True:
        snap = stream_snapshot(ctl, args.round)
        now = time.monotonic()
        if previous is not None:
            for before in previous["rounds"]:
                for after in snap["rounds"]:
                    apply_rates(before, after, now - taken)
        previous, taken = snap, now
        yield snap
        n += 1
        if args.count and n >= args.count:
            return
        if args.until_closed and all(r["state"] == "closed" for r in snap["rounds"]):
            return
        time.sleep(args.watch)


def _watch(ctl: StreamControl, args: argparse.Namespace, out: TextIO) -> int:
    """``--watch``: a live view in a terminal, one JSON document per line with ``--json``."""
    if args.json:
        try:
            for snap in _readings(ctl, args):
                out.write(json.dumps(snap, default=str) + "\n")
                out.flush()
        except KeyboardInterrupt:
            pass
        return EXIT_OK
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    console = _console(out)

    def view(snap: dict[str, Any]) -> Any:
        parts: list[Any] = [Text(f"stream {snap['stream']}  watermark {snap['watermark_label'] or '-'}  "
                                 f"retention floor {snap['retention_floor_label'] or '-'}  "
                                 f"(every {args.watch:g} s, Ctrl-C to stop)")]
        for rnd in snap["rounds"]:
            pct = "?" if rnd["progress"] is None else f"{rnd['progress'] * 100:.1f}%"
            parts.append(range_table(rnd, title=f"round {rnd['round_id']} ({rnd['start_label']}, "
                                                f"{rnd['end_label']}] {rnd['state']}  {pct}  rate "
                                                f"{_rate(rnd['rate'])}  ETA {_dur(rnd['eta_s'])}"))
        if not snap["rounds"]:
            parts.append(Text("no open rounds"))
        return Group(*parts)

    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            for snap in _readings(ctl, args):
                live.update(view(snap), refresh=True)
    except KeyboardInterrupt:
        pass
    if not console.is_terminal:
        console.line()
    return EXIT_OK


def cmd_ranges(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(connect_redis(args), args.stream, args.key_prefix)
    _require_stream(ctl)
    rnd = round_snapshot(ctl, args.round)
    if args.json:
        _emit_json(out, rnd)
    else:
        console = _console(out)
        render_round(console, rnd, wide=True)
        lagging = [r for r in ctl.range_status(args.round) if r["state"] != "complete"]
        if lagging and rnd["state"] != "closed":
            console.print("lagging:")
            for r in lagging:
                console.print(f"  {describe_range(r)}")
    return _check_exit(args, [rnd])


def cmd_dead_letters(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(connect_redis(args), args.stream, args.key_prefix)
    _require_stream(ctl)
    info = ctl.store.round_info(args.round)
    n = int(info["n_ranges"])
    if args.range is not None and not 0 <= args.range < n:
        raise CliError(f"round {args.round} has ranges 0..{n - 1}; got --range {args.range}", EXIT_USAGE)
    status = {r["range_id"]: r for r in ctl.range_status(args.round)}
    ids = [args.range] if args.range is not None else list(range(n))
    letters, counted = [], 0
    for i in ids:
        counted += status[i]["dead"]
        for d in ctl.dead_letters(args.round, i, args.limit):
            letters.append({"range_id": i, "key": to_json(d.get("key")), "error": d.get("error"),
                            "attempts": d.get("attempts"), "at": _iso_ms(d.get("at_ms"))})
    if args.json:
        _emit_json(out, {"stream": args.stream, "round_id": args.round, "range_id": args.range,
                         "dead_total": counted, "shown": len(letters), "dead_letters": letters})
        return EXIT_OK
    from rich import box
    from rich.table import Table

    console = _console(out)
    t = Table(title=f"dead letters of round {args.round}" + (f" range {args.range}" if args.range is not None else ""),
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for c in ("range", "key", "attempts", "at", "error"):
        t.add_column(c, no_wrap=c != "error", overflow="fold")
    for d in letters:
        t.add_row(str(d["range_id"]), str(d["key"]), str(d["attempts"]), d["at"] or "-", str(d["error"]))
    console.print(t)
    note = f"{len(letters)} shown, {counted} dead in total"
    if counted > len(letters):
        note += f" (each range keeps its newest dead letters up to dead_cap; --limit {args.limit} per range)"
    console.print(note)
    return EXIT_OK


def cmd_reset_round(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(connect_redis(args), args.stream, args.key_prefix)
    _require_stream(ctl)
    rnd = round_snapshot(ctl, args.round)
    wm_before = ctl.store.watermark()
    arity = len(decode_key(rnd["end_encoded"])) or 1
    wm_label = display_key(wm_before, arity) if wm_before else "-"
    if not args.yes:
        raise CliError(
            f"reset-round deletes round {args.round}'s ranges, cursors, retry sets and dead letters "
            f"({rnd['items']:,} items recorded, {rnd['dead']:,} dead); the watermark ({wm_label}) is not "
            "moved. Pass --yes to do it.", EXIT_USAGE)
    held = [r for r in rnd["ranges"] if r["owner"] and r["lease_left_s"] > 0]
    if held and not args.force:
        raise CliError(
            f"round {args.round}: {len(held)} range(s) held by a live owner ("
            + ", ".join(f"range {r['range_id']} by {_owner(r['owner'])}" for r in held[:5])
            + "). Stop those tasks first, or pass --force (their next write is then refused and they fail).",
            EXIT_REFUSED)
    removed = ctl.reset_round(args.round, confirm=True)
    wm_after = ctl.store.watermark()
    if wm_after != wm_before:  # defence in depth: reset must never move the watermark
        raise CliError(f"watermark changed during reset ({wm_before!r} -> {wm_after!r}); report this bug")
    result = {"stream": args.stream, "round_id": args.round, "keys_removed": removed,
              "state_before": rnd["state"], "watermark": to_json(_decode(wm_after, arity)) if wm_after else None}
    if args.json:
        _emit_json(out, result)
    else:
        console = _console(out)
        console.print(f"round {args.round} ({rnd['state']}) reset: {removed} Redis keys removed; watermark "
                      f"unchanged at {wm_label}.")
        if rnd["state"] != "closed":
            console.print("Its keys will be traversed by the next round planned over them "
                          "(a chained plan starts at the watermark).")
    return EXIT_OK


def cmd_replay(args: argparse.Namespace, out: TextIO) -> int:
    from .core.traversal import KeysetTraversal, load_processor

    if getattr(KeysetTraversal, "replay_dead_letters", None) is None:
        raise CliError(
            "replay-dead-letters is not available in this version of airflow-keyset-provider: the engine "
            "has no KeysetTraversal.replay_dead_letters. Upgrade the package.", EXIT_REFUSED)
    processor = load_processor(args.processor)
    client = connect_redis(args)
    source = _source_engine(args)
    keys = [k.strip() for k in args.key.split(",") if k.strip()]
    t = KeysetTraversal(source, args.table, keys if len(keys) > 1 else keys[0], stream=args.stream,
                        where=args.where, columns=args.columns.split(",") if args.columns else None,
                        redis_client=client, key_prefix=args.key_prefix)
    _require_stream(t.control)
    try:
        results = t.replay_dead_letters(
            args.round, processor=processor, range_id=args.range, chunk_size=args.chunk_size,
            max_item_attempts=args.max_item_attempts, item_retry_delay=args.item_retry_delay,
            owner_lineage=f"airflow-keyset/replay/{args.stream}/{args.round}")
    finally:
        t.close()
    rows = [r.as_dict() for r in results]
    still_dead = sum(r["dead"] for r in rows)
    if args.json:
        _emit_json(out, {"stream": args.stream, "round_id": args.round, "range_id": args.range,
                         "ranges": rows, "still_dead": still_dead})
    else:
        console = _console(out)
        where = f"range {args.range}" if args.range is not None else "every range"
        if not rows:
            console.print(f"round {args.round} ({where}): no dead letters to replay")
        for r in rows:
            console.print(f"round {args.round} range {r['range_id']}: replayed; now done {r['done']:,}, "
                          f"skipped {r['skipped']:,}, dead {r['dead']:,}; complete {r['complete']}")
    return EXIT_INCOMPLETE if still_dead else EXIT_OK


def _source_engine(args: argparse.Namespace) -> Any:
    if args.source_conn_id:
        try:
            from airflow.sdk import BaseHook
        except ImportError as exc:  # pragma: no cover - Airflow is a dependency
            raise CliError(f"--source-conn-id needs Apache Airflow: {exc}") from exc
        try:
            hook = BaseHook.get_connection(args.source_conn_id).get_hook()
            return hook.get_sqlalchemy_engine()
        except Exception as exc:
            raise CliError(f"Airflow connection {args.source_conn_id!r} is not usable as a SQL source: {exc}") from exc
    if not args.source_url:
        raise CliError("give --source-url (a SQLAlchemy URL) or --source-conn-id", EXIT_USAGE)
    return args.source_url


# --------------------------------------------------------------------------------------------
# Parser and entry point
# --------------------------------------------------------------------------------------------


def _epilog() -> str:
    codes = "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())
    return (
        "exit codes:\n" + codes + "\n\n"
        "environment:\n"
        f"  KEYSET_REDIS_URL   default for --redis-url ({DEFAULT_REDIS_URL})\n"
        f"  KEYSET_KEY_PREFIX  default for --key-prefix ({DEFAULT_KEY_PREFIX})\n\n"
        "Progress is key-space progress (cursor between lo and hi); rates and ETAs need --sample or --watch.\n"
        "Docs: docs/cli.md"
    )


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection")
    g.add_argument("--redis-url", default=os.environ.get("KEYSET_REDIS_URL", DEFAULT_REDIS_URL),
                   help="Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS "
                        "(default: $KEYSET_REDIS_URL or %(default)s)")
    g.add_argument("--redis-conn-id", default=None,
                   help="read Redis from this Airflow connection instead (imports Airflow)")
    g.add_argument("--cluster", action="store_true", help="--redis-url points at a Redis Cluster node")
    g.add_argument("--key-prefix", default=os.environ.get("KEYSET_KEY_PREFIX", DEFAULT_KEY_PREFIX),
                   help="Redis key prefix the traversal used (default: $KEYSET_KEY_PREFIX or %(default)s)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    common.add_argument("-v", "--verbose", action="store_true", help="log the engine's progress lines to stderr")

    from . import __version__

    parser = argparse.ArgumentParser(
        prog="airflow-keyset", description="Watch and operate keyset traversals (rounds, ranges, dead letters).",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str, fn: Callable[[argparse.Namespace, TextIO], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_, description=help_, epilog=_epilog(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=fn)
        return p

    p = add("status", "streams, or one stream's watermark, retention floor and open rounds with per-range progress",
            cmd_status)
    p.add_argument("stream", nargs="?", metavar="STREAM", help="stream name; omit to list every stream")
    p.add_argument("--round", metavar="ROUND", help="show this round (open or closed) instead of the open ones")
    p.add_argument("--sample", type=float, default=0.0, metavar="SECONDS",
                   help="read twice, SECONDS apart, to show per-range rates and ETAs")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after this many refreshes")
    p.add_argument("--until-closed", action="store_true", help="with --watch: stop when no round is open")
    p.add_argument("--check", action="store_true", help="exit 3 if a shown open round has unfinished ranges")

    p = add("ranges", "every range of one round: bounds, cursor, state, owner, lease, counters", cmd_ranges)
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("round", metavar="ROUND", help="round id, e.g. r3")
    p.add_argument("--check", action="store_true", help="exit 3 if the round has unfinished ranges")

    p = add("dead-letters", "dead-lettered items of one round (newest first per range)", cmd_dead_letters)
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("round", metavar="ROUND")
    p.add_argument("--range", type=int, default=None, metavar="N", help="only range N")
    p.add_argument("--limit", type=int, default=100, help="at most this many per range (default %(default)s)")

    p = add("reset-round", "delete one round's control state (never moves the watermark)", cmd_reset_round)
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("round", metavar="ROUND")
    p.add_argument("--yes", action="store_true", help="confirm: without it nothing is deleted")
    p.add_argument("--force", action="store_true", help="reset even while a live owner holds a range")

    p = add("replay-dead-letters", "run a processor again over a round's dead letters (fenced, at-least-once)",
            cmd_replay)
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("round", metavar="ROUND")
    p.add_argument("--range", type=int, default=None, metavar="N", help="only range N (default: every range)")
    p.add_argument("--source-url", default=None, help="SQLAlchemy URL of the source database")
    p.add_argument("--source-conn-id", default=None, help="Airflow connection of the source (imports Airflow)")
    p.add_argument("--table", required=True, help="table the round was planned over ('schema.table' allowed)")
    p.add_argument("--key", required=True, help="key column(s), comma-separated, as planned")
    p.add_argument("--where", default=None, help="the same where filter the round was planned with")
    p.add_argument("--columns", default=None, help="extra columns the processor needs, comma-separated")
    p.add_argument("--processor", required=True, metavar="pkg.mod:fn", help="the processor to run")
    p.add_argument("--chunk-size", type=int, default=1000, help="keys per processor call (default %(default)s)")
    p.add_argument("--max-item-attempts", type=int, default=3,
                   help="attempts per letter before it is dead-lettered again (default %(default)s)")
    p.add_argument("--item-retry-delay", type=float, default=0.5,
                   help="base delay in seconds between item attempts (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the CLI; returns the exit code (see ``EXIT_CODES``)."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse: --help/--version exit 0, bad usage exits 2
        return int(exc.code or 0)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=err, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return int(args.func(args, out))
    except CliError as exc:
        err.write(f"airflow-keyset: {exc}\n")
        return exc.code
    except RoundStateLostError as exc:
        err.write(f"airflow-keyset: round state lost: {exc}\n")
        return EXIT_LOST
    except LeaseHeldError as exc:
        err.write(f"airflow-keyset: refused: {exc}\n")
        return EXIT_REFUSED
    except RoundNotFoundError as exc:
        err.write(f"airflow-keyset: {exc}\n")
        return EXIT_NOT_FOUND
    except ConfigurationError as exc:
        err.write(f"airflow-keyset: {exc}\n")
        return EXIT_USAGE
    except redis.AuthenticationError as exc:
        err.write(f"airflow-keyset: Redis ({_where(args)}) refused the credentials: {exc}\n")
        return EXIT_ERROR
    except (StoreUnavailableError, redis.ConnectionError, redis.TimeoutError) as exc:
        err.write(f"airflow-keyset: Redis is unreachable ({_where(args)}): {exc}\n")
        return EXIT_ERROR
    except (KeysetError, redis.RedisError) as exc:
        err.write(f"airflow-keyset: {type(exc).__name__}: {exc}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `airflow-keyset status --json | head`: the reader left, not an error
        _silence_stdout()
        return EXIT_OK


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
