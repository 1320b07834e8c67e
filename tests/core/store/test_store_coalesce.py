"""Coalescing at claim time (``CLAIM`` with ``coalesce=m``, ``core/store/lua/claim.lua``), on
real Redis.

The invariant: a claim absorbs only ranges that nobody ever worked on (pending, never claimed,
nothing committed, no retries or dead letters, intact) and that start exactly where the claimed
range ends, at most ``m`` of them and only while the round is open; each absorbed range is left
empty and complete at the host's new end (``lo = hi``), so the ranges of the round still
partition ``(start, end]`` and ``close_round`` proves it as ever. Nothing hands an absorbed id out
again, and state lost reads as lost, never as complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import redis
from test_store_split import _round as round_with_cuts

from airflow_keyset_provider.core.errors import RoundStateLostError
from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import Closed, CursorStore, Incomplete

LEASE = 60_000


def k(i: int) -> str:
    return encode_key([i])


def _round(store: CursorStore, n: int) -> str:
    """A round of ``n`` ranges (MIN, 100], (100, 200], ..., ids in key order."""
    return round_with_cuts(store, [100 * (i + 1) for i in range(n)])


def _commit(store: CursorStore, rid: str, i: int, token: str, frm: str, to: str, done: int) -> None:
    store.advance(rid, i, token, frm, to, done=done, skipped=0, lease_ms=LEASE, max_item_attempts=3)


def _finish(store: CursorStore, rid: str, i: int, token: str, done: int = 1) -> None:
    """Claim range i (no coalescing) and commit it to its hi in one step."""
    c = store.claim(rid, i, token, "", LEASE)
    assert not c.complete
    _commit(store, rid, i, token, c.cursor, c.hi, done)


def _raw(client: redis.Redis, store: CursorStore, rid: str, i: int) -> dict[bytes, bytes]:
    return client.hgetall(store.range_key(rid, i))


def test_a_claim_absorbs_the_fresh_run_up_to_m_and_the_round_closes_with_exact_totals(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Eight fresh ranges; a claim of range 0 with ``coalesce=3`` absorbs exactly ranges 1..3 (the
    fresh range 4 stays: m reached): range 0 becomes (MIN, 400], ranges 1..3 read complete, empty
    at (400, 400], ``merged_into`` 0, done 0; a claim of one of them answers complete. The round
    closes only once the host and the rest are complete, with exactly the committed totals."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 8)
    c = store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=3)
    assert (c.absorbed, c.lo, c.hi, c.cursor, c.complete) == (3, MIN_KEY, k(400), MIN_KEY, False)
    assert store.range(rid, 0)["hi"] == k(400)
    for i in (1, 2, 3):
        r = store.range(rid, i)
        assert (r["lo"], r["hi"], r["cursor"], r["state"]) == (k(400), k(400), k(400), "complete")
        assert (r["merged_into"], r["done"], r["owner"], r["retries"], r["dead"]) == (
            "0",
            "0",
            "",
            "0",
            "0",
        )
    four = store.range(rid, 4)
    assert (four["lo"], four["hi"], four["state"], four["claimed_ms"]) == (
        k(400),
        k(500),
        "pending",
        "0",
    )
    info = store.round_info(rid)
    assert (info["merged"], info["skip:0"]) == ("3", "4")
    # the host claimed again (as a rescue would): the empties at its end are not fresh
    assert store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=4).absorbed == 0
    assert store.round_info(rid)["merged"] == "3"
    again = store.claim(rid, 2, "b#1", "task-b", LEASE, coalesce=3)
    assert again.complete and (again.done, again.absorbed) == (0, 0)
    assert store.close_round(rid) == Incomplete((0, 4, 5, 6, 7))
    _commit(store, rid, 0, "a#1", MIN_KEY, k(250), 250)
    _commit(store, rid, 0, "a#1", k(250), k(400), 150)
    for i in (4, 5, 6, 7):
        _finish(store, rid, i, f"w{i}#1", done=100)
    res = store.close_round(rid)
    assert isinstance(res, Closed) and (res.done, res.skipped, res.dead) == (800, 0, 0)
    assert store.watermark() == k(800)


def _claimed_released(store: CursorStore, rid: str) -> None:
    store.claim(rid, 2, "x#1", "task-x", LEASE)
    store.release(rid, 2, "x#1")  # unfinished, nothing committed: cursor still lo


def _committed(store: CursorStore, rid: str) -> None:
    c = store.claim(rid, 2, "x#1", "task-x", LEASE)
    _commit(store, rid, 2, "x#1", c.cursor, k(250), 50)
    store.release(rid, 2, "x#1")


def _held(store: CursorStore, rid: str) -> None:
    store.claim(rid, 2, "x#1", "task-x", LEASE)


def _complete(store: CursorStore, rid: str) -> None:
    _finish(store, rid, 2, "x#1")
    store.release(rid, 2, "x#1")


def _retry_pass(store: CursorStore, rid: str, attempts: int) -> None:
    """A pass over range 2 that fails key 205 and commits no cursor (expected = new = lo)."""
    c = store.claim(rid, 2, "x#1", "task-x", LEASE)
    store.advance(
        rid,
        2,
        "x#1",
        c.cursor,
        c.cursor,
        done=0,
        skipped=0,
        lease_ms=LEASE,
        max_item_attempts=attempts,
        failed=[(k(205), "boom")],
    )
    store.release(rid, 2, "x#1")


SPOILERS: dict[str, tuple[Callable[[CursorStore, str], None], bool]] = {
    # the state range 2 is in, and whether it then went through a mirror restore (RESTORE_ROUND
    # drops ``claimed_ms``: there the cursor / retries / dead checks alone must hold the line)
    "claimed-and-released-unfinished": (_claimed_released, False),
    "held-by-a-live-owner": (_held, False),
    "complete": (_complete, False),
    "committed-cursor": (_committed, False),
    "restored-with-a-committed-cursor": (_committed, True),
    "restored-with-a-pending-retry": (lambda s, r: _retry_pass(s, r, 3), True),
    "restored-with-a-dead-letter": (lambda s, r: _retry_pass(s, r, 1), True),
}


@pytest.mark.parametrize("case", list(SPOILERS))
def test_coalescing_stops_at_the_first_range_that_is_not_fresh(
    redis_client: redis.Redis, key_prefix: str, case: str
) -> None:
    """Range 2 was worked on (``case``); a claim of range 0 with room for four absorbs range 1
    only, and range 2 and everything after it are left exactly as they were."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 6)
    spoil, restored = SPOILERS[case]
    spoil(store, rid)
    if restored:  # Redis lost range 2's hash alone; the mirror's copy is written back
        snap = store.snapshot_ranges(rid, [2])
        redis_client.delete(store.range_key(rid, 2))
        assert store.restore_round(store.round_info(rid), snap)
        assert store.range(rid, 2)["claimed_ms"] == "0"
    before = {i: _raw(redis_client, store, rid, i) for i in range(2, 6)}
    c = store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=4)
    assert (c.absorbed, c.hi) == (1, k(200))
    assert store.range(rid, 1)["merged_into"] == "0"
    assert {i: _raw(redis_client, store, rid, i) for i in range(2, 6)} == before
    assert store.round_info(rid)["skip:0"] == "2"


