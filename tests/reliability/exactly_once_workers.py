"""Worker processes for the exactly-once scenario (``test_reliability_exactly_once.py``).

Like ``reliability_workers``, one ``traverse`` per process with crash hooks, but the processor
writes through ``chunk.connection`` (the engine's transaction on the target, here the same
PostgreSQL schema) into ``xeffects``, a table with no unique constraint: one row per delivered
key. With ``exactly_once`` those rows commit with the range's ledger row; without it (the
control) they commit when the processor returns.

Crash hooks (``spec["crash"] = {"point": ..., "nth": n}``), SIGKILL the n-th time at:
``fetch`` (before a chunk query), ``processor_after_effect`` (inside the processor, after its
insert, before the engine commits anything), ``advance_before`` (after the target's commit,
before the Redis advance: the crash this mode exists for), ``advance_after`` (Redis committed the
advance, the worker never heard back).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from reliability_workers import CrashPlan

from airflow_keyset_provider.core import Chunk, KeysetTraversal, LeaseLostError

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS xeffects (k bigint NOT NULL, worker text NOT NULL)"


def run_worker(spec: dict[str, Any]) -> None:
    """Entry point of a worker process."""
    crash = CrashPlan(spec.get("crash"))
    t = KeysetTraversal(
        spec["db_url"],
        table="items",
        key="id",
        redis_url=spec["redis_url"],
        stream=spec["stream"],
        key_prefix=spec["key_prefix"],
        target_url=spec["db_url"],
        checkpoint_url=spec["db_url"] if spec.get("mirror") else None,
        checkpoint_seconds=spec.get("checkpoint_seconds", 0.0),
    )
    real_fetch, real_advance = t.source.fetch, t.store.advance

    def fetch(lo: str, hi: str, n: int) -> list[tuple]:
        crash.reach("fetch")
        return real_fetch(lo, hi, n)

    def advance(*args: Any, **kwargs: Any) -> Any:
        crash.reach("advance_before")
        out = real_advance(*args, **kwargs)
        crash.reach("advance_after")
        return out

    t.source.fetch, t.store.advance = fetch, advance  # type: ignore[method-assign]
    sleep = float(spec.get("sleep_per_chunk", 0.0))

    def processor(chunk: Chunk) -> None:
        if sleep:
            time.sleep(sleep)
        chunk.connection.execute(
            sa.text("INSERT INTO xeffects (k, worker) VALUES (:k, :w)"),
            [{"k": k, "w": spec["worker"]} for k in chunk.keys],
        )
        crash.reach("processor_after_effect")

    outcome: dict[str, Any] = {"pid": os.getpid(), "worker": spec["worker"]}
    try:
        res = t.traverse(
            spec["round_id"],
            spec["range_id"],
            processor,
            chunk_size=spec["chunk_size"],
            lease_seconds=spec["lease_seconds"],
            owner_lineage=spec["lineage"],
            claim_timeout=60.0,
            backoff_base=0.05,
            backoff_max=0.2,
            log_every_seconds=3600,
            exactly_once=spec["exactly_once"],
        )
        outcome.update(status="complete" if res.complete else "returned", takeover=res.takeover)
    except LeaseLostError as exc:
        outcome.update(status="lease_lost", error=str(exc))
    except Exception as exc:  # reported to the parent, which fails the test with it
        outcome.update(
            status="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()
        )
    tmp = Path(spec["result_path"] + ".tmp")
    tmp.write_text(json.dumps(outcome, default=str))
    os.replace(tmp, spec["result_path"])
    t.close()
