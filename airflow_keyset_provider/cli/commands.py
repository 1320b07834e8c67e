"""The commands of ``airflow-keyset``: read the status model, render it or print its JSON.

Each ``cmd_*`` takes the parsed arguments and the output stream and returns an exit code
(``exits.py``). They read through ``StreamControl`` (records of ``core/rounds/status.py``) and write only
through ``StreamControl.reset_round`` (``replay-dead-letters`` lives in ``replay.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any, TextIO

import redis

from ..core.errors import ConfigurationError
from ..core.keys import decode_user_key as decode
from ..core.keys import display_key, to_json
from ..core.redaction import redact_url, scrub, url_error
from ..core.rounds.control import StreamControl, list_streams
from ..core.rounds.status import StreamStatus, iso_ms
from ..core.store.cursor_store import CursorStore
from . import render
from .exits import EXIT_INCOMPLETE, EXIT_OK, EXIT_REFUSED, EXIT_USAGE, CliError

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
            raise CliError(
                f"Airflow connection {args.redis_conn_id!r} is not usable: {scrub(str(exc))}"
            ) from exc
    url = args.redis_url
    try:
        if args.cluster:
            return redis.RedisCluster.from_url(url, socket_connect_timeout=5, socket_timeout=30)
        return redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    except (ValueError, redis.RedisError) as exc:
        raise CliError(
            url_error("--redis-url", url, exc), EXIT_USAGE
        ) from None  # the cause may quote the password


def where(args: argparse.Namespace) -> str:
    """Which Redis the command talked to, for error messages (never a password)."""
    if args.redis_conn_id:
        return f"Airflow connection {args.redis_conn_id!r}"
    return redact_url(args.redis_url)


def safe_text(args: argparse.Namespace, exc: BaseException) -> str:
    """``exc``'s message without a secret of the Redis URL in use (``core/redaction.py``)."""
    urls = [getattr(args, name, None) for name in ("redis_url", "source_url")]
    return scrub(str(exc), *[u for u in urls if u])


def _control(args: argparse.Namespace, *, require: bool = True) -> StreamControl:
    try:
        ctl = StreamControl(CursorStore(connect_redis(args), args.stream, prefix=args.key_prefix))
    except ConfigurationError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    if require:
        ctl.require_stream()
    return ctl


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    if not args.stream:
        if args.round:
            raise CliError("--round needs a STREAM", EXIT_USAGE)
        streams = list_streams(connect_redis(args), args.key_prefix)
        if args.json:
            render.emit_json(
                out,
                {
                    "key_prefix": args.key_prefix,
                    "redis": where(args),
                    "streams": [s.as_dict(with_rounds=False) for s in streams],
                },
            )
        else:
            render.render_streams(render.console(out), streams, args.key_prefix, where(args))
        return EXIT_OK
    ctl = _control(args, require=False)
    if args.watch:
        return _watch(ctl, args, out)
    snap = ctl.stream_status(args.round)
    if args.sample > 0:
        time.sleep(args.sample)
        snap = ctl.stream_status(args.round).sampled(snap, args.sample)
    if args.json:
        render.emit_json(out, snap.as_dict())
    else:
        render.render_stream(render.console(out), snap)
    return EXIT_INCOMPLETE if args.check and snap.unfinished else EXIT_OK


def _readings(ctl: StreamControl, args: argparse.Namespace) -> Iterator[StreamStatus]:
    """Readings every ``--watch`` seconds, rates and ETAs from the previous one; stops after
    ``--count`` readings, or with ``--until-closed`` when no shown round is open."""
    previous, taken, n = None, time.monotonic(), 0
    while True:
        snap = ctl.stream_status(args.round)
        now = time.monotonic()
        if previous is not None:
            snap = snap.sampled(previous, now - taken)
        previous, taken = snap, now
        yield snap
        n += 1
        if args.count and n >= args.count:
            return
        if args.until_closed and all(r.closed for r in snap.rounds):
            return
        time.sleep(args.watch)


def _watch(ctl: StreamControl, args: argparse.Namespace, out: TextIO) -> int:
    """``--watch``: a live view in a terminal; elsewhere (a pipe, a file, a log) plain text, one
    block per reading, flushed as it is written; one JSON document per line with ``--json``."""
    try:
        if args.json:
            for snap in _readings(ctl, args):
                out.write(json.dumps(snap.as_dict(), default=str) + "\n")
                out.flush()
        elif not out.isatty():
            _watch_plain(ctl, args, out)
        else:
            _watch_live(ctl, args, out)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _watch_plain(ctl: StreamControl, args: argparse.Namespace, out: TextIO) -> None:
    """No cursor movement, no colour: each reading is a block that starts with its time and ends
    with a blank line, so ``tail -f``, ``grep`` and log collectors read it as it comes."""
    con = render.console(out)  # not a terminal: no ANSI sequences
    for snap in _readings(ctl, args):
        con.print(f"--- {iso_ms(int(time.time() * 1000))}")
        con.print(render.watch_view(snap, args.watch))
        con.line()
        out.flush()


def _watch_live(ctl: StreamControl, args: argparse.Namespace, out: TextIO) -> None:
    from rich.live import Live

    con = render.console(out)
    with Live(console=con, auto_refresh=False, transient=False) as live:
        for snap in _readings(ctl, args):
            live.update(render.watch_view(snap, args.watch), refresh=True)


# --------------------------------------------------------------------------------------------
# ranges, dead-letters, reset-round
# --------------------------------------------------------------------------------------------


