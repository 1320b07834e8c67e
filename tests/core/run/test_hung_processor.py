"""A hung processor (issue #10, item 9): the lease follows progress, not the process.

Rule under test (docs/contract.md, "A hung processor"): a processor call that runs longer than
``chunk_timeout`` (default: ten leases) stops the heartbeat, so the lease lapses ``lease_seconds``
later and another try takes the range over; the stuck try is fenced and, if its call ever returns,
fails with ``LeaseLostError`` naming the chunk's keys, how long it ran and ``chunk_timeout``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from core_support import Recorder, make_events, traversal

from airflow_keyset_provider.core import Chunk, LeaseLostError

TROUBLE = Path(__file__).resolve().parents[3] / "docs" / "troubleshooting.md"


def test_a_hung_processor_loses_its_range_to_another_try(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Try A (lineage a) blocks on an Event in its chunk (40, 60] with lease_seconds=1 and the
    default chunk_timeout (ten leases: 10 s). Before: A's heartbeat thread kept renewing the lease
    for ever, so try B (lineage b) waited out its claim_timeout and failed with LeaseHeldError.
    Now A's heartbeat stops after 10 s, B takes the range over once the lease lapsed and completes
    it. Released afterwards, A fails with LeaseLostError naming keys 41 .. 60, how long it ran and
    chunk_timeout. No key is lost and only A's stuck chunk is delivered twice."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    seen: Counter[Any] = Counter()
    stuck, release = threading.Event(), threading.Event()

    def hangs(chunk: Chunk) -> None:
        seen.update(chunk.keys)
        if chunk.keys[0] == 41:
            stuck.set()
            release.wait(120)

    outcome: dict[str, Any] = {}

    def run_a() -> None:
        try:
            outcome["a"] = t.traverse(
                rnd.round_id,
                0,
                hangs,
                chunk_size=20,
                lease_seconds=1,
                owner_lineage="a",
                prefetch=False,
            )
        except Exception as exc:
            outcome["a"] = exc

    worker = threading.Thread(target=run_a)
    worker.start()
    try:
        assert stuck.wait(30)
        b = Recorder()
        other = traversal(pg_schema_url, redis_url, key_prefix)
        res = other.traverse(
            rnd.round_id, 0, b, chunk_size=20, lease_seconds=1, owner_lineage="b", claim_timeout=30
        )
        other.close()
        assert res.complete and res.takeover and res.done == 100
    finally:
        release.set()
        worker.join(60)
    err = outcome["a"]
    assert isinstance(err, LeaseLostError), err
    msg = str(err)
    assert "the chunk of keys 41 .. 60 (20 keys), past chunk_timeout=10 s" in msg, msg
    for phrase in (  # the message troubleshooting.md quotes
        "the processor ran ",
        ", past chunk_timeout=",
        " s. Heartbeats stopped at chunk_timeout so the lease could lapse and another try take the "
        "range over; this try is fenced and nothing of the chunk was committed. If chunks "
        "legitimately take this long, raise chunk_timeout (or lower chunk_size); otherwise find "
        "where the processor hangs (a lock wait, a call without a timeout).",
    ):
        assert phrase in msg and phrase in TROUBLE.read_text(), phrase
    delivered = seen + b.seen
    assert set(delivered) == set(range(1, 101))  # no key lost
    assert {k for k, n in delivered.items() if n > 1} <= set(range(41, 61))  # replay <= 1 chunk
    assert t.close_round(rnd.round_id).done == 100
    t.close()


def test_a_slow_chunk_within_chunk_timeout_keeps_its_range(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A chunk that takes three leases but less than chunk_timeout keeps being heartbeaten: the
    range completes in one try, nothing is replayed. The chunk lasts until Redis shows the lease
    renewed three leases past where it stood when the chunk started (an event, not a sleep)."""
    make_events(pg_engine, list(range(1, 41)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=40)
    rec = Recorder()
    renewed: list[int] = []

    def lease_until() -> int:
        return int(t.store.range(rnd.round_id, 0)["lease_until"])

    def slow(chunk: Chunk) -> None:
        rec(chunk)
        if chunk.keys[0] == 21:
            first = lease_until()
            limit = time.monotonic() + 60  # a heartbeat that stopped fails the test, not hangs
            while lease_until() < first + 3 * 2000 and time.monotonic() < limit:
                time.sleep(0.05)
            renewed.append(lease_until() - first)

    res = t.traverse(rnd.round_id, 0, slow, chunk_size=20, lease_seconds=2, chunk_timeout=30)
    assert renewed and renewed[0] >= 3 * 2000, renewed
    assert res.complete and res.done == 40 and max(rec.seen.values()) == 1
    t.close()


@pytest.mark.parametrize("value", [0, -1.0])
def test_chunk_timeout_must_be_positive(
    value: float, pg_engine, pg_schema_url, redis_url, key_prefix
):
    from airflow_keyset_provider.core import ConfigurationError

    make_events(pg_engine, [1])
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    with pytest.raises(ConfigurationError, match="chunk_timeout must be a positive number"):
        t.traverse(rnd.round_id, 0, lambda chunk: None, chunk_timeout=value)
    t.close()
