"""The Redis server under the cursor store: connecting to it, and refusing one that may evict.

``cursor_store.py`` re-exports ``connect_redis`` and ``CLUSTER_SCHEMES`` and calls
``check_eviction_policy`` from ``CursorStore.check_eviction_policy`` (the reason no stream key
has a TTL is in ``cursor_store.py``'s docstring).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import redis.cluster

from ..errors import ConfigurationError, EvictionPolicyError
from ..redaction import url_error
from .reads import _s

log = logging.getLogger("airflow_keyset_provider")

CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def connect_redis(url: str) -> redis.Redis:
    """A client for ``url``: ``redis://`` / ``rediss://`` / ``unix://`` give one server,
    ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) a ``RedisCluster`` that
    discovers the other nodes from that one. Socket timeouts are set so a hung server fails."""
    opts: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 30}
    try:
        if url.startswith(CLUSTER_SCHEMES):
            plain = url.replace("+cluster", "", 1)
            return redis.cluster.RedisCluster.from_url(plain, **opts)  # type: ignore[return-value]
        return redis.Redis.from_url(url, health_check_interval=30, **opts)
    except (ValueError, redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise ConfigurationError(
            url_error("redis_url", url, exc)
        ) from None  # the cause may quote the password


def check_eviction_policy(client: redis.Redis, stream: str, *, allow_unverified: bool) -> str:
    """Refuse a Redis server that may evict the stream's keys; returns the policy (what
    ``CursorStore.check_eviction_policy`` documents)."""
    policies = _eviction_policies(client)
    if not policies:
        if allow_unverified:
            log.warning(
                "stream %s: the Redis maxmemory-policy could not be read (CONFIG and INFO "
                "refused); planning anyway because allow_unverified_eviction_policy is set",
                stream,
            )
            return "unverified"
        raise EvictionPolicyError(
            f"stream {stream!r}: could not read the Redis server's maxmemory-policy "
            "(CONFIG GET and INFO memory were both refused), so it is unknown whether Redis "
            "may evict the stream's cursors. Run it on a server whose policy is noeviction "
            "(or volatile-*), or, if you know it is, pass "
            "allow_unverified_eviction_policy=True. Nothing was written."
        )
    bad = sorted({p for p in policies if not _policy_keeps_keys(p)})
    if bad:
        raise EvictionPolicyError(
            f"stream {stream!r}: the Redis server's maxmemory-policy is "
            f"{', '.join(bad)}, which may evict any key, including the stream's cursors "
            "and dead letters. Set `CONFIG SET maxmemory-policy noeviction` (and in "
            "redis.conf), or give the cursor store a dedicated Redis. Nothing was written."
        )
    return ", ".join(sorted(set(policies)))


def _eviction_policies(client: Any) -> list[str]:
    """The maxmemory-policy of each server (each primary of a cluster) that answered."""
    # every primary of a cluster (each may be configured differently), else the one server
    where: dict[str, Any] = {}
    if isinstance(client, redis.cluster.RedisCluster):
        where = {"target_nodes": redis.cluster.RedisCluster.PRIMARIES}
    try:
        out = _policy_values(client.config_get("maxmemory-policy", **where), "maxmemory-policy")
    except redis.ResponseError:
        out = []
    if out:
        return out
    try:
        info = client.info("memory", **where)
    except redis.ResponseError:
        return []
    return _policy_values(info, "maxmemory_policy")


def _policy_keeps_keys(policy: str) -> bool:
    """True when the policy never evicts a key without a TTL (the stream's keys have none)."""
    return policy == "noeviction" or policy.startswith("volatile-")


def _policy_values(reply: Any, name: str) -> list[str]:
    """The policy values in a CONFIG GET / INFO reply: one server's dict, or a cluster's dict of
    node -> dict (redis-py merges or keeps per node depending on the command)."""
    if not isinstance(reply, dict):
        return []
    if name in reply or name.encode() in reply:
        v = reply.get(name, reply.get(name.encode()))
        return [_s(v)] if v not in (None, "", b"") else []
    out: list[str] = []
    for sub in reply.values():
        out += _policy_values(sub, name)
    return out
