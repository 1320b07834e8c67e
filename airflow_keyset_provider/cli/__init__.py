"""``airflow-keyset``: watch and operate keyset traversals from a terminal or a script.

Reads the control state in Redis only (no database, no Airflow) for ``status``, ``ranges``,
``dead-letters`` and ``reset-round``; ``replay-dead-letters`` also reads the source table (which
table, key and filter: from the DAG's task or the command line, never from Redis).
Airflow is imported only when a ``--*-conn-id`` option asks for an Airflow connection.

Guarantees:

- Read commands never write to Redis. ``pause``, ``resume`` and ``throttle`` write only the
  stream's control hash (never a cursor, a round or a watermark).
- ``reset-round`` deletes one round's control state (ranges, cursors, retry sets, dead letters)
  and nothing else: it never moves a watermark. It refuses without ``--yes``, and refuses while a
  live owner holds one of the round's ranges unless ``--force`` is given.
- Every command has a human rendering (tables, progress bars) and a ``--json`` rendering with the
  same facts; exit codes are listed in ``EXIT_CODES`` and in ``--help``.

Progress is measured in *key space*: a range's fraction is where its cursor sits between ``lo``
and ``hi`` (first key column that differs, interpolated numerically). Ranges are balanced by row
count, so the round's fraction is the mean of its ranges'. Rates and ETAs come from two readings
``--sample`` seconds apart (or from successive ``--watch`` refreshes); without them only the
round's average rate since it was planned is shown (the maths live in ``core/rounds/status.py``).

The package: ``commands.py`` (what each command reads and does), ``replay.py``
(``replay-dead-letters``), ``render.py`` (rich tables of the status records), ``exits.py`` (exit
codes); this module holds the parser and ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

import redis

from ..core.errors import (
    ConfigurationError,
    KeysetError,
    LeaseHeldError,
    ReplayFailedError,
    RoundNotFoundError,
    RoundStateLostError,
    RoundUnknownError,
    StoreUnavailableError,
)
from ..core.redaction import scrub
from .arguments import (
    COUNT_ARG,
    PREFIX_ARG,
    RANGE_ARG,
    RATE_ARG,
    ROUND_ARG,
    SECONDS_ARG,
    STREAM_ARG,
)
from .commands import (
    cmd_dead_letters,
    cmd_pause,
    cmd_ranges,
    cmd_reset_round,
    cmd_resume,
    cmd_status,
    cmd_throttle,
    connect_redis,
    safe_text,
    where,
)
from .exits import (
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INCOMPLETE,
    EXIT_LOST,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
)
from .preview import add_arguments as _preview_arguments
from .preview import cmd_preview
from .replay import cmd_replay

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_KEY_PREFIX = "ks"

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_LOST",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "CliError",
    "build_parser",
    "connect_redis",
    "main",
]


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


Adder = Callable[[str, str, Callable[[argparse.Namespace, TextIO], int]], argparse.ArgumentParser]


def _common_parser() -> argparse.ArgumentParser:
    """The options every command takes: where Redis is, ``--json``, ``--verbose``."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("connection")
    g.add_argument(
        "--redis-url",
        default=os.environ.get("KEYSET_REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL: redis://[user:password@]host:port/db, rediss:// for TLS "
        "(default: $KEYSET_REDIS_URL or %(default)s)",
    )
    g.add_argument(
        "--redis-conn-id",
        default=None,
        help="read Redis from this Airflow connection instead (imports Airflow)",
    )
    g.add_argument(
        "--cluster", action="store_true", help="--redis-url points at a Redis Cluster node"
    )
    g.add_argument(
        "--key-prefix",
        type=PREFIX_ARG,
        default=os.environ.get("KEYSET_KEY_PREFIX", DEFAULT_KEY_PREFIX),
        help="Redis key prefix the traversal used (default: $KEYSET_KEY_PREFIX or %(default)s)",
    )
    common.add_argument(
        "--json", action="store_true", help="print JSON for scripts instead of tables"
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", help="log the engine's progress lines to stderr"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common_parser()
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="airflow-keyset",
        description="Watch and operate keyset traversals (rounds, ranges, dead letters).",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        name: str, help_: str, fn: Callable[[argparse.Namespace, TextIO], int]
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            parents=[common],
            help=help_,
            description=help_,
            epilog=_epilog(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=fn)
        return p

    _status_command(add)
    _round_commands(add)
    _replay_command(add)
    _preview_command(add)
    _control_commands(add)
    return parser


def _status_command(add: Adder) -> None:
    p = add(
        "status",
        "streams, or one stream's watermark, retention floor and open rounds with per-range progress",
        cmd_status,
    )
    p.add_argument(
        "stream",
        nargs="?",
        type=STREAM_ARG,
        metavar="STREAM",
        help="stream name; omit to list every stream",
    )
    p.add_argument(
        "--round",
        metavar="ROUND",
        type=ROUND_ARG,
        help="show this round (open or closed) instead of the open ones",
    )
    p.add_argument(
        "--sample",
        type=SECONDS_ARG,
        default=0.0,
        metavar="SECONDS",
        help="read twice, SECONDS apart, to show per-range rates and ETAs",
    )
    p.add_argument(
        "--watch",
        type=SECONDS_ARG,
        default=0.0,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C",
    )
    p.add_argument(
        "--count", type=COUNT_ARG, default=0, help="with --watch: stop after this many refreshes"
    )
    p.add_argument(
        "--until-closed", action="store_true", help="with --watch: stop when no round is open"
    )
    p.add_argument(
        "--check", action="store_true", help="exit 3 if a shown open round has unfinished ranges"
    )


def _round_commands(add: Adder) -> None:
    """``ranges``, ``dead-letters`` and ``reset-round``."""
    p = add(
        "ranges",
        "every range of one round: bounds, cursor, state, owner, lease, counters",
        cmd_ranges,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument("round", metavar="ROUND", type=ROUND_ARG, help="round id, e.g. r3")
    p.add_argument("--check", action="store_true", help="exit 3 if the round has unfinished ranges")

    p = add(
        "dead-letters",
        "dead-lettered items of one round (newest first per range)",
        cmd_dead_letters,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument("round", metavar="ROUND", type=ROUND_ARG)
    p.add_argument("--range", type=RANGE_ARG, default=None, metavar="N", help="only range N")
    p.add_argument(
        "--limit",
        type=COUNT_ARG,
        default=100,
        help="at most this many per range (default %(default)s)",
    )

    p = add(
        "reset-round",
        "delete one round's control state (never moves the watermark)",
        cmd_reset_round,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument("round", metavar="ROUND", type=ROUND_ARG)
    p.add_argument("--yes", action="store_true", help="confirm: without it nothing is deleted")
    p.add_argument(
        "--force", action="store_true", help="reset even while a live owner holds a range"
    )


def _replay_command(add: Adder) -> None:
    p = add(
        "replay-dead-letters",
        "run a processor again over a round's dead letters (fenced, at-least-once): the DAG's "
        "own traverse task (--dag-id), or --processor with the source flags",
        cmd_replay,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument("round", metavar="ROUND", type=ROUND_ARG)
    p.add_argument(
        "--range",
        type=RANGE_ARG,
        default=None,
        metavar="N",
        help="only range N (default: every range)",
    )
    g = p.add_argument_group(
        "from the DAG",
        "the DAG's traverse task gives the processor, target connection, exactly_once and "
        "tuning; its plan gives the source, table, key, where, key prefix and Redis connection",
    )
    g.add_argument("--dag-id", default=None, help="the DAG that planned the round")
    g.add_argument(
        "--task-id", default=None, help="its traverse task, when it has several for the stream"
    )
    g.add_argument(
        "--dag-file",
        default=None,
        help="the DAG's file or folder (default: Airflow's [core] dags_folder)",
    )
    g = p.add_argument_group(
        "from the command line",
        "without --dag-id; Redis is never read for the rows a replay reads: the round's record "
        "is only compared with these",
    )
    g.add_argument("--processor", default=None, metavar="pkg.mod:fn", help="the processor to run")
    g.add_argument("--source-url", default=None, help="SQLAlchemy URL of the source database")
    g.add_argument(
        "--source-conn-id", default=None, help="Airflow connection of the source (imports Airflow)"
    )
    g.add_argument("--table", default=None, help="table ('schema.table' allowed)")
    g.add_argument("--key", default=None, help="key column(s), comma-separated")
    g.add_argument(
        "--where", default=None, help="the round's where filter (with --dag-id: a templated one)"
    )
    g.add_argument("--where-params", default=None, help="the where's parameters, a JSON object")
    g.add_argument(
        "--columns",
        default=None,
        help="columns the processor needs, comma-separated (default: every column of the table)",
    )
    g.add_argument(
        "--target-url",
        default=None,
        help="SQLAlchemy URL of the database the processor writes to (chunk.connection)",
    )
    g.add_argument("--target-conn-id", default=None, help="Airflow connection of that database")
    g.add_argument(
        "--exactly-once", action="store_true", help="the target's ledger (needs a target)"
    )
    p.add_argument(
        "--chunk-size", type=int, default=None, help="keys per processor call (default: the "
        "DAG's, else 1000)",
    )  # fmt: skip
    p.add_argument(
        "--max-item-attempts",
        type=int,
        default=None,
        help="attempts per letter before it is dead-lettered again (default: the DAG's, else 3)",
    )
    p.add_argument(
        "--item-retry-delay",
        type=float,
        default=None,
        help="base delay in seconds between item attempts (default 0.5)",
    )
    p.add_argument(
        "--retry-budget-seconds",
        type=float,
        default=None,
        help="how long a range's failures in a row may last before the replay fails and puts "
        "its letters back (default: the DAG's, else 90)",
    )


def _preview_command(add: Adder) -> None:
    p = add(
        "preview",
        "what the stream's next round would be and do: bounds, ranges with row estimates, the "
        "chunk query's plan, a timed sample, the processor on it (rolled back), the ETA; "
        "writes nothing (exit 3 when it lists a problem)",
        cmd_preview,
    )
    _preview_arguments(p)


def _control_commands(add: Adder) -> None:
    """``pause``, ``resume`` and ``throttle``: the stream's control hash, read by every task."""
    p = add(
        "pause",
        "pause a stream: each task commits its chunk, releases its range and waits (Airflow: "
        "deferred, worker slot freed) until resumed",
        cmd_pause,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument("--reason", default="", help="why (shown by status and the UI page)")
    p.add_argument("--by", default="", help="who (default: $USER)")
    p = add("resume", "resume a paused stream; tasks continue from their cursors", cmd_resume)
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p = add(
        "throttle",
        "set or lift the stream's rows-per-second budget, shared by every task (takes effect "
        "within a second, also while a round runs)",
        cmd_throttle,
    )
    p.add_argument("stream", metavar="STREAM", type=STREAM_ARG)
    p.add_argument(
        "--max-rows-per-second", type=RATE_ARG, default=None, metavar="R", help="the budget"
    )
    p.add_argument("--off", action="store_true", help="lift the budget")


def main(
    argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run the CLI; returns the exit code (see ``EXIT_CODES``)."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    parser = build_parser()
    # argparse writes --help and --version to stdout, and usage errors to stderr, which may echo
    # arguments (`unrecognized arguments: --redis-url redis://:secret@...`): scrubbed first
    usage = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(usage):
            args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse: --help/--version exit 0, bad usage exits 2
        err.write(scrub(usage.getvalue(), *(a for a in (argv or sys.argv) if "://" in a)))
        return int(exc.code or 0)
    err.write(usage.getvalue())
    if args.verbose:
        logging.basicConfig(
            level=logging.INFO, stream=err, format="%(asctime)s %(levelname)s %(message)s"
        )
    try:
        return int(args.func(args, out))
    except CliError as exc:  # built with the URL redacted (core/redaction.py)
        err.write(f"airflow-keyset: {exc}\n")
        return exc.code
    except RoundUnknownError as exc:  # an id Redis never handed out (mirror included): not found
        err.write(f"airflow-keyset: {exc}\n")
        return EXIT_NOT_FOUND
    except RoundStateLostError as exc:
        err.write(
            f"airflow-keyset: round state lost: {safe_text(args, exc)} (Redis read: {where(args)})\n"
        )
        return EXIT_LOST
    except ReplayFailedError as exc:
        err.write(f"airflow-keyset: {exc}\n")
        return EXIT_ERROR
    except LeaseHeldError as exc:
        err.write(f"airflow-keyset: refused: {safe_text(args, exc)}\n")
        return EXIT_REFUSED
    except RoundNotFoundError as exc:
        err.write(f"airflow-keyset: {safe_text(args, exc)} (Redis read: {where(args)})\n")
        return EXIT_NOT_FOUND
    except ConfigurationError as exc:
        err.write(f"airflow-keyset: {safe_text(args, exc)}\n")
        return EXIT_USAGE
    except redis.AuthenticationError as exc:
        err.write(
            f"airflow-keyset: Redis ({where(args)}) refused the credentials: {safe_text(args, exc)}\n"
        )
        return EXIT_ERROR
    except (StoreUnavailableError, redis.ConnectionError, redis.TimeoutError) as exc:
        err.write(f"airflow-keyset: Redis is unreachable ({where(args)}): {safe_text(args, exc)}\n")
        return EXIT_ERROR
    except (KeysetError, redis.RedisError) as exc:
        err.write(f"airflow-keyset: {type(exc).__name__}: {safe_text(args, exc)}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `airflow-keyset status --json | head`: the reader left, not an error
        _silence_stdout()
        return EXIT_OK
    except Exception as exc:  # a bug: one line, no traceback (it may hold a row's data)
        err.write(
            f"airflow-keyset: unexpected {type(exc).__name__}: {safe_text(args, exc)} "
            "(please report it)\n"
        )
        return EXIT_ERROR


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
