"""The cursor store's named results, and how a script's reply becomes one (or a named error).

``CursorStore`` (``cursor_store.py``) returns these and re-exports them, so
``from airflow_keyset_provider.core.store.cursor_store import Claim`` keeps working. Each parser reads one Lua
script's reply in the shape its header in ``lua/<name>.lua`` documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import CursorConflictError, DeadLetterCapError, LeaseLostError, RoundStateLostError
from ..states import RangeState, RoundState
from .reads import _s


@dataclass(frozen=True)
class Claim:
    """What a successful claim hands the worker: the cursor to resume from and the range's
    counters so far. ``takeover`` is true when a previous owner's lease was broken."""

    token: str
    cursor: str
    epoch: int
    done: int
    skipped: int
    dead: int
    takeover: bool
    retries: int
    complete: bool = False
    lo: str = ""  # the range's bounds at the claim ('' from a complete claim; only the owner
    hi: str = ""  # splits, so they hold while this claim does)
    absorbed: int = 0  # fresh ranges that followed by id, coalesced into this one (``CLAIM``)


class Held(NamedTuple):
    """A claim refused because a live owner holds the range for ``ms_left`` more milliseconds
    (nothing written). A named tuple: it still unpacks as ``owner, ms_left``."""

    owner: str
    ms_left: int


@dataclass(frozen=True)
class Advanced:
    """A committed chunk: the range's cursor and counters after it."""

    cursor: str
    done: int
    skipped: int
    dead: int
    retries: int
    complete: bool
    split_req: str = ""  # an idle task asks the owner to split the range ('' = nobody)
    released: bool = False  # this step completed the range and released it (``release=True``)


@dataclass(frozen=True)
class Closed:
    """The round is closed (now or before): its totals and the stream's watermark ('' if none)."""

    done: int
    skipped: int
    dead: int
    watermark: str


@dataclass(frozen=True)
class Incomplete:
    """Nothing written: these ranges are not complete."""

    range_ids: tuple[int, ...]


@dataclass(frozen=True)
class Gap:
    """Nothing written: the ranges do not cover (start, end] at this range (n_ranges: the end)."""

    range_id: int


@dataclass(frozen=True)
class Unrecoverable:
    """Nothing written: the round was marked unrecoverable, for this reason."""

    reason: str


CloseResult = Closed | Incomplete | Gap | Unrecoverable


# ---- replies -------------------------------------------------------------------------------
def claim_result(where: str, token: str, res: Sequence[Any]) -> Claim | Held:
    """A ``CLAIM`` reply: ``Claim`` (``complete=True`` when nothing is left), ``Held``, or
    ``RoundStateLostError`` raised for ``'lost'``."""
    status = _s(res[0])
    if status == "lost":
        raise RoundStateLostError(
            f"{where} has no state in Redis; it was lost, not "
            "finished. Re-plan or restore from the checkpoint mirror."
        )
    if status == RangeState.COMPLETE:
        return Claim(token, _s(res[1]), 0, int(res[2]), int(res[3]), int(res[4]), False, 0, True)
    if status == "held":
        return Held(_s(res[1]), int(res[2]))
    return Claim(
        token,
        _s(res[1]),
        int(res[2]),
        int(res[3]),
        int(res[4]),
        int(res[5]),
        bool(int(res[6])),
        int(res[7]),
        lo=_s(res[8]),
        hi=_s(res[9]),
        absorbed=int(res[10]) if len(res) > 10 else 0,
    )


def advance_result(
    where: str, round_id: str, range_id: int, res: Sequence[Any], expected: str, new: str
) -> Advanced:
    """An ``ADVANCE`` reply: ``Advanced``, or the refusal raised as a named error (nothing was
    written)."""
    status = _s(res[0])
    if status == "ok":
        return Advanced(
            _s(res[1]),
            int(res[2]),
            int(res[3]),
            int(res[4]),
            int(res[5]),
            _s(res[6]) == RangeState.COMPLETE,
            _s(res[7]) if len(res) > 7 else "",
            len(res) > 8 and int(res[8]) == 1,
        )
    if status == "dead_cap":
        raise DeadLetterCapError(
            f"{where} holds {_s(res[1])} dead letter(s) and this "
            f"step would add {_s(res[2])}, more than dead_cap={_s(res[3])}. Dead letters are "
            "never dropped, so nothing of it was committed (the cursor stays at "
            f"{expected!r}). "
            f"List them with dead_letters({round_id!r}, {range_id}) (CLI: airflow-keyset "
            "dead-letters), fix the processor or the data and replay_dead_letters, or raise "
            "dead_cap and run the range again."
        )
    raise _advance_refused(where, status, res, expected, new)


def _advance_refused(
    where: str, status: str, res: Sequence[Any], expected: str, new: str
) -> Exception:
    """The error for a refused ``ADVANCE`` (nothing was written)."""
    if status == "lost":
        return RoundStateLostError(
            f"{where} lost state in Redis (its range hash, retry hash or dead list is missing or "
            "does not match the counts it keeps: flushed, evicted or deleted); nothing was "
            "committed. Restore it from the checkpoint mirror or re-plan the round."
        )
    if status == "not_owner":
        return LeaseLostError(
            f"{where} is now owned by {_s(res[1]) or 'nobody'}; this worker "
            "lost its lease and its advance was refused (fencing)"
        )
    if status == "expired":
        return LeaseLostError(f"the lease on {where} expired before the advance; refused (fencing)")
    if status == "cursor":
        return CursorConflictError(
            f"{where}: cursor is {_s(res[1])!r}, expected {expected!r}; refused"
        )
    if status == "backwards":
        return CursorConflictError(
            f"{where}: advance from {expected!r} to {new!r} moves backwards; refused"
        )
    return CursorConflictError(f"{where}: advance to {new!r} passes hi {_s(res[1])!r}; refused")


def close_result(round_id: str, stream: str, res: Sequence[Any]) -> CloseResult:
    """A ``CLOSE_ROUND`` reply as a ``CloseResult``; ``RoundStateLostError`` for ``'lost'``."""
    status, values = _s(res[0]), [_s(x) for x in res[1:]]
    if status == "lost":
        raise RoundStateLostError(f"round {round_id} of stream {stream!r} lost state in Redis")
    if status == RoundState.CLOSED:
        return Closed(int(values[0]), int(values[1]), int(values[2]), values[3])
    if status == RoundState.UNRECOVERABLE:
        return Unrecoverable(values[0])
    if status == "gap":
        return Gap(int(values[0]))
    return Incomplete(tuple(int(v) for v in values))
