"""Named errors of the traversal engine.

Every error that a user can cause says what is wrong *and* what to do about it. Errors raised
before anything is written (validation) leave Redis and the source untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class KeysetError(Exception):
    """Base class of every error raised by the engine."""


class ConfigurationError(KeysetError, ValueError):
    """A bad argument: wrong type, bad bound, non-positive size. Nothing was written."""


class InvalidNameError(ConfigurationError):
    """A stream, key prefix, round id, range id, DAG id or run id that does not match its rule
    in full (``core/names.py``). Nothing was read or written."""


class KeyValidationError(ConfigurationError):
    """The key does not define a stable total order on the table (or the table/column is missing)."""


class UnsupportedKeyTypeError(KeyValidationError):
    """A key column has a type whose order cannot be encoded exactly (e.g. float)."""


class RetryableError(KeysetError):
    """Raise from a processor when a *dependency* failed (database down, HTTP 503, timeout).

    The engine does not advance the cursor: it backs off and re-reads the same chunk. Use
    ``ChunkResult.failed`` instead for items that are bad on their own.
    """


class ProcessorContractError(KeysetError, TypeError):
    """The processor returned something other than ``ChunkResult`` or ``None``, or named keys
    that are not in the chunk. This is a bug in the processor; nothing of the chunk was committed."""


class StoreUnavailableError(KeysetError):
    """Redis (the cursor store) could not be reached. Nothing was written."""


class RoundStateLostError(KeysetError):
    """The round's control state is gone from Redis (flushed, evicted, restarted without
    persistence). The engine never reads missing state as "nothing left to do"."""


class StreamStateLostError(RoundStateLostError):
    """A chained plan found no state of the stream in Redis that it could restore (from the
    checkpoint mirror or a durable record such as Airflow's asset state), or found that Redis lost
    the stream's open round: it refuses rather than start the stream again below every key
    (``core/rounds/durability.py``). The message names the choices; nothing was written."""


class RoundNotFoundError(KeysetError):
    """No round with that id exists for the stream."""


class RoundUnknownError(RoundNotFoundError, RoundStateLostError):
    """Redis has no round with that id and its round counter never handed the id out: a wrong
    id, or a round planned on a primary whose writes the replica promoted after it never got (a
    failover to a lagging replica). It is also a ``RoundStateLostError``, so every path that puts a
    lost round back from the checkpoint mirror tries; when the mirror never saw the round either,
    it stays "not found"."""


class StreamNotFoundError(RoundNotFoundError):
    """The stream has no state at all under the key prefix (a typo, or a Redis that lost it)."""


class RoundIncompleteError(KeysetError):
    """``close_round`` found ranges that are not complete or a gap in the coverage."""

    def __init__(self, message: str, lagging: Sequence[Any] | None = None) -> None:
        super().__init__(message)
        self.lagging = list(lagging or [])  # the lagging ranges (``RangeStatus`` records)


class LeaseLostError(KeysetError):
    """This worker no longer owns the range (its lease expired and another worker claimed it, or
    the round was reset). It must stop: anything it would write is refused (fencing)."""


class LeaseHeldError(KeysetError):
    """Another live owner holds the range and did not release it within the wait budget."""


class CursorConflictError(KeysetError):
    """An advance was refused because the cursor is not where this worker expected it, would move
    backwards, or would pass the range's upper bound. The cursor was not changed."""


class CommitOrderTimeoutError(KeysetError):
    """Transactions that were open when the upper bound was read did not end in time. A key they
    hold could be below the bound, so the round was not saved."""


class DependencyFailedError(KeysetError):
    """The processor's dependency kept failing for the whole in-task retry budget. The cursor stayed
    at the last committed chunk; an Airflow retry (or a new ``traverse``) resumes from there."""


class ReplayFailedError(KeysetError):
    """A replay of dead letters failed (its ``__cause__`` says why). The letters it had moved
    back and that did not reach a terminal state are dead letters again, as they were; the
    message says how many, so the replay can be run again once the cause is fixed."""


class RetentionError(KeysetError):
    """The source no longer retains rows the round still has to read (it was truncated past a
    range's cursor). The round is unrecoverable; it is never reported complete."""


class DeadLetterCapError(KeysetError):
    """A range would hold more dead letters than its ``dead_cap``. Letters are never trimmed, so
    the advance that would pass the cap was refused and nothing of it was committed: the cursor
    and counters stay, every letter so far stays listable and replayable."""


class EvictionPolicyError(ConfigurationError):
    """The Redis server may evict the stream's keys (``maxmemory-policy`` ``allkeys-*``), or its
    policy could not be read. The plan was refused; nothing was written."""
