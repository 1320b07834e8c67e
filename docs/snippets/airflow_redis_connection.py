"""The Airflow connection of a TLS + password Redis, as an environment variable (the UI form has the
same fields). The operators read it through RedisHook: ``redis_conn_id="keyset_redis"``."""

import json

connection = {
    "conn_type": "redis",
    "host": "redis.internal",
    "port": 6380,
    "login": None,  # an ACL user name, if the server uses ACLs
    "password": "s3cret",
    "extra": {
        "db": 0,
        "ssl": True,
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": "/etc/ssl/certs/redis-ca.pem",
        # Redis Cluster instead: "cluster": true (and drop "db")
    },
}
print(f"export AIRFLOW_CONN_KEYSET_REDIS='{json.dumps(connection)}'")
