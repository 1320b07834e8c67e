"""Ranges pulled by tasks and split by their owners (``core/store/pull.py``), on real Redis.

The invariant behind the barrier: whatever the splits, the ranges of a round partition
``(start, end]`` (no gap, no overlap) and ``close_round`` checks it by walking them in key order,
not by id. Only the live owner splits, only strictly between its committed cursor and ``hi``.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import redis

from airflow_keyset_provider.core.errors import RoundStateLostError
from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import Closed, CursorStore, Gap, Incomplete

LEASE = 60_000


def k(i: int) -> str:
    return encode_key([i])


def _round(store: CursorStore, cuts: list[int]) -> str:
    points = [MIN_KEY, *(k(c) for c in cuts)]
    bounds = list(itertools.pairwise(points))
    rid, created = store.create_round(
        idempotency_key=None,
        chained=True,
        start=points[0],
        end=points[-1],
        source="{}",
        arity=1,
        bounds=bounds,
    )
    assert created
    return rid


def _finish(store: CursorStore, rid: str, i: int, token: str) -> None:
    """Claim range i (if not held by token) and advance it to its hi."""
    c = store.claim(rid, i, token, "", LEASE)
    hi = store.range(rid, i)["hi"]
    store.advance(
        rid, i, token, c.cursor, hi, done=1, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )


def test_owner_split_keeps_the_partition_and_the_round_closes(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Range 0 (MIN, 100] is split at 60 by its owner after committing up to 20: it becomes
    (MIN, 60] and the new range 2 is (60, 100], pending and unowned. The round (two ranges by id,
    three in key order 0, 2, 1) closes only once all three are complete, with their totals."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100, 200])
    c = store.claim(rid, 0, "a#1", "task-a", LEASE)
    adv = store.advance(
        rid, 0, "a#1", c.cursor, k(20), done=20, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    assert adv.split_req == ""
    assert store.request_split(rid, 0, "b#1") == "asked"
    assert store.split_answer(rid, 0, "b#1") is None  # pending until the owner's chunk boundary
    adv = store.advance(
        rid, 0, "a#1", k(20), k(40), done=20, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    assert adv.split_req == "b#1"  # the owner learns of it at its commit
    assert store.split(rid, 0, "a#1", k(60)) == 2
    assert store.split_answer(rid, 0, "b#1") == "2"
    assert store.range(rid, 0)["hi"] == k(60)
    new = store.range(rid, 2)
    assert (new["lo"], new["hi"], new["cursor"], new["state"], new["owner"]) == (
        k(60),
        k(100),
        k(60),
        "pending",
        "",
    )
    assert store.round_info(rid)["n_ranges"] == "3"
    assert store.close_round(rid) == Incomplete((0, 1, 2))
    store.advance(
        rid, 0, "a#1", k(40), k(60), done=20, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    _finish(store, rid, 2, "b#2")
    assert store.close_round(rid) == Incomplete((1,))
    _finish(store, rid, 1, "c#1")
    res = store.close_round(rid)
    assert isinstance(res, Closed) and res.done == 62
    assert store.watermark() == k(200)


def test_only_the_live_owner_splits_and_only_inside_cursor_hi(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100])
    c = store.claim(rid, 0, "a#1", "task-a", LEASE)
    store.advance(
        rid, 0, "a#1", c.cursor, k(30), done=30, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    assert store.split(rid, 0, "stale#0", k(60)) is None  # not the owner
    assert store.split(rid, 0, "a#1", k(30)) is None  # at the cursor: committed keys would move
    assert store.split(rid, 0, "a#1", k(10)) is None  # below the cursor
    assert store.split(rid, 0, "a#1", k(100)) is None  # at hi: an empty new range
    assert store.split(rid, 0, "a#1", k(150)) is None  # past hi: outside the round
    # a new attempt of the same lineage takes over: the old token is fenced out of splitting too
    store.claim(rid, 0, "a#2", "task-a", LEASE)
    assert store.split(rid, 0, "a#1", k(60)) is None
    assert store.round_info(rid)["n_ranges"] == "1"
    assert store.split(rid, 0, "a#2", k(60)) == 1


def test_a_declined_or_moot_request_answers_no(redis_client: redis.Redis, key_prefix: str) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100, 200])
    assert store.request_split(rid, 0, "b#1") == "not_running"  # pending: claim it instead
    c = store.claim(rid, 0, "a#1", "task-a", LEASE)
    assert store.request_split(rid, 0, "b#1") == "asked"
    assert store.request_split(rid, 0, "c#1") == "busy"
    assert store.split(rid, 0, "a#1", None) is None  # the owner declines
    assert store.split_answer(rid, 0, "b#1") == "no"
    assert store.request_split(rid, 0, "c#1") == "asked"
    store.release(rid, 0, "a#1")  # the owner goes away: the request is moot
    assert store.split_answer(rid, 0, "c#1") == "no"
    assert store.round_info(rid)["n_ranges"] == "2"
    assert c.cursor == MIN_KEY


def test_next_unclaimed_hands_out_every_range_once_including_split_ones(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100, 200, 300])
    assert [store.next_unclaimed(rid) for _ in range(2)] == [0, 1]
    c = store.claim(rid, 0, "a#1", "", LEASE)
    assert store.split(rid, 0, "a#1", k(50)) == 3
    assert [store.next_unclaimed(rid) for _ in range(3)] == [2, 3, None]
    assert c.cursor == MIN_KEY
    briefs = store.range_briefs(rid)
    assert [(b.range_id, b.state, b.live_owner) for b in briefs] == [
        (0, "running", True),
        (1, "pending", False),
        (2, "pending", False),
        (3, "pending", False),
    ]


def test_close_walks_ranges_in_key_order_and_refuses_an_overlap(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Scenario: a broken split left two ranges overlapping (here made by hand). Walking by id
    with 'lo == previous hi' cannot see it once ids are out of key order; the walk in key order
    stops on it and nothing closes."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100, 200])
    c = store.claim(rid, 0, "a#1", "", LEASE)
    assert store.split(rid, 0, "a#1", k(50)) == 2
    assert c.cursor == MIN_KEY
    for i, token in ((0, "a#1"), (1, "b#1"), (2, "c#1")):
        _finish(store, rid, i, token)
    redis_client.hset(
        store.range_key(rid, 2), mapping={"lo": k(40)}
    )  # (40, 100] overlaps (MIN, 50]
    assert store.close_round(rid) == Gap(2)
    redis_client.hset(store.range_key(rid, 2), mapping={"lo": k(60)})  # (50, 60] uncovered
    assert store.close_round(rid) == Gap(2)
    redis_client.hset(store.range_key(rid, 2), mapping={"lo": k(50)})
    assert isinstance(store.close_round(rid), Closed)


def test_range_briefs_read_many_ranges_in_batches(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, list(range(10, 13_001, 10)))  # 1,300 ranges: three pipelined batches
    briefs = store.range_briefs(rid)
    assert len(briefs) == 1300
    assert [b.range_id for b in briefs] == list(range(1300))
    assert briefs[-1].hi == k(13_000) and briefs[0].lo == MIN_KEY


def test_open_briefs_are_the_briefs_of_the_ranges_not_complete(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """What a pulling task polls: ``open_briefs`` filters the complete ranges out in Redis (batch
    by batch) and reads the others exactly as ``range_briefs`` does; a range with no state is
    lost, not skipped."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, list(range(10, 13_001, 10)))  # 1,300 ranges: three batches
    for i in (0, 700, 1299):
        _finish(store, rid, i, f"w{i}#1")
    c = store.claim(rid, 5, "a#1", "task-a", LEASE)
    store.advance(
        rid, 5, "a#1", c.cursor, k(55), done=5, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    every = {b.range_id: b for b in store.range_briefs(rid)}
    opened = store.open_briefs(rid)
    assert [b.range_id for b in opened] == [i for i in range(1300) if i not in (0, 700, 1299)]
    for b in opened:
        mine, theirs = dataclasses.asdict(b), dataclasses.asdict(every[b.range_id])
        assert abs(mine.pop("lease_ms_left") - theirs.pop("lease_ms_left")) < 5_000
        assert mine == theirs
    assert opened[4].range_id == 5 and opened[4].owner == "a#1" and opened[4].cursor == k(55)
    redis_client.delete(store.range_key(rid, 900))
    with pytest.raises(RoundStateLostError):
        store.open_briefs(rid)


def test_a_new_owner_does_not_inherit_the_previous_owners_split_request(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Scenario: a task asked the owner of range 0 to split; the owner died and a retry of its
    lineage took the range over. The request was made of the dead owner: the new owner must not
    split for a requester that has long moved on (it would only make an extra range)."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100])
    c = store.claim(rid, 0, "a#1", "task-a", LEASE)
    assert store.request_split(rid, 0, "b#1") == "asked"
    c2 = store.claim(rid, 0, "a#2", "task-a", LEASE)  # a new attempt of the lineage takes over
    assert c2.takeover
    assert store.split_answer(rid, 0, "b#1") == "no"
    adv = store.advance(
        rid, 0, "a#2", c.cursor, k(10), done=10, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    assert adv.split_req == ""


def test_a_second_request_of_the_same_requester_waits_for_a_new_answer(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A requester that asks the same range again (its first split was answered) gets a new
    answer, not the old one again: a pulling task keeps one requester token for all its requests,
    and reading the earlier new range's id as the answer would make it "win" a split that never
    happened, again and again (seen in the Celery test: 164 "splits won", one real split)."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [100, 200])
    c = store.claim(rid, 0, "a#1", "task-a", LEASE)
    store.advance(
        rid, 0, "a#1", c.cursor, k(20), done=20, skipped=0, lease_ms=LEASE, max_item_attempts=3
    )
    assert store.request_split(rid, 0, "b#1") == "asked"
    assert store.split(rid, 0, "a#1", k(60)) == 2
    assert store.split_answer(rid, 0, "b#1") == "2"
    assert store.request_split(rid, 0, "b#1") == "asked"
    assert store.split_answer(rid, 0, "b#1") is None  # pending: the owner has not answered yet
    assert store.split(rid, 0, "a#1", k(40)) == 3
    assert store.split_answer(rid, 0, "b#1") == "3"
    assert (store.range(rid, 0)["hi"], store.range(rid, 3)["lo"]) == (k(40), k(40))
