"""The eviction-policy check through ``KeysetHook``: a server whose policy cannot be read is
refused unless the Redis connection's extra opts in (issue #10, item 5a)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from redis_servers import start_redis

from airflow_keyset_provider.core import EvictionPolicyError

pytestmark = pytest.mark.airflow


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A throwaway server that refuses CONFIG and INFO (renamed away), as some managed ones do."""
    url, stop = start_redis("--rename-command", "CONFIG", "", "--rename-command", "INFO", "")
    yield url
    stop()


def _conn(url: str, extra: dict) -> str:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    return json.dumps({"conn_type": "redis", "host": "127.0.0.1", "port": port, "extra": extra})


def test_unverified_policy_needs_the_connection_opt_in(
    airflow_env, silent_redis, pg_engine, monkeypatch
):
    """Scenario: the policy cannot be read. Without the extra the plan is refused (nothing
    written); with ``{"allow_unverified_eviction_policy": true}`` it plans."""
    from airflow_keyset_provider.hooks.keyset import KeysetHook

    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1, 20) g"))
    monkeypatch.setenv("AIRFLOW_CONN_REDIS_SILENT", _conn(silent_redis, {}))
    hook = KeysetHook(source_conn_id="keyset_examples_db", redis_conn_id="redis_silent")
    t = hook.traversal(table="events", key="seq", stream="kt_silent")
    with pytest.raises(EvictionPolicyError, match="could not read"):
        t.plan(new_stream=True)
    assert t.store.client.dbsize() == 0
    t.close()

    monkeypatch.setenv(
        "AIRFLOW_CONN_REDIS_SILENT", _conn(silent_redis, {"allow_unverified_eviction_policy": True})
    )
    hook = KeysetHook(source_conn_id="keyset_examples_db", redis_conn_id="redis_silent")
    t = hook.traversal(table="events", key="seq", stream="kt_silent")
    assert t.plan(new_stream=True).round_id == "r1"
    t.close()
