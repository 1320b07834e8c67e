"""Test a processor against a real database in a few lines.

For DAG authors' unit tests::

    from airflow_keyset_provider.testing import run_processor

    def test_my_processor(pg_url):
        run = run_processor(my_processor, pg_url, "events", "seq", where="kind = 'click'")
        assert run.dead == 0
        assert run.done == 1_000

``run_processor`` uses the same engine the operators use: it plans a throwaway round, traverses
every range in this process, closes the round and returns the totals and dead letters.

Guarantees:

- It never touches a real stream: the round lives under a fresh key prefix and stream name, and
  every Redis key it wrote is deleted before it returns, also when the processor raises.
- It never writes to the source; only the processor does.
- Engine errors propagate unchanged (``DependencyFailedError`` when the processor keeps raising,
  ``ProcessorContractError`` for a bad return value, ``KeyValidationError`` for a bad key), so a
  test can assert on them with ``pytest.raises``.
- It imports nothing from Airflow.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from .core.chunk import Chunk, ChunkResult
from .core.errors import ConfigurationError
from .core.keys import MIN_KEY, encode_key
from .core.options import TraverseOptions
from .core.traversal import KeysetTraversal, RangeResult, load_processor

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

__all__ = ["ProcessorRun", "run_processor"]


@dataclass(frozen=True)
class ProcessorRun:
    """What one ``run_processor`` call did.

    ``done + skipped + dead`` equals the number of keys in ``(start_key, end_key]`` that the
    source held while the traversal passed over them (the engine's progress contract).
    ``dead_letters`` are ``{range_id, key, error, attempts}``, newest first per range.
    ``key_prefix`` is the throwaway Redis key prefix the round used (already deleted).
    """

    round_id: str
    start_key: Any
    end_key: Any
    key_prefix: str
    done: int
    skipped: int
    dead: int
    rows_read: int
    chunks: int
    ranges: list[RangeResult] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)

    @property
    def items(self) -> int:
        """Keys that reached a terminal state: ``done + skipped + dead``."""
        return self.done + self.skipped + self.dead

    @property
    def dead_keys(self) -> list[Any]:
        """Keys of the dead letters, in key order."""
        return sorted(d["key"] for d in self.dead_letters)

    def as_dict(self) -> dict[str, Any]:
        return {
            "round_id": self.round_id,
            "start_key": self.start_key,
            "end_key": self.end_key,
            "key_prefix": self.key_prefix,
            "done": self.done,
            "skipped": self.skipped,
            "dead": self.dead,
            "rows_read": self.rows_read,
            "chunks": self.chunks,
            "dead_letters": self.dead_letters,
        }


def run_processor(
    processor: Callable[[Chunk], ChunkResult | None] | str,
    source_url: Any,
    table: str,
    key: str | Sequence[str],
    *,
    redis_url: str | None = None,
    redis_client: redis.Redis | None = None,
    where: str | None = None,
    columns: Sequence[str] | None = None,
    rows: int | None = None,
    start_key: Any = None,
    end_key: Any = None,
    chunk_size: int = 1000,
    max_ranges: int = 1,
    max_item_attempts: int = 3,
    max_chunk_attempts: int = 3,
    item_retry_delay: float = 0.0,
    backoff_base: float = 0.01,
    **traverse_kwargs: Any,
) -> ProcessorRun:
    """Run ``processor`` over ``table`` in key order and return what happened.

    ``processor`` is a callable or ``"package.module:function"``. ``source_url`` is a SQLAlchemy
    URL or Engine (PostgreSQL or SQLite). The round covers ``start_key < key <= end_key``
    (``None``: from the first key / up to the last), restricted by ``where``; ``rows`` instead of
    ``end_key`` stops after the first ``rows`` keys. Redis comes from ``redis_client``, else
    ``redis_url``, else ``$KEYSET_REDIS_URL``, else ``redis://127.0.0.1:6379/0``. Retry delays
    default to (almost) zero so a failing item is dead-lettered at once; other keyword arguments
    are ``TraverseOptions`` fields (an unknown name is a ``ConfigurationError``).
    """
    _check_rows(rows, end_key)
    fn = load_processor(processor)
    options = TraverseOptions.from_kwargs(
        chunk_size=chunk_size,
        max_item_attempts=max_item_attempts,
        max_chunk_attempts=max_chunk_attempts,
        item_retry_delay=item_retry_delay,
        backoff_base=backoff_base,
        **traverse_kwargs,
    )
    run_id = _new_run_id()
    own_client = redis_client is None
    client = redis_client if redis_client is not None else _redis_from_url(redis_url)
    t = _scratch_traversal(source_url, table, key, where, columns, client, run_id)
    try:
        if rows is not None:
            end_key = _nth_key(t, start_key, rows)
            if end_key is None:  # nothing to read: no round at all
                return ProcessorRun("", start_key, start_key, t.store.stream_prefix, 0, 0, 0, 0, 0)
        return _run_round(t, fn, options, max_ranges, start_key, end_key, f"ks-test-{run_id}")
    finally:
        try:
            t.store.delete_stream()
        finally:
            t.close()
            if own_client:
                client.close()


def _scratch_traversal(
    source_url: Any,
    table: str,
    key: str | Sequence[str],
    where: str | None,
    columns: Sequence[str] | None,
    client: redis.Redis,
    run_id: str,
) -> KeysetTraversal:
    """A traversal on a stream and key prefix of its own (``test-<run_id>``, ``ks-test-<run_id>``)."""
    return KeysetTraversal(
        source_url,
        table,
        key,
        stream=f"test-{run_id}",
        where=where,
        columns=columns,
        redis_client=client,
        key_prefix=f"ks-test-{run_id}",
    )


def _redis_from_url(redis_url: str | None) -> redis.Redis:
    return redis.Redis.from_url(
        redis_url or os.environ.get("KEYSET_REDIS_URL") or DEFAULT_REDIS_URL
    )


def _check_rows(rows: Any, end_key: Any) -> None:
    if rows is not None and end_key is not None:
        raise ConfigurationError("give rows or end_key, not both")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
        raise ConfigurationError(f"rows must be a non-negative integer, got {rows!r}")


def _run_round(
    t: KeysetTraversal,
    fn: Callable[[Chunk], ChunkResult | None],
    options: TraverseOptions,
    max_ranges: int,
    start_key: Any,
    end_key: Any,
    key_prefix: str,
) -> ProcessorRun:
    """Plan one round, traverse its ranges one after the other, close it, collect dead letters."""
    # a throwaway key prefix per run: always a new stream (core/rounds/durability.py)
    rnd = t.plan(max_ranges=max_ranges, start_key=start_key, end_key=end_key, new_stream=True)
    results = [t.traverse(rnd.round_id, spec.range_id, fn, options=options) for spec in rnd.ranges]
    totals = t.close_round(rnd.round_id)
    letters = [
        {
            "range_id": spec.range_id,
            "key": d["key"],
            "error": d.get("error"),
            "attempts": d.get("attempts"),
        }
        for spec in rnd.ranges
        for d in t.dead_letters(rnd.round_id, spec.range_id, limit=options.dead_cap)
    ]
    return ProcessorRun(
        rnd.round_id,
        rnd.start_key,
        rnd.end_key,
        key_prefix,
        totals.done,
        totals.skipped,
        totals.dead,
        sum(r.rows_read for r in results),
        sum(r.chunks for r in results),
        results,
        letters,
    )


def _new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _nth_key(t: KeysetTraversal, start_key: Any, n: int) -> Any:
    """The ``n``-th key after ``start_key`` (or the last key, if fewer), None if there is none."""
    if n == 0:
        return None
    t.source.validate()
    start = MIN_KEY if start_key is None else t._encode_user_key("start_key", start_key)
    top = t.source.upper_bound()
    if top is None or top <= start:
        return None
    fetched = t.source.fetch(start, top, n)
    if not fetched:
        return None
    return t.decode(encode_key(tuple(fetched[-1][: t.arity])))
