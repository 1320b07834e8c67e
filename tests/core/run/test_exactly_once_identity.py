"""``exactly_once=True`` when a range changes identity: the ledger is a set of committed key
intervals per round, which every claim consults for its own keys, so neither a coalescing of a
range the mirror restored nor a failover that lost a split writes a committed key again.

Each scenario writes one row per key into ``effects`` (no unique constraint: a write done twice
shows) on a PostgreSQL (psycopg2 and psycopg 3), SQLite or MariaDB target, and closes the round
with exact totals. (Real PostgreSQL, MariaDB, SQLite and Redis.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from core_support import make_events, traversal
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import TraverseOptions
from airflow_keyset_provider.core.errors import LeaseLostError
from airflow_keyset_provider.core.keys import encode_key

TARGETS = ["psycopg2", "psycopg", "sqlite", "mariadb"]


def target_url(request: Any, kind: str, pg_schema_url: str, tmp_path: Any) -> str:
    """The URL of a target of ``kind``: a PostgreSQL driver's name, ``sqlite`` or ``mariadb``."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'target.db'}"
    if kind == "mariadb":
        return str(request.getfixturevalue("mariadb_db_url"))
    url = sa.engine.make_url(pg_schema_url).set(drivername=f"postgresql+{kind}")
    return url.render_as_string(hide_password=False)


@pytest.fixture(params=TARGETS)
def target(request, pg_schema_url, tmp_path) -> Iterator[tuple[str, sa.Engine]]:
    """(URL, engine) of the target, holding ``effects`` (no unique key)."""
    url = target_url(request, request.param, pg_schema_url, tmp_path)
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    yield url, engine
    engine.dispose()


def write(chunk: Any) -> None:
    chunk.connection.execute(
        sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in chunk.keys]
    )


def effects(engine: sa.Engine) -> Counter:
    with engine.connect() as c:
        return Counter(r[0] for r in c.execute(sa.text("SELECT seq FROM effects")))


def twice(engine: sa.Engine) -> list[int]:
    return sorted(k for k, n in effects(engine).items() if n > 1)


def forget_stream(client: redis.Redis, prefix: str) -> None:
    """Redis loses everything under the test's prefix (a restart without persistence)."""
    for key in list(client.scan_iter(f"{prefix}:*")):
        client.delete(key)


def snapshot(client: redis.Redis, prefix: str) -> dict[bytes, tuple[bytes, int]]:
    """Every key under the prefix as ``DUMP`` gives it, with its TTL: what a replica that
    stopped replicating at this moment holds."""
    return {k: (client.dump(k), max(client.pttl(k), 0)) for k in client.scan_iter(f"{prefix}:*")}


def fail_over_to(client: redis.Redis, prefix: str, replica: dict[bytes, tuple[bytes, int]]) -> None:
    """The lagging replica is promoted: the stream's keys are what it held, nothing later."""
    forget_stream(client, prefix)
    for k, (data, ttl) in replica.items():
        client.restore(k, ttl, data, replace=True)


class LoseAdvanceAt:
    """Writes each chunk; the first time the chunk starting at ``at`` is processed, the range's
    owner field changes in Redis, so this try's advance is refused after the target committed
    (the worker dies between the two commits)."""

    def __init__(self, client: redis.Redis, range_key: str, at: int) -> None:
        self.client, self.range_key, self.at, self.fired = client, range_key, at, False

    def __call__(self, chunk: Any) -> None:
        write(chunk)
        if chunk.keys[0] == self.at and not self.fired:
            self.fired = True
            self.client.hset(self.range_key, "owner", "lineage-a#gone")


