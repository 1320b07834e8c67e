"""``KeysetHook``: Airflow connections -> the engine's source engine and Redis client.

Connections are resolved through the official provider hooks (``PostgresHook``, ``SqliteHook``,
``RedisHook``), so whatever those hooks support (extras such as ``sqlalchemy_query``, SSL for
Redis) works here too; a ``mysql`` connection's URL is built from its fields (``mysql_url``: the
mysql provider requires mysqlclient, which PyMySQL users do not need). Guarantees:

- a source connection must be of type ``postgres``, ``sqlite`` or ``mysql`` and the store connection of type
  ``redis``; anything else, or a connection id that is not defined, raises
  :class:`~airflow_keyset_provider.core.ConfigurationError` naming the connection id and what to do;
- credentials never reach a log line, an error message or XCom: the hook hands SQLAlchemy a
  ``URL`` object (whose rendering hides the password) and never formats connection URIs.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from typing import Any

import redis
import sqlalchemy as sa
from airflow.sdk import BaseHook

from airflow_keyset_provider.core import ConfigurationError, KeysetTraversal, StreamControl
from airflow_keyset_provider.core.rounds.mirror import CheckpointMirror
from airflow_keyset_provider.core.sql.source import make_engine
from airflow_keyset_provider.core.sql.target import make_target_engine
from airflow_keyset_provider.core.store.cursor_store import CursorStore
from airflow_keyset_provider.extras import provider_hook
from airflow_keyset_provider.hooks.mysql_url import mysql_url

SOURCE_CONN_TYPES = ("postgres", "sqlite", "mysql")
STORE_CONN_TYPES = ("redis",)

# Applied to the Redis client when the connection does not set them: a hung Redis must fail a
# call (and so the try) instead of blocking a worker slot forever.
_REDIS_SOCKET_DEFAULTS = {
    "socket_connect_timeout": 5.0,
    "socket_timeout": 30.0,
    "health_check_interval": 30,
}


def _conn_type(conn_id: str, role: str, allowed: Sequence[str]) -> str:
    """The connection's type, checked against ``allowed``; clear errors for missing/wrong ones."""
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception as exc:  # AirflowNotFoundException and friends; the message names no secret
        if "isn't defined" in str(exc) or type(exc).__name__ == "AirflowNotFoundException":
            raise ConfigurationError(
                f"{role} connection {conn_id!r} is not defined. Create it in the Airflow UI "
                f"(Admin > Connections, type {' or '.join(allowed)}) or set the environment "
                f"variable AIRFLOW_CONN_{conn_id.upper()}."
            ) from exc
        raise
    conn_type = (conn.conn_type or "").lower()
    if conn_type == "postgresql":
        conn_type = "postgres"
    if conn_type not in allowed:
        raise ConfigurationError(
            f"{role} connection {conn_id!r} has type {conn.conn_type!r}; it must be of type "
            f"{' or '.join(repr(a) for a in allowed)}."
        )
    return conn_type


def _sql_url(conn_id: str, role: str) -> sa.URL | str:
    """SQLAlchemy URL of a postgres, sqlite or mysql connection (see the module doc)."""
    kind = _conn_type(conn_id, role, SOURCE_CONN_TYPES)
    if kind == "postgres":
        return provider_hook("postgres")(postgres_conn_id=conn_id).sqlalchemy_url
    if kind == "mysql":
        return mysql_url(BaseHook.get_connection(conn_id))
    return provider_hook("sqlite")(sqlite_conn_id=conn_id).get_uri()


