"""The page's API fuzzed from its own OpenAPI schema (schemathesis; issue 28, item 7), against
a real Airflow API server (SimpleAuthManager) as two roles, viewer and editor, over a stream
whose round has dead letters of failed writes that carried a marker value.

Every answer, whatever schemathesis sends (path parameters of any text, query numbers in and
out of range, pause reasons, JSON bodies): no 5xx, no traceback, JSON, no password of either
user, no row value. Cases: ``KEYSET_FUZZ_EXAMPLES_API`` per operation, each sent as both roles (default 25: the
short mode CI runs; 8 operations x 25 cases x 2 roles = 400 requests, 1-2 min)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings

from airflow_keyset_provider.core import ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.writeback import upsert

EXAMPLES = int(os.environ.get("KEYSET_FUZZ_EXAMPLES_API", "25"))
MARKER = "row-value-4f1c-MARKER"


@pytest.fixture(scope="module")
def api_schema() -> Any:
    """The page's OpenAPI schema as its app makes it (the app serves none: ``openapi_url=None``)."""
    from airflow_keyset_provider.plugins.app import create_app

    return schemathesis.openapi.from_dict(create_app().openapi())


@pytest.fixture
def seeded(airflow_api_server: Any, sqlite_url: str, redis_url: str) -> Any:
    """A stream ``fuzz`` with round r1 whose dead letters come from CHECK failures of rows that
    carried ``MARKER``."""
    srv = airflow_api_server
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE ev (seq INTEGER PRIMARY KEY)")
        c.exec_driver_sql("INSERT INTO ev VALUES (1), (2), (3), (4)")
        c.exec_driver_sql(
            "CREATE TABLE dst (id INTEGER PRIMARY KEY, note TEXT CONSTRAINT short "
            "CHECK (length(note) < 10))"
        )

    def processor(chunk: Any) -> ChunkResult:
        rows = [{"id": k, "note": MARKER if k % 2 else "ok"} for k in chunk.keys]
        return ChunkResult(failed=upsert(engine, "dst", rows, conflict="id").failed)

    t = KeysetTraversal(
        sqlite_url, "ev", "seq", redis_url=redis_url, stream="fuzz", key_prefix=srv.key_prefix
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    res = t.traverse(rnd.round_id, 0, processor, max_item_attempts=1, item_retry_delay=0)
    assert res.dead == 2
    yield srv
    t.close()
    engine.dispose()


def test_the_api_answers_every_request_without_5xx_traceback_secret_or_row_value(
    api_schema: Any, seeded: Any
) -> None:
    srv = seeded
    auths = {
        role: {"Authorization": f"Bearer {srv.token(role, password)}"}
        for role, password in (("viewer", srv.password), ("editor", srv.editor_password))
    }
    sent: list[str] = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 6, [op.label for op in operations]
    for operation in operations:
        if "{round_id}" in operation.path:  # first the seeds the issue found (a 500 on main)
            for round_id in ("r1:range:0", "r1:dead:0", "r1\n"):
                params: dict[str, Any] = {"stream": "fuzz", "round_id": round_id}
                if "{range_id}" in operation.path:
                    params["range_id"] = 0
                seed = operation.Case(path_parameters=params)
                for role, auth in auths.items():
                    response = seed.call(base_url=f"{srv.base_url}/keyset", headers=auth)
                    _check(srv, f"{role}: seed {round_id!r}", response)

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
        def fuzz(case: Any) -> None:
            for role, auth in auths.items():
                response = case.call(base_url=f"{srv.base_url}/keyset", headers=auth)
                sent.append(case.operation.label)
                _check(srv, f"{role}: {case.method} {case.formatted_path}", response)

        fuzz()
    assert len(sent) >= len(operations) * 2 * min(EXAMPLES, 5), len(sent)
    print(f"fuzzed: {len(sent)} requests over {len(operations)} operations")


def _check(srv: Any, what: str, response: Any) -> None:
    text = response.text
    where = f"{what} -> {response.status_code}: {text[:300]}"
    assert response.status_code < 500, where
    assert "Traceback" not in text and 'File "' not in text, where
    assert MARKER not in text, where
    assert srv.password not in text and srv.editor_password not in text, where
    kind = response.headers.get("content-type") or [""]
    kind = kind[0] if isinstance(kind, list) else kind
    assert kind.startswith("application/json"), where
