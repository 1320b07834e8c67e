"""Redis failover to a lagging replica (issue #18): a real primary and replica on loopback, the
primary killed at random points of a stream's rounds after the replica stopped getting its writes
(``failover_support``), the clients moved to the promoted replica, a PostgreSQL checkpoint mirror.

Guarantee, over every trial: no key is left undelivered, no round closes twice, the watermark
never moves backwards, and every round ends closed on the promoted replica (the regressions the
replica carries are detected and restored from the mirror). Replays (a key delivered again
because the replica's cursor, or its open round, was behind what the primary committed) are
at-least-once and only counted. Short mode runs a handful of failovers, long mode
(``KEYSET_RELIABILITY_LONG=1``) hundreds; ``KEYSET_FAILOVER_SEED=<seed>`` replays one trial.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest
import redis
import reliability_support as rs
import sqlalchemy as sa
from failover_support import run_trial

from airflow_keyset_provider.core import KeysetTraversal, TraverseOptions

N_KEYS = 300


class Snapshot:
    """The stream's keys in Redis as they are now (DUMP); ``rewind()`` puts Redis back to it:
    what a promoted replica that lagged from this point on holds (a focused, deterministic
    stand-in for the real failover the property test runs)."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self.keys = {k: client.dump(k) for k in client.scan_iter(f"{prefix}:*")}

    def rewind(self) -> None:
        for k in list(self.client.scan_iter(f"{self.prefix}:*")):
            self.client.delete(k)
        for k, v in self.keys.items():
            self.client.restore(k, 0, v, replace=True)


def _traversal(url: str, redis_url: str, prefix: str) -> KeysetTraversal:
    t = KeysetTraversal(
        url,
        table="events",
        key="seq",
        redis_url=redis_url,
        stream="s",
        key_prefix=prefix,
        checkpoint_url=url,
    )
    t.checkpoint_seconds = 0
    return t


@pytest.fixture
def events_table(pg_engine):
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text(f"INSERT INTO events SELECT g, 'e' FROM generate_series(1, {N_KEYS}) g"))
    return pg_engine


def test_failover_to_a_lagging_replica_never_loses_a_key_or_closes_twice(
    events_table, pg_schema_url
):
    pinned = os.environ.get("KEYSET_FAILOVER_SEED")
    seeds = [int(pinned)] if pinned else list(range(rs.trials(6, 200)))
    outcomes = []
    for seed in seeds:
        out = run_trial(pg_schema_url, f"fo{seed}", N_KEYS, random.Random(seed))
        outcomes.append((seed, out))
    bad = [(s, o) for s, o in outcomes if not o.safe]
    errors = sorted({e for _, o in outcomes for e in o.errors})
    rs.record(
        "failover to a lagging replica",
        trials=len(outcomes),
        keys_lost=sum(o.lost for _, o in outcomes),
        note=(
            f"replays {sum(o.replays for _, o in outcomes)} keys "
            f"(max {max(o.replays for _, o in outcomes)}/trial); double closes "
            f"{sum(o.double_closes for _, o in outcomes)}; watermark back "
            f"{sum(o.watermark_back for _, o in outcomes)}; rounds left open "
            f"{sum(o.unclosed for _, o in outcomes)}; errors {errors or 'none'}"
        ),
    )
    for s, o in outcomes:
        print(s, o)
    assert not bad, f"unsafe failovers (seed, outcome): {bad[:5]}"


