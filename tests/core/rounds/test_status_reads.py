"""Status reads of a round of thousands of ranges stay small per Redis call (issue #11).

The CLI, the UI page and the barrier read a round through ``StoreReads.ranges``: one script per
``READ_BATCH`` ranges, pipelined, so no single call holds Redis for the whole round. The only
call over every range is the close, run once, when the batched read saw every range complete.

The calls are read back from the server's own SLOWLOG on a throwaway ``redis-server`` logging
every command (``slowlog-log-slower-than 0``): the number of keys each EVALSHA touched, never a
duration.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from redis_servers import start_redis

from airflow_keyset_provider.core import StreamControl
from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, CursorStore
from airflow_keyset_provider.core.store.reads import READ_BATCH
from airflow_keyset_provider.plugins.status import round_view

N_RANGES = 1100  # > 4 batches, the last one partial


@pytest.fixture
def logged() -> Iterator[redis.Redis]:
    """A client of a throwaway server whose SLOWLOG records every command."""
    url, stop = start_redis("--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000")
    client = redis.Redis.from_url(url)
    yield client
    client.close()
    stop()


def _plan(store: CursorStore, n: int) -> str:
    bounds = [(encode_key((i * 10,)), encode_key((i * 10 + 10,))) for i in range(n)]
    rid, created = store.create_round(
        idempotency_key=None,
        chained=False,
        start=bounds[0][0],
        end=bounds[-1][1],
        source="test",
        arity=1,
        bounds=bounds,
    )
    assert created
    return rid


def _script_calls(client: redis.Redis) -> list[int]:
    """The number of keys of each EVALSHA/EVAL the server ran since the last reset, oldest first."""
    out = []
    for entry in reversed(client.slowlog_get(100_000)):
        words = entry["command"].split()
        if words and words[0].upper() in (b"EVALSHA", b"EVAL"):
            out.append(int(words[2]))
    return out


def _complete(store: CursorStore, rid: str, i: int) -> None:
    token = f"t-{uuid.uuid4().hex[:8]}"
    claim = store.claim(rid, i, token, "", 60_000)
    assert isinstance(claim, Claim)
    hi = encode_key((i * 10 + 10,))
    store.advance(
        rid, i, token, claim.cursor, hi, done=10, skipped=0, lease_ms=60_000, max_item_attempts=3
    )
    store.release(rid, i, token)


def test_status_reads_of_many_ranges_run_in_small_script_calls(logged):
    """Scenario: a round of 1,100 ranges is read by the CLI/UI (stream and round status) and by
    the barrier's check; no script call reads more than ``READ_BATCH`` ranges, and the reads
    still return every range, in id order, intact."""
    store = CursorStore(logged, "big")
    rid = _plan(store, N_RANGES)
    ctl = StreamControl(store)
    logged.slowlog_reset()

    snap = ctl.stream_status()
    rnd = ctl.round_status(rid)
    check = ctl.check_round(rid)

    assert [r.range_id for r in rnd.ranges] == list(range(N_RANGES))
    assert snap.rounds[0].n_ranges == N_RANGES and rnd.ranges_complete == 0
    assert not check.complete and len(check.lagging) == N_RANGES
    calls = _script_calls(logged)
    assert calls, "the ranges are read by scripts (each range atomic with its counts)"
    assert max(calls) <= 3 * READ_BATCH, f"a status read touched {max(calls)} keys in one call"
    # each reader read every range: three readers, ceil(1100 / READ_BATCH) calls each
    assert sum(calls) == 3 * 3 * N_RANGES


def test_the_barrier_closes_with_one_full_call_after_batched_checks(logged):
    """Scenario: every range of a 1,100-range round completes; the barrier's check (batched)
    sees it complete, then the close runs: the only script call over every range."""
    store = CursorStore(logged, "big")
    rid = _plan(store, N_RANGES)
    ctl = StreamControl(store)
    for i in range(N_RANGES):
        _complete(store, rid, i)
    logged.slowlog_reset()

    assert ctl.check_round(rid).complete
    batched = _script_calls(logged)
    totals = ctl.close_round(rid)

    assert totals.done == 10 * N_RANGES
    assert max(batched) <= 3 * READ_BATCH
    assert max(_script_calls(logged)[len(batched) :]) == 5 + 3 * N_RANGES  # the close itself


def test_a_reader_holding_an_old_range_count_still_reads_every_range(logged):
    """Scenario: a reader read ``n_ranges`` before ranges were added (a split appends them);
    the read re-reads the count after the ranges and reads the new ones too."""
    store = CursorStore(logged, "big")
    rid = _plan(store, 600)
    ranges = store.ranges(rid, 3)
    assert [int(r["range_id"]) for r in ranges] == list(range(600))


def test_status_lists_split_ranges_in_key_order(logged):
    """Scenario: range 0 of a 2-range round is split by its owner: the new range 2 sits between
    ranges 0 and 1 in key order. Status keeps ids (``ranges[i]`` is range i); the CLI table and
    the UI page list the ranges by ``lo``."""
    store = CursorStore(logged, "big")
    rid = _plan(store, 2)  # (0, 10], (10, 20]
    token = "owner-of-0"
    claim = store.claim(rid, 0, token, "", 60_000)
    assert isinstance(claim, Claim)
    assert store.split(rid, 0, token, encode_key((5,))) == 2
    rnd = StreamControl(store).round_status(rid)

    assert [r.range_id for r in rnd.ranges] == [0, 1, 2]
    assert [r.range_id for r in rnd.in_key_order] == [0, 2, 1]
    view = round_view(logged, "ks", "big", rid)
    assert [r["range_id"] for r in view["ranges"]] == [0, 2, 1]
