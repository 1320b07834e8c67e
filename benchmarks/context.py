"""Run-wide settings and connections shared by every metric."""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import redis
import sqlalchemy as sa

DEFAULT_PG_URL = os.environ.get(
    "KEYSET_BENCH_POSTGRES_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)
DEFAULT_REDIS_URL = os.environ.get("KEYSET_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
# server URL without a database: the MariaDB/MySQL write-back metrics use a throwaway database
DEFAULT_MYSQL_URL = os.environ.get("KEYSET_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/")
# mysqlclient when installed (the mysql-native extra: the faster driver), else PyMySQL
_MYSQL_DRIVER = "mysqldb" if importlib.util.find_spec("MySQLdb") else "pymysql"
DEFAULT_MARIADB_URL = os.environ.get(
    "KEYSET_BENCH_MARIADB_URL", f"mysql+{_MYSQL_DRIVER}://root@127.0.0.1:3306/test"
)


@dataclass
class BenchContext:
    """What every metric needs: sizes, URLs, the run's Redis key prefix and a result cache.

    ``pg_url`` is a SQLAlchemy URL; the engine gets it as is and the hand-written baselines get
    the same server through ``dsn`` (plain psycopg2), so both sides use the same driver.
    """

    rows: int = 2_000_000
    repeat: int = 3
    schema: str = "kbench"
    pg_url: str = DEFAULT_PG_URL
    redis_url: str = DEFAULT_REDIS_URL
    mysql_url: str = DEFAULT_MYSQL_URL
    mariadb_url: str = DEFAULT_MARIADB_URL
    chunk_size: int = 10_000
    io_wait_ms: float = 3.0
    wb_rows: int = 10_000
    deco_rows: int = 1_000_000
    ranges: int = 16
    prefix: str = field(default_factory=lambda: f"kbench{uuid.uuid4().hex[:8]}")
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def small_rows(self) -> int:
        """The comparison size of the scaling metrics (the issue's 1M vs 10M)."""
        return max(self.rows // 10, 1_000)

    @property
    def dsn(self) -> str:
        """libpq URI of the same server/database for psycopg2.connect."""
        url = sa.engine.make_url(self.pg_url).set(drivername="postgresql")
        return url.render_as_string(hide_password=False)

    def table(self, role: str) -> str:
        return f"{self.schema}.{role}"

    def pg(self, autocommit: bool = True) -> Any:
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = autocommit
        return conn

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def stream(self, name: str) -> str:
        """A fresh stream name (one per measured round, so no round chains into another)."""
        return f"{name}-{uuid.uuid4().hex[:8]}"

    def stream_keys(self, stream: str) -> list[bytes]:
        client = self.redis()
        try:
            return list(client.scan_iter(match=f"{self.prefix}:{{{stream}}}:*", count=1000))
        finally:
            client.close()

    def cleanup_redis(self) -> int:
        """Delete every key this run wrote (all under ``<prefix>:``)."""
        client = self.redis()
        n = 0
        try:
            batch: list[bytes] = []
            for key in client.scan_iter(match=f"{self.prefix}:*", count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    n += int(client.delete(*batch))
                    batch.clear()
            if batch:
                n += int(client.delete(*batch))
        finally:
            client.close()
        return n


@contextmanager
def pg_cursor(ctx: BenchContext, autocommit: bool = True) -> Iterator[Any]:
    conn = ctx.pg(autocommit)
    try:
        with conn.cursor() as cur:
            yield cur
        if not autocommit:
            conn.commit()
    finally:
        conn.close()