def test_coalescing_a_range_restored_from_the_mirror_passes_what_it_committed(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Issue 27 item 1. Ranges (0, 200] and (200, 400], a checkpoint mirror that recorded only
    the plan. Range 1 commits (200, 260] with the ledger; its worker dies before the advance
    past 230. Redis loses the stream; the mirror restores range 1 as fresh, so a pull task with
    ``tasks=1`` coalesces it into range 0's claim (0, 400]. The claim's traversal must pass the
    committed (200, 260] (the ledger keyed by range id aligned only range 0's row: 60 keys
    written twice)."""
    url, engine = target
    make_events(pg_engine, list(range(1, 401)))
    t = traversal(
        pg_schema_url, redis_url, key_prefix, target_url=url,
        checkpoint_url=pg_schema_url, checkpoint_seconds=3600,
    )  # fmt: skip
    rnd = t.plan(max_ranges=2, start_key=0, end_key=400)
    assert [(r.lo, r.hi) for r in rnd.ranges] == [(0, 200), (200, 400)]
    proc = LoseAdvanceAt(redis_client, t.store.range_key(rnd.round_id, 1), at=231)
    kw = dict(chunk_size=30, owner_lineage="lineage-a", exactly_once=True)
    with pytest.raises(LeaseLostError):
        t.traverse(rnd.round_id, 1, proc, **kw)
    assert sum(effects(engine).values()) == 60
    forget_stream(redis_client, key_prefix)
    options = TraverseOptions(owner_lineage="w", chunk_size=30, exactly_once=True)
    res = t.traverse_round(rnd.round_id, write, options=options, tasks=1)
    assert res.finished
    assert twice(engine) == []
    assert effects(engine) == Counter(range(1, 401))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (400, 0, 0)
    t.close()


def test_a_failover_that_lost_a_split_passes_the_keys_the_lost_range_committed(
    target, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Issue 27 item 2. One range (0, 400] in a pull loop. Its owner commits up to 150; Redis
    (the primary) is copied there (the replica stops replicating). On the primary an idle task
    asks for a split: the owner splits at the median of the keys left, s, keeps (0, s], and
    the loop then runs the new range (s, 400] to its end. The primary dies; the replica is promoted: one
    range (0, 400] at cursor 150. A new pull loop claims it: it must pass (150, s] (its own
    lineage, ahead of Redis) and (s, 400] (committed by the range the replica never saw),
    reading nothing (the ledger keyed by range id fast-forwarded to s and read (s, 400] again:
    every key of the lost range written twice). Totals stay exact."""
    url, engine = target
    make_events(pg_engine, list(range(1, 401)))
    with pg_engine.begin() as c:
        c.execute(sa.text("ANALYZE events"))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=400)
    replica: dict[bytes, tuple[bytes, int]] = {}
    delivered: Counter = Counter()

    def proc(chunk: Any) -> None:
        write(chunk)
        delivered.update(chunk.keys)
        if chunk.keys[0] == 151 and not replica:
            replica.update(snapshot(redis_client, key_prefix))  # committed through 150
            assert t.store.request_split(rnd.round_id, 0, "idle-task")

    options = TraverseOptions(owner_lineage="w", chunk_size=50, exactly_once=True)
    res = t.traverse_round(rnd.round_id, proc, options=options)
    assert res.finished and replica
    status = t.control.round_status(rnd.round_id)
    bounds = [(r.lo, r.hi) for r in status.ranges]
    assert len(bounds) == 2 and bounds[0][1] == bounds[1][0]  # split at a key above 200
    assert effects(engine) == Counter(range(1, 401))
    fail_over_to(redis_client, key_prefix, replica)
    status = t.control.round_status(rnd.round_id)
    assert [(r.lo, r.hi) for r in status.ranges] == [(0, 400)]  # the replica never saw it
    res = t.traverse_round(rnd.round_id, proc, options=options)
    assert res.finished
    assert twice(engine) == []
    assert sum(delivered.values()) == 400  # nothing read again
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (400, 0, 0)
    t.close()


