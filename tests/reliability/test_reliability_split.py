"""Scenario 12, dynamic splitting under crashes and takeovers: a model-based property test.

Guarantee: whatever the interleaving of pulls (claims that coalesce the fresh ranges after them
or not), chunk commits, split requests, owner splits (above everything the owner has read,
prefetch included), releases, crashes (with or without a retry of the task, the old process dead
or living on as a zombie), stalls past the lease and takeovers, on the real ``CursorStore`` in
real Redis:

(a) every key of the round is processed at least once (0 keys lost);
(b) the final ranges, sorted by ``(lo, hi)``, partition ``(start, end]`` exactly (no gap, no
    overlap), each complete, and ``close_round`` returns ``Closed``;
(c) a key is processed again only because a fence event (a crash, a stall, a zombie) abandoned
    the chunk it was in, and each such event abandons at most one chunk of one range;
(d) every key is committed exactly once, so the round's ``done`` equals the number of keys;
(e) a stale owner's advance or split is refused and changes nothing in Redis;
(f) a claim with ``coalesce=m`` absorbs exactly the ranges the model predicts (the next ids,
    at most ``m``, while each is fresh and starts where the claimed range ends), each left empty
    and complete at the new end, ``merged_into`` the claimed range; a claim of one answers
    complete, ``next_unclaimed`` never hands one out, ``open_briefs`` never takes an open range
    as complete, and a pulling claim is its lineage's ``held_by``.

Each trial is a seeded random world (``split_sim.Sim``): 20-160 keys spread over ``1..3N``, 1-12
planned ranges (so runs of fresh ranges exist to coalesce), 1-4 workers, chunks of 1-8 keys.
Short mode runs 300 trials, long mode (``KEYSET_RELIABILITY_LONG=1``) 10,000. A failure names its seed; ``KEYSET_SPLIT_SEED=<seed>``
replays that one trial.

The last tests plant bugs (an owner that splits below what it has read, a split that leaves a
gap, a close that ignores gaps, a fence that lets a stale owner through, a claim that coalesces
a range claimed before, a claim that leaves coalesced ranges at their old end) and require the
harness to catch each: the property test is only as good as what it can fail on.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import redis
import reliability_support as rs
from split_model import LEASE_MS, Figures, KeySpace, PropertyViolation
from split_sim import Sim

from airflow_keyset_provider.core.store.cursor_store import (
    Claim,
    Closed,
    CloseResult,
    CursorStore,
    Gap,
)
from airflow_keyset_provider.core.store.scripts import CLAIM

SCENARIO = "split + crash + takeover (model)"


def run_trial(
    client: redis.Redis,
    prefix: str,
    seed: int,
    store_cls: type[CursorStore] = CursorStore,
    **kw: Any,
) -> Figures:
    """One trial on its own stream; its keys are deleted when it passes."""
    store = store_cls(client, f"split-{seed}", prefix=prefix)
    sim = Sim(store, seed, **kw)
    figures = sim.run()
    store.delete_round(sim.round_id)
    client.delete(store.seq_key, store.watermark_key)
    return figures


def _seeds(n: int) -> list[int]:
    one = os.environ.get("KEYSET_SPLIT_SEED")
    if one:
        return [int(one)]
    base = random.SystemRandom().randrange(10**9)
    return [base + i for i in range(n)]


def test_split_crash_takeover_properties(redis_client: redis.Redis, key_prefix: str) -> None:
    total = Figures()
    started = time.perf_counter()
    failure: PropertyViolation | None = None
    for seed in _seeds(rs.trials(300, 10_000)):
        try:
            total.add(run_trial(redis_client, key_prefix, seed))
        except PropertyViolation as exc:
            failure = exc
            break
    seconds = time.perf_counter() - started
    note = (
        f"{total.splits} splits ({total.requests} requests, {total.declined} declined), "
        f"{total.coalesced} ranges coalesced, "
        f"{total.crashes} crashes, {total.stalls} stalls, {total.takeovers} takeovers, "
        f"{total.stale_refused} stale calls refused, {total.replayed_keys} keys replayed, "
        f"up to {total.max_ranges} ranges, {seconds:.1f} s"
    )
    rs.record(
        SCENARIO,
        trials=total.trials,
        keys_lost=total.keys_lost,
        max_replay=total.max_replay_chunks,
        note=note,
    )
    print(f"\n{SCENARIO}: {total.trials} trials, {total.keys_lost} keys lost; {note}")
    if failure is not None:
        raise failure
    assert total.keys_lost == 0 and total.max_replay_chunks <= 1
    # the trials must have exercised what they claim to (not timing: counts of events)
    if total.trials >= 100:
        assert min(total.splits, total.crashes, total.stalls, total.takeovers) > 0, note
        assert total.coalesced > 0, note
        assert total.stale_refused > 0 and total.requests > 0, note


def test_a_claim_coalesces_only_while_the_round_is_open(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The trials' round is open until it closes (when nothing is fresh any more), so this
    clause of ``CLAIM`` is checked here: three fresh ranges, a claim of the first with
    ``coalesce=2`` absorbs both others in an open round and none in an unrecoverable one."""
    store = CursorStore(redis_client, "split-open", prefix=key_prefix)
    enc = KeySpace.enc
    absorbed = {}
    for unrecoverable in (False, True):
        rid, _ = store.create_round(
            idempotency_key=None,
            chained=False,
            start=enc(0),
            end=enc(30),
            source="{}",
            arity=1,
            bounds=[(enc(0), enc(10)), (enc(10), enc(20)), (enc(20), enc(30))],
        )
        if unrecoverable:
            assert store.mark_unrecoverable(rid, "test")
        res = store.claim(rid, 0, f"t{rid}", "w0", LEASE_MS, coalesce=2)
        assert isinstance(res, Claim)
        absorbed[unrecoverable] = (res.absorbed, res.hi, store.range(rid, 2)["state"])
    assert absorbed == {False: (2, enc(30), "complete"), True: (0, enc(10), "pending")}


