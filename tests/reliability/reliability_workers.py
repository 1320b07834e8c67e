"""Worker processes for the reliability suite: one ``traverse`` per process, with crash hooks.

A worker is started by the parent test (``reliability_support.start_worker``) in its own process
and gets a JSON-safe *spec* (a dict). It builds a ``KeysetTraversal`` exactly like a user would,
runs ``traverse`` on one range and writes its outcome to ``spec["result_path"]`` (atomically, so a
killed worker leaves no file). Its processor is the *independent record of side effects*: for
every chunk it inserts one row per key into the PostgreSQL table ``effects`` and commits that
transaction *before returning*, so a worker that dies between its side effect and the cursor
advance leaves the evidence the parent needs to count replays.

Crash hooks (``spec["crash"] = {"point": ..., "nth": n}``) make the worker SIGKILL itself the
n-th time it reaches ``point``:

``fetch``                   before a chunk query (also the prefetch thread's)
``processor_before_effect`` inside the processor, before the side effect
``processor_after_effect``  inside the processor, after the side effect committed
``advance_before``          between the side effect and the advance (the Lua call not sent)
``advance_after``           inside the advance call: Redis committed it, the worker never hears back
``retry_pass``              before an item-retry pass reads its rows

The hooks wrap the engine objects' methods on the instance (``t.source.fetch``,
``t.store.advance``); nothing of the engine is changed. A worker may also be killed from outside
(the parent sends SIGKILL / SIGSTOP / SIGCONT at a time of its choosing).
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider.core import (
    Chunk,
    ChunkResult,
    KeysetTraversal,
    LeaseLostError,
)
from airflow_keyset_provider.core.keys import as_tuple, encode_key

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS effects ("
    " id bigserial PRIMARY KEY,"
    " k text NOT NULL,"  # the encoded key (order-preserving, compares like the cursor)
    " round_id text NOT NULL,"
    " range_id int NOT NULL,"
    " pid int NOT NULL,"
    " worker text NOT NULL,"
    " batch text NOT NULL,"  # one id per processor call
    " chunk_attempt int NOT NULL,"
    " ok boolean NOT NULL,"  # false: the item failed on its own in this call
    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
)


def die() -> None:
    """SIGKILL this process: no finally blocks, no atexit, no release of the lease."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


class CrashPlan:
    """Counts how often each hook point is reached and kills the process at the planned one."""

    def __init__(self, crash: dict[str, Any] | None) -> None:
        self.point = crash["point"] if crash else None
        self.nth = int(crash["nth"]) if crash else 0
        self.seen: dict[str, int] = {}

    def reach(self, point: str) -> None:
        self.seen[point] = self.seen.get(point, 0) + 1
        if point == self.point and self.seen[point] == self.nth:
            die()


class EffectsProcessor:
    """Records every delivered key in ``effects`` (own committed transaction), then returns.

    ``flaky``: encoded keys that fail on their own the first time they are delivered (the failure
    is recorded with ``ok = false`` in the same transaction), and succeed afterwards.
    ``sleep``: seconds per chunk, so that external signals land while the worker is busy.
    """

    def __init__(self, engine: sa.Engine, spec: dict[str, Any], crash: CrashPlan) -> None:
        self.engine = engine
        self.spec = spec
        self.crash = crash
        self.flaky = set(spec.get("flaky", ()))
        self.sleep = float(spec.get("sleep_per_chunk", 0.0))
        self.arity = 1 if isinstance(spec["key"], str) else len(spec["key"])
        self.pid = os.getpid()

    def __call__(self, chunk: Chunk) -> ChunkResult:
        self.crash.reach("processor_before_effect")
        if self.sleep:
            time.sleep(self.sleep)
        encoded = [encode_key(as_tuple(k, self.arity)) for k in chunk.keys]
        by_enc = dict(zip(encoded, chunk.keys, strict=True))
        batch = uuid.uuid4().hex
        failed: dict[Any, str] = {}
        with self.engine.begin() as conn:
            candidates = [e for e in encoded if e in self.flaky]
            if candidates:
                seen_fail = {
                    r[0]
                    for r in conn.execute(
                        sa.text("SELECT DISTINCT k FROM effects WHERE NOT ok AND k = ANY(:ks)"),
                        {"ks": candidates},
                    )
                }
                failed = {
                    by_enc[e]: f"flaky item {e}: first delivery fails"
                    for e in candidates
                    if e not in seen_fail
                }
            failed_enc = {encode_key(as_tuple(k, self.arity)) for k in failed}
            conn.execute(
                sa.text(
                    "INSERT INTO effects (k, round_id, range_id, pid, worker, batch, chunk_attempt, ok) "
                    "VALUES (:k, :r, :i, :p, :w, :b, :a, :ok)"
                ),
                [
                    {
                        "k": e,
                        "r": chunk.round_id,
                        "i": chunk.range_id,
                        "p": self.pid,
                        "w": self.spec["worker"],
                        "b": batch,
                        "a": chunk.attempt,
                        "ok": e not in failed_enc,
                    }
                    for e in encoded
                ],
            )
        self.crash.reach("processor_after_effect")
        return ChunkResult(failed=failed)


