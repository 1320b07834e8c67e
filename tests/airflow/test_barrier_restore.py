"""The barrier (sensor poke and trigger) restores a round Redis lost from the checkpoint mirror,
through the same path as ``close_round`` (issue #10, item 10)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal

pytestmark = pytest.mark.airflow

MIRROR_CONN = "keyset_examples_db"  # the test's PostgreSQL schema (see conftest.airflow_env)


def _completed_round(env: dict[str, Any], pg_engine: sa.Engine, url: str, stream: str) -> str:
    """200 rows traversed in 2 ranges with a checkpoint mirror, then every key of the stream
    deleted from Redis (a restart without persistence) before the barrier looks."""
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1, 200) g"))
    t = KeysetTraversal(
        url,
        "events",
        "seq",
        redis_url=env["redis_url"],
        stream=stream,
        key_prefix=env["prefix"],
        checkpoint_url=url,
        checkpoint_seconds=0,
    )
    rnd = t.plan(max_ranges=2, new_stream=True)
    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=50)
    t.close()
    client = redis.Redis.from_url(env["redis_url"])
    keys = list(client.scan_iter(f"{env['prefix']}:{{{stream}}}:*"))
    assert keys and client.delete(*keys) == len(keys)
    client.close()
    return rnd.round_id


def test_sensor_poke_restores_a_lost_completed_round(airflow_env, pg_engine, pg_schema_url):
    """Scenario: every range completed and was mirrored, then Redis lost the round. Before the
    fix the poke's ``check_round`` raised RoundStateLostError and the sensor failed without
    retries; now the poke restores the round from the mirror and closes it."""
    from airflow.sdk import PokeReturnValue

    from airflow_keyset_provider import BarrierSensor

    rid = _completed_round(airflow_env, pg_engine, pg_schema_url, "kt_poke_restore")
    sensor = BarrierSensor(
        task_id="barrier",
        round_id=rid,
        stream="kt_poke_restore",
        key_prefix=airflow_env["prefix"],
        checkpoint_conn_id=MIRROR_CONN,
    )
    done = sensor.poke({})
    assert isinstance(done, PokeReturnValue) and done.is_done
    assert (done.xcom_value["done"], done.xcom_value["watermark"]) == (200, 200)


def test_trigger_restores_a_lost_completed_round(airflow_env, pg_engine, pg_schema_url):
    """Scenario: as above, with the deferred barrier's trigger polling. Before the fix the trigger
    fired an error event (RoundStateLostError); now, given the mirror's connection (the sensor
    passes its own when it defers), it restores the round and fires ``complete``."""
    from airflow_keyset_provider.triggers.keyset import KeysetRoundTrigger

    rid = _completed_round(airflow_env, pg_engine, pg_schema_url, "kt_trigger_restore")
    trigger = KeysetRoundTrigger(
        round_id=rid,
        stream="kt_trigger_restore",
        key_prefix=airflow_env["prefix"],
        poll_interval=0.2,
        deadline=time.time() + 30,
        checkpoint_conn_id=MIRROR_CONN,
    )
    assert trigger.serialize()[1]["checkpoint_conn_id"] == MIRROR_CONN

    async def first_event() -> Any:
        async for event in trigger.run():
            return event.payload
        return None

    event = asyncio.run(first_event())
    assert event == {"status": "complete", "round_id": rid}
