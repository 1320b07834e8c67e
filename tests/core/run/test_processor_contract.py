"""A processor that returns a malformed ``ChunkResult`` is refused at once (issue 28, item 6):
``ProcessorContractError`` naming the field and the expected type, on the first call (no
retries, no isolation), and nothing of the call is committed: not its writes to the target (the
check runs before the call's transaction commits), not the cursor. Real PostgreSQL + Redis."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider.core import ChunkResult, ProcessorContractError

# (what the processor returns for the chunk's keys, the field named, the expected type named)
MALFORMED = {
    "failed-as-list": (lambda keys: ChunkResult(failed=[keys[0]]), "failed", "mapping"),  # type: ignore[arg-type]
    "failed-as-set": (lambda keys: ChunkResult(failed={keys[0]}), "failed", "mapping"),  # type: ignore[arg-type]
    "failed-none": (lambda keys: ChunkResult(failed=None), "failed", "mapping"),  # type: ignore[arg-type]
    "reason-not-str": (lambda keys: ChunkResult(failed={keys[0]: 42}), "failed", "str"),  # type: ignore[dict-item]
    "skipped-none": (lambda keys: ChunkResult(skipped=None), "skipped", "list, tuple or set"),  # type: ignore[arg-type]
    "skipped-a-key": (lambda keys: ChunkResult(skipped=keys[0]), "skipped", "list, tuple or set"),
    "skipped-str": (lambda keys: ChunkResult(skipped="1,2"), "skipped", "list, tuple or set"),
    "skipped-unhashable": (lambda keys: ChunkResult(skipped=[[keys[0]]]), "skipped", "key"),
    "not-a-result": (lambda keys: {"failed": {}}, "returned dict", "ChunkResult"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_result_is_refused_at_once_and_nothing_is_committed(
    case: str, pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    make_events(pg_engine, list(range(1, 41)))
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE effects (seq bigint NOT NULL)"))
    make_result, field, expected = MALFORMED[case]
    calls: list[list[Any]] = []

    def processor(chunk: Any) -> Any:
        calls.append(list(chunk.keys))
        chunk.connection.execute(
            sa.text("INSERT INTO effects VALUES (:s)"), [{"s": k} for k in chunk.keys]
        )
        return make_result(chunk.keys)

    t = traversal(pg_schema_url, redis_url, key_prefix, target_url=pg_schema_url)
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        with pytest.raises(ProcessorContractError) as raised:
            t.traverse(
                rnd.round_id, 0, processor, chunk_size=10, backoff_base=0.01, max_chunk_attempts=5
            )
        text = str(raised.value)
        assert field in text and expected in text, text
        assert f"Nothing of round {rnd.round_id} range 0 was committed" in text
        assert len(calls) == 1, f"retried or isolated: {len(calls)} calls"
        with pg_engine.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM effects")).scalar() == 0
        status = t.control.round_status(rnd.round_id).ranges[0]
        assert (status.done, status.dead, status.skipped) == (0, 0, 0)
        assert status.cursor_encoded == status.lo_encoded
    finally:
        t.close()


def test_a_well_formed_result_of_any_collection_still_works(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    make_events(pg_engine, list(range(1, 21)))
    t = traversal(pg_schema_url, redis_url, key_prefix)
    try:
        rnd = t.plan(max_ranges=1, new_stream=True)
        res = t.traverse(
            rnd.round_id,
            0,
            lambda chunk: ChunkResult(skipped={chunk.keys[0]}, failed={}),
            chunk_size=10,
        )
        assert res.complete and res.skipped == 2 and res.done == 18
    finally:
        t.close()
