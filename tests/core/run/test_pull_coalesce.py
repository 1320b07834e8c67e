"""Pull mode with coalescing (``traverse_round(..., tasks=N)``, ``core/run/pull.py``) on real
PostgreSQL and Redis: every key exactly once with far fewer claims than ranges, the round closes
with exact totals, status and the CLI tell coalesced ranges apart, a round restored from the
checkpoint mirror after coalescing is still a partition; without ``tasks`` nothing coalesces.
Workers are threads, each with its own traversal, as separate processes would be."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import pytest
from core_support import traversal
from test_pull import Deliveries, RedisLoss, analyzed_events, pull_workers

from airflow_keyset_provider.cli import main as cli_main
from airflow_keyset_provider.core import RoundPullResult, TraverseOptions
from airflow_keyset_provider.core.errors import RoundStateLostError
from airflow_keyset_provider.core.run.pull import first_positions

STREAM = "events-nightly"  # core_support.traversal's stream


def coalescing_workers(
    url: str,
    redis_url: str,
    key_prefix: str,
    round_id: str,
    firsts: list[int],
    processor: Callable[[str, Any], None],
    tasks: int | None,
    split: bool = True,
    **options: Any,
) -> dict[str, RoundPullResult]:
    """One worker per first range, all pulling the round at once with ``tasks``; each result."""
    return pull_workers(
        url,
        redis_url,
        key_prefix,
        round_id,
        len(firsts),
        processor,
        firsts=firsts,
        tasks=tasks,
        split=split,
        **options,
    )


def cli(redis_url: str, key_prefix: str, *argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = cli_main(
        [*argv, "--redis-url", redis_url, "--key-prefix", key_prefix], stdout=out, stderr=err
    )
    assert code in (0, 3), err.getvalue()
    return out.getvalue()


def test_four_coalescing_tasks_deliver_every_key_once_with_far_fewer_claims_than_ranges(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """200 ranges, 4 tasks starting spread over the key order (``first_positions``), each
    coalescing its share: every key is delivered exactly once, the tasks claim far fewer ranges
    than the round has, status counts the coalesced ranges (the CLI says so), the round closes
    with exact totals, and a dead-letter replay finds nothing to do in the empties."""
    keys = [k for k in range(1, 20_001) if k % 7]
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=200, new_stream=True)
    assert len(rnd.ranges) == 200
    ordered = sorted(rnd.ranges, key=lambda r: r.lo_encoded)
    firsts = [ordered[i].range_id for i in first_positions(200, 4)]
    seen = Deliveries()
    results = coalescing_workers(
        pg_schema_url, redis_url, key_prefix, rnd.round_id, firsts, seen.record, 4, chunk_size=100
    )
    assert all(r.finished for r in results.values())
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    claims = sum(len(res.ranges) for res in results.values())
    info = t.store.round_info(rnd.round_id)
    assert claims <= 20, claims  # measured: 4 or 5 (a tail split at most)
    status = t.control.round_status(rnd.round_id)
    merged = status.ranges_merged
    assert merged >= 150 and merged == int(info["merged"])
    assert status.ranges_complete == status.n_ranges == int(info["n_ranges"])
    assert all(r.done == 0 and r.lo == r.hi for r in status.ranges if r.merged_into is not None)
    line = f"{status.n_ranges}/{status.n_ranges} ranges complete ({merged:,} coalesced)"
    assert line in cli(redis_url, key_prefix, "ranges", STREAM, rnd.round_id)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    before = t.control.round_status(rnd.round_id).ranges
    assert t.replay_dead_letters(rnd.round_id, lambda chunk: None) == []
    after = t.control.round_status(rnd.round_id).ranges
    assert [r.as_dict() for r in after] == [r.as_dict() for r in before]


def test_progress_ignores_coalesced_ranges(pg_engine, pg_schema_url, redis_url, key_prefix):
    """16 ranges, four hosts (the spread first ranges) each coalescing the three after it and not
    yet past their ``lo``: the round has read nothing, so its progress is 0.0 (not the 12 empty
    complete ranges' 0.75), and the CLI reports 12/16 complete, 12 coalesced."""
    analyzed_events(pg_engine, list(range(1, 1601)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=16, start_key=0, end_key=1600)
    assert [r.range_id for r in sorted(rnd.ranges, key=lambda r: r.lo_encoded)] == list(range(16))
    for i in first_positions(16, 4):
        assert t.store.claim(rnd.round_id, i, f"h{i}#1", f"h{i}", 60_000, coalesce=3).absorbed == 3
    status = t.control.round_status(rnd.round_id)
    assert (status.ranges_complete, status.ranges_merged) == (12, 12)
    assert status.progress == 0.0
    out = cli(redis_url, key_prefix, "ranges", STREAM, rnd.round_id)
    assert "12/16 ranges complete (12 coalesced), 0.0% of key space" in out


def test_without_tasks_nothing_coalesces_and_each_range_is_claimed_once(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """``tasks=None`` (the behaviour before coalescing): every one of the 40 ranges is run by
    exactly one claim of its own, no range is merged, every key is delivered exactly once."""
    keys = list(range(1, 4001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=40, start_key=0, end_key=4000)
    seen = Deliveries()
    results = coalescing_workers(
        pg_schema_url,
        redis_url,
        key_prefix,
        rnd.round_id,
        [0, 10, 20, 30],
        seen.record,
        None,
        split=False,  # no tail splits: the claims are exactly the planned ranges
        chunk_size=50,
    )
    assert all(r.finished for r in results.values())
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    ran = sorted(r.range_id for res in results.values() for r in res.ranges if r.rows_read)
    assert ran == list(range(40))
    info = t.store.round_info(rnd.round_id)
    assert "merged" not in info and not any(name.startswith("skip:") for name in info)
    status = t.control.round_status(rnd.round_id)
    assert status.ranges_merged == 0 and status.ranges_complete == status.n_ranges == 40
    assert t.close_round(rnd.round_id).done == len(keys)


def test_a_round_restored_from_the_mirror_after_coalescing_closes_with_exact_totals(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client, caplog
):
    """One task with ``tasks=2`` over 8 ranges: its first claim takes ranges 0..3 as one, the
    next 4..5. Redis then loses everything mid-range: the mirror recorded each coalescing (host
    with its new end and its empties, in one transaction), so the restored round is still a
    partition (its empties still marked as coalesced), the task goes on from the last checkpoint
    and the round closes with exact totals; at most the chunk in hand is delivered again."""
    keys = list(range(1, 801))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=8, start_key=0, end_key=800)
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=451)

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        redis_loss(chunk)  # Redis restarts without persistence

    caplog.set_level("WARNING", logger="airflow_keyset_provider")
    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10), tasks=2
    )
    assert redis_loss.done and res.finished
    assert "restored from the checkpoint mirror" in caplog.text
    status = t.control.round_status(rnd.round_id)
    hosts = {r.range_id: r.hi for r in status.ranges if r.lo != r.hi}
    # the restored empties still say what they were coalesced into (status, progress, the CLI)
    assert [r.merged_into for r in status.ranges] == [None, 0, 0, 0, None, 4, None, None]
    assert status.ranges_merged == 4
    assert sorted(hosts) == [0, 4, 6, 7] and hosts[0] == 400 and hosts[4] == 600
    assert set(seen.seen) == set(keys)
    assert max(seen.seen.values()) == 2 and seen.seen[451] == 2  # the chunk in hand, again
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


