"""The engine on Redis Cluster: every key of a stream shares the hash tag {<stream>}, so each Lua
script touches one slot. Give a cluster client; one node's address is enough to discover the rest."""

import os

import redis

from airflow_keyset_provider.core import KeysetTraversal

client = redis.RedisCluster.from_url(
    os.environ.get("KEYSET_CLUSTER_URL", "redis://redis-node-1:6379/0"),
    socket_connect_timeout=5,
    socket_timeout=30,
)
t = KeysetTraversal(
    os.environ.get("KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"),
    table="events",
    key="seq",
    stream="events-nightly",
    redis_client=client,
    key_prefix=os.environ.get("KEYSET_KEY_PREFIX", "ks"),
)
rnd = t.plan(max_ranges=2, new_stream=True)
for spec in rnd.ranges:
    t.traverse(rnd.round_id, spec.range_id, lambda chunk: None)
print(t.close_round(rnd.round_id).as_dict())
t.close()
