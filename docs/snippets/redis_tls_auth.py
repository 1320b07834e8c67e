"""The engine on a Redis that requires TLS and a password: build the client, pass redis_client=."""

import os

import redis

from airflow_keyset_provider.core import KeysetTraversal

client = redis.Redis.from_url(
    os.environ.get("KEYSET_REDIS_URL", "rediss://:s3cret@redis.internal:6380/0"),  # rediss:// = TLS
    ssl_ca_certs=os.environ.get("KEYSET_REDIS_CA", "/etc/ssl/certs/redis-ca.pem"),
    ssl_cert_reqs="required",  # verify the server certificate and host name
    socket_connect_timeout=5,
    socket_timeout=30,
    health_check_interval=30,
)
client.ping()  # fails fast on a wrong password (AuthenticationError) or certificate (SSLError)
t = KeysetTraversal(
    os.environ.get("KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"),
    table="events",
    key="seq",
    stream="events-nightly",
    redis_client=client,
    key_prefix=os.environ.get("KEYSET_KEY_PREFIX", "ks"),
)
print(t.plan(max_ranges=2, new_stream=True).round_id)
t.close()
