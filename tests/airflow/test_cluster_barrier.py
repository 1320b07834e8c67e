"""A Redis connection with the extra ``{"cluster": true}``: ``KeysetHook`` hands the engine a
``RedisCluster`` (through the Redis provider's ``RedisHook``), and the barrier's poke and trigger
work on a real 3-primary cluster (pub/sub wake-ups are a hint; the trigger polls regardless)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from redis.cluster import RedisCluster
from redis_servers import start_cluster

pytestmark = pytest.mark.airflow

CONN = "redis_cluster_test"


@pytest.fixture(scope="module")
def cluster_port() -> Iterator[int]:
    ports, stop = start_cluster(3)
    yield ports[0]
    stop()


@pytest.fixture
def cluster_conn(airflow_env, cluster_port, monkeypatch) -> str:
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN.upper()}",
        json.dumps(
            {
                "conn_type": "redis",
                "host": "127.0.0.1",
                "port": cluster_port,
                "extra": {"cluster": True},
            }
        ),
    )
    return CONN


def test_hook_poke_and_trigger_on_a_cluster(airflow_env, cluster_conn, pg_engine):
    """Plan and traverse through the hook on the cluster; the trigger fires ``complete`` and
    the sensor's poke closes the round."""
    from airflow.sdk import PokeReturnValue

    from airflow_keyset_provider import BarrierSensor
    from airflow_keyset_provider.hooks.keyset import KeysetHook
    from airflow_keyset_provider.triggers.keyset import KeysetRoundTrigger

    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO events SELECT g, 'e' FROM generate_series(1, 300) g"))
    hook = KeysetHook(source_conn_id="keyset_examples_db", redis_conn_id=cluster_conn)
    client = hook.redis_client()
    assert isinstance(client, RedisCluster)
    assert all(
        n.redis_connection.connection_pool.connection_kwargs["socket_timeout"]
        for n in client.get_nodes()
    ), "a hung node must fail a call, not block it"
    prefix = airflow_env["prefix"]
    t = hook.traversal(table="events", key="seq", stream="kt_cluster", key_prefix=prefix)
    rnd = t.plan(max_ranges=3, new_stream=True)
    for spec in rnd.ranges:
        t.traverse(rnd.round_id, spec.range_id, lambda chunk: None, chunk_size=50)
    t.close()

    trigger = KeysetRoundTrigger(
        round_id=rnd.round_id,
        stream="kt_cluster",
        redis_conn_id=cluster_conn,
        key_prefix=prefix,
        poll_interval=0.2,
        deadline=time.time() + 30,
    )

    async def first_event() -> Any:
        async for event in trigger.run():
            return event.payload
        return None

    assert asyncio.run(first_event()) == {"status": "complete", "round_id": rnd.round_id}

    done = BarrierSensor(
        task_id="barrier",
        round_id=rnd.round_id,
        stream="kt_cluster",
        redis_conn_id=cluster_conn,
        key_prefix=prefix,
    ).poke({})
    assert isinstance(done, PokeReturnValue) and done.is_done
    assert (done.xcom_value["done"], done.xcom_value["watermark"]) == (300, 300)
    for k in list(client.scan_iter(match=f"{prefix}:*")):
        client.delete(k)
