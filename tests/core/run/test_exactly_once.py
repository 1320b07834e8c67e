"""``exactly_once=True``: the range's ledger row commits in the same transaction as the
processor's writes through ``chunk.connection``, fenced by the claim's epoch, before the Redis
cursor moves. A chunk whose transaction committed is never delivered again (the next claim moves
Redis forward to the ledger); a stale owner's transaction is rolled back. Each test writes one
row per key into a table with no unique constraint, so a write done twice shows; each scenario
runs without the mode too (the control), where the same fault writes a chunk twice.
(Real PostgreSQL, SQLite and Redis.)"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider import RetryableError
from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import ConfigurationError, LeaseLostError
from airflow_keyset_provider.core.keys import encode_key


def _effects(engine: sa.Engine) -> Counter:
    with engine.connect() as c:
        return Counter(r[0] for r in c.execute(sa.text("SELECT seq FROM effects")))


def _prepare(source: sa.Engine, target: sa.Engine, n: int) -> None:
    make_events(source, list(range(1, n + 1)))
    with target.begin() as c:  # no unique constraint: a write done twice would show
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))


def _write(chunk: Any) -> None:
    chunk.connection.execute(
        sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in chunk.keys]
    )


def _ledger(engine: sa.Engine) -> list[Any]:
    """The committed intervals (``hi``, ``done``, ``epoch``), in order of their opening."""
    with engine.connect() as c:
        q = "SELECT hi, done, epoch FROM keyset_ledger WHERE seg > 0 ORDER BY seg"
        return list(c.execute(sa.text(q)))


class StealAfter:
    """Writes each chunk; while processing the chunk starting at ``at``, another owner of the
    same lineage "takes" the range in Redis (its owner field changes), so this try's Redis
    advance is refused after the target committed: the crash between the two commits."""

    def __init__(self, client: redis.Redis, t: KeysetTraversal, rnd: Any, at: int) -> None:
        self.client, self.key, self.at = client, t.store.range_key(rnd.round_id, 0), at
        self.deliveries: Counter = Counter()

    def __call__(self, chunk: Any) -> None:
        _write(chunk)
        self.deliveries[chunk.keys[0]] += 1
        if chunk.keys[0] == self.at and self.deliveries[self.at] == 1:
            self.client.hset(self.key, "owner", "lineage-a#taken-over")


def check_raising_calls(t: KeysetTraversal, target: sa.Engine) -> None:
    """Over keys 1..60 in chunks of 10, a processor that writes every chunk, then raises for
    the poison key 37 and once (the sink went away after the insert) for the chunk starting at
    11: every key but 37 is written exactly once, 37 is dead-lettered. Closes ``t``."""
    outages: Counter = Counter()

    def proc(chunk: Any) -> None:
        _write(chunk)
        if 37 in chunk.keys:
            raise ValueError("poison row")
        if chunk.keys[0] == 11 and outages[11] == 0:
            outages[11] += 1
            raise RetryableError("the sink went away after the insert")

    rnd = t.plan(max_ranges=1, new_stream=True)
    res = t.traverse(
        rnd.round_id, 0, proc, chunk_size=10, exactly_once=True, backoff_base=0.01,
        item_retry_delay=0.01,
    )  # fmt: skip
    assert res.complete and res.dead == 1 and res.done == 59
    assert _effects(target) == Counter(k for k in range(1, 61) if k != 37)
    t.close()


@pytest.mark.parametrize("mode", [True, False], ids=["exactly_once", "control"])
def test_a_chunk_committed_but_not_advanced_is_not_delivered_again(
    mode, pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    _prepare(pg_engine, pg_engine, 500)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = StealAfter(redis_client, t, rnd, at=201)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=mode)
    with pytest.raises(LeaseLostError):
        t.traverse(rnd.round_id, 0, proc, **kw)
    res = t.traverse(rnd.round_id, 0, proc, **kw)  # the next try of the same lineage
    assert res.complete and res.done == 500
    effects = _effects(pg_engine)
    if mode:
        assert effects == Counter(range(1, 501)) and proc.deliveries[201] == 1
        assert _ledger(pg_engine)[0][:2] == (encode_key((500,)), 500)
    else:  # at-least-once: the chunk that committed without its advance is written again
        assert proc.deliveries[201] == 2
        assert {k for k, n in effects.items() if n == 2} == set(range(201, 301))
    t.close()


@pytest.mark.parametrize("mode", [True, False], ids=["exactly_once", "control"])
def test_a_stale_owners_transaction_is_rolled_back(
    mode, pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Owner A is in the middle of chunk (200, 300] when B (a new try of the lineage) takes the
    range over and runs it to the end. A's processor then returns: its transaction finds the
    ledger's epoch raised by B and rolls back (``LeaseLostError``)."""
    _prepare(pg_engine, pg_engine, 500)
    a = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    b = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    run_stale_owner(a, b, mode)
    effects = _effects(pg_engine)
    if mode:
        assert effects == Counter(range(1, 501))
    else:
        assert {k for k, n in effects.items() if n == 2} == set(range(201, 301))
    a.close()
    b.close()