def test_a_close_redis_lost_is_not_done_twice_nor_the_watermark_moved_back(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Redis goes back to before the round's traversal and close (the round open, its ranges
    fresh, no watermark): the next plan of the same key finds the round closed as the mirror
    recorded it (same ``closed_ms``, same totals), the watermark forward again; a close or a
    barrier check does not close it a second time."""
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=3, end_key=150, round_key="run0", new_stream=True)
    before = Snapshot(redis_client, key_prefix)
    t.traverse_round(rnd.round_id, lambda ch: None, options=TraverseOptions(chunk_size=20))
    totals = t.close_round(rnd.round_id)
    closed_ms, wm = t.store.round_info(rnd.round_id)["closed_ms"], t.store.watermark()
    before.rewind()
    assert t.store.round_state(rnd.round_id) == "open" and t.store.watermark() is None
    assert t.control.check_round(rnd.round_id).complete  # the barrier sees it closed
    again = t.plan(max_ranges=3, end_key=150, round_key="run0", new_stream=True)
    assert again.round_id == rnd.round_id and again.state == "closed"
    assert t.close_round(rnd.round_id) == totals
    assert t.store.round_info(rnd.round_id)["closed_ms"] == closed_ms
    assert t.store.watermark() == wm
    t.close()
    t.mirror.engine.dispose()


def test_rounds_redis_never_saw_are_restored_and_no_round_id_is_handed_out_twice(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Redis goes back to before rounds r2 (closed) and r3 (open, half done) were planned: the
    next plan puts both back from the mirror (their keys find them) and moves the round counter
    past them, so a new round is r4, not a second r2 over the first one's mirror rows; r3 goes on
    from its checkpoints and closes with exact totals."""
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    r1 = t.plan(max_ranges=2, end_key=100, round_key="run0", new_stream=True)
    t.traverse_round(r1.round_id, lambda ch: None, options=TraverseOptions(chunk_size=20))
    t.close_round(r1.round_id)
    before = Snapshot(redis_client, key_prefix)
    r2 = t.plan(max_ranges=2, end_key=200, round_key="run1", new_stream=True)
    t.traverse_round(r2.round_id, lambda ch: None, options=TraverseOptions(chunk_size=20))
    t.close_round(r2.round_id)
    r3 = t.plan(max_ranges=2, end_key=300, round_key="run2", new_stream=True)
    seen: Counter[int] = Counter()

    class Killed(BaseException):
        pass

    def dies_at_250(chunk: Any) -> None:
        if chunk.keys[0] > 250:
            raise Killed()
        seen.update(chunk.keys)

    with pytest.raises(Killed):
        t.traverse_round(r3.round_id, dies_at_250, options=TraverseOptions(chunk_size=10))
    before.rewind()
    assert t.store.round_counter() == 1
    assert [r.round_id for r in (r2, r3)] == ["r2", "r3"]
    assert t.plan(max_ranges=2, end_key=200, round_key="run1", new_stream=True).state == "closed"
    again = t.plan(max_ranges=2, end_key=300, round_key="run2", new_stream=True)
    assert again.round_id == "r3" and again.state == "open"
    res = t.traverse_round(
        "r3", lambda ch: seen.update(ch.keys), options=TraverseOptions(chunk_size=10)
    )
    assert res.finished and set(seen) == set(range(201, 301))
    assert t.close_round("r3").done == 100
    assert t.plan(max_ranges=2, end_key=300, round_key="run3", new_stream=True).round_id == "r4"
    t.close()
    t.mirror.engine.dispose()


def test_a_split_redis_lost_leaves_the_mirror_a_partition(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """The round's one range was split and the split mirrored; then Redis goes back to before
    the split: its range (0, 300] is the round's partition again. The next plan makes the mirror
    follow Redis (the split's range dropped from it), so when the range's owner has gone past
    the old split point and Redis then loses everything, the round restored from the mirror is
    a partition (not the whole range beside the split's range: an overlap that never closes)."""
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, end_key=300, round_key="run0", new_stream=True)
    before = Snapshot(redis_client, key_prefix)
    t.store.claim(rnd.round_id, 0, "w#1", "w", 60_000)
    at = t.source.encode([150])
    assert t.store.split(rnd.round_id, 0, "w#1", at, mirror=True) == 1
    info = t.store.round_info(rnd.round_id)
    t.mirror.save_round("s", rnd.round_id, info, t.store.snapshot_ranges(rnd.round_id, [0, 1]))
    before.rewind()
    t.plan(
        max_ranges=1, end_key=300, round_key="run0", new_stream=True
    )  # sees Redis behind the mirror
    seen: Counter[int] = Counter()

    class Killed(BaseException):
        pass

    def dies_at_200(chunk: Any) -> None:
        if chunk.keys[0] > 200:
            raise Killed()
        seen.update(chunk.keys)

    with pytest.raises(Killed):
        t.traverse_round(rnd.round_id, dies_at_200, options=TraverseOptions(chunk_size=10))
    for k in list(redis_client.scan_iter(f"{key_prefix}:*")):
        redis_client.delete(k)
    res = t.traverse_round(
        rnd.round_id, lambda ch: seen.update(ch.keys), options=TraverseOptions(chunk_size=10)
    )
    assert res.finished and set(seen) == set(range(1, 301))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (300, 0, 0)
    t.close()
    t.mirror.engine.dispose()


