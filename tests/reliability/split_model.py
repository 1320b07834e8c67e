"""The model behind the split property test: the key space, what every simulated worker believes,
what the test itself records, and the checks a finished trial must pass.

The store is driven by ``split_sim.Sim``; this module never calls Redis except through the
final checks' reads. The model is independent of the store: it records which keys each worker
*processed* (delivered to its processor) and which it *committed* (its advance was accepted),
and the checks compare that record with what the store says at the end.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from airflow_keyset_provider.core.keys import MIN_KEY, decode_key, encode_key

LEASE_MS = 60_000  # a live owner never loses its lease by accident in a trial
EXPIRE_MS = 1  # the last heartbeat of a stalled or dead owner: its lease runs out at once


class PropertyViolation(AssertionError):
    """A trial broke a guarantee; the message names the seed that reproduces it."""


class KeySpace:
    """The table: sorted distinct integer keys ``> 0``; 0 stands for ``MIN_KEY`` (below all)."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = sorted(keys)
        self.end = self.keys[-1]

    @staticmethod
    def enc(i: int) -> str:
        return MIN_KEY if i == 0 else encode_key([i])

    @staticmethod
    def dec(s: str) -> int:
        return 0 if s == MIN_KEY else int(decode_key(s)[0])

    def between(self, lo: int, hi: int) -> list[int]:
        """The keys ``k`` with ``lo < k <= hi``."""
        return self.keys[bisect.bisect_right(self.keys, lo) : bisect.bisect_right(self.keys, hi)]

    def chunk(self, pos: int, hi: int, size: int) -> tuple[list[int], int]:
        """The next keyset chunk after ``pos`` in ``(pos, hi]``: its keys and the cursor it
        commits (the last key, or ``hi`` when the range is exhausted, as the engine does)."""
        rest = self.between(pos, hi)
        if len(rest) <= size:
            return rest, hi
        return rest[:size], rest[size - 1]


@dataclass
class Figures:
    """What trials did, summed over a run (reported, and the replay bound asserted)."""

    trials: int = 0
    keys: int = 0
    chunks: int = 0
    splits: int = 0
    coalesced: int = 0  # ranges absorbed by claims (``CursorStore.claim(..., coalesce=m)``)
    declined: int = 0
    requests: int = 0
    crashes: int = 0
    stalls: int = 0
    takeovers: int = 0
    stale_refused: int = 0
    releases: int = 0
    replayed_keys: int = 0
    keys_lost: int = 0
    max_replay_chunks: int = 0
    max_ranges: int = 0

    def add(self, other: Figures) -> None:
        for name, value in vars(other).items():
            if name.startswith("max_"):
                setattr(self, name, max(getattr(self, name), value))
            else:
                setattr(self, name, getattr(self, name) + value)


@dataclass
class ModelRange:
    """The test's own record of one range: bounds, committed cursor, owner and lease."""

    lo: int
    hi: int
    cursor: int
    owner: str = ""
    lineage: str = ""
    expired: bool = False  # the owner's lease was run out (stall / crash without restart)
    claimed: bool = False  # some claim of it was ever accepted
    merged_into: int | None = None  # coalesced into that range by its claim (empty, complete)

    @property
    def complete(self) -> bool:
        return self.cursor == self.hi

    @property
    def fresh(self) -> bool:
        """A claim may coalesce it: never claimed, nothing committed, not complete (the sim
        makes no retries or dead letters, so those are always 0)."""
        return not self.claimed and self.owner == "" and self.cursor == self.lo < self.hi


@dataclass
class Event:
    """A fence event (crash, stall, zombie): the keys processed but never committed, in one
    range. ``chunks`` is how many chunks those keys came from (the replay bound: at most 1)."""

    kind: str
    range_id: int
    keys: list[int]
    chunks: int


@dataclass
class Attempt:
    """One attempt of a simulated worker (a task try): its lineage, the range it holds and what
    it has read. ``status``: live, stalled (its lease ran out while it slept), zombie (its
    process died to the scheduler but kept running), gone."""

    lineage: str
    number: int
    status: str = "live"
    token: str = ""
    rid: int | None = None
    cursor: int = 0  # the committed cursor as this attempt believes it
    hi: int = 0
    chunk: list[int] = field(default_factory=list)  # processed, not committed
    chunk_end: int = 0
    has_chunk: bool = False
    prefetch: list[int] = field(default_factory=list)  # read, not processed
    prefetch_end: int = 0
    has_prefetch: bool = False
    request: str = ""  # the split request seen at the last commit
    asked: int | None = None  # the range this idle attempt asked to split
    resume: int | None = None  # the range a restarted attempt resumes first
    hint: int | None = None  # an id ``next_unclaimed`` handed out, claimed at a later step
    known: set[int] = field(default_factory=set)  # ``open_briefs``' known_complete
    finished: bool = False

    @property
    def requester(self) -> str:
        return f"{self.lineage}.{self.number}"

    @property
    def read_pos(self) -> int:
        """How far this attempt has read (committed cursor, chunk in hand, prefetch)."""
        if self.has_prefetch:
            return self.prefetch_end
        if self.has_chunk:
            return self.chunk_end
        return self.cursor

    def drop_reads(self) -> None:
        self.chunk, self.has_chunk, self.prefetch, self.has_prefetch = [], False, [], False


