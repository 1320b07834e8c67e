"""The engine on a real 3-primary Redis Cluster: plan, traverse, dead letters, barrier check,
close, mirror restore, partial-loss detection, a lost round counter, the eviction check on every
primary and stream listing across every primary, all through ``KeysetTraversal`` with a
``redis+cluster://`` URL (a ``redis.cluster.RedisCluster`` client)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from redis.cluster import RedisCluster

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import (
    EvictionPolicyError,
    KeysetTraversal,
    RoundStateLostError,
    StreamControl,
)
from airflow_keyset_provider.core.rounds.control import list_streams
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror
from airflow_keyset_provider.core.store.cursor_store import CursorStore, connect_redis


@pytest.fixture
def prefix(cluster_url: str) -> Any:
    p = f"kscl{uuid.uuid4().hex[:8]}"
    yield p
    client = connect_redis(cluster_url)
    for k in list(client.scan_iter(match=f"{p}:*")):
        client.delete(k)
    client.close()


@pytest.fixture
def events(pg_engine: sa.Engine) -> int:
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1, 1000) g"))
    return 1000


def _traversal(pg_schema_url: str, cluster_url: str, prefix: str, **kw: Any) -> KeysetTraversal:
    return KeysetTraversal(
        pg_schema_url,
        "events",
        "seq",
        redis_url=cluster_url,
        stream="events-cluster",
        key_prefix=prefix,
        **kw,
    )


def _poison(chunk: Any) -> Any:
    return ChunkResult(failed={k: "poison" for k in chunk.keys if k % 100 == 0})


def test_round_end_to_end_on_a_cluster(events, pg_schema_url, cluster_url, prefix):
    """Plan, traverse (with dead letters), check, close and replay on a cluster: every key of the
    stream shares one hash slot, and the totals count every key once."""
    t = _traversal(pg_schema_url, cluster_url, prefix)
    assert isinstance(t.store.client, RedisCluster)
    rnd = t.plan(max_ranges=4, new_stream=True)
    assert len(rnd.ranges) == 4
    for spec in rnd.ranges:
        res = t.traverse(
            rnd.round_id,
            spec.range_id,
            _poison,
            chunk_size=50,
            max_item_attempts=1,
            item_retry_delay=0,
        )
        assert res.complete
    check = t.control.check_round(rnd.round_id)
    assert check.complete
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead, totals.watermark) == (990, 0, 10, 1000)
    letters = [d["key"] for s in rnd.ranges for d in t.dead_letters(rnd.round_id, s.range_id)]
    assert sorted(letters) == list(range(100, 1001, 100))
    replayed = t.replay_dead_letters(rnd.round_id, lambda c: None, chunk_size=50)
    assert sum(r.dead for r in replayed) == 0
    assert t.control.round_status(rnd.round_id).done == 1000

    keys = list(t.store.client.scan_iter(match=f"{prefix}:*"))
    slots = {t.store.client.keyslot(k) for k in keys}
    assert len(keys) >= 7 and len(slots) == 1, "one hash tag per stream: one slot"
    t.close()


def test_mirror_restore_and_partial_loss_on_a_cluster(events, pg_schema_url, cluster_url, prefix):
    """Redis loses the whole round: the barrier's check restores it from the mirror and the
    round closes. A range's dead list lost on its own is detected (RoundStateLostError) and
    restored from the mirror."""
    t = _traversal(
        pg_schema_url, cluster_url, prefix, checkpoint_url=pg_schema_url, checkpoint_seconds=0
    )
    rnd = t.plan(max_ranges=2, new_stream=True)
    for spec in rnd.ranges:
        t.traverse(
            rnd.round_id,
            spec.range_id,
            _poison,
            chunk_size=100,
            max_item_attempts=1,
            item_retry_delay=0,
        )
    client = t.store.client
    for k in list(client.scan_iter(match=f"{prefix}:*")):
        client.delete(k)

    bare = StreamControl(CursorStore(client, "events-cluster", prefix=prefix))
    with pytest.raises(RoundStateLostError):
        bare.check_round(rnd.round_id)
    ctl = StreamControl(
        CursorStore(client, "events-cluster", prefix=prefix), CheckpointMirror(pg_schema_url)
    )
    assert ctl.check_round(rnd.round_id).complete

    client.delete(t.store.dead_key(rnd.round_id, 1))  # one piece lost on its own
    with pytest.raises(RoundStateLostError):
        bare.close_round(rnd.round_id)
    totals = ctl.close_round(rnd.round_id)
    assert (totals.done, totals.dead) == (990, 10)
    assert len(ctl.dead_letters(rnd.round_id, 1)) == 5
    t.close()


def test_chained_rounds_with_a_mirror_on_a_cluster(events, pg_schema_url, cluster_url, prefix):
    """The second plan of a stream with a mirror reconciles Redis with the mirror (watermark and
    round counter moved forward only): one Lua script under the stream's hash tag, no WATCH
    (redis-py's RedisCluster refuses WATCH outside a transaction: RedisClusterException). A
    lagging watermark and counter are moved forward from the mirror, never back."""
    t = _traversal(
        pg_schema_url, cluster_url, prefix, checkpoint_url=pg_schema_url, checkpoint_seconds=0
    )
    r1 = t.plan(max_ranges=2, new_stream=True)
    for spec in r1.ranges:
        assert t.traverse(r1.round_id, spec.range_id, _noop, chunk_size=200).complete
    assert t.close_round(r1.round_id).watermark == 1000
    with t.source.engine.begin() as c:
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1001, 1100) g"))
    r2 = t.plan(max_ranges=2, new_stream=True)  # reconciles with the mirror first
    assert (r2.round_id, r2.start_key, r2.end_key) == ("r2", 1000, 1100)
    for spec in r2.ranges:
        assert t.traverse(r2.round_id, spec.range_id, _noop, chunk_size=200).complete
    t.close_round(r2.round_id)
    client = t.store.client
    client.set(t.store.watermark_key, _encoded(t, 1000))  # a lagging replica
    client.set(t.store.seq_key, 1)
    r3 = t.plan(max_ranges=1, new_stream=True)
    assert (r3.round_id, r3.start_key) == ("r3", 1100)
    assert t.watermark() == 1100
    t.close()


def _noop(chunk: Any) -> None:
    return None


def _encoded(t: KeysetTraversal, key: int) -> str:
    return t._encode_user_key("key", key)


def test_lost_round_counter_on_a_cluster(events, pg_schema_url, cluster_url, prefix):
    """The counter is re-derived by SCAN over every primary: a live round is not overwritten."""
    t = _traversal(pg_schema_url, cluster_url, prefix)
    r1 = t.plan(max_ranges=2, start_key=0, end_key=1000)
    t.store.client.delete(t.store.seq_key)
    r2 = t.plan(max_ranges=2, start_key=0, end_key=500)
    assert (r1.round_id, r2.round_id) == ("r1", "r2")
    assert t.round("r1").end_key == 1000
    t.close()


def test_stream_listing_iterates_every_primary(cluster_url, cluster_ports, prefix):
    """Streams hash to different primaries; listing finds them all (SCAN on every primary)."""
    client = connect_redis(cluster_url)
    names = [f"s{i}" for i in range(24)]
    for name in names:
        client.set(CursorStore(client, name, prefix=prefix).seq_key, 0)
    nodes = set()
    for port in cluster_ports:
        if any(True for _ in redis.Redis(port=port).scan_iter(match=f"{prefix}:*")):
            nodes.add(port)
    assert len(nodes) >= 2, "the streams should land on more than one primary"
    assert sorted(s.stream for s in list_streams(client, prefix)) == sorted(names)
    client.close()


def test_eviction_policy_is_checked_on_every_primary(
    events, pg_schema_url, cluster_url, cluster_ports, prefix
):
    """One primary of three runs allkeys-lru: the plan is refused, naming the policy."""
    node = redis.Redis(port=cluster_ports[-1])
    node.config_set("maxmemory-policy", "allkeys-lru")
    try:
        t = _traversal(pg_schema_url, cluster_url, prefix)
        with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
            t.plan(new_stream=True)
        t.close()
    finally:
        node.config_set("maxmemory-policy", "noeviction")
