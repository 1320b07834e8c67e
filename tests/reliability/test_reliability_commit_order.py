"""Scenario 7, commit order: keys taken out of commit order are never missed.

On PostgreSQL a transaction can hold sequence value 100 uncommitted while 101 is already visible;
a round that ended at ``max(key)`` = 101 without waiting would miss 100 for ever (the next round
starts above 101). Guarantee: ``plan`` reads ``max(key)``, then waits until every transaction
that was open at that moment has ended, so every key at or below the bound that will ever commit
has committed before the round is saved. Chained rounds then cover every committed key exactly
once, whatever the interleaving of writers, commits, rollbacks and rounds.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import reliability_support as rs
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from airflow_keyset_provider.core import Chunk, KeysetTraversal, Round


def _make_table(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE ev (seq bigserial PRIMARY KEY, payload text NOT NULL)"))


class Collector:
    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, chunk: Chunk) -> None:
        with self.lock:
            for k in chunk.keys:
                self.seen[k].append(chunk.round_id)


class HeldTransactions:
    """Transactions that took sequence values and have not committed yet. ``open`` is decremented
    *before* each commit or rollback is sent, so a plan that returns while ``open`` > 0 returned
    while a lower key could still appear."""

    def __init__(self, engine: sa.Engine, n: int) -> None:
        self.conns = [engine.connect() for _ in range(n)]
        self.txs = [c.begin() for c in self.conns]
        self.keys = [
            int(
                c.execute(
                    sa.text("INSERT INTO ev (payload) VALUES ('held') RETURNING seq")
                ).scalar_one()
            )
            for c in self.conns
        ]
        self.open = n
        self.committed: list[int] = []

    def finish(self, rng: random.Random) -> None:
        order = list(range(len(self.conns)))
        rng.shuffle(order)
        for i in order:
            time.sleep(rng.uniform(0.0, 0.03))
            self.open -= 1
            if rng.random() < 0.8:
                self.txs[i].commit()
                self.committed.append(self.keys[i])
            else:
                self.txs[i].rollback()
            self.conns[i].close()


def _traverse_round(t: KeysetTraversal, rnd: Round, proc: Collector) -> None:
    for r in rnd.ranges:
        res = t.traverse(
            rnd.round_id, r.range_id, proc, chunk_size=rnd_chunk(r.range_id), lease_seconds=5
        )
        assert res.complete


def rnd_chunk(i: int) -> int:
    return (7, 50, 500)[i % 3]


def test_plan_waits_for_a_lower_key_committed_after_the_bound_is_read(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """The textbook case: 100 held uncommitted, 101 committed, the plan must wait for 100."""
    _make_table(pg_engine)
    engine = sa.create_engine(pg_schema_url, poolclass=NullPool)
    t = KeysetTraversal(
        pg_schema_url,
        table="ev",
        key="seq",
        redis_url=redis_url,
        stream="order-basic",
        key_prefix=key_prefix,
    )
    held = HeldTransactions(engine, 1)
    with pg_engine.begin() as c:
        high = int(
            c.execute(
                sa.text("INSERT INTO ev (payload) VALUES ('high') RETURNING seq")
            ).scalar_one()
        )
    out: dict[str, Any] = {}

    def plan() -> None:
        out["round"] = t.plan(max_ranges=2, new_stream=True)
        out["open_at_return"] = held.open

    planner = threading.Thread(target=plan)
    planner.start()
    time.sleep(0.3)
    waited = planner.is_alive()
    held.finish(random.Random(1))  # 80 %: commit (seed 1 commits)
    planner.join(60)
    proc = Collector()
    rnd = out["round"]
    _traverse_round(t, rnd, proc)
    t.close_round(rnd.round_id)
    rs.record("7 commit order", trials=1, keys_lost=len(set(held.committed) - set(proc.seen)))
    assert waited, "plan returned while a transaction holding a lower key was still open"
    assert out["open_at_return"] == 0
    assert rnd.end_key == high > held.keys[0]
    assert set(proc.seen) == {*held.committed, high}
    t.close()
    engine.dispose()


def test_randomized_commit_order_never_misses_a_key(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    _make_table(pg_engine)
    engine = sa.create_engine(pg_schema_url, poolclass=NullPool)
    writer_engine = sa.create_engine(pg_schema_url, pool_size=4)
    t = KeysetTraversal(
        pg_schema_url,
        table="ev",
        key="seq",
        redis_url=redis_url,
        stream="order",
        key_prefix=key_prefix,
        commit_wait_timeout=120,
    )
    committed: set[int] = set()
    aborted: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def writer(wseed: int) -> None:
        r = random.Random(wseed)
        while not stop.is_set():
            with writer_engine.connect() as conn:
                tx = conn.begin()
                ks = [
                    int(x)
                    for x in conn.execute(
                        sa.text(
                            "INSERT INTO ev (payload) SELECT 'w' FROM generate_series(1, :n) RETURNING seq"
                        ),
                        {"n": r.randint(1, 3)},
                    ).scalars()
                ]
                time.sleep(r.uniform(0.0, 0.02))
                if r.random() < 0.9:
                    tx.commit()
                    with lock:
                        committed.update(ks)
                else:
                    tx.rollback()
                    with lock:
                        aborted.update(ks)

    writers = [threading.Thread(target=writer, args=(rng.random(),), daemon=True) for _ in range(3)]
    for w in writers:
        w.start()
    proc = Collector()
    rounds: list[Round] = []
    plan_returned_early = 0
    n_trials = rs.trials(20, 1000)
    try:
        for _trial in range(n_trials):
            held = HeldTransactions(engine, rng.randint(1, 3))
            with pg_engine.begin() as c:
                high = int(
                    c.execute(
                        sa.text("INSERT INTO ev (payload) VALUES ('high') RETURNING seq")
                    ).scalar_one()
                )
            with lock:
                committed.add(high)
            out: dict[str, Any] = {}

            def plan_and_traverse(out: dict = out, held: HeldTransactions = held) -> None:
                # traversal starts as soon as the plan returns, while held transactions may still
                # be committing: a bound that did not wait for them would let the cursor pass them
                out["round"] = rnd = t.plan(max_ranges=rng.randint(1, 3), new_stream=True)
                out["open_at_return"] = held.open
                _traverse_round(t, rnd, proc)
                t.close_round(rnd.round_id)

            planner = threading.Thread(target=plan_and_traverse)
            planner.start()
            time.sleep(rng.uniform(0.0, 0.02))
            held.finish(rng)
            planner.join(150)
            with lock:
                committed.update(held.committed)
                aborted.update(set(held.keys) - set(held.committed))
            rnd = out["round"]
            plan_returned_early += out["open_at_return"] > 0
            assert rnd.end_key >= high
            rounds.append(rnd)
    finally:
        stop.set()
        for w in writers:
            w.join(30)
    last = t.plan(max_ranges=2, new_stream=True)  # drain what the writers left
    _traverse_round(t, last, proc)
    t.close_round(last.round_id)
    rounds.append(last)

    seen = set(proc.seen)
    lost = committed - seen
    bounds = {r.round_id: (r.start_key or 0, r.end_key or 0) for r in rounds}
    outside = [
        k
        for k, rids in proc.seen.items()
        for rid in rids
        if not bounds[rid][0] < k <= bounds[rid][1]
    ]
    twice = [k for k, rids in proc.seen.items() if len(rids) > 1]
    rs.record(
        "7 commit order",
        trials=n_trials,
        keys_lost=len(lost),
        counter_errors=len(outside) + len(twice),
        note=f"{len(committed)} committed keys, {len(aborted)} rolled back, {len(rounds)} chained rounds",
    )
    assert not lost, f"seed {seed}: committed keys never traversed: {sorted(lost)[:20]}"
    assert plan_returned_early == 0, (
        f"seed {seed}: plan returned {plan_returned_early} time(s) with a lower key open"
    )
    assert not seen & aborted, (
        f"seed {seed}: rolled-back keys traversed: {sorted(seen & aborted)[:20]}"
    )
    assert not outside and not twice, (
        f"seed {seed}: keys outside their round {outside[:10]} or in two {twice[:10]}"
    )
    t.close()
    engine.dispose()
    writer_engine.dispose()
