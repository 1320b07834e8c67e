"""``KeysetTraversal.replay_dead_letters`` when the replay itself fails, on real PostgreSQL + Redis
(and what a processor that fails for every row is told).

- A replay whose processor's dependency is down (``RetryableError`` on every call) raises
  ``ReplayFailedError`` naming how many letters went back, and the letters are dead letters again
  exactly as they were (key, error, attempts): the round stays closed with its totals, and a
  later replay with the dependency back finds and resolves them (the old engine left them in the
  closed round's retry set, where the next replay reported "no dead letters").
- A letter the failed replay did resolve stays resolved (counted done), not put back.
- A wrapper naming its processor through ``__keyset_processor__`` (what ``@task.keyset_traverse``
  sets) is called through that function, never as the wrapper.
- The round's source is checked before anything moves: a traversal over other rows is refused.
"""

from __future__ import annotations

import json

import pytest
from core_support import make_events, traversal

from airflow_keyset_provider import ChunkResult, RetryableError
from airflow_keyset_provider.core import (
    ConfigurationError,
    DependencyFailedError,
    ReplayFailedError,
)

BROKEN = {7, 100, 250}


def _closed_round_with_letters(pg_engine, pg_schema_url, redis_url, key_prefix):
    make_events(pg_engine, list(range(1, 301)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)

    def reject(chunk):
        return ChunkResult(failed={k: f"rejected {k}" for k in chunk.keys if k in BROKEN})

    t.traverse(rnd.round_id, 0, reject, chunk_size=50, max_item_attempts=2, item_retry_delay=0)
    assert t.close_round(rnd.round_id).dead == 3
    return t, rnd.round_id


def _letters(t, round_id):
    return sorted((d["key"], d["error"], d["attempts"]) for d in t.dead_letters(round_id, 0))


def test_a_failed_replay_puts_the_letters_back_and_a_later_one_finds_them(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    t, round_id = _closed_round_with_letters(pg_engine, pg_schema_url, redis_url, key_prefix)
    before = _letters(t, round_id)
    assert [k for k, _, _ in before] == [7, 100, 250]

    def down(chunk):
        raise RetryableError("the downstream API answers 503")

    fast = {"max_chunk_attempts": 2, "backoff_base": 0.001, "item_retry_delay": 0}
    with pytest.raises(ReplayFailedError, match="3 of the 3 letter") as info:
        t.replay_dead_letters(round_id, down, **fast)
    assert "503" in str(info.value) and "run the replay again" in str(info.value)
    assert _letters(t, round_id) == before  # where they were, as they were
    (status,) = t.range_status(round_id)
    assert (status.state, status.retries, status.dead) == ("complete", 0, 3)
    assert t.round(round_id).state == "closed"

    # the dependency is back for 7 only: 100 and 250 go back, 7 stays resolved
    def partial(chunk):
        if any(k in (100, 250) for k in chunk.keys):
            raise RetryableError("still 503 for these")
        return None

    with pytest.raises(ReplayFailedError, match="2 of the 3 letter"):
        t.replay_dead_letters(round_id, partial, chunk_size=1, **fast)
    assert [k for k, _, _ in _letters(t, round_id)] == [100, 250]
    assert _letters(t, round_id) == [x for x in before if x[0] != 7]

    class Wrapper:  # what @task.keyset_traverse makes: calling it with a chunk is a TypeError
        __keyset_processor__ = staticmethod(lambda chunk: None)

        def __call__(self, plan):
            raise TypeError("expected XComArg or list[dict]")

    results = t.replay_dead_letters(round_id, Wrapper(), item_retry_delay=0)
    assert [(r.done + r.skipped, r.dead, r.complete) for r in results] == [(300, 0, True)]
    assert t.dead_letters(round_id, 0) == []
    totals = t.store.round_info(round_id)
    assert (int(totals["done"]), int(totals["dead"])) == (300, 0)
    t.close()


def test_a_replay_over_other_rows_is_refused_before_anything_moves(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    t, round_id = _closed_round_with_letters(pg_engine, pg_schema_url, redis_url, key_prefix)
    other = traversal(pg_schema_url, redis_url, key_prefix, where="seq > 5")
    with pytest.raises(ConfigurationError, match="planned over"):
        other.replay_dead_letters(round_id, lambda chunk: None)
    assert len(t.dead_letters(round_id, 0)) == 3
    assert json.loads(t.store.round_info(round_id)["source"])["where"] is None
    other.close()
    t.close()


def test_a_processor_raising_for_every_row_is_not_called_only_a_dependency_failure(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A bug of the processor's own (a ``KeyError`` on every row, from the first chunk: no key
    ever succeeded to probe with) ends as a dependency failure, as it must (the cursor stays):
    the message says it may be the processor's own bug and how to tell. A failed read (the
    source is the dependency) does not get that hint."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, new_stream=True)

    def buggy(chunk):
        return [row["no_such_column"] for row in chunk.rows]

    with pytest.raises(DependencyFailedError) as err:
        t.traverse(rnd.round_id, 0, buggy, chunk_size=20, max_chunk_attempts=2, backoff_base=0.001)
    msg = str(err.value)
    assert "KeyError" in msg and "the bug may be the processor's own" in msg, msg
    assert "run_processor" in msg and "ChunkResult(failed=...)" in msg
    assert "max_chunk_attempts=2 reached" in msg
    t.close()
