"""The cursor store: rounds, ranges, leases and cursors in Redis, moved only by small Lua scripts.

Redis is the *recovery layer*, not the truth: the truth is the source's key order, the round's
fixed bounds and the committed cursors. Every state change is one Lua script, so a cursor and its
counters always move together, and every script touches the keys of one stream only, all sharing
the hash tag ``{<stream>}``, so the scripts run unchanged on Redis Cluster.

Key layout (``P`` is the key prefix, ``ks`` by default; ``S`` the stream)::

    P:{S}:watermark                 string  encoded end of the contiguous completed prefix
    P:{S}:key                       string  fingerprint of the key the watermark is encoded with
    P:{S}:seq                       string  round id counter
    P:{S}:open                      set     ids of open rounds
    P:{S}:chained                   string  id of the open round that started at the watermark
    P:{S}:by_key                    hash    idempotency key (e.g. Airflow run id) -> round id
    P:{S}:ahead                     hash    closed rounds above a gap: round id -> "start|end"
    P:{S}:released                  list    call ids of the last 1,024 steps that released a
                                            complete range (a second run of one is recognised)
    P:{S}:round:R                   hash    start, end, n_ranges, state, chained, source, totals;
                                            pull mode: next (hint counter), skip:<I> (first id
                                            after the run range I coalesced), held:<lineage>
                                            (the range that lineage claimed last), merged;
                                            answer:<name> (what a plan first returned)
    P:{S}:round:R:range:I           hash    lo, hi, cursor, state, dead, retries; as it runs:
                                            owner, lineage, epoch, lease_until, heartbeat_ms,
                                            claimed_ms, completed_ms, done, skipped, chunks,
                                            takeovers, split_* (a field at its default may be
                                            missing: see below); merged_into (coalesced: empty);
                                            unmirrored (ranges it absorbed, not yet mirrored)
    P:{S}:round:R:retry:I           hash    encoded key -> "attempts|last error"   (sparse)
    P:{S}:round:R:dead:I            list    JSON dead letters, newest first, never trimmed (sparse)
    P:{S}:control                   hash    pause, reason, rate (``core/pace/stream_control.py``)
    P:{S}:control:bucket            hash    the shared rows/s token bucket (``core/pace/governor.py``)
    P:{S}:control:health            hash    the shared health verdict (``core/pace/health.py``)
    P:{S}:control:health_lock       string  token of the task probing health (``core/pace/health.py``)
    P:{S}:events                    channel "R:I:complete" (a hint to wake a barrier, never truth)

No key has a TTL (nothing here calls EXPIRE or SET with EX/PX) but the three throttling keys
(``control:bucket``, ``control:health``, ``control:health_lock``: their scripts set one; losing
one costs a fresh burst or a fresh probe, never a cursor), so a ``volatile-*`` eviction policy
never evicts the others; ``allkeys-*`` could, and ``check_eviction_policy`` refuses it.

Small state (issue #11: a 4,096-range round stays under 1 MB, ``tests/core/
test_redis_footprint.py``; the rules in ``layout.py``): a range is created with lo, hi,
cursor, state, dead and retries only; the scripts and the readers fill every other field in with
its default ('' or 0; a missing cursor is hi once complete, else lo). When its owner releases a
complete range, the hash is written anew with lo, hi, state, retries, dead, completed_ms and its
non-zero counters: the owner token, lineage, lease, cursor, epoch and claim time go. A hash
written by an older version (every field) reads the same.

Partial loss is detected, not only total loss: each range hash keeps ``retries`` (= HLEN of its
retry hash) and ``dead`` (= LLEN of its dead list), changed in the same script as what they
count, and every script that reads a range (claim, advance, requeue, close, the status read)
checks both. A piece lost on its own reads as lost (``RoundStateLostError``), which the mirror
restores (only the pieces that are not intact) or the caller reports; never as complete.

Lost replies: redis-py retries a command after ``ConnectionError``/``TimeoutError``, and the
error may come after Redis ran it, so every script here is safe to run twice (each header in
``lua/`` says why). Most take a call id (``reads.call_id``, one per call) and keep it in the hash
they change (``call`` on a range, ``create_call``/``next_call``/``restore_call`` on a round,
``split_req_call`` for a split request; a step that releases a complete range compacts it and
records its id in ``released`` instead): a second run of the same call writes nothing and
answers what the first answered. ``StoreUnavailableError`` therefore never says "nothing was
written" (``tests/reliability/test_reliability_replay*.py``).

Why owner tokens (the timeline ``redis.lock`` taught us)::

    t0  worker A claims range 3 (token a1, epoch 1, lease 60 s), reads chunk (100, 200]
    t1  A stalls (GC pause, SIGSTOP, network partition) for longer than its lease
    t2  worker B claims range 3: the lease expired, so B gets token b1, epoch 2, cursor 100
    t3  B processes (100, 200] and advances the cursor to 200, then to 300
    t4  A wakes up and tries to advance 100 -> 200 with token a1
        -> refused: the owner is b1 (and the cursor is no longer 100). A stops.

Without the token A's late write would move the cursor *backwards* to 200 and B's work on
(200, 300] would be replayed or, worse, a later worker would skip past keys on a stale cursor.
Leases are measured on the Redis server's clock (``TIME``), never on a worker's.

State changes that are *not* a Lua script, and why each is still safe::

    create_round       INCR seq before the script: a single atomic command; an id the script
                       then does not use (or a retried INCR) is burnt, never reused. If the counter was lost, the
                       script refuses an id whose round or range hash exists ('taken'); the
                       counter is then raised past every round of the stream (SCAN) and the
                       next id is tried: a live round is never overwritten
    lookup             HSETNX by_key: a single atomic command (the request joins the open
                       chained round, first writer wins)
    restore_watermark  SET NX watermark, init_round_counter SET NX seq: single atomic commands
                       that never overwrite what exists
    delete_stream      SCAN + DEL key by key: not atomic; for tests and tooling that wipe a whole
                       stream while nothing runs on it
    set_control_field  HSET / HDEL of one field of the control hash (the rate): a single atomic
                       command; pause and resume are scripts (``core/pace/stream_control.py``)
    reset_bucket       DEL of the token bucket: the next charge starts with a full burst
    mirrored_coalescing HDEL of a range's 'unmirrored' mark, after the mirror recorded the
                       ranges it absorbed; clearing it late only mirrors them once more

The module: ``reads.py`` holds the key names and the reads (``StoreReads``), ``pull.py``
what tasks that pull ranges need (next unclaimed range, briefs, split requests and the owner's
split), this module the other writes (``CursorStore``), ``results.py`` their named results
(``Claim``, ``Advanced``, ``Closed``, ...: re-exported here), ``server.py`` the connection and
the eviction-policy check, ``scripts.py`` the loader of the Lua scripts (one file each in
``lua/``, shared fragments in ``lua/includes/``). Only these modules touch the Redis client or build a key: the rest of the package names
keys with the ``*_key`` properties and runs its own scripts (pause, rate budget, health) through
``store.script(source)``, which registers them on the store's client (EVALSHA, reloaded on
NOSCRIPT). This docstring is the one place the key layout and the reasons behind it are written
down, on purpose: it makes the module longer than the others, and the code itself is short.

The states written here (``open``/``closed``/``unrecoverable`` for rounds, ``pending``/
``running``/``complete`` for ranges) are named in ``core/states.py`` (``RoundState``,
``RangeState``, re-exported by ``core/rounds/status.py``); the Lua scripts spell the same strings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from ..errors import LeaseHeldError, RoundStateLostError
from .pull import RangePull
from .reads import _s, call_id
from .results import (
    Advanced,
    Claim,
    Closed,
    CloseResult,
    Gap,
    Held,
    Incomplete,
    Unrecoverable,
    advance_result,
    claim_result,
)
from .rounds import RoundWrites
from .scripts import (
    ADVANCE,
    CLAIM,
    HEARTBEAT,
    RELEASE,
    REQUEUE_DEAD,
    RESTORE_DEAD,
)
from .server import CLUSTER_SCHEMES, check_eviction_policy, connect_redis

log = logging.getLogger("airflow_keyset_provider")


class CursorStore(RoundWrites, RangePull):
    """Fenced, atomic round/range state for one stream in Redis.

    Guarantees (each enforced inside one Lua script, so they hold under any interleaving):

    - a cursor moves only forward, never past its range's ``hi``, only from the value the
      worker expected, and only by the current owner while its lease is valid;
    - a cursor and its counters move in the same step;
    - a round closes only when its ranges cover ``(start, end]`` exactly and are all complete;
    - the watermark only moves forward;
    - missing state raises ``RoundStateLostError``; it is never read as "nothing left to do".

    The store owns the key layout (the module docstring): callers use the ``*_key`` names and
    the methods below, never the client.
    """

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        prefix: str = "ks",
        *,
        allow_unverified_eviction_policy: bool = False,
    ) -> None:
        super().__init__(client, stream, prefix)
        self.allow_unverified_eviction_policy = allow_unverified_eviction_policy
        reg = self.script
        self._claim = reg(CLAIM)
        self._heartbeat = reg(HEARTBEAT)
        self._advance = reg(ADVANCE)
        self._release = reg(RELEASE)
        self._requeue = reg(REQUEUE_DEAD)
        self._restore_dead = reg(RESTORE_DEAD)

    # ---- the connection and the stream -----------------------------------------------------
    # ---- the stream's control hash ----------------------------------------------------------
    def set_control_field(self, field: str, value: str | None) -> None:
        """Set one field of the stream's control hash (HSET), or remove it when ``value`` is
        None (HDEL). ``core/pace/stream_control.py`` owns the fields."""
        if value is None:
            self.client.hdel(self.control_key, field)
        else:
            self.client.hset(self.control_key, field, value)

    def reset_bucket(self) -> None:
        """Forget the stream's token bucket (its debt too)."""
        self.client.delete(self.bucket_key)

    # ---- the server ------------------------------------------------------------------------
    def check_eviction_policy(self) -> str:
        """Refuse a Redis server that may evict the stream's keys; returns the policy.

        ``noeviction`` and ``volatile-*`` are accepted (no key of the stream has a TTL, so a
        ``volatile-*`` policy never picks one); ``allkeys-*`` raises ``EvictionPolicyError``. The
        policy is read with ``CONFIG GET maxmemory-policy``, else (managed Redis often refuses
        CONFIG) from ``INFO memory``; when neither answers the plan is refused too, unless the
        store was opened with ``allow_unverified_eviction_policy=True``. On a cluster every
        primary is checked.
        """
        return check_eviction_policy(
            self.client, self.stream, allow_unverified=self.allow_unverified_eviction_policy
        )

    # ---- one range -------------------------------------------------------------------------
    def claim(
        self,
        round_id: str,
        range_id: int,
        token: str,
        lineage: str,
        lease_ms: int,
        coalesce: int = 0,
        pull: bool = False,
        mirror: bool = False,
    ) -> Claim | Held:
        """A ``Claim`` (``complete=True`` when there is nothing left to do), or ``Held`` when a
        live owner holds the range (nothing written). ``coalesce``: the claim also absorbs up to
        that many of the ranges that follow by id, while each is fresh (never claimed, nothing
        committed) and adjacent (``Claim.absorbed``, ``Claim.hi`` the new end; see ``CLAIM``).
        ``pull``: a pulling task's claim; the round records it as its lineage's (``held_by``).
        ``mirror``: the caller keeps a checkpoint mirror; a coalescing claim marks the range
        ``unmirrored`` until ``mirrored_coalescing``."""
        keys = [self.round_key(round_id), *self._range_keys(round_id, range_id)]
        for i in range(range_id + 1, range_id + 1 + max(coalesce, 0)):
            keys += self._range_keys(round_id, i)
        res = self._call(
            self._claim,
            keys,
            [
                token,
                lineage,
                lease_ms,
                range_id,
                "1" if pull else "",
                "1" if mirror else "",
                call_id(),
            ],
        )
        return claim_result(self._where(round_id, range_id), token, res)

    def mirrored_coalescing(self, round_id: str, range_id: int) -> None:
        """The checkpoint mirror has recorded the ranges this one absorbed: clear its mark."""
        self.client.hdel(self.range_key(round_id, range_id), "unmirrored")

    def heartbeat(self, round_id: str, range_id: int, token: str, lease_ms: int) -> bool:
        return bool(
            self._call(self._heartbeat, [self.range_key(round_id, range_id)], [token, lease_ms])
        )

    def advance(
        self,
        round_id: str,
        range_id: int,
        token: str,
        expected: str,
        new: str,
        *,
        done: int,
        skipped: int,
        lease_ms: int,
        max_item_attempts: int,
        dead_cap: int = 1000,
        resolved: Iterable[tuple[str, str]] = (),
        failed: Iterable[tuple[str, str]] = (),
        release: bool = False,
    ) -> Advanced:
        """Commit one chunk's outcome. Raises ``LeaseLostError`` or ``CursorConflictError`` (and
        changes nothing) when the fence refuses it; ``DeadLetterCapError`` (nothing committed)
        when the step would push the range's dead letters past ``dead_cap``. ``release``: when
        this step completes the range, release it in the same step (``Advanced.released``; not
        while a split request waits for the owner's answer: then call ``release`` after
        answering)."""
        fence = [token, expected, new, done, skipped, lease_ms, max_item_attempts, dead_cap]
        args = _advance_args([*fence, f"{round_id}:{range_id}"], resolved, failed)
        args += ["1" if release else "", call_id()]
        keys = [
            self.range_key(round_id, range_id),
            self.retry_key(round_id, range_id),
            self.dead_key(round_id, range_id),
            self.events_channel,
            self.released_key,
        ]
        res = self._call(self._advance, keys, args)
        return advance_result(
            self._where(round_id, range_id), round_id, range_id, res, expected, new
        )

    def release(self, round_id: str, range_id: int, token: str) -> bool:
        return bool(
            self._call(
                self._release,
                [self.range_key(round_id, range_id), self.released_key],
                [token, call_id()],
            )
        )

    def requeue_dead(self, round_id: str, range_id: int, limit: int) -> int:
        """Move up to ``limit`` dead letters back to the retry set; returns how many. Raises
        ``LeaseHeldError`` (nothing moved) while a live owner holds the range."""
        return self.take_dead(round_id, range_id, limit)[0]

    def take_dead(self, round_id: str, range_id: int, limit: int) -> tuple[int, list[str]]:
        """``requeue_dead``, also returning the letters moved as they were (JSON), for
        ``restore_dead``: how many moved, and the letters (empty when a resent call found its
        first run done: that run's reply had them)."""
        res = self._call(self._requeue, self._dead_keys(round_id, range_id), [limit, call_id()])
        self._refused(res, round_id, range_id, "replay it when that owner is done")
        letters = [_s(raw) for raw in res[2]] if len(res) > 2 else []
        return int(res[1]), letters

    def restore_dead(self, round_id: str, range_id: int, letters: Sequence[str]) -> int:
        """Put back ``letters`` (from ``take_dead``) whose keys are still in the retry set, as
        they were: a replay that failed leaves the range as it found it, less the letters that
        reached a terminal state meanwhile. Returns how many went back; ``LeaseHeldError``
        while a live owner holds the range (nothing moved: that owner resolves them)."""
        if not letters:
            return 0
        res = self._call(self._restore_dead, self._dead_keys(round_id, range_id), list(letters))
        self._refused(res, round_id, range_id, "its owner processes the replayed letters")
        return int(res[1])

    def _refused(self, res: Any, round_id: str, range_id: int, held_hint: str) -> None:
        """Raise for a dead-letter script's refusal: ``lost`` or ``held`` (``held_hint``)."""
        status = _s(res[0])
        if status == "lost":
            raise RoundStateLostError(f"{self._where(round_id, range_id)} has no state")
        if status == "held":
            raise LeaseHeldError(
                f"round {round_id} range {range_id} is held by {_s(res[1])}; {held_hint}"
            )

    def _dead_keys(self, round_id: str, range_id: int) -> list[str]:
        """KEYS of the dead-letter scripts: the range hash, its dead list, its retry hash."""
        return [
            self.range_key(round_id, range_id),
            self.dead_key(round_id, range_id),
            self.retry_key(round_id, range_id),
        ]


def _advance_args(
    head: list[Any], resolved: Iterable[tuple[str, str]], failed: Iterable[tuple[str, str]]
) -> list[Any]:
    """``ADVANCE``'s ARGV: ``head`` (token .. label), then the count and the (key, outcome) pairs
    of the resolved retries, then the count and the (key, error) pairs of this pass's failures
    (an error on one line, at most 500 characters)."""
    args = list(head)
    res_list = list(resolved)
    args.append(len(res_list))
    for k, outcome in res_list:
        args += [k, outcome]
    fail_list = list(failed)
    args.append(len(fail_list))
    for k, err in fail_list:
        args += [k, err.replace("\n", " ")[:500]]
    return args


__all__ = [
    "CLUSTER_SCHEMES",
    "Advanced",
    "Claim",
    "CloseResult",
    "Closed",
    "CursorStore",
    "Gap",
    "Held",
    "Incomplete",
    "Unrecoverable",
    "connect_redis",
]