def test_state_of_the_ledger_grows_with_claims_not_rows(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """2000 keys in chunks of 10 (200 commits) over 4 ranges: the ledger holds one head and at
    most one interval per claim (4), whatever the rows."""
    url, engine = target
    make_events(pg_engine, list(range(1, 2001)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=4, start_key=0, end_key=2000)
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, write, chunk_size=10, exactly_once=True)
    with engine.connect() as c:
        n = c.execute(sa.text("SELECT count(*) FROM keyset_ledger")).scalar()
    assert n == 1 + len(rnd.ranges)
    assert effects(engine) == Counter(range(1, 2001))
    t.close()


@pytest.mark.parametrize("kind", ["psycopg2", "psycopg", "mariadb"])
def test_two_live_identities_of_the_same_keys_never_both_commit_them(
    kind, pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path, request
):
    """The race the overlap fence exists for. Two Redis states of one round (two key prefixes:
    the promoted replica, and the old primary a stale worker still talks to): on the primary,
    range 0 was split at 200 (range 1 is (200, 400]); the replica has one range (0, 400]. C
    claims range 0 on the replica and reads; while C is in its chunk (150, 200], D claims range
    1 on the primary, its ledger step after C's (a newer generation, which C's claim could not
    take), and commits (200, 400]. C's commit of (200, 250] then overlaps D's interval: it is
    refused and rolled back (``LeaseLostError``); the next claim of range 0 passes (200, 400].
    Every key once. (The generation fence alone lets C through: 200 keys written twice.) Not
    on SQLite: C's open transaction holds the database's write lock, so D would wait for it."""
    url = target_url(request, kind, pg_schema_url, tmp_path)
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_events(pg_engine, list(range(1, 401)))
    replica = traversal(pg_schema_url, redis_url, f"{key_prefix}:replica", target_url=url)
    primary = traversal(pg_schema_url, redis_url, f"{key_prefix}:primary", target_url=url)
    rnd = replica.plan(max_ranges=1, start_key=0, end_key=400)
    assert primary.plan(max_ranges=1, start_key=0, end_key=400).round_id == rnd.round_id
    # one round in two Redis states: the replica holds the primary's copy of it (its plan time)
    planned = replica.store.round_info(rnd.round_id)["created_ms"]
    primary.store.set_round_field(rnd.round_id, "created_ms", planned)
    claim = primary.store.claim(rnd.round_id, 0, "old#1", "old", 60_000)
    assert primary.store.request_split(rnd.round_id, 0, "idle-task") == "asked"
    assert primary.store.split(rnd.round_id, 0, claim.token, encode_key((200,))) == 1
    primary.store.release(rnd.round_id, 0, claim.token)
    kw = dict(chunk_size=50, exactly_once=True)
    results = []

    def c_proc(chunk: Any) -> None:
        write(chunk)
        if chunk.keys[0] == 151 and not results:  # D, on the primary, meanwhile
            results.append(primary.traverse(rnd.round_id, 1, write, **kw))

    with pytest.raises(LeaseLostError, match="committed by another owner"):
        replica.traverse(rnd.round_id, 0, c_proc, **kw)
    assert results[0].complete and results[0].done == 200
    res = replica.traverse(rnd.round_id, 0, write, **kw)
    assert res.complete and res.done == 400
    assert twice(engine) == []
    assert effects(engine) == Counter(range(1, 401))
    replica.close()
    primary.close()
    engine.dispose()


@pytest.mark.parametrize("kind", ["psycopg2", "mariadb"])
def test_a_neighbour_finishing_at_this_ranges_cursor_does_not_fence_it(
    kind, pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path, request
):
    """Ranges (0, 200] and (200, 400]. B claims range 1 first; while B is in its first chunk,
    A claims range 0 (a newer generation) and runs it to its end, 200: A's interval ends where
    B's starts. B's commit must go through (an interval of another range ending at B's cursor,
    newer or not, is no takeover of B's keys)."""
    url = target_url(request, kind, pg_schema_url, tmp_path)
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_events(pg_engine, list(range(1, 401)))
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=url)
    rnd = t.plan(max_ranges=2, start_key=0, end_key=400)
    kw = dict(chunk_size=50, exactly_once=True)
    results = []

    def b_proc(chunk: Any) -> None:
        write(chunk)
        if not results:
            results.append(t.traverse(rnd.round_id, 0, write, **kw))

    res = t.traverse(rnd.round_id, 1, b_proc, **kw)
    assert results[0].complete and res.complete and res.done == 200
    assert effects(engine) == Counter(range(1, 401))
    t.close()
    engine.dispose()


class Crash(BaseException):
    """The owner dies in its first call (nothing of it committed; its claim's step did)."""


def test_an_empty_interval_of_a_range_a_failover_lost_does_not_fence_its_keys(
    target, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Found by the one-world model (``empty-interval-fence``, seed 4). On the primary, range 0
    (0, 400] was split at 210; range 1 (210, 400] is claimed (its claim's ledger step opens its
    empty interval (210, 210]) and its owner dies before committing a key. The primary dies;
    the replica never saw the split: one range (0, 400]. Its owner's chunk (200, 250] holds
    210: the empty interval holds no key and must not fence it (it did: ``LeaseLostError ...
    keys (210, 210] inside (200, 250] were committed by another owner (range 1)`` on every
    try, the round never closed). Every key once, exact totals."""
    url, engine = target
    make_events(pg_engine, list(range(1, 401)))
    replica = traversal(pg_schema_url, redis_url, f"{key_prefix}:replica", target_url=url)
    primary = traversal(pg_schema_url, redis_url, f"{key_prefix}:primary", target_url=url)
    rnd = replica.plan(max_ranges=1, start_key=0, end_key=400)
    assert primary.plan(max_ranges=1, start_key=0, end_key=400).round_id == rnd.round_id
    # one round in two Redis states: the replica holds the primary's copy of it (its plan time)
    planned = replica.store.round_info(rnd.round_id)["created_ms"]
    primary.store.set_round_field(rnd.round_id, "created_ms", planned)
    claim = primary.store.claim(rnd.round_id, 0, "old#1", "old", 60_000)
    assert primary.store.request_split(rnd.round_id, 0, "idle-task") == "asked"
    assert primary.store.split(rnd.round_id, 0, claim.token, encode_key((210,))) == 1
    primary.store.release(rnd.round_id, 0, claim.token)

    def dies(chunk: Any) -> None:
        raise Crash

    kw = dict(chunk_size=50, exactly_once=True)
    with pytest.raises(Crash):
        primary.traverse(rnd.round_id, 1, dies, **kw)
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT lo, hi FROM keyset_ledger WHERE seg > 0")).all()
    assert [tuple(r) for r in rows] == [(encode_key((210,)), encode_key((210,)))]
    res = replica.traverse(rnd.round_id, 0, write, **kw)
    assert res.complete and res.done == 400
    assert effects(engine) == Counter(range(1, 401))
    totals = replica.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (400, 0, 0)
    replica.close()
    primary.close()
