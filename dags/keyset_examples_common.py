"""Shared code of the example DAGs: settings, table definitions and the processors.

The processors live here (not in the DAG files) so they can be referenced as
``"keyset_examples_common:redispatch"`` and tested against a real database without Airflow:
Airflow puts the DAGs folder on ``sys.path``. Every setting has a default and can be overridden
with an environment variable ``KEYSET_EXAMPLE_<NAME>`` (the tests and the demo do that).

Each processor is idempotent, as the engine requires (a chunk may be delivered again after a
crash): the outbox insert is ``ON CONFLICT DO NOTHING``, the cancellation is guarded by the
expected status, the roll-up rows are keyed by round and sale.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider import Chunk, ChunkResult
from airflow_keyset_provider.core.writeback import guarded_update, upsert


def setting(name: str, default: str) -> str:
    """``KEYSET_EXAMPLE_<NAME>`` from the environment, else ``default``."""
    return os.environ.get(f"KEYSET_EXAMPLE_{name.upper()}", default)


def int_setting(name: str, default: int) -> int:
    return int(setting(name, str(default)))


def float_setting(name: str, default: float) -> float:
    return float(setting(name, str(default)))


def bool_setting(name: str, default: bool) -> bool:
    return setting(name, "1" if default else "0").strip().lower() in {"1", "true", "yes", "on"}


SOURCE_CONN_ID = setting("source_conn", "keyset_examples_db")
REDIS_CONN_ID = setting("redis_conn", "redis_default")
KEY_PREFIX = setting("key_prefix", "ks")
EVENTS_TABLE = setting("events_table", "im_events")
OUTBOX_TABLE = setting("outbox_table", "im_outbox")
ORDERS_TABLE = setting("orders_table", "orders")
SALES_TABLE = setting("sales_table", "sales")
ROLLUP_ROWS_TABLE = setting("rollup_rows_table", "sales_rollup_rows")
ROLLUP_SUMMARY_TABLE = setting("rollup_summary_table", "sales_region_summary")


def task_defaults() -> dict[str, Any]:
    """Tuning shared by the example DAGs (env-overridable so tests and the demo run fast)."""
    return {
        "max_ranges": int_setting("max_ranges", 8),
        "chunk_size": int_setting("chunk_size", 1000),
        "retries": int_setting("retries", 3),
        "retry_delay": dt.timedelta(seconds=float_setting("retry_delay_seconds", 60)),
        "poke_interval": float_setting("poke_interval", 30),
        "barrier_timeout": float_setting("barrier_timeout", 6 * 3600),
    }


# --------------------------------------------------------------------------- tables

_BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only
# text keys in byte order, as keys need; MySQL/MariaDB index no TEXT key (VARCHAR, binary order)
_KEY_TEXT = (
    sa.Text()
    .with_variant(sa.Text(collation="C"), "postgresql")
    .with_variant(sa.String(64, collation="utf8mb4_nopad_bin"), "mysql", "mariadb")
)
_ID_TEXT = sa.Text().with_variant(sa.String(64), "mysql", "mariadb")  # a round id, a region name


def example_metadata() -> sa.MetaData:
    """Every table the examples use (names from the settings)."""
    md = sa.MetaData()
    sa.Table(
        EVENTS_TABLE,
        md,
        sa.Column("seq", _BIGINT, primary_key=True, autoincrement=True),
        sa.Column("user_id", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
    )
    sa.Table(
        OUTBOX_TABLE,
        md,
        sa.Column("event_seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("user_id", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
    )
    orders = sa.Table(
        ORDERS_TABLE,
        md,
        sa.Column("id", _BIGINT, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.Text, nullable=False),
    )
    sa.Index(f"{ORDERS_TABLE}_created_at_id", orders.c.created_at, orders.c.id, unique=True)
    sa.Table(
        SALES_TABLE,
        md,
        sa.Column("region", _KEY_TEXT, primary_key=True),
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
        # integer cents (the engine's fetch cannot read numeric columns on PostgreSQL yet)
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
    )
    sa.Table(
        ROLLUP_ROWS_TABLE,
        md,
        sa.Column("round_id", _ID_TEXT, primary_key=True),
        sa.Column("region", _ID_TEXT, primary_key=True),
        sa.Column("sale_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
    )
    sa.Table(
        ROLLUP_SUMMARY_TABLE,
        md,
        sa.Column("round_id", _ID_TEXT, primary_key=True),
        sa.Column("region", _ID_TEXT, primary_key=True),
        sa.Column("sales", sa.BigInteger, nullable=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
    )
    return md


def create_example_tables(bind: sa.Engine | sa.Connection) -> None:
    """Create the example tables that do not exist yet."""
    example_metadata().create_all(bind, checkfirst=True)


# --------------------------------------------------------------------------- connections

_ENGINES: dict[tuple[str, Any], sa.Engine] = {}


def target_engine(conn_id: str = SOURCE_CONN_ID) -> sa.Engine:
    """A transactional engine on an Airflow connection, for a processor's writes.

    One engine per task try (Airflow runs each try in a process of its own; under ``dag.test``
    several tries share a process, hence the try in the cache key), created on first use, so the
    connection is looked up once per try, not once per chunk. Outside a task (a processor under
    test) it is cached per connection id.
    """
    from airflow_keyset_provider.hooks.keyset import KeysetHook

    try:
        from airflow.sdk import get_current_context

        ti = get_current_context()["ti"]
        scope: Any = (str(ti.id), ti.try_number)
    except Exception:  # not inside a running task
        scope = None
    engine = _ENGINES.get((conn_id, scope))
    if engine is None:
        for old in [k for k in _ENGINES if k[0] == conn_id]:
            _ENGINES.pop(old).dispose()
        engine = KeysetHook(target_conn_id=conn_id).target_engine()  # hides bound parameters
        assert engine is not None
        create_example_tables(engine)
        _ENGINES[(conn_id, scope)] = engine
    return engine


# --------------------------------------------------------------------------- processors


def redispatch(chunk: Chunk) -> ChunkResult:
    """DAG 1: copy each event of the chunk into the outbox, idempotently.

    ``INSERT ... ON CONFLICT (event_seq) DO NOTHING`` in one statement per chunk: an event that is
    already in the outbox (delivered again after a crash) counts as *skipped*, a new one as *done*.
    """
    rows = [
        {"event_seq": r["seq"], "user_id": r["user_id"], "kind": r["kind"], "payload": r["payload"]}
        for r in chunk.rows
    ]
    with target_engine().begin() as conn:
        outcome = upsert(conn, OUTBOX_TABLE, rows, conflict="event_seq")
    return outcome.to_chunk_result()


def cancel_expired(chunk: Chunk) -> ChunkResult:
    """DAG 2: ``PENDING -> CANCELLED`` for every order of the chunk, guarded by the status.

    One guarded bulk UPDATE per chunk (``WHERE id IN (...) AND status = 'PENDING'``); an order
    that is no longer PENDING when the update runs (paid meanwhile: it lost the race to the
    payment, or was settled before) is left alone and reported as *skipped*.
    """
    by_id = {key[1]: key for key in chunk.keys}  # key = (created_at, id)
    with target_engine().begin() as conn:
        outcome = guarded_update(
            conn,
            ORDERS_TABLE,
            "id",
            list(by_id),
            values={"status": "CANCELLED"},
            expected={"status": "PENDING"},
        )
    return ChunkResult(
        failed={by_id[i]: reason for i, reason in outcome.failed.items()},
        skipped=[by_id[i] for i in outcome.not_applied],
    )


def cancel_pending(chunk: Chunk) -> ChunkResult:
    """DAG 6: ``PENDING -> CANCELLED`` through ``chunk.connection`` (the transaction the engine
    opens for the call on ``target_conn_id``), guarded by the status: an order paid meanwhile is
    *skipped*. Writing only through ``chunk.connection`` is what lets a preview run it on a
    sample and roll it back."""
    by_id = {key[1]: key for key in chunk.keys}  # key = (created_at, id)
    outcome = guarded_update(
        chunk.connection,
        ORDERS_TABLE,
        "id",
        list(by_id),
        values={"status": "CANCELLED"},
        expected={"status": "PENDING"},
    )
    return ChunkResult(
        failed={by_id[i]: reason for i, reason in outcome.failed.items()},
        skipped=[by_id[i] for i in outcome.not_applied],
    )


def collect_shard(chunk: Chunk) -> ChunkResult:
    """DAG 3: record each sale of the chunk for this round (keyed by round and sale, so a chunk
    delivered again is *skipped*, never counted twice)."""
    rows = [
        {
            "round_id": chunk.round_id,
            "region": r["region"],
            "sale_id": r["id"],
            "amount_cents": r["amount_cents"],
        }
        for r in chunk.rows
    ]
    with target_engine().begin() as conn:
        outcome = upsert(
            conn,
            ROLLUP_ROWS_TABLE,
            rows,
            conflict=["round_id", "region", "sale_id"],
            key=["region", "sale_id"],
        )
    return outcome.to_chunk_result()


def summarize_round(totals: dict[str, Any]) -> dict[str, Any]:
    """DAG 3's summary: per-region totals of a *closed* round, written to the summary table.

    ``totals`` is the barrier's XCom. The summary refuses to run on part of the data: it checks
    that the rows recorded for the round are exactly ``done + skipped`` of the closed round and
    that nothing was dead-lettered.
    """
    round_id = totals["round_id"]
    md = example_metadata()
    rollup, summary = md.tables[ROLLUP_ROWS_TABLE], md.tables[ROLLUP_SUMMARY_TABLE]
    with target_engine().begin() as conn:
        per_region = conn.execute(
            sa.select(
                rollup.c.region,
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(rollup.c.amount_cents), 0),
            )
            .where(rollup.c.round_id == round_id)
            .group_by(rollup.c.region)
            .order_by(rollup.c.region)
        ).all()
        recorded = sum(int(n) for _, n, _ in per_region)
        expected = int(totals["done"]) + int(totals["skipped"])
        if int(totals["dead"]) or recorded != expected:
            raise RuntimeError(
                f"round {round_id}: {recorded} sale(s) recorded, the closed round traversed {expected} "
                f"and dead-lettered {totals['dead']}; refusing to publish a partial summary"
            )
        rows = [
            {"round_id": round_id, "region": region, "sales": int(n), "amount_cents": int(cents)}
            for region, n, cents in per_region
        ]
        if rows:
            upsert(
                conn,
                summary,
                rows,
                conflict=["round_id", "region"],
                update=["sales", "amount_cents"],
            )
    return {
        "round_id": round_id,
        "sales": recorded,
        "regions": {
            r["region"]: {"sales": r["sales"], "amount_cents": r["amount_cents"]} for r in rows
        },
    }
