"""The processor of ``keyset_celery_kill``, referenced by the string
``"keyset_celery_effects:record_and_sleep"``: it resolves on a Celery worker only because this
module sits in the DAG bundle (the DAGs folder), which the task process puts on ``sys.path``
when it parses the DAG. (``.airflowignore`` keeps the DAG processor from parsing it as a DAG.)

For every chunk delivered it upserts each key into ``KEYSET_CELERY_EFFECTS`` (``processed`` counts
the deliveries of that key, so a replayed key shows ``processed >= 2``), appends one row to
``KEYSET_CELERY_CHUNKS`` (range, task map index and try, task process and its supervisor, worker,
first/last key), commits, then sleeps ``KEYSET_CELERY_SLEEP_S`` so a kill lands in the middle of a
range; ``KEYSET_CELERY_SLOW_SLEEP_S`` instead for a chunk whose last key is above
``KEYSET_CELERY_SLOW_ABOVE`` (a straggler: keys slow to process).
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa
from airflow.sdk import get_current_context

from airflow_keyset_provider import Chunk

SOURCE_CONN_ID = os.environ.get("KEYSET_CELERY_SOURCE_CONN", "keyset_celery_db")
EFFECTS_TABLE = os.environ.get("KEYSET_CELERY_EFFECTS", "celery_effects")
CHUNKS_TABLE = os.environ.get("KEYSET_CELERY_CHUNKS", "celery_chunks")
SLEEP_S = float(os.environ.get("KEYSET_CELERY_SLEEP_S", "0.15"))
SLOW_ABOVE = int(os.environ.get("KEYSET_CELERY_SLOW_ABOVE", "0"))  # 0: no slow keys
SLOW_SLEEP_S = float(os.environ.get("KEYSET_CELERY_SLOW_SLEEP_S", "0"))
WORKER = os.environ.get("KEYSET_CELERY_WORKER_HOST", "unknown")  # set per worker by the test

_ENGINE: sa.Engine | None = None  # one per task process: each try runs in a process of its own


def _engine() -> sa.Engine:
    global _ENGINE
    if _ENGINE is None:
        from airflow_keyset_provider.hooks.keyset import KeysetHook

        _ENGINE = sa.create_engine(KeysetHook(SOURCE_CONN_ID).source_url(), pool_size=1)
    return _ENGINE


def record_and_sleep(chunk: Chunk) -> None:
    """Count every delivered key, log the chunk (try, pids, worker), commit, then take a while."""
    keys = list(chunk.keys)
    if keys:
        ti = get_current_context()["ti"]
        try_number, map_index = ti.try_number, ti.map_index
        with _engine().begin() as conn:
            conn.execute(
                sa.text(
                    f"INSERT INTO {EFFECTS_TABLE} (seq, range_id, processed, tries) "
                    "VALUES (:seq, :range_id, 1, ARRAY[:try_number]) ON CONFLICT (seq) DO UPDATE "
                    f"SET processed = {EFFECTS_TABLE}.processed + 1, "
                    f"tries = {EFFECTS_TABLE}.tries || excluded.tries"
                ),
                [{"seq": k, "range_id": chunk.range_id, "try_number": try_number} for k in keys],
            )
            conn.execute(
                sa.text(
                    f"INSERT INTO {CHUNKS_TABLE} (range_id, map_index, try_number, pid, ppid, worker, "
                    "first_key, last_key, n) VALUES (:range_id, :map_index, :try_number, :pid, "
                    ":ppid, :worker, :first, :last, :n)"
                ),
                {
                    "range_id": chunk.range_id,
                    "map_index": map_index,
                    "try_number": try_number,
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "worker": WORKER,
                    "first": keys[0],
                    "last": keys[-1],
                    "n": len(keys),
                },
            )
    slow = SLOW_ABOVE > 0 and bool(keys) and keys[-1] > SLOW_ABOVE
    time.sleep(SLOW_SLEEP_S if slow else SLEEP_S)
