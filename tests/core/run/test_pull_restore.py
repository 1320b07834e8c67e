"""A pull loop and a restore from the checkpoint mirror, on real PostgreSQL and Redis: whatever the
loop learnt about the round before the restore (ranges it finished, saw complete, skipped or that
declined a split) describes a state that is gone; the loop reads the round again."""

from __future__ import annotations

from typing import Any

from core_support import traversal
from test_pull import Deliveries, RedisLoss, analyzed_events

from airflow_keyset_provider.core import TraverseOptions


def test_a_range_finished_before_a_restore_and_reopened_by_it_is_run_again(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client, caplog
):
    """One pull task over ranges (0, 200] and (200, 400], mirror checkpoints after every commit.
    The mirror is down (its table renamed away) when range 0 completes, so the mirror's last
    record of range 0 is its cursor at 190, not complete; it is back for range 1. Redis then
    loses everything in range 1: the restore puts range 0 back as running at 190, which this
    loop had finished. The loop must run range 0 again (keys 191..200 a second time) instead of
    reporting ``finished`` with range 0 left for nobody, and the round must close exactly."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=2, start_key=0, end_key=400)
    assert [(r.lo, r.hi) for r in rnd.ranges] == [(0, 200), (200, 400)]
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=301)

    def rename(old: str, new: str) -> None:
        with pg_engine.begin() as c:
            c.exec_driver_sql(f"ALTER TABLE {old} RENAME TO {new}")

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        first_time = seen.seen[chunk.keys[0]] == 1
        if chunk.keys[0] == 191 and first_time:  # range 0's completion is not mirrored
            rename("keyset_checkpoints", "keyset_checkpoints_away")
        if chunk.keys[0] == 201 and first_time:
            rename("keyset_checkpoints_away", "keyset_checkpoints")
        redis_loss(chunk)  # Redis restarts without persistence

    caplog.set_level("WARNING", logger="airflow_keyset_provider")
    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10)
    )
    assert redis_loss.done and res.finished
    assert "checkpoint mirror write failed" in caplog.text
    assert "restored from the checkpoint mirror" in caplog.text
    assert set(seen.seen) == set(keys)
    again = sorted(k for k, n in seen.seen.items() if n > 1)
    # range 0 from its last mirrored cursor (190), range 1's chunk in hand at the loss
    assert again == [*range(191, 201), *range(301, 311)]
    assert max(seen.seen.values()) == 2
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


def test_a_restore_between_ranges_reopens_a_finished_range_and_the_loop_runs_it(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """As above, but Redis loses everything between two ranges: range 1 is complete (and
    mirrored) when the loop asks for the next unclaimed range; that read finds the round gone and
    the loop restores it from the mirror itself (not a range's run). Range 0 comes back at its
    mirrored cursor 190; the loop must forget that it had finished it and run it again."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=2, start_key=0, end_key=400)
    seen = Deliveries()

    def rename(old: str, new: str) -> None:
        with pg_engine.begin() as c:
            c.exec_driver_sql(f"ALTER TABLE {old} RENAME TO {new}")

    def proc(chunk: Any) -> None:
        seen.record("w", chunk)
        first_time = seen.seen[chunk.keys[0]] == 1
        if chunk.keys[0] == 191 and first_time:  # range 0's completion is not mirrored
            rename("keyset_checkpoints", "keyset_checkpoints_away")
        if chunk.keys[0] == 201 and first_time:
            rename("keyset_checkpoints_away", "keyset_checkpoints")

    lost: list[bool] = []
    next_unclaimed = t.store.next_unclaimed_of

    def losing_next_unclaimed(round_id: str) -> Any:
        if not lost and seen.seen[400]:  # range 1 is done: Redis restarts without persistence
            lost.append(True)
            for key in list(redis_client.scan_iter(f"{key_prefix}:*")):
                redis_client.delete(key)
        return next_unclaimed(round_id)

    t.store.next_unclaimed_of = losing_next_unclaimed  # type: ignore[method-assign]
    res = t.traverse_round(
        rnd.round_id,
        proc,
        options=TraverseOptions(owner_lineage="w", chunk_size=10),
        split=False,
    )
    assert lost and res.finished
    assert set(seen.seen) == set(keys)
    assert sorted(k for k, n in seen.seen.items() if n > 1) == list(range(191, 201))
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
