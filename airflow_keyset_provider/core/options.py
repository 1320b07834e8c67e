"""``TraverseOptions``: every setting of one ``KeysetTraversal.traverse`` call, checked once.

Adding a setting means adding one documented field here (and reading it where it is used in
``core/run/range_run.py``); ``traverse``, ``TraverseRangeOperator`` and ``run_processor`` accept it by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError


@dataclass(frozen=True, kw_only=True)
class TraverseOptions:
    """How one range is traversed. Keyword-only, so two numbers can never be swapped by position;
    every field is validated when the object is built, and a refusal names the field."""

    chunk_size: int = 1000
    """Rows per chunk handed to the processor (positive integer). Also the replay bound after a
    crash: at most one chunk (or one group, see ``group_commit_chunks``) is delivered again."""

    lease_seconds: float = 60
    """How long a claim on the range lives without a heartbeat (at least 1); heartbeats renew it
    every third of it, so a worker that stops beating loses the range after this long."""

    max_chunk_attempts: int = 5
    """Consecutive failures of one chunk (dependency failures: the cursor stays) before
    ``DependencyFailedError`` is raised (positive integer)."""

    max_item_attempts: int = 3
    """Attempts of one failed item before it is dead-lettered and counted as dead (positive
    integer)."""

    owner_lineage: str = ""
    """Names the logical worker (e.g. an Airflow task instance). A new attempt of the same lineage
    takes the range over at once and fences the old one; ``""`` is anonymous."""

    claim_timeout: float | None = None
    """Seconds to wait while another live owner holds the range before ``LeaseHeldError``
    (non-negative; None: three leases)."""

    chunk_timeout: float | None = None
    """Seconds one processor call may run before this try gives the range up (positive; None: ten
    leases, 600 s with the default lease; ``math.inf`` turns the bound off). The lease follows
    progress, not the process: past this bound the heartbeat stops, the lease lapses
    ``lease_seconds`` later and another try takes the range over; this try is fenced and, if the
    call ever returns, fails with ``LeaseLostError`` naming the chunk. On by default because a hung
    processor (a lock wait, a socket without timeout) otherwise holds its range for ever; ten
    leases is far above a healthy chunk (seconds), so only a real hang trips it, and a false trip
    costs one replayed chunk, never a lost key."""

    backoff_base: float = 0.5
    """Seconds before retrying a failed chunk; doubles with each consecutive failure, jittered to
    50-100 % (non-negative)."""

    backoff_max: float = 30.0
    """Upper bound of that backoff and of the wait between item retry passes (non-negative)."""

    item_retry_delay: float = 0.5
    """Seconds before the first retry pass over failed items; doubles with the items' attempts, up
    to ``backoff_max`` (non-negative)."""

    outage_failure_ratio: float = 0.5
    """When more than this fraction of a chunk's items (and at least two) fail, it is a dependency
    outage, not bad items: the chunk is retried and nothing is dead-lettered (non-negative; above
    1 turns the check off)."""

    prefetch: bool = True
    """Read the next chunk while the processor works on this one (one more chunk in memory)."""

    log_every_seconds: float = 30.0
    """At most one progress line (cursor, counters, rows/s, ETA) this often (non-negative)."""

    dead_cap: int = 1000
    """The most dead letters a range may hold (non-negative integer). Letters are never dropped:
    the advance that would pass the cap is refused, nothing of it committed, and the range raises
    ``DeadLetterCapError``; fix the cause and replay, or raise the cap."""

    group_commit_chunks: int = 1
    """Commit the cursor once per this many chunks instead of once per chunk (positive integer; 1
    is off). Saves a Redis round trip per chunk; the replay bound after a crash widens from one
    chunk to one group. A group is always committed before stopping, backing off or retrying
    items."""

    group_commit_seconds: float | None = None
    """Also commit once the group is this old (non-negative; None: off). With
    ``group_commit_chunks`` left at 1, groups are cut by time only."""

    control_poll_seconds: float = 1.0
    """How often the stream's control state (pause, ``max_rows_per_second``) is read, by a light
    poller thread, never per chunk (positive). A pause is noticed within this plus the chunk in
    hand."""

    yield_after_seconds: float | None = None
    """When the stream's throughput budget would make this call wait longer than this before a
    chunk, commit, release the lease and return with ``RangeResult.yielded == "throttled"`` (and
    ``retry_after``) instead of sleeping (non-negative; None: wait in place).
    ``TraverseRangeOperator`` sets it so a throttled task defers and frees its worker slot."""

    health_checks: tuple[Any, ...] = ()
    """Checks of the source database evaluated before each chunk and shared by every task of
    the stream (``core/pace/health.py``: ``ReplicationLag``, ``ActiveBackends``, ``SqlThreshold``,
    ``CallableCheck``, or any object with ``name`` and ``probe(engine)``). While the verdict is
    unhealthy no chunk is started. Costs one Redis round trip per chunk; empty: off."""

    health_poll_seconds: float = 5.0
    """How old the shared health verdict may get before one task probes again (positive)."""

    target_chunk_seconds: float | None = None
    """Adaptive chunk size: steer the rows per chunk (read + process + commit) toward this many
    seconds, starting at ``chunk_size``, between ``min_chunk_size`` and ``max_chunk_size``
    (positive; None: off, every chunk has ``chunk_size`` rows). The cursor contract is unchanged;
    the replay bound after a crash is one chunk of at most ``max_chunk_size`` rows."""

    min_chunk_size: int = 10
    """Smallest chunk the adaptive size may choose (positive integer)."""

    max_chunk_size: int = 100_000
    """Largest chunk the adaptive size may choose: also the memory bound (positive integer)."""

    max_task_seconds: float | None = None
    """Time budget of one call (``traverse``, or ``traverse_round`` over many ranges): once it is
    spent, at the next chunk boundary the call commits the chunk in hand, releases its lease and
    returns with ``yielded == "budget"``; calling again resumes from the committed cursor (a
    ``traverse_round`` of the same ``owner_lineage`` resumes the range it released). Positive;
    None: no budget. ``TraverseRangeOperator`` in pull mode sets 3600 s by default and defers
    briefly, so a task that pulls range after range never outlives what its executor tolerates.
    Checked before each chunk of the forward pass, once the call has read one chunk (so every
    call makes progress); item retry passes run to their end."""

    exactly_once: bool = False
    """Exactly-once effects for writes through ``chunk.connection`` (needs a target database):
    one transaction per chunk (or group) on the target, each processor call in a SAVEPOINT of
    it, and the chunk's key interval recorded in the round's ledger (``keyset_ledger``: the
    committed key intervals of each round, whatever range identity committed them) in the same
    transaction, fenced by the claim's generation and by overlap, before the Redis cursor
    advances. A claim passes every interval committed inside its keys, so a chunk whose
    transaction committed is never delivered again. Item retry passes stay at-least-once
    (docs/contract.md, "Exactly-once effects")."""

    def __post_init__(self) -> None:
        for name in (
            "chunk_size",
            "max_chunk_attempts",
            "max_item_attempts",
            "group_commit_chunks",
            "min_chunk_size",
            "max_chunk_size",
        ):
            _check_integer(name, getattr(self, name))
        if self.target_chunk_seconds is not None:
            _check_number("target_chunk_seconds", self.target_chunk_seconds)
        if not self.min_chunk_size <= self.max_chunk_size:
            raise ConfigurationError(
                f"min_chunk_size must be at most max_chunk_size, got {self.min_chunk_size} > "
                f"{self.max_chunk_size}"
            )
        _check_integer("dead_cap", self.dead_cap, allow_zero=True)
        _check_number("lease_seconds", self.lease_seconds)
        _check_number("control_poll_seconds", self.control_poll_seconds)
        _check_number("health_poll_seconds", self.health_poll_seconds)
        checks = self.health_checks
        if not isinstance(checks, (list, tuple)) or not all(
            callable(getattr(c, "probe", None)) for c in checks
        ):
            raise ConfigurationError(
                "health_checks must be a list of checks with a probe(engine) method (e.g. "
                f"ReplicationLag(30), SqlThreshold(sql, max_value)), got {checks!r}"
            )
        object.__setattr__(self, "health_checks", tuple(checks))
        if self.lease_seconds < 1:
            raise ConfigurationError(
                "lease_seconds must be at least 1 (heartbeats renew it every third), "
                f"got {self.lease_seconds!r}"
            )
        for name in (
            "backoff_base",
            "backoff_max",
            "item_retry_delay",
            "outage_failure_ratio",
            "log_every_seconds",
        ):
            _check_number(name, getattr(self, name), allow_zero=True)
        if self.max_task_seconds is not None:
            _check_number("max_task_seconds", self.max_task_seconds)
        for name in ("claim_timeout", "group_commit_seconds", "yield_after_seconds"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), allow_zero=True)
        if self.chunk_timeout is not None:
            _check_number("chunk_timeout", self.chunk_timeout)
        if not isinstance(self.owner_lineage, str):
            raise ConfigurationError(f"owner_lineage must be a string, got {self.owner_lineage!r}")
        if not isinstance(self.exactly_once, bool):
            raise ConfigurationError(
                f"exactly_once must be True or False, got {self.exactly_once!r}"
            )
        if not isinstance(self.prefetch, bool):
            raise ConfigurationError(f"prefetch must be True or False, got {self.prefetch!r}")

    @property
    def lease_ms(self) -> int:
        return int(self.lease_seconds * 1000)

    @property
    def claim_timeout_seconds(self) -> float:
        """``claim_timeout``, or three leases when it is None."""
        return self.claim_timeout if self.claim_timeout is not None else 3 * self.lease_seconds

    @property
    def chunk_timeout_seconds(self) -> float:
        """``chunk_timeout``, or ten leases when it is None."""
        return self.chunk_timeout if self.chunk_timeout is not None else 10 * self.lease_seconds

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> TraverseOptions:
        """Options from keyword arguments, refusing an unknown name with a ``ConfigurationError``
        that lists the known ones (a constructor would raise ``TypeError``)."""
        unknown = sorted(set(kwargs) - OPTION_NAMES)
        if unknown:
            raise ConfigurationError(
                f"unknown traverse option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(OPTION_NAMES))}"
            )
        return cls(**kwargs)


#: The field names of ``TraverseOptions``.
OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(TraverseOptions))


def call_options(arguments: Mapping[str, Any], options: TraverseOptions | None) -> TraverseOptions:
    """The options of a call that takes its settings as keywords *or* as one ``options`` object
    (``KeysetTraversal.traverse``). ``arguments`` is the call's arguments by name (its
    ``locals()``); those named like a ``TraverseOptions`` field are the keyword settings. Both at
    once (``options`` and a keyword away from its default) is refused."""
    given = TraverseOptions(**{n: v for n, v in arguments.items() if n in OPTION_NAMES})
    if options is not None and given != TraverseOptions():
        raise ConfigurationError("give the traverse settings as keywords or as options=, not both")
    return options or given


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if not (_is_number(value) and (value >= 0 if allow_zero else value > 0)):
        kind = "non-negative" if allow_zero else "positive"
        raise ConfigurationError(f"{name} must be a {kind} number, got {value!r}")


def _check_integer(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        kind = "non-negative" if allow_zero else "positive"
        raise ConfigurationError(f"{name} must be a {kind} integer, got {value!r}")


__all__ = ["OPTION_NAMES", "TraverseOptions", "call_options"]
