"""A ``BaseException`` through the run loop (issue #18 item 6), on real PostgreSQL and Redis:
Airflow's ``AirflowTaskTimeout`` (raised by ``execution_timeout``'s alarm, inside the processor
call) is a ``BaseException``; the chunks processed before it are committed, the interrupted one
is not."""

from __future__ import annotations

import pytest
from core_support import Recorder, make_events, traversal

from airflow_keyset_provider.core import Chunk
from airflow_keyset_provider.core.keys import encode_key


class Alarm(BaseException):
    """Stands in for ``airflow.sdk.exceptions.AirflowTaskTimeout`` (the core imports no
    Airflow)."""


def test_an_interrupted_try_commits_its_processed_group_but_not_the_chunk_in_hand(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """Keys 1..100, chunks of 10, group commit every 5 chunks: the alarm goes off inside the
    processor call of the 4th chunk (31..40). Before: the exception went through the loop and the
    lease was released with nothing committed (cursor 0: chunks 1..3 delivered again). Now the 3
    processed chunks are committed (cursor 30) and the interrupted one is not; the next traverse
    delivers 31..100 and nothing else again."""
    make_events(pg_engine, list(range(1, 101)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=100)
    rec = Recorder()

    def alarmed(chunk: Chunk) -> None:
        rec(chunk)
        if chunk.keys[0] == 31:
            raise Alarm("execution_timeout")

    opts = {"chunk_size": 10, "group_commit_chunks": 5, "prefetch": False}
    with pytest.raises(Alarm):
        t.traverse(rnd.round_id, 0, alarmed, **opts)
    status = t.range_status(rnd.round_id)[0]
    assert status["cursor_encoded"] == encode_key((30,)) and status["done"] == 30
    assert not status["owner"]  # released
    again = Recorder()
    res = t.traverse(rnd.round_id, 0, again, **opts)
    assert res.complete and res.done == 100
    assert sorted(again.seen) == list(range(31, 101))  # only the interrupted chunk again
    assert t.close_round(rnd.round_id).done == 100
    t.close()
