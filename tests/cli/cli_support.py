"""Helpers of the CLI, test-helper and docs tests (fixtures in this folder's conftest.py): a
live round in real Redis over a real SQLite or PostgreSQL table, left in a known, mixed state."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.cli import main
from airflow_keyset_provider.core import KeysetTraversal

ROWS = 400
POISON = 37  # keys divisible by this fail on every attempt and end as dead letters
SKIP = 50  # keys divisible by this (and not poison) are reported skipped


def make_events(url: str, n: int = ROWS) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            c.execute(
                sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)")
            )
            c.execute(
                sa.text("INSERT INTO events VALUES (:s, :p)"),
                [{"s": k, "p": f"e{k}"} for k in range(1, n + 1)],
            )
    finally:
        engine.dispose()


def poison_processor(chunk: Any) -> ChunkResult:
    """Fails keys divisible by POISON (bad items), skips keys divisible by SKIP."""
    failed = {k: f"poison: payload {k} is not JSON" for k in chunk.keys if k % POISON == 0}
    return ChunkResult(
        failed=failed, skipped=[k for k in chunk.keys if k % SKIP == 0 and k not in failed]
    )


@dataclass
class LiveRound:
    """A round r1 of stream ``events-nightly`` in 4 ranges over keys 1..400:
    ranges 0 and 1 complete (with dead letters and skips), range 2 stopped after one chunk of
    20, range 3 never claimed."""

    traversal: KeysetTraversal
    round_id: str
    source_url: str
    redis_url: str
    key_prefix: str
    stream: str = "events-nightly"

    def cli(self, *argv: str) -> tuple[int, str, str]:
        """Run ``airflow-keyset`` in-process against this round's Redis and prefix."""
        out, err = io.StringIO(), io.StringIO()
        code = main(
            [*argv, "--redis-url", self.redis_url, "--key-prefix", self.key_prefix],
            stdout=out,
            stderr=err,
        )
        return code, out.getvalue(), err.getvalue()

    def cli_json(self, *argv: str) -> Any:
        code, out, err = self.cli(*argv, "--json")
        assert code in (0, 3), err
        return json.loads(out)


def build_live_round(source_url: str, redis_url: str, key_prefix: str) -> LiveRound:
    make_events(source_url)
    t = KeysetTraversal(
        source_url,
        "events",
        "seq",
        redis_url=redis_url,
        stream="events-nightly",
        key_prefix=key_prefix,
    )
    rnd = t.plan(max_ranges=4, new_stream=True)
    assert [r.hi for r in rnd.ranges] == [100, 200, 300, 400]
    for i in (0, 1):
        t.traverse(
            rnd.round_id,
            i,
            poison_processor,
            chunk_size=25,
            item_retry_delay=0.0,
            backoff_base=0.01,
        )
    calls = []

    def stop_after_first_chunk(chunk: Any) -> None:
        calls.append(len(chunk))
        t.request_stop()

    res = t.traverse(rnd.round_id, 2, stop_after_first_chunk, chunk_size=20, prefetch=False)
    assert res.stopped and res.cursor
    t._stop.clear()  # the traversal object is reused by tests
    return LiveRound(t, rnd.round_id, source_url, redis_url, key_prefix)