def test_a_round_the_promoted_replica_never_saw_is_traversed_and_closed_without_a_plan(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Found by the one-world model: Redis goes back to before round r2 was planned, and no plan
    runs after the failover (the DAG run's mapped tasks and its barrier go on). The id is above
    Redis's round counter, so Redis answers "no such round" (``RoundUnknownError``); a task and
    the close restore it from the mirror, as they do a round Redis lost, instead of failing with
    ``RoundNotFoundError`` on every try."""
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    r1 = t.plan(max_ranges=1, end_key=100, round_key="run0", new_stream=True)
    before = Snapshot(redis_client, key_prefix)
    r2 = t.plan(max_ranges=2, start_key=100, end_key=200)
    before.rewind()
    seen: Counter[int] = Counter()
    for i in range(2):
        res = t.traverse(r2.round_id, i, lambda ch: seen.update(ch.keys), chunk_size=30)
        assert res.complete
    assert sorted(seen) == list(range(101, 201)) and max(seen.values()) == 1
    assert t.close_round(r2.round_id).done == 100
    assert t.plan(max_ranges=1, start_key=200, end_key=300).round_id not in (
        r1.round_id,
        r2.round_id,
    )
    t.close()
    t.mirror.engine.dispose()


@pytest.mark.parametrize("how", ["redis loss", "failover"])
def test_a_round_restored_alone_does_not_hide_the_open_chained_round_from_the_next_plan(
    how: str, events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """The one-world model's long-mode seed 5 symptom (a chained plan while r1 was open returned
    a new round, with a mirror), found by reading the restore paths: the open chained round r1 and an
    explicit round r2 are mirrored; Redis loses the stream (or goes back to before both were
    planned). A task of r2 runs first and restores r2 alone from the mirror, which moves Redis's
    round counter to 2. The next chained plan then took r1 (below that counter) for a round
    removed on purpose, left it unrestored and planned r3 from the watermark while r1 was open
    (contract 2: a chained plan while a round is open returns that round). A restore of a round
    above the counter now restores every round above it first (``StreamControl.restore``)."""
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    before = Snapshot(redis_client, key_prefix)
    r1 = t.plan(max_ranges=2, new_stream=True)
    r2 = t.plan(max_ranges=1, start_key=100, end_key=200)
    if how == "redis loss":
        t.store.delete_stream()
    else:
        before.rewind()
    res = t.traverse(r2.round_id, 0, lambda ch: None, chunk_size=50)
    assert res.complete
    again = t.plan(max_ranges=2)
    assert (again.round_id, again.created) == (r1.round_id, False)
    seen: Counter[int] = Counter()
    for spec in again.ranges:
        t.traverse(again.round_id, spec.range_id, lambda ch: seen.update(ch.keys), chunk_size=50)
    assert t.close_round(r1.round_id).done == N_KEYS
    assert sorted(seen) == list(range(1, N_KEYS + 1))
    t.close()
    t.mirror.engine.dispose()


def test_a_range_whose_split_the_promoted_replica_lost_is_a_lost_lease_not_a_usage_error(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Found by the one-world model (long mode, seed 7, world 91): range 1 was split off range 0
    and recorded in the mirror; while a task processes it, Redis fails over to a replica that
    never saw the split (one range). The task's commit finds its range gone; the restore from
    the mirror puts the range's hash back but not the split (Redis's ranges are the partition),
    so the round still has one range. The old code then ended the task with
    ``ConfigurationError: round r1 has ranges 0..0; got range_id 1``, a usage error (and in pull
    mode the whole call). It is a lease lost: the keys are range 0's again."""
    from airflow_keyset_provider.core import LeaseLostError
    from airflow_keyset_provider.core.keys import encode_key

    t = _traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=200, new_stream=True)
    before = Snapshot(redis_client, key_prefix)
    claim = t.store.claim(rnd.round_id, 0, "a#1", "a", 60_000)
    assert t.store.request_split(rnd.round_id, 0, "idle-task") == "asked"
    assert t.store.split(rnd.round_id, 0, claim.token, encode_key((100,))) == 1
    t.store.release(rnd.round_id, 0, claim.token)
    t.control._mirror_round(rnd.round_id)  # the mirror recorded the split
    rewound: list[int] = []

    def proc(ch: Any) -> None:
        if not rewound:
            rewound.append(1)
            before.rewind()  # the failover, while this chunk is in hand

    with pytest.raises(LeaseLostError, match="range 1"):
        t.traverse(rnd.round_id, 1, proc, chunk_size=20)
    res = t.traverse(rnd.round_id, 0, lambda ch: None, chunk_size=50)
    assert res.complete
    assert t.close_round(rnd.round_id).done == 200
    t.close()
    t.mirror.engine.dispose()