def test_group_commit_spans_one_transaction(
    pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """With group commit the transaction spans the group: a lost advance of a group of three
    chunks delivers none of them again."""
    _prepare(pg_engine, pg_engine, 900)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    check_group_commit(t, pg_engine, redis_client)


def run_stale_owner(a: KeysetTraversal, b: KeysetTraversal, mode: bool) -> None:
    """A writes chunk (200, 300]; before A's processor returns, B (a new try of the lineage)
    takes the range over and runs it to the end; A then fails with ``LeaseLostError`` (with
    the mode: its ledger step found the row moved on)."""
    rnd = a.plan(max_ranges=1, new_stream=True)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=mode)
    results = []

    def owner_a(chunk: Any) -> None:
        _write(chunk)
        if chunk.keys[0] == 201 and not results:
            results.append(b.traverse(rnd.round_id, 0, _write, **kw))  # B takes over

    with pytest.raises(LeaseLostError, match="ledger moved on" if mode else None):
        a.traverse(rnd.round_id, 0, owner_a, **kw)
    assert results[0].complete


def check_group_commit(t: KeysetTraversal, target: sa.Engine, client: redis.Redis) -> None:
    """Over 900 keys in chunks of 100, groups of 3: the advance of the group (300, 600] is lost
    after its commit; the next try delivers none of it again. Closes ``t``."""
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = StealAfter(client, t, rnd, at=401)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=True, group_commit_chunks=3)
    with pytest.raises(LeaseLostError):
        t.traverse(rnd.round_id, 0, proc, **kw)
    with target.connect() as c:  # the group (300, 600] committed with the ledger
        assert c.execute(sa.text("SELECT count(*) FROM effects")).scalar() == 600
    res = t.traverse(rnd.round_id, 0, proc, **kw)
    assert res.complete and res.done == 900
    assert _effects(target) == Counter(range(1, 901))
    assert sum(proc.deliveries.values()) == 9
    t.close()


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_a_raising_call_and_a_canary_leave_nothing(
    db, pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path
):
    """A call that writes then raises is rolled back to its SAVEPOINT; isolation's canary (a key
    processed before, delivered alone again) is rolled back whatever it returns; the poison key
    (it fails alone, then in every retry pass) writes nothing; every other key exactly once. On
    SQLite the canary runs in a SAVEPOINT of the open transaction (another connection would
    wait for its write lock)."""
    target_url = pg_schema_url if db == "postgresql" else f"sqlite:///{tmp_path / 'target.db'}"
    target = pg_engine if db == "postgresql" else sa.create_engine(target_url)
    _prepare(pg_engine, target, 60)
    check_raising_calls(
        traversal(pg_schema_url, redis_url, key_prefix, target_url=target_url), target
    )
    if target is not pg_engine:
        target.dispose()


def test_a_sqlite_target(pg_engine, pg_schema_url, redis_url, redis_client, key_prefix, tmp_path):
    target_url = f"sqlite:///{tmp_path / 'target.db'}"
    target = sa.create_engine(target_url)
    _prepare(pg_engine, target, 500)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=target_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    proc = StealAfter(redis_client, t, rnd, at=201)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=True)
    with pytest.raises(LeaseLostError):
        t.traverse(rnd.round_id, 0, proc, **kw)
    res = t.traverse(rnd.round_id, 0, proc, **kw)
    assert res.complete and res.done == 500
    assert _effects(target) == Counter(range(1, 501)) and proc.deliveries[201] == 1
    t.close()
    target.dispose()


