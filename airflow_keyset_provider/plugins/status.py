"""What the UI page shows, as JSON-safe dicts: streams, their rounds, ranges, lag and dead letters.

Everything here only *reads* Redis, through ``StreamControl`` and ``CursorStore`` read
methods, except ``pause_stream``/``resume_stream``, which write the stream's control hash and
nothing else (the app allows them to DAG editors only). It imports nothing from Airflow, so it
is testable against a bare Redis client.

The numbers are the CLI's (``airflow-keyset status``): both render the records of
``core/rounds/status.py`` (``as_dict()`` is the JSON of both), and durations are worded by its
``format_duration`` (the page's ``fmtDur`` mirrors it), so the terminal and the browser never
disagree about a round. On top of it this module adds what a page
needs and a terminal table does not:

- **lagging**: a range of an open round is lagging when it is not complete and either nobody owns
  it, or its owner's last heartbeat is older than twice the expected heartbeat interval. Workers
  renew a lease every third of its length, so the expected interval is ``lease / 3``, where the
  lease length is read back from the range itself (``lease_until - heartbeat_ms``, both written by
  the same heartbeat: ``RangeStatus.lease_s``). ``lag_reason`` says which rule fired, in words.
- **progress basis**: ``progress`` is the key-space fraction of ``(lo, hi]`` the cursor has passed
  (interpolated on the first key column where ``lo`` and ``hi`` differ: integers, decimals, dates,
  timestamps, UUIDs, coarse for text). When no such number exists (``progress`` is ``None``) the
  page shows counts only; ``progress_basis`` tells the page which case it is.
- **dead letters**: per range, the count and the newest ``dead_limit`` entries (key, error,
  attempts, time).
- **why an unfinished range stopped** (``stopped``, on ranges of an open round that are lagging or
  have items waiting for a retry): what the store records, nothing more. The engine keeps no
  "stop reason" on a range; it keeps the ``lineage`` of the task instance that held it last (an
  Airflow ``dag/run/task[/map_index]``, kept when a range is released unfinished) and, per item
  waiting for a retry, its attempts and last error. ``stopped.last_task`` is that lineage parsed
  (``None`` outside Airflow), ``stopped.retry_errors`` up to ``RETRY_ERRORS_SHOWN`` of those items.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.errors import (
    ConfigurationError,
    LeaseHeldError,
    RoundNotFoundError,
    RoundStateLostError,
    StreamNotFoundError,
)
from ..core.keys import display_key
from ..core.rounds.control import StreamControl, list_streams
from ..core.rounds.status import RangeState, RoundState, RoundStatus, format_duration, iso_ms
from ..core.store.cursor_store import CursorStore
from ..core.store.reads import stream_names

#: Heartbeats renew a lease every third of its length (see ``core.traversal._Heartbeat``).
HEARTBEATS_PER_LEASE = 3
#: A range is lagging when its heartbeat is older than this many expected intervals.
LAG_FACTOR = 2.0
#: Items waiting for a retry shown per stopped range (key, attempts, last error).
RETRY_ERRORS_SHOWN = 3
#: Stopped ranges of one round whose lineage and retries are read (a bounded number of reads).
STOPPED_READ_LIMIT = 64

_SUMMARY_KEYS = (
    "round_id",
    "state",
    "chained",
    "round_key",
    "created_at",
    "closed_at",
    "start_key",
    "end_key",
    "start_label",
    "end_label",
    "n_ranges",
    "ranges_complete",
    "done",
    "skipped",
    "dead",
    "retries",
    "items",
    "progress",
    "rate",
    "eta_s",
    "verification",
)


class NotFound(LookupError):
    """No such stream or round under the configured key prefix (the message says which)."""


class Conflict(RuntimeError):
    """The action does not apply to the round's or range's current state (the message says why
    and what to do instead)."""


class Forbidden(PermissionError):
    """The user may not do this to that DAG (the message says which right is missing)."""


class StateLost(RuntimeError):
    """Redis no longer holds a round that was planned (flushed, evicted, restarted)."""


def _control(client: Any, stream: str, prefix: str) -> StreamControl:
    try:
        return StreamControl(CursorStore(client, stream, prefix=prefix))
    except ConfigurationError as exc:  # an invalid stream name cannot exist
        raise NotFound(str(exc)) from exc


def streams(client: Any, prefix: str) -> list[dict[str, Any]]:
    """Every stream under ``prefix`` with its watermark, retention floor and open round ids."""
    return [s.as_dict(with_rounds=False) for s in list_streams(client, prefix)]


def stream_view(client: Any, prefix: str, stream: str, closed_limit: int = 3) -> dict[str, Any]:
    """The stream's watermark and retention floor, its open rounds (oldest first), then up to
    ``closed_limit`` most recent closed rounds (newest first). Round dicts carry the round's
    totals and progress but not its ranges (see :func:`round_view`)."""
    ctl = _control(client, stream, prefix)
    try:
        snap = ctl.stream_status()
    except RoundNotFoundError as exc:
        raise NotFound(str(exc)) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    out = snap.as_dict(with_rounds=False)
    rounds = [*snap.rounds, *_recent_closed(ctl, snap.rounds_planned, closed_limit)]
    out["rounds"] = [_summary(r) for r in rounds]
    return out


def pause_stream(client: Any, prefix: str, stream: str, reason: str, by: str) -> dict[str, Any]:
    """Pause an existing stream; returns its control state (``StreamStatus.control`` JSON)."""
    ctl = _existing(client, stream, prefix)
    return ctl.pause(reason, by).as_dict()


def resume_stream(client: Any, prefix: str, stream: str) -> dict[str, Any]:
    """Resume an existing stream; returns its control state."""
    ctl = _existing(client, stream, prefix)
    ctl.resume()
    return ctl.control_state().as_dict()


#: How the CLI's replay names itself as a range's owner (``cli/replay.py``): not a task instance.
CLI_REPLAY_LINEAGE = "airflow-keyset/replay/"

#: Most dead letters one page action moves back to a range's retry set.
REQUEUE_LIMIT = 10_000


def round_range(
    client: Any, prefix: str, stream: str, round_id: str, range_id: int
) -> tuple[StreamControl, str, dict[str, str]]:
    """The stream's control, the round's state and its record, for an action on one existing
    range (``NotFound`` naming what is missing)."""
    ctl = _existing(client, stream, prefix)
    state = ctl.store.round_state(round_id)
    if state is None:
        raise NotFound(f"stream {stream!r} has no round {round_id!r} under key prefix {prefix!r}")
    info = ctl.store.round_info(round_id)
    if not 0 <= range_id < int(info.get("n_ranges", 0)):
        raise NotFound(f"round {round_id} of stream {stream!r} has no range {range_id}")
    return ctl, state, info


def planning_dag(info: Mapping[str, str]) -> str | None:
    """The DAG whose plan task planned the round (its round key ``<dag_id>/<run_id>/<task_id>``,
    ``common.run_key``), or None for a round planned outside Airflow."""
    planned = parse_lineage(info.get("round_key") or "")
    return planned["dag_id"] if planned else None


def requeue_dead(
    client: Any, prefix: str, stream: str, round_id: str, range_id: int
) -> dict[str, Any]:
    """Move a range's dead letters (up to ``REQUEUE_LIMIT``) back to its retry set, attempts
    reset, through the engine's fenced script (``CursorStore.requeue_dead``): the range is
    pending again and nothing runs them now. ``picked_up_by`` says, from what the store records,
    which traverse try will: a retry or a clear of the task instance that last held the range,
    the next run of the DAG when the round is its open chained round (that run's plan continues
    it), or, either way, a replay (``replays.replay_range``, the CLI's ``replay-dead-letters``),
    which processes them at once. Only an open round: a closed round has no traverse try left,
    so it is refused (``Conflict``) saying to replay instead. A range a live owner holds is
    refused too (nothing moved)."""
    ctl, state, info = round_range(client, prefix, stream, round_id, range_id)
    if state == RoundState.CLOSED:
        raise Conflict(
            f"round {round_id} of stream {stream!r} is closed: no traverse try will take its "
            f"letters any more. Replay them instead (the page's Replay button, or "
            f"airflow-keyset replay-dead-letters {stream} {round_id} --range {range_id} "
            f"--dag-id <the DAG that planned it>)"
        )
    try:
        moved = ctl.store.requeue_dead(round_id, range_id, REQUEUE_LIMIT)
    except LeaseHeldError as exc:
        raise Conflict(str(exc)) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    picked_up_by = _picked_up_by(ctl, round_id, range_id, info)
    return {
        "stream": stream,
        "round_id": round_id,
        "range_id": range_id,
        "moved": moved,
        "picked_up_by": picked_up_by,
        "message": (
            f"{moved} dead letter(s) of round {round_id} range {range_id} are back in its retry "
            "set with fresh attempts; the range is pending again, its cursor unchanged. Nothing "
            "runs them now: " + "; or ".join(picked_up_by) + "."
            if moved
            else f"round {round_id} range {range_id} has no dead letters"
        ),
    }


def _picked_up_by(
    ctl: StreamControl, round_id: str, range_id: int, info: Mapping[str, str]
) -> list[str]:
    """Which traverse tries will process a requeued range's letters (see ``requeue_dead``)."""
    lineage = ctl.store.client.hget(ctl.store.range_key(round_id, range_id), "lineage")
    held = parse_lineage(lineage.decode() if isinstance(lineage, bytes) else lineage or "")
    out = []
    planned = parse_lineage(info.get("round_key") or "")
    if held is not None:
        task = held["task_id"] + ("" if held["map_index"] is None else f" [{held['map_index']}]")
        out.append(
            f"the next try of task {task} of DAG {held['dag_id']} run {held['run_id']}, which "
            "last held the range (a retry, or clear that task instance if it succeeded)"
        )
    elif planned is not None:
        out.append(
            f"a traverse try of this range in run {planned['run_id']} of DAG "
            f"{planned['dag_id']}, which planned the round: the traverse task instance with map "
            f"index {range_id} (clear it: it succeeded when the range completed; in pull mode, "
            "any of the run's traverse tasks still claiming ranges)"
        )
    else:
        out.append(
            "the next traverse of this range by the program that runs the round (no Airflow "
            "DAG planned it: KeysetTraversal.traverse or traverse_round)"
        )
    dag_id = planning_dag(info)
    if info.get("chained") == "1" and dag_id is not None:
        out.append(
            f"the next run of DAG {dag_id}: its plan continues this open chained round and its "
            "traverse tasks claim every unfinished range"
        )
    out.append(
        "a replay of the range, which processes them at once (Replay on this page, or "
        f"airflow-keyset replay-dead-letters {ctl.stream} {round_id} --range {range_id} "
        f"--dag-id {dag_id or '<the DAG that planned it>'})"
    )
    return out


def _existing(client: Any, stream: str, prefix: str) -> StreamControl:
    ctl = _control(client, stream, prefix)
    try:
        ctl.require_stream()
    except StreamNotFoundError as exc:
        raise NotFound(str(exc)) from exc
    return ctl


def _recent_closed(ctl: StreamControl, planned: int, limit: int) -> list[RoundStatus]:
    """The newest closed rounds still in Redis (round ids are ``r1, r2, ...``)."""
    out: list[RoundStatus] = []
    n = planned
    while n > 0 and len(out) < limit and planned - n < 50:
        rid = f"r{n}"
        n -= 1
        if ctl.store.round_state(rid) != RoundState.CLOSED:
            continue
        try:
            out.append(ctl.round_status(rid))
        except (RoundStateLostError, RoundNotFoundError):
            continue  # deleted between the two reads
    return out


def _summary(rnd: RoundStatus) -> dict[str, Any]:
    d = rnd.as_dict()
    out = {k: d.get(k) for k in _SUMMARY_KEYS}
    out["lagging"] = sum(1 for r in _with_lag(rnd) if r["lagging"])
    return out


def round_view(
    client: Any, prefix: str, stream: str, round_id: str, dead_limit: int = 3
) -> dict[str, Any]:
    """One round with every range: bounds, cursor, progress, counters, owner, heartbeat,
    ``lagging`` / ``lag_reason`` and the newest ``dead_limit`` dead letters of each range."""
    ctl = _control(client, stream, prefix)
    try:
        rnd = ctl.round_status(round_id)
    except RoundNotFoundError as exc:
        raise NotFound(str(exc)) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    out = rnd.as_dict()
    out["ranges"] = _with_lag(rnd)
    out["lagging"] = sum(1 for r in out["ranges"] if r["lagging"])
    for r in out["ranges"]:
        r["dead_letters"] = (
            _dead_letters(ctl, round_id, r["range_id"], rnd.arity, dead_limit) if r["dead"] else []
        )
    _add_stopped(ctl, round_id, rnd.arity, out["ranges"])
    return out


def parse_lineage(lineage: str) -> dict[str, Any] | None:
    """An owner lineage ``<dag_id>/<run_id>/<task_id>[/<map_index>]`` (``common.run_key``) as
    ``dag_id``, ``run_id``, ``task_id``, ``map_index`` (None when not mapped); None for ''
    (a traversal outside Airflow), a replay's (``airflow-keyset/replay/...``, the CLI's; the
    page's has no ``/``) or anything else. Dag and task ids hold no ``/``."""
    if lineage.startswith(CLI_REPLAY_LINEAGE):
        return None
    parts = lineage.split("/")
    if len(parts) < 3 or not all(parts):
        return None
    map_index = None
    if len(parts) >= 4 and parts[-1].isdigit():
        map_index = int(parts.pop())
    return {
        "dag_id": parts[0],
        "run_id": "/".join(parts[1:-1]),
        "task_id": parts[-1],
        "map_index": map_index,
    }


def _add_stopped(ctl: StreamControl, round_id: str, arity: int, rows: list[dict[str, Any]]) -> None:
    """``stopped`` on each unfinished range that lags or has items waiting for a retry (see the
    module docstring); None on the others. One pipelined read of the lineages, one HSCAN per range
    with retries; at most ``STOPPED_READ_LIMIT`` ranges."""
    for r in rows:
        r["stopped"] = None
    wanted = [
        r for r in rows if r["state"] != RangeState.COMPLETE and (r["lagging"] or r["retries"])
    ][:STOPPED_READ_LIMIT]
    if not wanted:
        return
    store = ctl.store
    pipe = store.client.pipeline(transaction=False)
    for r in wanted:
        pipe.hget(store.range_key(round_id, r["range_id"]), "lineage")
    for r, lineage in zip(wanted, pipe.execute(), strict=True):
        text = lineage.decode() if isinstance(lineage, bytes) else lineage or ""
        retries = (
            store.retry_entries(round_id, r["range_id"], RETRY_ERRORS_SHOWN) if r["retries"] else []
        )
        r["stopped"] = {
            "last_task": parse_lineage(text),
            "retry_errors": [
                {"key_label": _label(key, arity), "attempts": attempts, "error": error}
                for key, attempts, error in retries
            ],
        }


def _label(encoded: str, arity: int) -> str:
    try:
        return display_key(encoded, arity)
    except Exception:  # a malformed entry is still worth showing
        return encoded


def _with_lag(rnd: RoundStatus) -> list[dict[str, Any]]:
    """The round's range rows, in key order (by ``lo``), with ``lagging``, ``lag_reason``,
    ``expected_heartbeat_s`` and ``progress_basis`` added."""
    out = []
    for rs in rnd.in_key_order:
        r = rs.as_dict()
        lease_s = None if rnd.closed else rs.lease_s
        expected = lease_s / HEARTBEATS_PER_LEASE if lease_s else None
        r["expected_heartbeat_s"] = None if expected is None else round(expected, 1)
        r["lag_reason"] = lag_reason(rnd.state, r, expected)
        r["lagging"] = r["lag_reason"] is not None
        r["progress_basis"] = (
            "complete"
            if rs.complete
            else "key space"
            if r["progress"] is not None
            else "counts only"
        )
        out.append(r)
    return out


def lag_reason(
    round_state: str, r: Mapping[str, Any], expected_heartbeat_s: float | None
) -> str | None:
    """Why a range counts as lagging, or ``None`` when it does not (see the module docstring).

    A closed round and a complete range never lag. Otherwise: no owner -> lagging (never claimed,
    or released unfinished); an owner whose heartbeat is older than ``LAG_FACTOR`` expected
    intervals (or whose lease length cannot be read back) -> lagging."""
    if round_state == RoundState.CLOSED or r["state"] == RangeState.COMPLETE:
        return None
    age = r.get("heartbeat_age_s")
    if not r.get("owner"):
        if age is None:
            return "no owner: never claimed"
        return f"no owner: released unfinished, last heartbeat {format_duration(age)} ago"
    if expected_heartbeat_s is None:
        return "owner without a readable lease"
    if age is None or age > LAG_FACTOR * expected_heartbeat_s:
        shown = "never" if age is None else f"{format_duration(age)} ago"
        return f"stale owner: last heartbeat {shown}, expected every {format_duration(expected_heartbeat_s)}"
    return None


def _dead_letters(
    ctl: StreamControl, round_id: str, range_id: int, arity: int, limit: int
) -> list[dict[str, Any]]:
    out = []
    for d in ctl.store.dead_letters(round_id, range_id, limit):
        out.append(
            {
                "key_label": _label(str(d.get("key") or ""), arity),
                "error": str(d.get("error") or ""),
                "attempts": int(d.get("attempts") or 0),
                "at": iso_ms(d.get("at_ms")),
            }
        )
    return out


def rounds_of_run(client: Any, prefix: str, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    """The rounds the plan tasks of one DAG run planned (or were given: a chained round that was
    still open), found by their round key ``<dag_id>/<run_id>/<task_id>[/<map_index>]`` (what
    ``PlanRangesOperator`` passes as ``round_key``) in every stream under ``prefix``; the stream
    named after the DAG (the default) first. Each: ``stream``, ``round_id``, ``task_id``,
    ``map_index`` (None when the plan task is not mapped). Reads ``by_key`` hashes with HSCAN."""
    head = f"{dag_id}/{run_id}/"
    names = stream_names(client, prefix)
    names.sort(key=lambda n: n != dag_id)
    found: list[dict[str, Any]] = []
    for name in names:
        try:
            store = CursorStore(client, name, prefix=prefix)
        except ConfigurationError:
            continue  # not one of ours
        for key, round_id in store.rounds_by_key_prefix(head):
            task_id, _, map_index = key[len(head) :].partition("/")
            found.append(
                {
                    "stream": name,
                    "round_id": round_id,
                    "task_id": task_id,
                    "map_index": int(map_index) if map_index.isdigit() else None,
                }
            )
    return found