def test_a_split_range_the_mirror_lost_is_covered_again_and_the_round_closes(
    events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Found by the one-world model (long mode, seed 7, world seed 61): range 1 was split off
    range 0 at 150 and mirrored; Redis fails over to a replica that never saw the split. A plan
    makes the mirror follow Redis (``_drop_lost_splits``: it records the round as Redis has it,
    one range, then drops the mirror's ranges from 1 up); between its record and its drop, the
    range's owner splits again at 100 and mirrors that split (range 1 anew, n_ranges 2), so the
    drop removes the new range's record while the round's record counts it. Redis then loses
    everything: the old code restored n_ranges 2 with range 1 nowhere, and the round never
    closed (``RoundStateLostError: range 1 of round r1 has no state in Redis`` on every task
    and close). The restore now rebuilds the range over the keys no record covers, pending at
    its lo: every key is delivered (at-least-once) and the round closes."""
    from airflow_keyset_provider.core.keys import encode_key

    t = _traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=300, round_key="run0", new_stream=True)
    rid = rnd.round_id
    before = Snapshot(redis_client, key_prefix)
    claim = t.store.claim(rid, 0, "a#1", "a", 60_000)
    assert t.store.split(rid, 0, claim.token, encode_key((150,)), mirror=True) == 1
    t.control._mirror_round(rid)  # the first split, recorded
    t.store.mirrored_split(rid, 0, [1])
    before.rewind()  # the failover: one range (0, 300] again
    n = int(t.store.round_info(rid)["n_ranges"])
    t.control._mirror_round(rid)  # a plan's reconcile records Redis's one range, then
    claim = t.store.claim(rid, 0, "b#1", "b", 60_000)
    assert t.store.split(rid, 0, claim.token, encode_key((100,)), mirror=True) == 1
    t.control._mirror_round(rid)  # the second split, recorded by its owner (n_ranges 2)
    t.store.mirrored_split(rid, 0, [1])
    t.store.release(rid, 0, claim.token)
    t.mirror.drop_ranges("s", rid, n)  # ... drops the mirror's ranges from 1 up
    for k in list(redis_client.scan_iter(f"{key_prefix}:*")):
        redis_client.delete(k)  # Redis loses everything
    seen: Counter[int] = Counter()
    again = t.plan(max_ranges=1, start_key=0, end_key=300, round_key="run0")
    assert again.round_id == rid and len(again.ranges) == 2
    for spec in again.ranges:
        res = t.traverse(rid, spec.range_id, lambda ch: seen.update(ch.keys), chunk_size=50)
        assert res.complete
    assert set(seen) == set(range(1, 301))
    assert t.close_round(rid).done == 300
    t.close()
    t.mirror.engine.dispose()


class _Crash(BaseException):
    """Kills a traverse call like a worker crash (no handler in the engine catches it)."""


@pytest.mark.parametrize("absorber", ["pending", "complete"])
def test_a_coalescing_the_promoted_replica_lost_leaves_no_overlap_after_a_restore(
    absorber: str, events_table, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Found by the one-world model (long mode, seed 9, world 82: SQLite, mirror, one pulling
    task): a pulling task's claim of range 0 coalesced ranges 1-3 into it (range 0 became
    ``(0, 300]``, the others empty) and the mirror recorded that. Redis failed over to a
    replica that never saw the claim: there range 1 is its own range again, and a task ran part
    of it (mirrored: ``(75, 150]`` at its cursor). Redis then lost everything; the restore put
    back the mirror's range 0 ``(0, 300]`` (recorded before the failover) beside range 1: two
    ranges over the same keys, the round's pulling tasks skipping range 1 (the coalescing's
    ``skip`` hint) and its close refused on every try ("ranges do not cover"). The restore now
    makes the ranges a partition again: a range that committed nothing past the other's ``lo``
    ends there (its keys above are a pending range again, delivered at-least-once); one whose
    committed keys reach past it absorbs it as the coalescing did. Every key is delivered, the
    round closes with exact counts."""
    from airflow_keyset_provider.core.keys import encode_key

    t = _traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=4, start_key=0, end_key=300, round_key="run0", new_stream=True)
    rid = rnd.round_id
    assert len(rnd.ranges) == 4
    before = Snapshot(redis_client, key_prefix)
    seen: Counter[int] = Counter()
    opts = TraverseOptions(chunk_size=25)
    if absorber == "complete":
        t.traverse_round(rid, lambda ch: seen.update(ch.keys), options=opts, split=False, tasks=1)
    else:  # the claim coalesces, then the task dies before its first chunk commits

        def dies(ch: Any) -> None:
            raise _Crash

        with pytest.raises(_Crash):
            t.traverse_round(rid, dies, options=opts, split=False, tasks=1)
    mirrored = t.mirror.load_round("s", rid)
    assert mirrored is not None and mirrored[1][0]["hi"] == encode_key((300,))  # coalesced
    before.rewind()  # the failover: four fresh ranges again
    calls: list[int] = []

    def dies_after_one(ch: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise _Crash
        seen.update(ch.keys)

    with pytest.raises(_Crash):
        t.traverse(rid, 1, dies_after_one, chunk_size=25)
    for k in list(redis_client.scan_iter(f"{key_prefix}:*")):
        redis_client.delete(k)  # Redis loses everything
    again = t.plan(max_ranges=4, start_key=0, end_key=300, round_key="run0")
    assert again.round_id == rid
    t.traverse_round(rid, lambda ch: seen.update(ch.keys), options=opts, tasks=1)
    assert set(seen) == set(range(1, 301))
    totals = t.close_round(rid)
    assert totals.done == 300
    t.close()
    t.mirror.engine.dispose()
