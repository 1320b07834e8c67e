"""A processor with every verdict it can give: done, skipped, failed (bad item), retry (dependency down).

Table: ``coupons (id bigint PRIMARY KEY, currency text NOT NULL, status text NOT NULL)``.
"""

import os

import sqlalchemy as sa

from airflow_keyset_provider import Chunk, ChunkResult, RetryableError
from airflow_keyset_provider.core.writeback import guarded_update

CURRENCIES = {"EUR", "USD", "JPY"}
# One engine per process, created once: never one connection per chunk.
engine = sa.create_engine(
    os.environ.get("KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"),
    pool_pre_ping=True,
)


def expire_coupons(chunk: Chunk) -> ChunkResult:
    """ACTIVE -> EXPIRED, one guarded UPDATE per chunk, so running it twice changes nothing."""
    bad = {
        r["id"]: f"unknown currency {r['currency']!r}"
        for r in chunk.rows
        if r["currency"] not in CURRENCIES
    }
    ids = [r["id"] for r in chunk.rows if r["id"] not in bad]
    try:
        with engine.begin() as conn:
            outcome = guarded_update(
                conn,
                "coupons",
                "id",
                ids,
                values={"status": "EXPIRED"},
                expected={"status": "ACTIVE"},
            )
    except (
        sa.exc.OperationalError
    ) as exc:  # the database is down: keep the cursor, back off, re-read
        raise RetryableError(f"coupons database unavailable: {exc}") from exc
    # bad items are retried, then dead-lettered; rows that were not ACTIVE any more count as skipped
    return ChunkResult(failed={**bad, **outcome.failed}, skipped=outcome.not_applied)