@dataclass
class Record:
    """What the workers did, as the test saw it."""

    delivered: Counter[int] = field(default_factory=Counter)
    committed: Counter[int] = field(default_factory=Counter)
    abandoned: Counter[int] = field(default_factory=Counter)
    events: list[Event] = field(default_factory=list)

    def abandon(self, kind: str, a: Attempt) -> None:
        """``a`` stops for good with what it processed uncommitted: a fence event."""
        if a.rid is not None:
            chunks = 1 if a.has_chunk else 0
            self.events.append(Event(kind, a.rid, list(a.chunk), chunks))
            self.abandoned.update(a.chunk)
        a.drop_reads()


def check_outcome(
    seed: int, ks: KeySpace, model: dict[int, ModelRange], rec: Record, figures: Figures
) -> None:
    """(a) every key processed, (c) replays only from fence events, at most one chunk each,
    (d) every key committed exactly once. Fills the figures before it raises."""
    lost = [k for k in ks.keys if rec.delivered[k] == 0]
    figures.keys_lost += len(lost)
    figures.replayed_keys += sum(n - 1 for n in rec.delivered.values() if n > 1)
    figures.max_replay_chunks = max([figures.max_replay_chunks, *(e.chunks for e in rec.events)])
    stray = sorted(set(rec.delivered) - set(ks.keys))
    if lost or stray:
        fail(seed, f"keys never processed {lost[:10]} (of {len(lost)}), stray keys {stray[:10]}")
    twice = [k for k in ks.keys if rec.committed[k] != 1]
    if twice:
        fail(
            seed, f"keys not committed exactly once: {[(k, rec.committed[k]) for k in twice[:10]]}"
        )
    unexplained = [k for k in ks.keys if rec.delivered[k] != 1 + rec.abandoned[k]]
    if unexplained:
        k = unexplained[0]
        fail(
            seed,
            f"{len(unexplained)} key(s) replayed beyond what fence events abandoned: key {k} "
            f"processed {rec.delivered[k]}x, abandoned {rec.abandoned[k]}x",
        )
    too_big = [e for e in rec.events if e.chunks > 1]
    if too_big:
        fail(seed, f"a fence event replays more than one chunk: {too_big[0]}")


def check_partition(
    seed: int, ks: KeySpace, briefs: list[Any], model: dict[int, ModelRange]
) -> None:
    """(b) the final ranges, in key order (lo, then hi: an empty range left by coalescing sits
    before the range that starts where it is), partition ``(start, end]`` with no gap or
    overlap; each is complete with its counters equal to its keys, and matches the model."""
    walk = sorted(briefs, key=lambda b: (KeySpace.dec(b.lo), KeySpace.dec(b.hi), b.range_id))
    expect = KeySpace.enc(0)
    for b in walk:
        if b.lo != expect:
            fail(seed, f"range {b.range_id} starts at {b.lo!r}, the previous ends at {expect!r}")
        lo, hi = KeySpace.dec(b.lo), KeySpace.dec(b.hi)
        if hi < lo:
            fail(seed, f"range {b.range_id} is inverted: ({lo}, {hi}]")
        m = model.get(b.range_id)
        if m is None or (m.lo, m.hi) != (lo, hi):
            fail(seed, f"range {b.range_id} is ({lo}, {hi}] in Redis, {m} in the model")
        if b.state != "complete" or b.cursor != b.hi:
            fail(seed, f"range {b.range_id} is {b.state} at {b.cursor!r}, hi {b.hi!r}")
        if int(b.done) != len(ks.between(lo, hi)):
            fail(
                seed,
                f"range {b.range_id} counted {b.done} done, it holds {len(ks.between(lo, hi))}",
            )
        expect = b.hi
    if expect != KeySpace.enc(ks.end):
        fail(seed, f"the ranges end at {expect!r}, the round at {KeySpace.enc(ks.end)!r}")
    if len(briefs) != len(model):
        fail(seed, f"Redis has {len(briefs)} ranges, the model {len(model)}")


def fail(seed: int, message: str) -> None:
    raise PropertyViolation(
        f"seed {seed}: {message} (reproduce: KEYSET_SPLIT_SEED={seed} pytest "
        "tests/reliability/test_reliability_split.py)"
    )
