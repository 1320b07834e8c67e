"""``airflow-keyset status`` shows a round's verification (``verify=``) from the one status
model: pending before the barrier ran it, then its state, count and first keys (never row data),
in the terminal and in ``--json``."""

from __future__ import annotations

import io
import json

import sqlalchemy as sa
from cli_support import make_events

from airflow_keyset_provider.cli import main
from airflow_keyset_provider.core import KeysetTraversal

VERIFY = "payload LIKE 'x%'"


def _status(redis_url: str, key_prefix: str, *extra: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    argv = ["status", "events-nightly", "--redis-url", redis_url, "--key-prefix", key_prefix]
    code = main([*argv, *extra], stdout=out, stderr=err)
    assert code in (0, 3), err.getvalue()
    return out.getvalue()


def test_status_shows_pending_then_the_failed_verification_with_count_and_keys(
    pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    make_events(pg_schema_url, 100)
    t = KeysetTraversal(
        pg_schema_url, "events", "seq", redis_url, stream="events-nightly", key_prefix=key_prefix
    )
    try:
        rnd = t.plan(2, new_stream=True, verify=VERIFY)
        for spec in rnd.ranges:
            t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=30)
        assert "verify: pending" in _status(redis_url, key_prefix)
        engine = sa.create_engine(pg_schema_url)
        with engine.begin() as c:  # rows the processor never fixed: 'x-secret-5' is row data
            c.execute(
                sa.text("UPDATE events SET payload = 'x-secret-' || seq WHERE seq IN (5, 9, 77)")
            )
        engine.dispose()
        t.verify_round(rnd.round_id, VERIFY, max_keys=2)
    finally:
        t.close()
    out = _status(redis_url, key_prefix)
    assert "verify: failed: 3 row(s) still match (first keys: 5, 9, ...)" in out
    assert "secret" not in out
    [shown] = json.loads(_status(redis_url, key_prefix, "--json"))["rounds"]
    v = shown["verification"]
    assert (v["state"], v["matching"], v["first_keys"], v["repaired"]) == (
        "failed",
        3,
        ["5", "9"],
        None,
    )
