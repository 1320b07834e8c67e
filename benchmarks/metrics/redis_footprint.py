"""Issue #11: Redis state of a 4,096-range round, and how long one status read holds Redis.

A 4,096-range round is planned with the store API (keys like a 41M-row bigint table), half its
ranges are traversed as ``run_range`` does (claim, two chunks, release) while 16 tasks hold a
range each mid-way, then every range completes and the round closes. At each of the four stages
the sum of ``MEMORY USAGE <key> SAMPLES 0`` over the stream's keys is read (``memory.py``'s
helper). Then the round's status is read in its batches (``StoreReads.ranges``: one script per
``READ_BATCH`` ranges), each batch timed on its own as a round trip: an upper bound on how long
one call holds the server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, CursorStore
from airflow_keyset_provider.core.store.reads import READ_BATCH
from benchmarks.context import BenchContext
from benchmarks.report import Metric

N_RANGES = 4096
BUDGET_BYTES = 1_000_000
ROWS = 10_000  # per range
LEASE_MS = 600_000
TASKS = 16


def _k(i: int) -> str:
    return MIN_KEY if i == 0 else encode_key((i * ROWS,))


def _claim(store: CursorStore, rid: str, i: int) -> tuple[str, str]:
    """Claim range ``i`` with an Airflow-shaped lineage and token; ``(token, cursor)``."""
    lineage = f"bench_nightly/scheduled__2026-12-01T00:00:00+00:00/traverse/{i}"
    token = f"{lineage}#{uuid.uuid4().hex[:12]}"
    claim = store.claim(rid, i, token, lineage, LEASE_MS)
    if not isinstance(claim, Claim) or claim.complete:
        raise RuntimeError(f"range {i} could not be claimed: {claim}")
    return token, claim.cursor


def _advance(store: CursorStore, rid: str, i: int, token: str, frm: str, to: str) -> None:
    store.advance(
        rid, i, token, frm, to, done=ROWS // 2, skipped=0, lease_ms=LEASE_MS, max_item_attempts=3
    )


def _half(i: int) -> str:
    return encode_key((i * ROWS + ROWS // 2,))


def _run(store: CursorStore, rid: str, i: int) -> None:
    token, cursor = _claim(store, rid, i)
    _advance(store, rid, i, token, cursor, _half(i))
    _advance(store, rid, i, token, _half(i), _k(i + 1))
    store.release(rid, i, token)


def _stages(ctx: BenchContext, store: CursorStore, stream: str) -> tuple[str, dict[str, int]]:
    from benchmarks.metrics.memory import redis_bytes

    bounds = [(_k(i), _k(i + 1)) for i in range(N_RANGES)]
    rid, _ = store.create_round(
        idempotency_key=None,
        chained=True,
        start=bounds[0][0],
        end=bounds[-1][1],
        source='{"table": "public.events", "key": ["id"]}',
        arity=1,
        bounds=bounds,
    )
    sizes = {"planned": redis_bytes(ctx, stream)[0]}
    for i in range(N_RANGES // 2):
        _run(store, rid, i)
    held = {}
    for i in range(N_RANGES // 2, N_RANGES // 2 + TASKS):
        token, cursor = _claim(store, rid, i)
        _advance(store, rid, i, token, cursor, _half(i))
        held[i] = token
    sizes["running"] = redis_bytes(ctx, stream)[0]
    for i, token in held.items():
        _advance(store, rid, i, token, _half(i), _k(i + 1))
        store.release(rid, i, token)
    for i in range(N_RANGES // 2 + TASKS, N_RANGES):
        _run(store, rid, i)
    sizes["complete"] = redis_bytes(ctx, stream)[0]
    store.close_round(rid)
    sizes["closed"] = redis_bytes(ctx, stream)[0]
    return rid, sizes


def _status_calls(store: CursorStore, rid: str) -> dict[str, Any]:
    """Each batch of a status read of the round, timed alone (round trip, ms)."""
    times = []
    for first in range(0, N_RANGES, READ_BATCH):
        t0 = time.perf_counter()
        store._read_ranges(rid, first, min(first + READ_BATCH, N_RANGES))
        times.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    store.ranges(rid)
    whole = (time.perf_counter() - t0) * 1000
    return {
        "status_calls": len(times),
        "ranges_per_call": READ_BATCH,
        "slowest_call_ms": round(max(times), 2),
        "median_call_ms": round(sorted(times)[len(times) // 2], 2),
        "status_read_ms": round(whole, 1),
    }


def run(ctx: BenchContext) -> Metric:
    stream = ctx.stream("mem-4096")
    client = ctx.redis()
    try:
        store = CursorStore(client, stream, prefix=ctx.prefix)
        rid, sizes = _stages(ctx, store, stream)
        calls = _status_calls(store, rid)
    finally:
        client.close()
    top = max(sizes.values())
    stage = max(sizes, key=lambda s: sizes[s])
    figures = ", ".join(f"{s} {b / 1000:,.0f} KB" for s, b in sizes.items())
    return Metric(
        "redis_4096_bytes",
        "memory",
        f"Redis bytes of a {N_RANGES}-range round, largest of its stages",
        float(top),
        float(BUDGET_BYTES),
        "bytes",
        top / BUDGET_BYTES,
        "<= 1.00x (1 MB)",
        top <= BUDGET_BYTES,
        f"{figures} (largest: {stage}, {top / N_RANGES:.0f} B per range); status read: "
        f"{calls['status_calls']} calls of {READ_BATCH} ranges, round trip median "
        f"{calls['median_call_ms']:.1f} ms, slowest {calls['slowest_call_ms']:.1f} ms",
        {"stages": sizes, "ranges": N_RANGES, **calls},
    )