def cmd_ranges(args: argparse.Namespace, out: TextIO) -> int:
    rnd = _control(args).round_status(args.round)
    if args.json:
        render.emit_json(out, rnd.as_dict())
    else:
        con = render.console(out)
        render.render_round(con, rnd, wide=True)
        render.render_lagging(con, rnd)
    return EXIT_INCOMPLETE if args.check and rnd.unfinished else EXIT_OK


def cmd_dead_letters(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(args)
    rnd = ctl.round_status(args.round)
    n = rnd.n_ranges
    if args.range is not None and not 0 <= args.range < n:
        raise CliError(
            f"round {args.round} has ranges 0..{n - 1}; got --range {args.range}", EXIT_USAGE
        )
    ids = [args.range] if args.range is not None else list(range(n))
    letters, counted = [], 0
    for i in ids:
        counted += rnd.ranges[i].dead
        for d in ctl.dead_letters(args.round, i, args.limit):
            letters.append(
                {
                    "range_id": i,
                    "key": to_json(d.get("key")),
                    "error": d.get("error"),
                    "attempts": d.get("attempts"),
                    "at": iso_ms(d.get("at_ms")),
                }
            )
    if args.json:
        render.emit_json(
            out,
            {
                "stream": args.stream,
                "round_id": args.round,
                "range_id": args.range,
                "dead_total": counted,
                "shown": len(letters),
                "dead_letters": letters,
            },
        )
        return EXIT_OK
    con = render.console(out)
    only = f" range {args.range}" if args.range is not None else ""
    t = render.table(f"dead letters of round {args.round}{only}")
    for c in ("range", "key", "attempts", "at", "error"):
        t.add_column(c, no_wrap=c != "error", overflow="fold")
    for d in letters:
        t.add_row(
            str(d["range_id"]), str(d["key"]), str(d["attempts"]), d["at"] or "-", str(d["error"])
        )
    con.print(t)
    note = f"{len(letters)} shown, {counted} dead in total"
    if counted > len(letters):
        note += f" (--limit {args.limit} per range; raise it to list them all)"
    con.print(note)
    return EXIT_OK


def cmd_reset_round(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(args)
    rnd = ctl.round_status(args.round)
    wm_before = ctl.store.watermark()
    wm_label = display_key(wm_before, rnd.arity) if wm_before else "-"
    if not args.yes:
        raise CliError(
            f"reset-round deletes round {args.round}'s ranges, cursors, retry sets and dead letters "
            f"({rnd.items:,} items recorded, {rnd.dead:,} dead); the watermark ({wm_label}) is not "
            "moved. Pass --yes to do it.",
            EXIT_USAGE,
        )
    held = [r for r in rnd.ranges if r.owner and r.lease_left_s > 0]
    if held and not args.force:
        raise CliError(
            f"round {args.round}: {len(held)} range(s) held by a live owner ("
            + ", ".join(f"range {r.range_id} by {render.owner_label(r.owner)}" for r in held[:5])
            + "). Stop those tasks first, or pass --force (their next write is then refused and they fail).",
            EXIT_REFUSED,
        )
    removed = ctl.reset_round(args.round, confirm=True)
    wm_after = ctl.store.watermark()
    if wm_after != wm_before:  # defence in depth: reset must never move the watermark
        raise CliError(
            f"watermark changed during reset ({wm_before!r} -> {wm_after!r}); report this bug"
        )
    result = {
        "stream": args.stream,
        "round_id": args.round,
        "keys_removed": removed,
        "state_before": str(rnd.state),
        "watermark": to_json(decode(wm_after, rnd.arity)) if wm_after else None,
    }
    if args.json:
        render.emit_json(out, result)
    else:
        con = render.console(out)
        con.print(
            f"round {args.round} ({rnd.state}) reset: {removed} Redis keys removed; watermark "
            f"unchanged at {wm_label}."
        )
        if not rnd.closed:
            con.print(
                "Its keys will be traversed by the next round planned over them "
                "(a chained plan starts at the watermark)."
            )
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# pause / resume / throttle (the stream's control hash: core/pace/stream_control.py)
# --------------------------------------------------------------------------------------------


def _control_result(args: argparse.Namespace, out: TextIO, ctl: StreamControl, text: str) -> int:
    state = ctl.control_state()
    if args.json:
        render.emit_json(out, {"stream": args.stream, "control": state.as_dict()})
    else:
        render.console(out).print(text)
    return EXIT_OK


def cmd_pause(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(args)
    by = args.by or os.environ.get("USER", "")
    ctl.pause(args.reason or "", by=f"cli:{by}" if by else "cli")
    return _control_result(
        args,
        out,
        ctl,
        f"stream {args.stream} paused: each running task commits its chunk, releases its range "
        "and waits (Airflow: deferred) until `airflow-keyset resume`.",
    )


def cmd_resume(args: argparse.Namespace, out: TextIO) -> int:
    ctl = _control(args)
    was = ctl.resume()
    text = (
        f"stream {args.stream} resumed: tasks continue from their committed cursors."
        if was
        else f"stream {args.stream} was not paused; nothing changed."
    )
    return _control_result(args, out, ctl, text)


def cmd_throttle(args: argparse.Namespace, out: TextIO) -> int:
    if args.off == (args.max_rows_per_second is not None):
        raise CliError("give --max-rows-per-second R or --off", EXIT_USAGE)
    ctl = _control(args)
    state = ctl.throttle(None if args.off else args.max_rows_per_second)
    text = (
        f"stream {args.stream}: no throughput limit."
        if state.max_rows_per_second is None
        else f"stream {args.stream}: at most {state.max_rows_per_second:,.0f} rows/s, shared by "
        "every task; running tasks pick it up within a second."
    )
    return _control_result(args, out, ctl, text)
