"""Production-shaped Redis: eviction policies, a piece of a round lost on its own, a lost round
counter, dead letters past the cap, and the barrier's check after Redis lost a round (issue #10).

Every server-configuration test runs on a throwaway ``redis-server`` (``tests/redis_servers.py``),
never on the shared one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from core_support import make_events, traversal
from redis_servers import start_redis

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import (
    DeadLetterCapError,
    EvictionPolicyError,
    RoundStateLostError,
    StreamControl,
)
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror
from airflow_keyset_provider.core.store.cursor_store import CursorStore

TROUBLESHOOTING = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"


def _quoted(message: str, phrase: str) -> None:
    """The phrase is in the real message and quoted verbatim in docs/troubleshooting.md."""
    assert phrase in message
    assert phrase in TROUBLESHOOTING.read_text(), f"troubleshooting.md does not quote {phrase!r}"


@pytest.fixture
def server() -> Iterator[Any]:
    """Start throwaway servers with given arguments; all are stopped at teardown."""
    stops = []

    def start(*args: str) -> str:
        url, stop = start_redis(*args)
        stops.append(stop)
        return url

    yield start
    for stop in stops:
        stop()


# ---------------------------------------------------------------- 5a: the eviction policy


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_plan_refuses_a_server_that_may_evict_any_key(server, pg_engine, pg_schema_url, policy):
    """Scenario: the cursor store's Redis runs with ``maxmemory-policy allkeys-*``; under memory
    pressure it would evict a range's retry hash or a whole round. The plan is refused before
    anything is written, naming the policy and the fix."""
    make_events(pg_engine, list(range(1, 11)))
    url = server("--maxmemory-policy", policy)
    t = traversal(pg_schema_url, url, "kst")
    with pytest.raises(EvictionPolicyError, match=policy) as err:
        t.plan(max_ranges=2, new_stream=True)
    _quoted(
        str(err.value).replace(policy, "allkeys-lru"),
        "the Redis server's maxmemory-policy is allkeys-lru, which may evict any key, "
        "including the stream's cursors and dead letters. Set `CONFIG SET maxmemory-policy "
        "noeviction` "
        "(and in redis.conf), or give the cursor store a dedicated Redis. Nothing was written.",
    )
    assert redis.Redis.from_url(url).dbsize() == 0, "a refused plan writes nothing"
    t.close()


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
def test_plan_accepts_policies_that_never_evict_keys_without_ttl(
    server, pg_engine, pg_schema_url, policy
):
    """Scenario: ``noeviction`` or ``volatile-*`` (evicts only keys with a TTL). The plan goes
    ahead, and no key the stream wrote has a TTL, so ``volatile-*`` can never pick one."""
    make_events(pg_engine, list(range(1, 101)))
    url = server("--maxmemory-policy", policy)
    t = traversal(pg_schema_url, url, "kst", checkpoint_url=pg_schema_url)
    rnd = t.plan(max_ranges=2, new_stream=True)
    t.traverse(
        rnd.round_id,
        0,
        lambda c: ChunkResult(failed={c.keys[0]: "bad"}),
        chunk_size=10,
        max_item_attempts=1,
        item_retry_delay=0,
    )
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter("kst:*"))
    assert len(keys) >= 6  # round, ranges, dead list, seq, open, ...
    assert all(client.ttl(k) == -1 for k in keys), "no stream key may carry a TTL"
    t.close()


def test_policy_read_from_info_when_config_is_refused(server, pg_engine, pg_schema_url):
    """Scenario: managed Redis refuses CONFIG (renamed away here); the policy is read from
    ``INFO memory`` instead and ``allkeys-lru`` is still refused."""
    make_events(pg_engine, list(range(1, 11)))
    url = server("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "")
    t = traversal(pg_schema_url, url, "kst")
    with pytest.raises(EvictionPolicyError, match="allkeys-lru"):
        t.plan(new_stream=True)
    t.close()


def test_unreadable_policy_is_refused_unless_explicitly_allowed(server, pg_engine, pg_schema_url):
    """Scenario: neither CONFIG nor INFO answers. The plan is refused with a message saying the
    policy could not be checked and how to opt in; with the opt-in it plans."""
    make_events(pg_engine, list(range(1, 11)))
    url = server("--rename-command", "CONFIG", "", "--rename-command", "INFO", "")
    t = traversal(pg_schema_url, url, "kst")
    with pytest.raises(EvictionPolicyError, match="could not read") as err:
        t.plan(new_stream=True)
    assert "allow_unverified_eviction_policy=True" in str(err.value)
    _quoted(
        str(err.value),
        "could not read the Redis server's maxmemory-policy (CONFIG GET and "
        "INFO memory were both refused)",
    )
    t.close()
    t = traversal(pg_schema_url, url, "kst", allow_unverified_eviction_policy=True)
    assert t.plan(new_stream=True).round_id == "r1"
    t.close()


# ---------------------------------------------------------------- 5b: a piece lost on its own


def _evict_once(client: redis.Redis, key: str, when: Any) -> Any:
    """A processor that fails key 5 once (it waits in the retry hash) and, on the chunk that
    starts at ``when``, deletes ``key`` as an allkeys-lru eviction would."""
    state = {"failed": False, "evicted": False}

    def proc(chunk: Any) -> Any:
        if chunk.keys[0] == when and not state["evicted"]:
            state["evicted"] = True
            assert client.delete(key) == 1
        if 5 in chunk.keys and not state["failed"]:
            state["failed"] = True
            return ChunkResult(failed={5: "flaky"})
        return None

    return proc


def test_lost_retry_hash_never_closes_short(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: key 5 fails once and waits in the range's retry hash; mid-range the retry hash
    is evicted. Before the fix the range reached hi with no retries left and the round closed
    with done+skipped+dead = 99 of 100. Now the next advance sees the range's ``retries`` count
    disagree with its retry hash: RoundStateLostError, and the round never closes."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = _evict_once(redis_client, t.store.retry_key(rnd.round_id, 0), 51)
    with pytest.raises(RoundStateLostError, match="lost") as err:
        t.traverse(rnd.round_id, 0, proc, chunk_size=10, item_retry_delay=0)
    _quoted(
        str(err.value),
        "lost state in Redis (its range hash, retry hash or dead list is "
        "missing or does not match the counts it keeps: flushed, evicted or deleted); nothing "
        "was committed.",
    )
    with pytest.raises(RoundStateLostError):
        t.close_round(rnd.round_id)
    with pytest.raises(RoundStateLostError):
        t.control.check_round(rnd.round_id)
    t.close()


def test_lost_retry_hash_is_restored_from_the_mirror(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: as above, with a checkpoint mirror. The damaged range (only it) is rebuilt from
    its last checkpoint, key 5 gets its retry, and the round closes with all 100 keys."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(
        pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url, checkpoint_seconds=0
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = _evict_once(redis_client, t.store.retry_key(rnd.round_id, 0), 51)
    res = t.traverse(rnd.round_id, 0, proc, chunk_size=10, item_retry_delay=0)
    assert res.complete
    totals = t.close_round(rnd.round_id)
    assert totals.done + totals.skipped + totals.dead == 100
    assert totals.dead == 0
    assert redis_client.hget(t.store.range_key(rnd.round_id, 0), "restored") == b"1"
    t.close()


def test_lost_dead_list_of_a_complete_range_is_detected(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: a range completes with one dead letter, then its dead list is evicted. Before
    the fix the round closed with dead=1 and no letter to list or replay; now the close (and the
    barrier's check) raise RoundStateLostError."""
    make_events(pg_engine, list(range(1, 51)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)

    def proc(c: Any) -> Any:
        return ChunkResult(failed={3: "poison"}) if 3 in c.keys else None

    t.traverse(rnd.round_id, 0, proc, chunk_size=10, max_item_attempts=1, item_retry_delay=0)
    redis_client.delete(t.store.dead_key(rnd.round_id, 0))
    with pytest.raises(RoundStateLostError):
        t.control.check_round(rnd.round_id)
    with pytest.raises(RoundStateLostError):
        t.close_round(rnd.round_id)
    t.close()


# ---------------------------------------------------------------- 5c: a lost round counter


def test_lost_round_counter_never_overwrites_a_live_round(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: round r1 is live (range 0 traversed), then the ``seq`` key is lost. Before the
    fix the next plan got id r1 again and CREATE_ROUND overwrote the live round (cursors back at
    lo, counters zero). Now the used id is refused, the counter is re-derived from the stream's
    rounds, and the new round gets a fresh id."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    r1 = t.plan(max_ranges=2, start_key=0, end_key=100)
    t.traverse(r1.round_id, 0, lambda c: None, chunk_size=10)
    before = t.store.range(r1.round_id, 0)
    redis_client.delete(t.store.seq_key)
    r2 = t.plan(max_ranges=2, start_key=0, end_key=50)
    assert r2.round_id != r1.round_id and r2.created
    assert t.store.range(r1.round_id, 0) == before
    assert t.round(r1.round_id).end_key == 100
    assert t.store.round_counter() == int(r2.round_id[1:])
    t.close()


# ---------------------------------------------------------------- 6: dead letters are never dropped


def test_dead_letters_past_the_cap_are_never_dropped(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Scenario: 2,000 poison keys in one range, default dead_cap 1000. Before the fix the list
    was trimmed: dead=2000 but only 1,000 letters listable or replayable. Now the advance that
    would pass the cap is refused (DeadLetterCapError, nothing of it committed) and ``dead``
    always equals the letters listed; with the cap raised all 2,000 are kept and replayed."""
    make_events(pg_engine, list(range(1, 6001)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    rid = rnd.round_id

    def poison(chunk: Any) -> Any:
        return ChunkResult(failed={k: "poison" for k in chunk.keys if k % 3 == 0})

    opts = {"chunk_size": 300, "max_item_attempts": 1, "item_retry_delay": 0}
    with pytest.raises(DeadLetterCapError, match="dead_cap=1000") as err:
        t.traverse(rid, 0, poison, **opts)
    _quoted(
        str(err.value),
        "dead letter(s) and this step would add 100, more than dead_cap=1000. "
        "Dead letters are never dropped, so nothing of it was committed",
    )
    rng = t.store.range(rid, 0)
    assert int(rng["dead"]) == 1000 == len(t.dead_letters(rid, 0, limit=10**6))
    assert t.decode(rng["cursor"]) == 3000  # ten chunks committed, the eleventh refused

    res = t.traverse(rid, 0, poison, dead_cap=5000, **opts)
    assert res.complete and res.dead == 2000
    letters = t.dead_letters(rid, 0, limit=10**6)
    assert len(letters) == 2000 and {d["key"] for d in letters} == set(range(3, 6001, 3))

    replayed = t.replay_dead_letters(rid, lambda c: None, dead_cap=5000, **opts)
    assert sum(r.done for r in replayed) == 6000 and replayed[0].dead == 0
    totals = t.close_round(rid)
    assert (totals.done, totals.dead) == (6000, 0)
    t.close()


# ---------------------------------------------------------------- 10: the barrier uses the mirror


def _completed_round(pg_engine, pg_schema_url, redis_url, key_prefix) -> Any:
    make_events(pg_engine, list(range(1, 201)))
    t = traversal(
        pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url, checkpoint_seconds=0
    )
    rnd = t.plan(max_ranges=2, new_stream=True)
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, lambda c: None, chunk_size=50)
    return t, rnd


def _flush(client: redis.Redis, prefix: str) -> None:
    for k in list(client.scan_iter(f"{prefix}:*")):
        client.delete(k)


def test_check_round_restores_a_lost_completed_round_from_the_mirror(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: every range completed and was mirrored, then Redis lost the round (restart
    without persistence) before the barrier looked. Before the fix ``check_round`` raised
    RoundStateLostError (the sensor failed) though ``close_round`` would have restored it; now the
    check restores it through the same path and reports it complete, and the close succeeds."""
    t, rnd = _completed_round(pg_engine, pg_schema_url, redis_url, key_prefix)
    t.close()
    _flush(redis_client, key_prefix)
    ctl = StreamControl(
        CursorStore(redis_client, "events-nightly", prefix=key_prefix),
        CheckpointMirror(pg_schema_url),
    )
    check = ctl.check_round(rnd.round_id)
    assert check.complete and check.lagging == []
    totals = ctl.close_round(rnd.round_id)
    assert (totals.done, totals.watermark) == (200, 200)

    _flush(redis_client, key_prefix)  # a closed round lost: restored as closed
    check = ctl.check_round(rnd.round_id)
    assert check.complete and check.state == "closed"


def test_check_round_without_mirror_still_raises(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Scenario: the same loss with no mirror: the check raises RoundStateLostError, never
    reports the round complete."""
    t, rnd = _completed_round(pg_engine, pg_schema_url, redis_url, key_prefix)
    t.close()
    _flush(redis_client, key_prefix)
    ctl = StreamControl(CursorStore(redis_client, "events-nightly", prefix=key_prefix))
    with pytest.raises(RoundStateLostError):
        ctl.check_round(rnd.round_id)


def test_mirror_table_is_unchanged_by_a_check(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """The check only reads the mirror: a restore writes Redis, never the mirror's rows."""
    t, rnd = _completed_round(pg_engine, pg_schema_url, redis_url, key_prefix)
    t.close()
    with pg_engine.connect() as c:
        before = c.execute(sa.text("SELECT range_id, doc FROM keyset_checkpoints ORDER BY 1")).all()
    _flush(redis_client, key_prefix)
    ctl = StreamControl(
        CursorStore(redis_client, "events-nightly", prefix=key_prefix),
        CheckpointMirror(pg_schema_url),
    )
    assert ctl.check_round(rnd.round_id).complete
    with pg_engine.connect() as c:
        after = c.execute(sa.text("SELECT range_id, doc FROM keyset_checkpoints ORDER BY 1")).all()
    assert before == after