# --------------------------------------------------------------------------- planted bugs


def _first_violation(client: redis.Redis, prefix: str, trials: int, **kw: Any) -> str:
    for seed in range(1, trials + 1):
        try:
            run_trial(client, prefix, seed, **kw)
        except PropertyViolation as exc:
            return str(exc)
    return ""


class GapSplitStore(CursorStore):
    """A split off by one: the new range starts one integer above ``at``, so ``(at, at + 1]``
    belongs to no range any more."""

    def split(self, round_id: str, range_id: int, token: str, at: str | None) -> int | None:
        new = super().split(round_id, range_id, token, at)
        if new is not None and at is not None:
            shifted = KeySpace.enc(KeySpace.dec(at) + 1)
            self.client.hset(
                self.range_key(round_id, new), mapping={"lo": shifted, "cursor": shifted}
            )
        return new


class GapBlindStore(GapSplitStore):
    """... and a close that ignores gaps (closes whenever every range is complete)."""

    def close_round(self, round_id: str) -> CloseResult:
        res = super().close_round(round_id)
        if isinstance(res, Gap):
            done = sum(int(b.done) for b in self.range_briefs(round_id))
            return Closed(done, 0, 0, "")
        return res


class LeakyFenceStore(CursorStore):
    """A fence that lets anyone advance: the caller is made the owner, with a live lease."""

    def advance(self, round_id: str, range_id: int, token: str, *args: Any, **kw: Any) -> Any:
        self.client.hset(
            self.range_key(round_id, range_id),
            mapping={"owner": token, "lease_until": 2**50},
        )
        return super().advance(round_id, range_id, token, *args, **kw)


def _planted_claim(old: str, new: str) -> str:
    assert CLAIM.count(old) == 1, f"the planted bug no longer applies to CLAIM: {old!r}"
    return CLAIM.replace(old, new)


# absorbs a range someone claimed before (released, nothing committed yet): no claim-time or
# owner check, only pending and untouched
CLAIM_ABSORBS_CLAIMED = _planted_claim(
    "(c[3] or 'pending') ~= 'pending' or (c[4] or '') ~= ''\n"
    "      or (c[5] or c[1]) ~= c[1] or (c[6] or '0') ~= '0' or",
    "(c[3] or 'pending') ~= 'pending'\n      or (c[5] or c[1]) ~= c[1] or",
)
# writes each absorbed range, empty, at its own old hi instead of the host's new hi: the
# empties sit inside the host's range (an overlap)
CLAIM_EMPTIES_AT_OLD_HI = _planted_claim(
    "    local key = KEYS[2 + 3 * k]\n    redis.call('DEL', key)\n",
    "    local key = KEYS[2 + 3 * k]\n    local hi = redis.call('HGET', key, 'hi')\n"
    "    redis.call('DEL', key)\n",
)


class AbsorbsClaimedStore(CursorStore):
    """A claim that coalesces a range that was claimed before (not fresh)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._claim = self.script(CLAIM_ABSORBS_CLAIMED)


class EmptiesAtOldHiStore(CursorStore):
    """A claim that leaves each coalesced range empty at its own old end, not the new one."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._claim = self.script(CLAIM_EMPTIES_AT_OLD_HI)


def test_harness_catches_an_owner_splitting_below_what_it_read(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """The owner splits above its committed cursor only, not above its chunk in hand and its
    prefetch: keys it read change hands; its next commit is refused or a key is replayed."""
    found = _first_violation(redis_client, key_prefix, 200, split_policy="naive")
    assert found, "200 trials did not notice read keys changing hands at a split"


def test_harness_catches_a_split_that_leaves_a_gap(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    found = _first_violation(redis_client, key_prefix, 200, store_cls=GapSplitStore)
    assert "split of" in found, found


def test_end_checks_catch_a_gap_that_close_ignores(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """With the step checks off, a gap left by the split reaches the end: the real close says
    ``Gap``; a close blind to gaps says ``Closed``, and the end checks still refuse the trial."""
    real = _first_violation(
        redis_client, key_prefix, 200, store_cls=GapSplitStore, check_steps=False
    )
    assert "close_round returned Gap" in real, real
    blind = _first_violation(
        redis_client, key_prefix, 200, store_cls=GapBlindStore, check_steps=False
    )
    assert "never processed" in blind or "starts at" in blind, blind


def test_harness_catches_a_fence_that_lets_a_stale_owner_through(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    found = _first_violation(redis_client, key_prefix, 200, store_cls=LeakyFenceStore)
    assert "stale" in found, found


def test_harness_catches_a_claim_coalescing_a_claimed_range(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    found = _first_violation(redis_client, key_prefix, 300, store_cls=AbsorbsClaimedStore)
    assert "seed" in found and "the model predicts" in found, found


def test_harness_catches_coalesced_ranges_left_at_their_old_end(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Caught at the claim; with the step checks off, ``close_round`` finds the overlap."""
    found = _first_violation(redis_client, key_prefix, 200, store_cls=EmptiesAtOldHiStore)
    assert "seed" in found and "coalesced into" in found, found
    blind = _first_violation(
        redis_client, key_prefix, 200, store_cls=EmptiesAtOldHiStore, check_steps=False
    )
    assert "close_round returned Gap" in blind, blind