@pytest.mark.parametrize("mirrored", [True, False])
def test_an_absorbed_range_lost_alone_is_restored_empty_or_reads_as_lost(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client, mirrored
):
    """A task coalesced all 4 ranges into range 0 and finished it; then Redis loses range 2's
    hash alone. With a mirror, the close rewrites range 2 from it (empty, complete, still marked
    as coalesced) and closes with exact totals; without one, the close raises
    ``RoundStateLostError``: a lost range never reads as complete."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    kw = {"checkpoint_url": pg_schema_url} if mirrored else {}
    t = traversal(pg_schema_url, redis_url, key_prefix, **kw)
    rnd = t.plan(max_ranges=4, start_key=0, end_key=400)
    res = t.traverse_round(
        rnd.round_id, lambda chunk: None, options=TraverseOptions(chunk_size=50), tasks=1
    )
    assert res.finished and [r.range_id for r in res.ranges] == [0]
    redis_client.delete(t.store.range_key(rnd.round_id, 2))
    if not mirrored:
        with pytest.raises(RoundStateLostError):
            t.close_round(rnd.round_id)
        return
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    two = t.store.range(rnd.round_id, 2)
    assert (two["lo"], two["hi"], two["state"], two["done"], two["merged_into"]) == (
        t.source.encode([400]),
        t.source.encode([400]),
        "complete",
        "0",
        "0",
    )


def test_a_coalescing_the_mirror_missed_is_mirrored_by_the_hosts_next_checkpoint(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client, caplog
):
    """Double fault: the mirror is down (its table renamed away) when a claim coalesces ranges
    1..3 into range 0, and back for the range's checkpoints; then Redis loses everything. The
    restored round must still be a partition: the host's checkpoints may not reach the mirror
    without the coalescing they depend on (a host (0, 400] beside the fresh ranges 1..3 would
    overlap them: their keys delivered a second time and the round never closing)."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=4, start_key=0, end_key=400)
    with pg_engine.begin() as c:  # the mirror's outage
        c.exec_driver_sql("ALTER TABLE keyset_checkpoints RENAME TO keyset_checkpoints_away")
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=251)

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        if chunk.keys[0] == 1:  # the mirror is back
            with pg_engine.begin() as c:
                c.exec_driver_sql(
                    "ALTER TABLE keyset_checkpoints_away RENAME TO keyset_checkpoints"
                )
        redis_loss(chunk)  # Redis restarts without persistence

    caplog.set_level("WARNING", logger="airflow_keyset_provider")
    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=50), tasks=1
    )
    assert "did not record the coalescing" in caplog.text
    assert "restored from the checkpoint mirror" in caplog.text
    assert redis_loss.done and res.finished
    assert set(seen.seen) == set(keys)
    assert max(seen.seen.values()) == 2 and seen.seen[251] == 2  # the chunk in hand, again
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


