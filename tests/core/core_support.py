"""Helpers shared by the engine's tests in ``tests/core``: an ``events`` table, a traversal over
it, and a processor that records every delivery."""

from __future__ import annotations

from collections import Counter
from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal, Round

#: Traverse settings of tests that want failures fast: 5 attempts, backoffs of 10-20 ms.
FAST = {
    "max_chunk_attempts": 5,
    "backoff_base": 0.01,
    "backoff_max": 0.02,
    "item_retry_delay": 0.01,
    "prefetch": False,
}


def make_events(engine: sa.Engine, keys: list[int]) -> None:
    with engine.begin() as c:
        c.execute(
            sa.text("CREATE TABLE events (seq bigint NOT NULL PRIMARY KEY, payload text NOT NULL)")
        )
        if keys:
            c.execute(
                sa.text("INSERT INTO events VALUES (:s, :p)"),
                [{"s": k, "p": f"e{k}"} for k in keys],
            )


def traversal(url: str, redis_url: str, key_prefix: str, **kw: Any) -> KeysetTraversal:
    kw.setdefault("table", "events")
    kw.setdefault("key", "seq")
    return KeysetTraversal(
        url, redis_url=redis_url, stream="events-nightly", key_prefix=key_prefix, **kw
    )


class Recorder:
    """Processor that records every delivery (an independent record of side effects)."""

    def __init__(self) -> None:
        self.seen: Counter = Counter()
        self.chunks: list[list] = []

    def __call__(self, chunk: Any) -> None:
        self.chunks.append(list(chunk.keys))
        self.seen.update(chunk.keys)


def run_all(t: KeysetTraversal, rnd: Round, proc: Any, **kw: Any) -> None:
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, proc, **kw)