def test_the_mode_needs_a_target(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, [1, 2, 3])
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    with pytest.raises(ConfigurationError, match="needs a target database"):
        t.traverse(rnd.round_id, 0, _write, exactly_once=True)
    with pytest.raises(ConfigurationError, match="exactly_once must be True or False"):
        t.traverse(rnd.round_id, 0, _write, exactly_once="yes")
    t.close()


def test_a_round_restored_from_the_mirror_resumes_at_the_ledger(
    pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Redis loses the stream; the round comes back from the checkpoint mirror, behind the last
    commit and with claim epochs counted again from there. The ledger's own epoch (bumped by
    every claim) still admits the new owner, which moves the cursor forward to the ledger."""
    _prepare(pg_engine, pg_engine, 500)
    t = traversal(
        pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url,
        checkpoint_url=pg_schema_url, checkpoint_seconds=3600,
    )  # fmt: skip
    rnd = t.plan(max_ranges=1, new_stream=True)

    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=True)
    for at in (201, 301):  # two owners, each losing its last advance
        with pytest.raises(LeaseLostError):
            t.traverse(rnd.round_id, 0, StealAfter(redis_client, t, rnd, at), **kw)
    assert _ledger(pg_engine)[0] == (encode_key((400,)), 400, 2)
    for k in list(redis_client.scan_iter(match=f"{key_prefix}:*")):
        redis_client.delete(k)
    res = t.traverse(rnd.round_id, 0, _write, **kw)  # restored at a claim epoch below 2
    assert res.complete and res.done == 500
    assert _effects(pg_engine) == Counter(range(1, 501))
    t.close()


def test_a_failing_ledger_step_at_the_claim_releases_the_lease(
    pg_engine, pg_schema_url, redis_url, key_prefix, tmp_path
):
    """The target is unreachable when the claim bumps the ledger's epoch: the try fails with
    the database's error and gives its lease back, so the next try claims at once (instead of
    waiting out a 10-minute lease); nothing was read."""
    make_events(pg_engine, list(range(1, 21)))
    unreachable = f"sqlite:///{tmp_path / 'no-such-dir' / 'target.db'}"
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=unreachable)
    rnd = t.plan(max_ranges=1, new_stream=True)
    with pytest.raises(sa.exc.OperationalError):
        t.traverse(rnd.round_id, 0, _write, exactly_once=True, lease_seconds=600)
    status = t.range_status(rnd.round_id)[0]
    assert status["lease_left_s"] == 0 and status["done"] == 0
    t.close()


def test_a_round_id_handed_out_again_does_not_inherit_the_old_rounds_ledger(
    pg_engine, pg_schema_url, redis_url, redis_client, key_prefix
):
    """Found by the one-world model (long mode, seed 7: MariaDB target, ``exactly_once``, no
    mirror, failovers to a lagging replica and Redis losses: round r1 closed without 47 of its
    keys). Round r1 commits keys 1-300 and is lost with Redis (no mirror); the stream is declared
    new, and the new round gets the id r1 again. The ledger is keyed by the round: the old code
    took the old r1's committed intervals for the new one's and skipped keys 1-300 without
    delivering them (counted done). A round's ledger now belongs to the round planned at its
    ``created_ms``; a round of the same id planned later starts with an empty one."""
    _prepare(pg_engine, pg_engine, 500)
    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    rnd = t.plan(max_ranges=1, new_stream=True)
    kw = dict(chunk_size=100, owner_lineage="lineage-a", exactly_once=True)

    def stops_at_301(chunk: Any) -> None:
        if chunk.keys[0] == 301:
            raise KeyboardInterrupt  # the task dies here: keys 1-300 committed
        _write(chunk)

    with pytest.raises(KeyboardInterrupt):
        t.traverse(rnd.round_id, 0, stops_at_301, **kw)
    t.store.delete_stream()  # Redis lost the stream; no mirror
    again = t.plan(max_ranges=1, new_stream=True)
    assert again.round_id == rnd.round_id and again.created
    res = t.traverse(again.round_id, 0, _write, **kw)
    assert res.complete and res.done == 500
    assert _effects(pg_engine) == Counter({k: 2 if k <= 300 else 1 for k in range(1, 501)})
    t.close()
