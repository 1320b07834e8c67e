"""Verification (``core/rounds/verification.py``) on real PostgreSQL and MariaDB: a round whose
processor did its job verifies; rows changed back behind the traversal's back fail it, with the
count and the first keys; one repair pass through the processor fixes them and verifies."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.core.errors import ConfigurationError
from airflow_keyset_provider.core.rounds.verification import VerifyState

N = 300
VERIFY = "status = 'open'"


@pytest.fixture(params=["postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "postgresql":
        yield request.getfixturevalue("pg_schema_url")
    else:
        yield request.getfixturevalue("mariadb_db_url")


def make_orders(url: str, n: int = N) -> None:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE orders (id bigint NOT NULL PRIMARY KEY, status varchar(16) NOT NULL,"
                " kind varchar(8) NOT NULL)"
            )
        )
        c.execute(
            sa.text("INSERT INTO orders VALUES (:i, 'open', :k)"),
            [{"i": i, "k": "a" if i % 2 else "b"} for i in range(1, n + 1)],
        )
    engine.dispose()


def reopen(url: str, keys: list[int]) -> None:
    """Another writer puts rows back into the predicate (behind the traversal's back)."""
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(
            sa.text("UPDATE orders SET status = 'open' WHERE id IN :ids").bindparams(
                sa.bindparam("ids", expanding=True)
            ),
            {"ids": keys},
        )
    engine.dispose()


class Cancel:
    """The processor: cancel the chunk's orders through ``chunk.connection``; ``on_key``: when
    the chunk holding that key is processed, reopen ``reopen_keys`` (already processed)."""

    def __init__(self, url: str, on_key: int | None = None, reopen_keys: list[int] | None = None):
        self.url, self.on_key, self.reopen_keys = url, on_key, reopen_keys or []
        self.delivered: list[int] = []

    def __call__(self, chunk: Any) -> None:
        keys = list(chunk.keys)
        self.delivered.extend(keys)
        if self.on_key is not None and self.on_key in keys:
            # before this chunk's own UPDATE: on MariaDB it may lock every row it scans
            reopen(self.url, self.reopen_keys)
        chunk.connection.execute(
            sa.text("UPDATE orders SET status = 'cancelled' WHERE id IN :ids").bindparams(
                sa.bindparam("ids", expanding=True)
            ),
            {"ids": keys},
        )


def _traversal(url: str, redis_url: str, key_prefix: str, **kw: Any) -> KeysetTraversal:
    return KeysetTraversal(
        url,
        "orders",
        "id",
        redis_url=redis_url,
        stream="orders-cancel",
        key_prefix=key_prefix,
        target_url=url,
        **kw,
    )


def _plan_and_traverse(t: KeysetTraversal, proc: Any, **plan: Any) -> str:
    rnd = t.plan(3, new_stream=True, **plan)
    for r in rnd.ranges:
        res = t.traverse(rnd.round_id, r.range_id, proc, chunk_size=50)
        assert res.complete
    return rnd.round_id


def test_a_round_whose_processor_did_its_job_verifies(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    make_orders(db_url)
    t = _traversal(db_url, redis_url, key_prefix)
    try:
        round_id = _plan_and_traverse(t, Cancel(db_url), verify=VERIFY)
        assert t.control.round_status(round_id).verification_dict == {"state": "pending"}
        v = t.verify_round(round_id, VERIFY, chunk_size=64)
        assert v.state == VerifyState.VERIFIED and v.matching == 0 and v.repaired is None
        assert v.rows_scanned == N  # every row of (start, end] read once
        status = t.control.round_status(round_id)
        assert status.verification_dict is not None
        assert status.verification_dict["state"] == "verified"
        assert t.close_round(round_id).done == N
    finally:
        t.close()


def test_rows_changed_back_fail_verification_then_one_repair_pass_fixes_them(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    make_orders(db_url)
    # when the last chunk is processed, rows 7, 120 and 121 (processed long before) match again
    changed = [7, 120, 121]
    t = _traversal(db_url, redis_url, key_prefix)
    try:
        proc = Cancel(db_url, on_key=N, reopen_keys=changed)
        round_id = _plan_and_traverse(t, proc, verify=VERIFY)
        assert t.control.check_round(round_id).complete  # coverage alone says "done"

        failed = t.verify_round(round_id, VERIFY, max_keys=2, chunk_size=64)
        assert failed.state == VerifyState.FAILED
        assert failed.matching == 3
        assert failed.key_labels == ["7", "120"]  # the first max_keys, in key order
        assert "3 row(s) still match (first keys: 7, 120, ...)" in failed.describe()
        recorded = t.control.round_status(round_id).verification_dict
        assert recorded is not None and recorded["state"] == "failed"
        assert recorded["first_keys"] == ["7", "120"]

        repairer = Cancel(db_url)
        fixed = t.verify_round(
            round_id, VERIFY, on_failure="repair", processor=repairer, chunk_size=64
        )
        assert sorted(repairer.delivered) == changed  # only the rows that still matched
        assert fixed.state == VerifyState.VERIFIED and fixed.repaired == 3
        assert fixed.matching == 0
        # the repair pass moves no counter: the round's totals are its traversal's
        assert t.close_round(round_id).done == N
    finally:
        t.close()


def test_repair_that_does_not_fix_the_rows_still_fails_with_the_list(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    make_orders(db_url)
    t = _traversal(db_url, redis_url, key_prefix)
    try:
        round_id = _plan_and_traverse(t, Cancel(db_url, on_key=N, reopen_keys=[5]), verify=VERIFY)
        res = t.verify_round(round_id, VERIFY, on_failure="repair", processor=lambda chunk: None)
        assert res.state == VerifyState.FAILED and res.repaired == 1
        assert res.matching == 1 and res.key_labels == ["5"]
    finally:
        t.close()


def test_verification_honours_where_and_refuses_another_predicate(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    make_orders(db_url)
    t = _traversal(db_url, redis_url, key_prefix, where="kind = 'a'")
    try:
        # only kind 'a' (odd ids) is the round's; the even ids stay open and are not its business
        round_id = _plan_and_traverse(t, Cancel(db_url), verify=VERIFY)
        v = t.verify_round(round_id, VERIFY)
        assert v.verified and v.rows_scanned == N // 2
        with pytest.raises(ConfigurationError, match="another verify predicate"):
            t.verify_round(round_id, "status <> 'cancelled'")
    finally:
        t.close()


def test_verify_refuses_a_round_with_incomplete_ranges(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    make_orders(db_url, 10)
    t = _traversal(db_url, redis_url, key_prefix)
    try:
        rnd = t.plan(1, new_stream=True, verify=VERIFY)
        with pytest.raises(ConfigurationError, match="not complete"):
            t.verify_round(rnd.round_id, VERIFY)
    finally:
        t.close()


def test_a_composite_key_round_verifies_and_lists_its_keys(
    db_url: str, redis_url: str, key_prefix: str
) -> None:
    """A composite key (no max() of a row value: the chunk's last row with window aggregates):
    chunks cut inside a tenant, the first keys in key order."""
    engine = sa.create_engine(db_url, poolclass=NullPool)
    with engine.begin() as c:
        c.execute(
            sa.text(
                "CREATE TABLE items (tenant int NOT NULL, n int NOT NULL, "
                "status varchar(16) NOT NULL, PRIMARY KEY (tenant, n))"
            )
        )
        c.execute(
            sa.text("INSERT INTO items VALUES (:t, :n, :s)"),
            [
                {"t": t, "n": n, "s": "open" if (t, n) in {(1, 30), (2, 7), (3, 39)} else "done"}
                for t in range(1, 4)
                for n in range(1, 41)
            ],
        )
    engine.dispose()
    t = KeysetTraversal(
        db_url, "items", ["tenant", "n"], redis_url=redis_url, stream="items", key_prefix=key_prefix
    )
    try:
        rnd = t.plan(2, new_stream=True, verify=VERIFY)
        for r in rnd.ranges:
            t.traverse(rnd.round_id, r.range_id, lambda chunk: None, chunk_size=25)
        v = t.verify_round(rnd.round_id, VERIFY, max_keys=2, chunk_size=17)
        assert (v.state, v.matching, v.rows_scanned) == (VerifyState.FAILED, 3, 120)
        assert v.key_labels == ["(1, 30)", "(2, 7)"]
    finally:
        t.close()


def test_the_scan_is_paced_by_the_stream_governor_and_held_while_paused(
    pg_schema_url: str, redis_url: str, key_prefix: str, redis_client: Any
) -> None:
    """A throttled stream's verification charges the stream's token bucket (the governor); a
    paused stream holds the scan until it is resumed."""
    make_orders(pg_schema_url)
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    try:
        round_id = _plan_and_traverse(t, Cancel(pg_schema_url), verify=VERIFY)
        t.store.reset_bucket()
        t.throttle(1_000_000)
        assert t.verify_round(round_id, VERIFY, chunk_size=64).verified
        assert redis_client.exists(t.store.bucket_key)  # the scan's rows were charged
        t.throttle(None)

        t.pause("maintenance", "test")
        done: list[Any] = []
        worker = threading.Thread(target=lambda: done.append(t.verify_round(round_id, VERIFY)))
        worker.start()
        worker.join(3)
        assert worker.is_alive() and not done  # held while paused
        t.resume()
        worker.join(60)
        assert done and done[0].verified
    finally:
        t.close()


def test_a_predicate_redis_holds_is_compared_never_run(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """Redis is not a source of SQL: a round whose recorded predicate was changed in Redis (here
    to SQL that would fail if it ran) is refused before any statement reads the source."""
    make_orders(pg_schema_url, 10)
    t = _traversal(pg_schema_url, redis_url, key_prefix)
    try:
        round_id = _plan_and_traverse(t, Cancel(pg_schema_url), verify=VERIFY)
        t.store.set_round_field(round_id, "verify", "1/0 = 1")
        with pytest.raises(ConfigurationError, match="another verify predicate"):
            t.verify_round(round_id, VERIFY)
        assert t.control.round_status(round_id).verification is None  # nothing ran or recorded
    finally:
        t.close()
