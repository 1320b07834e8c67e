"""Example 5: the decorator form. Orders still PENDING a day after they were placed are
cancelled with a reason when the nightly round reaches them, in the transaction the engine opens
for each chunk (``target_conn_id``): the write and nothing else commits when the function
returns; a raise rolls it back."""

import datetime as dt

from airflow.sdk import DAG, task

from airflow_keyset_provider import Chunk, ChunkResult
from airflow_keyset_provider.core.writeback import update_rows


@task.keyset_traverse(target_conn_id="orders_db", chunk_size=1000, retries=3)
def cancel_stale(chunk: Chunk) -> ChunkResult:
    rows = [
        {**r, "status": "CANCELLED", "cancel_reason": f"unpaid since {r['created_at']:%F %R}"}
        for r in chunk.rows
    ]
    keys = ["created_at", "id"]
    return update_rows(
        chunk.connection, "orders", keys, rows, {"status": "PENDING"}
    ).to_chunk_result()


with DAG("cancel_stale_orders", schedule="@daily", start_date=dt.datetime(2026, 1, 1)) as dag:
    cancel_stale.round(
        source_conn_id="orders_db",
        table="orders",
        key=["created_at", "id"],
        columns=["id", "created_at"],
        # unpaid for a day: an order placed a minute ago is still being paid
        where="status = 'PENDING' AND created_at < now() - interval '1 day'",
    )
