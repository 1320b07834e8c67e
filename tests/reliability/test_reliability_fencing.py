"""Scenario 2, stale owner / fencing: a paused worker comes back after another took its range.

Guarantee: a worker that lost its lease (paused past it: GC pause, SIGSTOP, partition) can never
move the cursor again. When it wakes up its advance is refused (``LeaseLostError``) and so is
every later attempt with its old token, whatever cursor values it uses; the cursor never moves
backwards; the range is finished by the new owner with exact counters, and the stale owner's
late side effect is at most the one chunk it had in hand.

Timeline of one trial (the one in ``store.py``'s docstring, with real processes):
A claims the range (lease 1 s) and works; the parent SIGSTOPs A at a random moment; A's lease
expires on the Redis clock; B claims (a takeover) and advances; the parent SIGCONTs A either while
B is still working or after B finished; A must stop with ``LeaseLostError`` and its five stale
advance attempts (to ``hi``, from its last cursor, from the current cursor, in place, backwards)
must all be refused.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import KeysetTraversal


def _effect_batches(engine: sa.Engine, worker: str) -> int:
    with engine.connect() as c:
        return int(
            c.execute(
                sa.text("SELECT count(DISTINCT batch) FROM effects WHERE worker = :w"),
                {"w": worker},
            ).scalar()
            or 0
        )


def _fencing_trial(
    ctx: rs.TrialContext, trial: int, rng: random.Random, tally: rs.Tally
) -> tuple[int, bool]:
    """One timeline; returns (stale advances refused, whether B was still running at A's resume)."""
    with ctx.engine.begin() as c:
        c.execute(sa.text("TRUNCATE effects"))
    stream = f"fence-{trial}"
    t = KeysetTraversal(
        ctx.url,
        table="items",
        key="id",
        redis_url=ctx.redis_url,
        stream=stream,
        key_prefix=ctx.prefix,
    )
    rnd = t.plan(max_ranges=1, new_stream=True)
    base: dict[str, Any] = {
        "db_url": ctx.url,
        "redis_url": ctx.redis_url,
        "key_prefix": ctx.prefix,
        "stream": stream,
        "table": "items",
        "key": "id",
        "round_id": rnd.round_id,
        "range_id": 0,
        "chunk_size": 10,
        "lease_seconds": 1,
    }
    b_running = False
    with rs.CursorWatcher(ctx.redis_url, t.store, rnd.round_id, 1) as watcher:
        a = rs.Worker(
            dict(
                base,
                worker="A",
                lineage=f"A{trial}",
                sleep_per_chunk=0.02,
                stale_probe=True,
                result_path=str(ctx.tmp_path / f"A{trial}.json"),
            )
        )
        rs.wait_for(lambda: _effect_batches(ctx.engine, "A") >= 1, what="A's first chunk")
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(a.pid, signal.SIGSTOP)
        try:
            rs.wait_for(
                lambda: t.range_status(rnd.round_id)[0]["lease_left_s"] == 0,
                what="A's lease to expire",
            )
            b = rs.Worker(
                dict(
                    base,
                    worker="B",
                    lineage=f"B{trial}",
                    sleep_per_chunk=rng.choice([0.0, 0.02]),
                    result_path=str(ctx.tmp_path / f"B{trial}.json"),
                )
            )
            if trial % 2 == 0:
                b.join()  # A wakes up after B finished and released the range
            else:  # A wakes up while B owns the range and works
                rs.wait_for(
                    lambda: _effect_batches(ctx.engine, "B") >= 2 or not b.process.is_alive(),
                    what="B's progress",
                )
                b_running = b.process.is_alive()
        finally:
            os.kill(a.pid, signal.SIGCONT)
        a.join()
        b.join()
    tally.trials += 1
    ao, bo = a.outcome, b.outcome
    refused = 0
    if ao is None or ao["status"] != "lease_lost":
        tally.fail(f"trial {trial}: stale owner A was not fenced: {ao}")
    else:
        probes = ao.get("stale_probes", [])
        ok = [p["refused"] and p["error"].startswith("LeaseLostError") for p in probes]
        refused = sum(ok)
        if len(probes) != 5 or not all(ok):
            tally.fail(
                f"trial {trial}: stale advances not all refused with LeaseLostError: {probes}"
            )
    if bo is None or bo["status"] != "complete" or not bo["takeover"]:
        tally.fail(f"trial {trial}: B did not take over and finish: {bo}")
    report = rs.replay_report(rs.effects(ctx.engine, rnd.round_id))
    replayed = sum(report.per_worker.values())  # both owners' calls that repeated a key
    tally.replay(replayed)
    if replayed > 1 or report.duplicates > 10:
        tally.fail(
            f"trial {trial}: {replayed} replayed chunk(s), {report.duplicates} duplicate keys "
            f"(per worker {report.per_worker}); the stale owner may repeat one chunk only"
        )
    tally.check(
        f"trial {trial}", rs.check_round(ctx.engine, t.store, rnd.round_id, ctx.keys), watcher
    )
    t.close()
    return refused, b_running


def test_stale_owner_is_fenced(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO items SELECT g * 3, 'p' FROM generate_series(1, 300) g"))
    rs.create_effects_table(pg_engine)
    ctx = rs.TrialContext(
        pg_engine,
        pg_schema_url,
        redis_url,
        key_prefix,
        tmp_path,
        rs.encoded_keys(pg_engine, "items", "id"),
    )
    tally = rs.Tally()
    refused = resumed_while_running = 0
    for trial in range(rs.trials(3, 100)):
        n, running = _fencing_trial(ctx, trial, rng, tally)
        refused += n
        resumed_while_running += running
        if tally.failures:
            break
    tally.record(
        "2 stale owner / fencing",
        note=f"{refused} stale advances refused; "
        f"{resumed_while_running} resumes while the new owner ran",
    )
    assert not tally.failures, tally.verdict(seed)