class KeysetHook(BaseHook):
    """Builds ``KeysetTraversal`` / ``StreamControl`` objects from Airflow connection ids.

    :param source_conn_id: a ``postgres``, ``sqlite`` or ``mysql`` connection (the traversed table's database).
        Not needed for round-level operations (``control``).
    :param redis_conn_id: a ``redis`` connection (the cursor store); its extra
        ``{"cluster": true}`` selects Redis Cluster.
    :param checkpoint_conn_id: optional ``postgres``/``sqlite``/``mysql`` connection of the durable
        checkpoint mirror (see ``core.mirror``): with it, a round that Redis loses is restored with
        bounded replay.
    :param target_conn_id: optional ``postgres``/``sqlite``/``mysql`` connection of the database the
        processor writes to: every processor call then gets ``chunk.connection``, a connection in
        a transaction the engine commits when the processor returns and rolls back when it
        raises (``target_engine``).
    """

    hook_name = "Keyset traversal"

    def __init__(
        self,
        source_conn_id: str | None = None,
        redis_conn_id: str = "redis_default",
        checkpoint_conn_id: str | None = None,
        target_conn_id: str | None = None,
    ) -> None:
        super().__init__()
        self.source_conn_id = source_conn_id
        self.redis_conn_id = redis_conn_id
        self.checkpoint_conn_id = checkpoint_conn_id
        self.target_conn_id = target_conn_id

    # ---- connections ---------------------------------------------------------------------
    def source_url(self) -> sa.URL | str:
        """SQLAlchemy URL of the source connection (a ``URL`` object for PostgreSQL, so the
        password is hidden whenever it is rendered)."""
        if not self.source_conn_id:
            raise ConfigurationError(
                "source_conn_id is required: name a postgres, sqlite or mysql connection"
            )
        return _sql_url(self.source_conn_id, "source")

    def checkpoint_url(self) -> sa.URL | str | None:
        """SQLAlchemy URL of the checkpoint mirror's database (``checkpoint_conn_id``), or None."""
        return _sql_url(self.checkpoint_conn_id, "checkpoint") if self.checkpoint_conn_id else None

    def get_conn(self) -> sa.Engine:
        """An autocommit SQLAlchemy engine on the source (the same kind the engine reads with).
        For writes, use ``target_engine``: autocommit does not fit a processor's transaction."""
        return make_engine(self.source_url())  # type: ignore[arg-type]

    def target_engine(self) -> sa.Engine | None:
        """A transactional SQLAlchemy engine on ``target_conn_id`` (None without one), bound
        parameters hidden from logs (``AIRFLOW_KEYSET_LOG_ROW_DATA=1`` shows them). The operator
        hands the engine to the traversal, which begins one transaction per processor call."""
        url = self.target_url()
        return make_target_engine(url) if url is not None else None

    def target_url(self) -> sa.URL | str | None:
        """SQLAlchemy URL of ``target_conn_id`` (the database the processor writes to), or None."""
        return _sql_url(self.target_conn_id, "target") if self.target_conn_id else None

    def redis_client(self) -> redis.Redis:
        """The Redis client of ``redis_conn_id`` (via ``RedisHook``), with socket timeouts.

        A connection whose extra sets ``{"cluster": true}`` gives a ``redis.cluster.RedisCluster``
        (``RedisHook`` builds it; every stream's keys share one hash slot, so the engine's scripts
        run unchanged; its node connections keep redis-py's cluster socket timeouts)."""
        _conn_type(self.redis_conn_id, "Redis (cursor store)", STORE_CONN_TYPES)
        from airflow.providers.redis.hooks.redis import RedisHook

        client = RedisHook(redis_conn_id=self.redis_conn_id).get_conn()
        # a RedisCluster has no single pool: its node clients come with redis-py's own timeouts
        pool_kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
        if isinstance(pool_kwargs, dict):
            for name, value in _REDIS_SOCKET_DEFAULTS.items():
                if pool_kwargs.get(name) is None:
                    pool_kwargs[name] = value
        return client

    # ---- engine objects ------------------------------------------------------------------
    @staticmethod
    def metrics() -> AirflowStatsMetrics:
        return AirflowStatsMetrics()

    def traversal(
        self,
        *,
        table: str,
        key: str | Sequence[str],
        stream: str,
        where: str | None = None,
        where_params: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        key_prefix: str = "ks",
        **kwargs: Any,
    ) -> KeysetTraversal:
        """A ``KeysetTraversal`` over ``table`` of the source connection, cursors in Redis.

        The Redis connection's extra ``{"allow_unverified_eviction_policy": true}`` lets a plan
        go ahead on a server whose ``maxmemory-policy`` cannot be read (CONFIG and INFO refused);
        an ``allkeys-*`` policy is refused either way."""
        if "allow_unverified_eviction_policy" not in kwargs:
            extra = self.get_connection(self.redis_conn_id).extra_dejson
            allow = extra.get("allow_unverified_eviction_policy", False)
            kwargs["allow_unverified_eviction_policy"] = allow is True or str(allow).lower() in {
                "true",
                "1",
                "yes",
            }
        return KeysetTraversal(
            self.source_url(),
            table=table,
            key=key,
            stream=stream,
            where=where,
            where_params=where_params,
            columns=list(columns) if columns is not None else None,
            redis_client=self.redis_client(),
            key_prefix=key_prefix,
            **{
                "metrics": self.metrics(),
                "checkpoint_url": self.checkpoint_url(),
                "target_url": self.target_url(),
                **kwargs,
            },
        )

    def control(self, stream: str, key_prefix: str = "ks") -> StreamControl:
        """Round-level operations on ``stream`` (no source connection needed)."""
        url = self.checkpoint_url()
        return StreamControl(
            CursorStore(self.redis_client(), stream, prefix=key_prefix),
            CheckpointMirror(url) if url is not None else None,
        )


class AirflowStatsMetrics:
    """The engine's metrics (``core.metrics``) sent to Airflow's ``Stats`` as ``keyset.<name>``,
    so they reach StatsD or OpenTelemetry as the deployment configures. Never raises."""

    def incr(self, name: str, count: int = 1, tags: dict[str, str] | None = None) -> None:
        with contextlib.suppress(Exception):
            _stats().incr(f"keyset.{name}", count, tags=tags)

    def timing(self, name: str, ms: float, tags: dict[str, str] | None = None) -> None:
        with contextlib.suppress(Exception):
            _stats().timing(f"keyset.{name}", datetime.timedelta(milliseconds=ms), tags=tags)


def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


__all__ = ["SOURCE_CONN_TYPES", "STORE_CONN_TYPES", "AirflowStatsMetrics", "KeysetHook"]
