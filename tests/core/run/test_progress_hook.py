"""``traverse(on_progress=...)``: the engine hands the committed range state to a plain callable,
throttled, always once at the end, and never lets it stop the range (real PostgreSQL + Redis)."""

from __future__ import annotations

from core_support import make_events, traversal

from airflow_keyset_provider.core.keys import encode_key


def test_on_progress_sees_committed_monotonic_states_and_the_final_one(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Unthrottled (0 s), the callable sees one state per commit: cursors strictly increase,
    counters grow with them, each state equals what Redis holds for that cursor (done = keys up
    to the cursor), and the last one is the complete range."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    seen = []
    res = t.traverse(
        rnd.round_id,
        0,
        lambda chunk: None,
        chunk_size=30,
        on_progress=seen.append,
        progress_every_seconds=0,
    )
    assert res.complete and res.done == 100
    cursors = [s.cursor for s in seen]
    assert cursors == sorted(set(cursors)), cursors  # forward only, one state per commit
    assert [s.done for s in seen] == [30, 60, 90, 100]
    assert all(s.cursor == encode_key((s.done,)) for s in seen[:4])
    assert seen[-1].complete and seen[-1].done == 100
    status = t.range_status(rnd.round_id)[0]
    assert (status.done, status.cursor_encoded) == (100, seen[-1].cursor)


def test_on_progress_is_throttled_but_reports_the_end(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """With the default interval (5 s) a fast range reports its first commit and its completion
    only, not every chunk."""
    make_events(pg_engine, list(range(1, 201)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)
    seen = []
    t.traverse(rnd.round_id, 0, lambda chunk: None, chunk_size=10, on_progress=seen.append)
    assert len(seen) == 2, [(s.cursor, s.done) for s in seen]
    assert (seen[0].done, seen[0].complete) == (10, False)
    assert (seen[-1].done, seen[-1].complete) == (200, True)


def test_a_failing_callback_does_not_stop_the_range(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    make_events(pg_engine, list(range(1, 51)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)

    def broken(state):
        raise RuntimeError("metadata DB down")

    res = t.traverse(
        rnd.round_id,
        0,
        lambda chunk: None,
        chunk_size=10,
        on_progress=broken,
        progress_every_seconds=0,
    )
    assert res.complete and res.done == 50
    assert t.close_round(rnd.round_id).done == 50