def test_a_split_of_a_host_whose_coalescing_the_mirror_missed_carries_the_coalescing(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """As above, but the host's first mirror record after the outage is its split (no periodic
    checkpoint): the split's record carries the absorbed ranges too, so the round restored after
    Redis loses everything is a partition and closes with exact totals."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 3600  # no periodic checkpoint: the split writes the first record
    rnd = t.plan(max_ranges=4, start_key=0, end_key=400)
    ghost = traversal(pg_schema_url, redis_url, key_prefix)
    with pg_engine.begin() as c:
        c.exec_driver_sql("ALTER TABLE keyset_checkpoints RENAME TO keyset_checkpoints_away")
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=101)

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        if chunk.keys[0] == 1:  # the mirror is back; an idle task asks for a split, then dies
            with pg_engine.begin() as c:
                c.exec_driver_sql(
                    "ALTER TABLE keyset_checkpoints_away RENAME TO keyset_checkpoints"
                )
            assert ghost.store.request_split(rnd.round_id, 0, "ghost#1") == "asked"
        redis_loss(chunk)  # after the split: Redis loses everything

    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10), tasks=1
    )
    assert redis_loss.done and res.finished
    assert int(t.store.round_info(rnd.round_id)["n_ranges"]) == 5  # the split's range 4
    assert set(seen.seen) == set(keys)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


def test_a_first_claim_stops_before_the_next_tasks_first_range(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """10 ranges over 4 tasks start at 0, 2, 5, 7 (``first_positions``); a share is
    ceil(10 / 4) - 1 = 2 ranges, but task 0's first claim absorbs only range 1: range 2 is where
    task 1 starts, so it is left for task 1 (here claimed later by task 0 itself, as a range of
    its own, since task 1 never runs)."""
    keys = list(range(1, 1001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=10, start_key=0, end_key=1000)
    assert len(rnd.ranges) == 10 and first_positions(10, 4) == [0, 2, 5, 7]
    seen = Deliveries()
    res = t.traverse_round(
        rnd.round_id,
        lambda chunk: seen.record("w0", chunk),
        options=TraverseOptions(owner_lineage="w0", chunk_size=50),
        first_range=0,
        tasks=4,
    )
    assert res.finished and set(seen.seen) == set(keys)
    merged = {r.range_id: r.merged_into for r in t.control.round_status(rnd.round_id).ranges}
    assert merged[1] == 0 and merged[2] is None  # range 2 was claimed on its own
    assert t.close_round(rnd.round_id).done == len(keys)
    t.close()


def test_a_coalescing_the_mirror_missed_is_carried_by_the_next_owners_checkpoint(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """The claim that coalesced ranges 1..3 into range 0 came from a process that died before
    it could write the mirror (here: the claim alone, with a lease of 1 ms). The mark stays on
    the range in Redis, so the owner that takes it over (another process: nothing in its memory)
    mirrors the run with its first checkpoint; Redis then loses everything, and the round
    restored from the mirror is a partition: every key once more at most in the chunk in hand,
    exact totals."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=4, start_key=0, end_key=400)
    dead = t.store.claim(rnd.round_id, 0, "w#dead", "w", 1, 3, pull=True, mirror=True)
    assert dead.absorbed == 3 and t.store.range(rnd.round_id, 0)["unmirrored"] == "3"
    time.sleep(0.01)  # its lease runs out
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=251)

    def proc(chunk: Any) -> None:
        seen.record("w2", chunk)
        redis_loss(chunk)  # Redis restarts without persistence

    t2 = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t2.checkpoint_seconds = 0
    res = t2.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w2", chunk_size=50), tasks=1
    )
    assert redis_loss.done and res.finished
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) <= 2
    totals = t2.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
    t.close()
    t2.close()