def test_a_range_that_no_longer_starts_at_the_hosts_end_is_not_absorbed(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Range 0 was split at 50 by its owner (new range 6 = (50, 100]), then released: a new claim
    of range 0 ends at 50, and range 1 (fresh, but starting at 100) is not adjacent; range 5 ends
    at the round's end and range 6 (fresh) starts at 50: not adjacent either."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 6)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    assert store.split(rid, 0, "a#1", k(50)) == 6
    store.release(rid, 0, "a#1")
    others = (1, 2, 3, 4, 6)  # all but the two claimed below
    before = {i: _raw(redis_client, store, rid, i) for i in others}
    c = store.claim(rid, 0, "b#1", "task-b", LEASE, coalesce=5)
    assert (c.absorbed, c.hi) == (0, k(50))
    c5 = store.claim(rid, 5, "c#1", "task-c", LEASE, coalesce=1)
    assert (c5.absorbed, c5.hi) == (0, k(600))
    assert {i: _raw(redis_client, store, rid, i) for i in others} == before
    c6 = store.claim(rid, 6, "d#1", "task-d", LEASE, coalesce=3)  # no id 7: nothing to absorb
    assert (c6.absorbed, c6.hi) == (0, k(100))
    assert not redis_client.exists(store.range_key(rid, 7))
    assert "merged" not in store.round_info(rid)


def test_no_coalescing_once_the_round_is_not_open(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A round marked unrecoverable (not open): a claim still answers as before, but absorbs
    nothing (the round hash records no run, the fresh ranges stay as they were)."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 4)
    assert store.mark_unrecoverable(rid, "rows lost at the source")
    before = {i: _raw(redis_client, store, rid, i) for i in range(1, 4)}
    c = store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=3)
    assert (c.absorbed, c.hi) == (0, k(100))
    assert {i: _raw(redis_client, store, rid, i) for i in range(1, 4)} == before
    info = store.round_info(rid)
    assert "merged" not in info and "skip:0" not in info


def test_next_unclaimed_never_hands_out_an_absorbed_id(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Counter before the host: it jumps from the host past its run (chained runs too). Counter
    inside the run (an id handed out but not claimed yet is still fresh and gets absorbed): the
    claim moves the counter past the run."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 10)
    assert store.claim(rid, 2, "a#1", "", LEASE, coalesce=3).absorbed == 3  # 3, 4, 5
    assert store.claim(rid, 6, "b#1", "", LEASE, coalesce=1).absorbed == 1  # 7
    assert [store.next_unclaimed(rid) for _ in range(5)] == [0, 1, 8, 9, None]

    store = CursorStore(redis_client, "s2", prefix=key_prefix)  # one open chained round each
    rid = _round(store, 8)
    assert [store.next_unclaimed(rid) for _ in range(4)] == [0, 1, 2, 3]
    assert store.claim(rid, 2, "a#1", "", LEASE, coalesce=3).absorbed == 3  # 3 (handed), 4, 5
    assert store.next_unclaimed_of(rid) == (6, 8)
    assert [store.next_unclaimed(rid) for _ in range(2)] == [7, None]
    assert store.claim(rid, 3, "c#1", "", LEASE).complete  # the one handed out before


def test_held_by_records_the_last_pull_claim_of_a_lineage(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 6)
    assert store.held_by(rid, "task-a") is None
    store.claim(rid, 1, "a#1", "task-a", LEASE, coalesce=1, pull=True)
    assert store.held_by(rid, "task-a") == 1
    store.claim(rid, 3, "a#1", "task-a", LEASE, pull=True)
    assert store.held_by(rid, "task-a") == 3
    store.claim(rid, 4, "a#1", "task-a", LEASE)  # not a pull claim: not recorded
    store.claim(rid, 5, "b#1", "", LEASE, pull=True)  # no lineage: nothing to record
    assert store.held_by(rid, "task-a") == 3 and store.held_by(rid, "") is None
    assert store.held_by(rid, "task-b") is None


def test_open_briefs_with_known_complete_skip_absorbed_ids_and_equal_the_full_read(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """``open_briefs(known_complete)`` learns the absorbed ids from the round hash and never reads
    them; what it returns equals the briefs of every range that is not complete."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 40)
    assert store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=9).absorbed == 9
    assert store.claim(rid, 20, "b#1", "task-b", LEASE, coalesce=4, pull=True).absorbed == 4
    _finish(store, rid, 12, "c#1")
    known: set[int] = set()
    opened = store.open_briefs(rid, known)
    every = {b.range_id: b for b in store.range_briefs(rid)}
    expected = [i for i, b in every.items() if b.state != "complete"]
    assert [b.range_id for b in opened] == expected
    assert set(range(1, 10)) | set(range(21, 25)) | {12} <= known
    for b in opened:
        mine, theirs = dataclasses.asdict(b), dataclasses.asdict(every[b.range_id])
        assert abs(mine.pop("lease_ms_left") - theirs.pop("lease_ms_left")) < 5_000
        assert mine == theirs
    redis_client.delete(store.range_key(rid, 5))  # an absorbed range lost: not read again here
    assert [b.range_id for b in store.open_briefs(rid, known)] == expected
    with pytest.raises(RoundStateLostError):
        store.open_briefs(rid)  # a full read sees the loss


def test_requeue_dead_of_an_absorbed_range_changes_nothing(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 4)
    assert store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=3).absorbed == 3
    before = {i: _raw(redis_client, store, rid, i) for i in range(1, 4)}
    assert [store.requeue_dead(rid, i, 100) for i in (1, 2, 3)] == [0, 0, 0]
    assert {i: _raw(redis_client, store, rid, i) for i in range(1, 4)} == before


@pytest.mark.parametrize("lost", ["hash", "dead-list"])
def test_an_absorbed_range_that_lost_state_reads_as_lost_never_as_complete(
    redis_client: redis.Redis, key_prefix: str, lost: str
) -> None:
    """An absorbed range's hash deleted (or a dead list planted beside it, so its counts
    disagree): reads, claims and the close all raise ``RoundStateLostError``, even once the host
    and every other range are complete."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 4)
    c = store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=2)
    _commit(store, rid, 0, "a#1", c.cursor, c.hi, 300)
    _finish(store, rid, 3, "b#1")
    if lost == "hash":
        redis_client.delete(store.range_key(rid, 1))
    else:
        redis_client.rpush(store.dead_key(rid, 1), '{"key": "x", "error": "e"}')
    with pytest.raises(RoundStateLostError):
        store.close_round(rid)
    with pytest.raises(RoundStateLostError):
        store.ranges(rid)
    with pytest.raises(RoundStateLostError):
        store.claim(rid, 1, "c#1", "", LEASE)
    assert store.round_state(rid) == "open"


def test_a_lost_range_is_never_absorbed(redis_client: redis.Redis, key_prefix: str) -> None:
    """Range 2's hash is gone before the claim: coalescing stops in front of it and does not
    write it anew (that would turn a loss into 'complete')."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, 4)
    redis_client.delete(store.range_key(rid, 2))
    assert store.claim(rid, 0, "a#1", "", LEASE, coalesce=3).absorbed == 1
    assert not redis_client.exists(store.range_key(rid, 2))
    with pytest.raises(RoundStateLostError):
        store.close_round(rid)
