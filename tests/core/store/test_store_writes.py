"""State changes of the cursor store that were plain Redis calls and are one Lua script now:
marking a round unrecoverable, recomputing its totals, deleting it. Real Redis, no source."""

from __future__ import annotations

import redis

from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import CursorStore


def _round(store: CursorStore, bounds: list[tuple[str, str]], key: str | None = None) -> str:
    start, end = bounds[0][0], bounds[-1][1]
    rid, created = store.create_round(
        idempotency_key=key, chained=True, start=start, end=end, source="{}", arity=1, bounds=bounds
    )
    assert created
    return rid


def _state(client: redis.Redis, store: CursorStore, rid: str) -> str | None:
    v = client.hget(store.round_key(rid), "state")
    return None if v is None else v.decode()


def test_a_closed_round_is_never_marked_unrecoverable(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Scenario: a round closed (coverage proven, watermark moved); later a worker of a replay sees
    the source's retention boundary pass and marks the round unrecoverable. A plain HSET turned the
    closed round into an unrecoverable one; the script leaves a closed round closed."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    k = encode_key([10])
    rid = _round(store, [(MIN_KEY, k), (k, k)])
    store.client.hset(store.range_key(rid, 0), mapping={"cursor": k, "state": "complete"})
    store.close_round(rid)
    assert _state(redis_client, store, rid) == "closed"
    store.mark_unrecoverable(rid, "retention passed the cursor")
    assert _state(redis_client, store, rid) == "closed"


def test_marking_a_missing_round_writes_nothing(redis_client: redis.Redis, key_prefix: str) -> None:
    """Scenario: Redis lost the round, then a worker marks it unrecoverable. A plain HSET created a
    stray round hash with only ``state`` and ``reason`` (no bounds, no ranges) that later reads took
    for the round; the script writes nothing."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    store.mark_unrecoverable("r7", "retention passed the cursor")
    assert redis_client.exists(store.round_key("r7")) == 0


def test_unrecoverable_round_refuses_to_close(redis_client: redis.Redis, key_prefix: str) -> None:
    from airflow_keyset_provider.core.store.cursor_store import Unrecoverable

    store = CursorStore(redis_client, "s", prefix=key_prefix)
    rid = _round(store, [(MIN_KEY, encode_key([10]))])
    assert store.mark_unrecoverable(rid, "gone")
    assert store.close_round(rid) == Unrecoverable("gone")


def test_refresh_totals_and_delete_round(redis_client: redis.Redis, key_prefix: str) -> None:
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    a, b = encode_key([10]), encode_key([20])
    rid = _round(store, [(MIN_KEY, a), (a, b)], key="run-1")
    store.client.hset(store.range_key(rid, 0), mapping={"done": 3, "skipped": 1, "dead": 2})
    store.client.hset(store.range_key(rid, 1), mapping={"done": 4})
    store.refresh_totals(rid)
    totals = store.client.hmget(store.round_key(rid), "done", "skipped", "dead")
    assert [int(x) for x in totals] == [7, 1, 2]
    assert store.lookup(None, chained=True) == rid
    assert store.delete_round(rid) == 3  # round hash + two range hashes (no retry, no dead keys)
    assert store.lookup("run-1", chained=True) is None  # index entries and chained pointer gone
    assert store.open_rounds() == []


def test_control_hash_bucket_and_retry_reads_go_through_the_store(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Scenario: the pacer, the governor, the health gate and the item-failure path used to call
    the Redis client themselves (pipeline, HSET/HDEL, HMGET, DEL, register_script). They now use
    the store's named methods, which read and write the same keys, all under the stream's hash
    tag."""
    from airflow_keyset_provider.core.pace.governor import Governor

    store = CursorStore(redis_client, "s", prefix=key_prefix)
    tag = f"{key_prefix}:{{s}}:control"
    assert store.control_key == tag
    assert (store.bucket_key, store.health_key, store.health_lock_key) == (
        f"{tag}:bucket",
        f"{tag}:health",
        f"{tag}:health_lock",
    )

    assert store.control_hashes() == ({}, {})
    store.set_control_field("max_rows_per_second", "120.0")
    redis_client.hset(store.health_key, mapping={"healthy": "0", "reason": "lag"})
    assert store.control_hashes() == (
        {"max_rows_per_second": "120.0"},
        {"healthy": "0", "reason": "lag"},
    )
    store.set_control_field("max_rows_per_second", None)
    assert store.control_hashes()[0] == {}

    Governor(store).charge(10, 100.0)
    assert redis_client.exists(store.bucket_key) == 1
    store.reset_bucket()
    assert redis_client.exists(store.bucket_key) == 0

    redis_client.hset(store.retry_key("r1", 0), "k2", "1|boom")
    assert store.retry_states("r1", 0, ["k1", "k2"]) == [None, "1|boom"]
    assert store.retry_states("r1", 0, []) == []


def test_the_completing_advance_releases_the_range_in_the_same_step(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """``advance(release=True)``: a step that does not complete the range keeps the owner; the
    step that completes it releases it as ``release`` would (compacted: no owner, no lease), so a
    range costs one round trip less. The claim hands out the bounds (no read after it)."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    k10, k20 = encode_key([10]), encode_key([20])
    rid = _round(store, [(MIN_KEY, k20)])
    c = store.claim(rid, 0, "a#1", "", 60_000)
    assert not isinstance(c, tuple) and (c.lo, c.hi) == (MIN_KEY, k20)
    a = store.advance(
        rid,
        0,
        "a#1",
        c.cursor,
        k10,
        done=10,
        skipped=0,
        lease_ms=60_000,
        max_item_attempts=3,
        release=True,
    )
    assert not a.complete and not a.released
    assert redis_client.hget(store.range_key(rid, 0), "owner") == b"a#1"
    a = store.advance(
        rid,
        0,
        "a#1",
        k10,
        k20,
        done=10,
        skipped=0,
        lease_ms=60_000,
        max_item_attempts=3,
        release=True,
    )
    assert a.complete and a.released and a.done == 20
    h = redis_client.hgetall(store.range_key(rid, 0))
    assert b"owner" not in h and b"lease_until" not in h and h[b"state"] == b"complete"
    assert not store.release(rid, 0, "a#1")  # nothing left to release
    assert store.claim(rid, 0, "b#1", "", 60_000).complete


def test_a_completing_advance_keeps_the_lease_while_a_split_request_waits(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A split request is pending when the range completes: the advance does not release it, so
    the owner can still answer (decline) before it releases."""
    store = CursorStore(redis_client, "s", prefix=key_prefix)
    k20 = encode_key([20])
    rid = _round(store, [(MIN_KEY, k20)])
    c = store.claim(rid, 0, "a#1", "", 60_000)
    assert store.request_split(rid, 0, "idle#1") == "asked"
    a = store.advance(
        rid,
        0,
        "a#1",
        c.cursor,
        k20,
        done=20,
        skipped=0,
        lease_ms=60_000,
        max_item_attempts=3,
        release=True,
    )
    assert a.complete and not a.released and a.split_req == "idle#1"
    assert redis_client.hget(store.range_key(rid, 0), "owner") == b"a#1"
    assert store.split(rid, 0, "a#1", None) is None  # declined by the owner
    assert store.release(rid, 0, "a#1")