def _write_result(path: str, payload: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(payload, default=str))
    os.replace(tmp, path)


def run_worker(spec: dict[str, Any]) -> None:
    """Entry point of a worker process (see the module docstring for ``spec``)."""
    crash = CrashPlan(spec.get("crash"))
    engine = sa.create_engine(spec.get("effects_url", spec["db_url"]), pool_size=1)  # PostgreSQL
    t = KeysetTraversal(
        spec["db_url"],
        table=spec["table"],
        key=spec["key"],
        redis_url=spec["redis_url"],
        stream=spec["stream"],
        key_prefix=spec["key_prefix"],
    )
    tokens: list[str] = []
    committed: list[str] = []

    real_fetch, real_fetch_keys = t.source.fetch, t.source.fetch_keys
    real_advance, real_claim = t.store.advance, t.store.claim

    def fetch(lo: str, hi: str, n: int) -> list[tuple]:
        crash.reach("fetch")
        return real_fetch(lo, hi, n)

    def fetch_keys(keys: Any) -> list[tuple]:
        crash.reach("retry_pass")
        return real_fetch_keys(keys)

    def advance(*args: Any, **kwargs: Any) -> Any:
        crash.reach("advance_before")
        out = real_advance(*args, **kwargs)
        committed.append(out.cursor)
        crash.reach("advance_after")
        return out

    def claim(round_id: str, range_id: int, token: str, *args: Any, **kwargs: Any) -> Any:
        tokens.append(token)
        return real_claim(round_id, range_id, token, *args, **kwargs)

    t.source.fetch, t.source.fetch_keys = fetch, fetch_keys  # type: ignore[method-assign]
    t.store.advance, t.store.claim = advance, claim  # type: ignore[method-assign]

    outcome: dict[str, Any] = {"pid": os.getpid(), "worker": spec["worker"]}
    try:
        res = t.traverse(
            spec["round_id"],
            spec["range_id"],
            EffectsProcessor(engine, spec, crash),
            chunk_size=spec["chunk_size"],
            lease_seconds=spec["lease_seconds"],
            owner_lineage=spec.get("lineage", ""),
            claim_timeout=spec.get("claim_timeout", 60.0),
            max_item_attempts=spec.get("max_item_attempts", 3),
            item_retry_delay=0.01,
            backoff_base=0.05,
            backoff_max=0.2,
            log_every_seconds=3600,
            **(
                {"group_commit_chunks": spec["group_commit_chunks"]}
                if spec.get("group_commit_chunks")
                else {}
            ),
        )
        outcome.update(
            status="complete" if res.complete else "returned",
            result=res.as_dict(),
            cursor=res.cursor,
            takeover=res.takeover,
        )
    except LeaseLostError as exc:
        outcome.update(status="lease_lost", error=str(exc))
    except Exception as exc:  # reported to the parent, which fails the test with it
        outcome.update(
            status="error", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()
        )
    outcome["token"] = tokens[-1] if tokens else None
    outcome["committed"] = committed
    if spec.get("stale_probe") and outcome["token"]:
        outcome["stale_probes"] = stale_probes(t, spec, outcome["token"], committed)
    _write_result(spec["result_path"], outcome)
    t.close()
    engine.dispose()


def stale_probes(
    t: KeysetTraversal, spec: dict[str, Any], token: str, committed: list[str]
) -> list[dict[str, Any]]:
    """After losing the range, try to advance it with the old token in every way that could hurt:
    to ``hi``, from the last cursor this worker committed, from the range's current cursor, and
    backwards. Every attempt must be refused with ``LeaseLostError``."""
    store = t.store
    rng = store.ranges(spec["round_id"])[spec["range_id"]]
    mine = committed[-1] if committed else rng["lo"]
    attempts = [
        (mine, rng["hi"]),
        (rng["cursor"], rng["hi"]),
        (rng["cursor"], rng["cursor"]),
        (mine, mine),
        (rng["cursor"], rng["lo"]),
    ]
    out = []
    for expected, new in attempts:
        try:
            store.advance(
                spec["round_id"],
                spec["range_id"],
                token,
                expected,
                new,
                done=1,
                skipped=0,
                lease_ms=60_000,
                max_item_attempts=3,
            )
            out.append({"expected": expected, "new": new, "refused": False, "error": None})
        except Exception as exc:
            out.append(
                {
                    "expected": expected,
                    "new": new,
                    "refused": True,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
    return out
