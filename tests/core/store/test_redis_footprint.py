"""Redis stays small: a round of 4,096 ranges takes at most 1 MB at every stage (issue #11).

A range hash leaves out the fields at their default and a complete range drops its owner's
fields when released (``core/store/layout.py``); ``retries`` and ``dead`` stay
in every hash, so partial loss is still detected. Hashes written by the older layout (every
field) keep working. Sizes are the server's own ``MEMORY USAGE <key> SAMPLES 0`` summed over every
key of the stream (a size, never a duration).
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from airflow_keyset_provider.core import RoundStateLostError, StreamControl
from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, Closed, CursorStore

N_RANGES = 4096
BUDGET = 1_000_000
ROWS = 10_000  # per range: keys up to ~41M, encoded like a real bigint key of that size
LEASE = 60_000
STREAM = "events-nightly"
LEGACY_DEFAULTS = {  # what a range hash held at creation before issue #11
    "owner": "",
    "lineage": "",
    "epoch": 0,
    "lease_until": 0,
    "heartbeat_ms": 0,
    "done": 0,
    "skipped": 0,
    "takeovers": 0,
    "chunks": 0,
}


def _k(i: int) -> str:
    return MIN_KEY if i == 0 else encode_key((i * ROWS,))


def _plan(store: CursorStore, n: int) -> str:
    bounds = [(_k(i), _k(i + 1)) for i in range(n)]
    rid, created = store.create_round(
        idempotency_key=f"keyset_nightly/scheduled__2026-12-01T00:00:00+00:00/plan/{uuid.uuid4()}",
        chained=True,
        start=bounds[0][0],
        end=bounds[-1][1],
        source='{"table": "public.events", "key": ["id"]}',
        arity=1,
        bounds=bounds,
    )
    assert created
    return rid


def _token(i: int) -> tuple[str, str]:
    """An Airflow-shaped lineage and owner token (as ``run_range`` builds them)."""
    lineage = f"keyset_nightly/scheduled__2026-12-01T00:00:00+00:00/traverse/{i}"
    return f"{lineage}#{uuid.uuid4().hex[:12]}", lineage


def _claim(store: CursorStore, rid: str, i: int) -> tuple[str, Claim]:
    token, lineage = _token(i)
    claim = store.claim(rid, i, token, lineage, LEASE)
    assert isinstance(claim, Claim) and not claim.complete
    return token, claim


def _advance(store: CursorStore, rid: str, i: int, token: str, frm: str, to: int) -> None:
    store.advance(
        rid, i, token, frm, encode_key((to,)), done=ROWS // 2, skipped=0, lease_ms=LEASE,
        max_item_attempts=3,
    )  # fmt: skip


def _run(store: CursorStore, rid: str, i: int) -> None:
    """Claim, two chunks to hi, release: what ``run_range`` does to a range."""
    token, claim = _claim(store, rid, i)
    _advance(store, rid, i, token, claim.cursor, i * ROWS + ROWS // 2)
    _advance(store, rid, i, token, encode_key((i * ROWS + ROWS // 2,)), (i + 1) * ROWS)
    assert store.release(rid, i, token)


def _bytes(client: redis.Redis, prefix: str) -> int:
    keys = list(client.scan_iter(match=f"{prefix}:{{{STREAM}}}:*", count=1000))
    return sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)


def test_a_4096_range_round_stays_under_1_mb_at_every_stage(redis_client, key_prefix):
    """Scenario: a 4,096-range round is planned, half of it traversed while 16 tasks hold a
    range each, then completed and closed; the stream's keys never take more than 1 MB."""
    store = CursorStore(redis_client, STREAM, prefix=key_prefix)
    rid = _plan(store, N_RANGES)
    sizes = {"planned": _bytes(redis_client, key_prefix)}

    for i in range(N_RANGES // 2):
        _run(store, rid, i)
    held = {}
    for i in range(N_RANGES // 2, N_RANGES // 2 + 16):  # 16 tasks hold a range mid-way
        token, claim = _claim(store, rid, i)
        _advance(store, rid, i, token, claim.cursor, i * ROWS + ROWS // 2)
        held[i] = token
    sizes["running"] = _bytes(redis_client, key_prefix)

    for i, token in held.items():
        _advance(store, rid, i, token, encode_key((i * ROWS + ROWS // 2,)), (i + 1) * ROWS)
        assert store.release(rid, i, token)
    for i in range(N_RANGES // 2 + 16, N_RANGES):
        _run(store, rid, i)
    sizes["complete"] = _bytes(redis_client, key_prefix)
    res = store.close_round(rid)
    sizes["closed"] = _bytes(redis_client, key_prefix)

    assert isinstance(res, Closed) and res.done == N_RANGES * ROWS
    over = {stage: b for stage, b in sizes.items() if b > BUDGET}
    assert not over, f"Redis bytes of a {N_RANGES}-range round: {sizes} (budget {BUDGET:,})"


def _legacy(client: redis.Redis, store: CursorStore, rid: str, n: int) -> None:
    """Rewrite the round's range hashes as the older layout wrote them (every field)."""
    for i in range(n):
        client.hset(store.range_key(rid, i), mapping=LEGACY_DEFAULTS)


@pytest.mark.parametrize("layout", ["compact", "legacy"])
def test_reads_and_writes_agree_on_both_layouts(redis_client, key_prefix, layout):
    """Scenario: the same round of 3 ranges, written compactly or with every field (a round
    planned by the older version), is claimed, advanced, released, read and closed: the same
    answers, and a range's ``retries``/``dead`` still guard against a lost retry hash."""
    store = CursorStore(redis_client, STREAM, prefix=key_prefix)
    rid = _plan(store, 3)
    if layout == "legacy":
        _legacy(redis_client, store, rid, 3)
    ctl = StreamControl(store)
    before = ctl.round_status(rid).ranges[1]
    assert (before.cursor_encoded, before.owner, before.done, str(before.state)) == (
        _k(1), "", 0, "pending",
    )  # fmt: skip
    token, claim = _claim(store, rid, 1)
    assert (claim.cursor, claim.epoch, claim.done) == (_k(1), 1, 0)
    # an item fails once: it waits in the retry hash, counted by the range's ``retries``
    store.advance(
        rid, 1, token, _k(1), _k(2), done=ROWS - 1, skipped=0, lease_ms=LEASE,
        max_item_attempts=3, failed=[(encode_key((ROWS + 5,)), "boom")],
    )  # fmt: skip
    running = ctl.round_status(rid).ranges[1]
    assert (running.owner, running.retries, running.cursor_encoded) == (token, 1, _k(2))
    redis_client.delete(store.retry_key(rid, 1))  # the retry hash is lost on its own
    with pytest.raises(RoundStateLostError):
        store.ranges(rid)
    redis_client.hset(store.retry_key(rid, 1), encode_key((ROWS + 5,)), "1|boom")
    store.advance(
        rid, 1, token, _k(2), _k(2), done=0, skipped=0, lease_ms=LEASE, max_item_attempts=3,
        resolved=[(encode_key((ROWS + 5,)), "d")],
    )  # fmt: skip
    assert store.release(rid, 1, token)
    for i in (0, 2):
        _run(store, rid, i)
    after = {r.range_id: r for r in ctl.round_status(rid).ranges}
    assert all(r.complete and r.cursor_encoded == r.hi_encoded for r in after.values())
    assert (after[1].done, after[1].owner, after[1].retries) == (ROWS, "", 0)
    assert store.range(rid, 1)["cursor"] == _k(2)
    assert [b.cursor for b in store.range_briefs(rid)] == [_k(1), _k(2), _k(3)]
    assert not store.release(rid, 1, token), "the old token no longer owns a complete range"
    assert ctl.check_round(rid).complete
    assert ctl.close_round(rid).done == 3 * ROWS


def test_a_released_complete_range_keeps_only_what_the_close_and_status_read(
    redis_client, key_prefix
):
    """Scenario: a range completes and is released: its hash keeps lo, hi, state, counters,
    retries, dead and the completion time, nothing of its owner. A dead letter replayed from it
    reopens the range at hi (its cursor), never at lo."""
    store = CursorStore(redis_client, STREAM, prefix=key_prefix)
    rid = _plan(store, 2)
    token, claim = _claim(store, rid, 1)
    store.advance(
        rid, 1, token, claim.cursor, _k(2), done=ROWS - 1, skipped=0, lease_ms=LEASE,
        max_item_attempts=1, failed=[(encode_key((ROWS + 5,)), "boom")],
    )  # fmt: skip
    assert store.release(rid, 1, token)
    raw: dict[Any, Any] = redis_client.hgetall(store.range_key(rid, 1))
    assert {k.decode() for k in raw} == {
        "lo", "hi", "state", "done", "dead", "retries", "chunks", "completed_ms",
    }  # fmt: skip

    assert store.requeue_dead(rid, 1, 10) == 1
    rng = store.range(rid, 1)
    assert (rng["state"], rng["cursor"], rng["retries"]) == ("pending", _k(2), "1")
    token, claim = _claim(store, rid, 1)
    assert claim.cursor == _k(2) and claim.retries == 1


def test_an_owner_that_never_released_a_complete_range_is_dropped_by_the_next_claim(
    redis_client, key_prefix
):
    """Scenario: a try completes its range and dies before releasing it; the next try of the
    same lineage finds the range complete, and its claim drops the dead try's fields."""
    store = CursorStore(redis_client, STREAM, prefix=key_prefix)
    rid = _plan(store, 2)
    token, claim = _claim(store, rid, 1)
    _advance(store, rid, 1, token, claim.cursor, 2 * ROWS)
    assert redis_client.hget(store.range_key(rid, 1), "owner") == token.encode()
    again = store.claim(rid, 1, f"{token}-2", token.partition("#")[0], LEASE)
    assert isinstance(again, Claim) and again.complete and again.cursor == _k(2)
    assert redis_client.hget(store.range_key(rid, 1), "owner") is None
    assert store.range(rid, 1)["owner"] == ""
