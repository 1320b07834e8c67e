"""Scenario 5, poison items: bad items are dead-lettered, their neighbours finish.

Guarantee: an item the processor reports as failed (``ChunkResult.failed``) is delivered again in
the range's retry passes, up to ``max_item_attempts`` deliveries in all, and then dead-lettered
with the processor's error text and its attempt count; the cursor moves on at once, so every
other item of the range (its neighbours in key order included) is processed; items that fail
fewer times than that end as done; skipped items count as skipped. The counters are exact:
``done + skipped + dead`` = keys, ``dead`` = poison items, ``done`` = distinct keys processed.

Replay: once the cause is fixed, ``KeysetTraversal.replay_dead_letters`` delivers every letter
again (fenced, at-least-once); the letters leave the list and the counters move from dead to done.
(A replay refused while another owner holds the range: tests/core/test_traversal.py.)
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from typing import Any

import reliability_support as rs
import sqlalchemy as sa

from airflow_keyset_provider.core import Chunk, ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.keys import encode_key

MAX_ATTEMPTS = 3


def reason(k: int) -> str:
    return f"poison item {k}: payload fails the schema check (field 'amount' is not a number)"


class PoisonProcessor:
    """Fails ``poison`` keys every time, ``flaky`` keys the first ``flaky[k]`` times, skips
    ``skip`` keys; records every delivery in ``effects`` (ok = processed successfully)."""

    def __init__(
        self, engine: sa.Engine, poison: set[int], flaky: dict[int, int], skip: set[int]
    ) -> None:
        self.engine, self.poison, self.flaky, self.skip = engine, poison, flaky, skip
        self.deliveries: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __call__(self, chunk: Chunk) -> ChunkResult:
        failed: dict[Any, str] = {}
        skipped: list[Any] = []
        rows = []
        with self.lock:
            for k in chunk.keys:
                self.deliveries[k] += 1
                if k in self.poison:
                    failed[k] = reason(k)
                elif self.deliveries[k] <= self.flaky.get(k, 0):
                    failed[k] = f"flaky item {k}: timeout talking to the item's owner"
                elif k in self.skip:
                    skipped.append(k)
                    continue
                rows.append(
                    {
                        "k": encode_key((k,)),
                        "r": chunk.round_id,
                        "i": chunk.range_id,
                        "b": uuid.uuid4().hex,
                        "a": chunk.attempt,
                        "ok": k not in failed,
                    }
                )
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO effects (k, round_id, range_id, pid, worker, batch, chunk_attempt, ok) "
                    "VALUES (:k, :r, :i, 0, 'w', :b, :a, :ok)"
                ),
                rows,
            )
        return ChunkResult(failed=failed, skipped=skipped)


def _poison_trial(
    engine: sa.Engine,
    url: str,
    redis_url: str,
    prefix: str,
    trial: int,
    rng: random.Random,
    tally: rs.Tally,
) -> int:
    """One round of 4 ranges over 400 keys: 16 poison, 16 flaky (1-2 failures), 12 skipped.
    Returns the number of dead letters."""
    with engine.begin() as c:
        c.execute(sa.text("TRUNCATE effects"))
    all_ids = list(range(1, 401))
    special = rng.sample(all_ids, 44)
    poison, skip = set(special[:16]), set(special[32:])
    flaky = {k: rng.randint(1, MAX_ATTEMPTS - 1) for k in special[16:32]}
    proc = PoisonProcessor(engine, poison, flaky, skip)
    t = KeysetTraversal(
        url,
        table="items",
        key="id",
        redis_url=redis_url,
        stream=f"poison-{trial}",
        key_prefix=prefix,
    )
    rnd = t.plan(max_ranges=4, new_stream=True)
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = t.traverse(
                rnd.round_id,
                i,
                proc,
                chunk_size=20,
                max_item_attempts=MAX_ATTEMPTS,
                item_retry_delay=0.01,
                backoff_max=0.05,
                lease_seconds=5,
            )
        except Exception as exc:
            results[i] = exc

    with rs.CursorWatcher(redis_url, t.store, rnd.round_id, 4) as watcher:
        threads = [threading.Thread(target=run, args=(r.range_id,)) for r in rnd.ranges]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    tally.trials += 1
    for i, res in sorted(results.items()):
        if isinstance(res, Exception) or not res.complete:
            tally.fail(f"trial {trial} range {i}: {res!r}")
    letters = [d for r in rnd.ranges for d in t.dead_letters(rnd.round_id, r.range_id, limit=1000)]
    by_key = {d["key"]: d for d in letters}
    if set(by_key) != poison or len(letters) != len(poison):
        tally.fail(f"trial {trial}: dead letters {sorted(by_key)} != poison {sorted(poison)}")
    for k, d in by_key.items():
        if d["error"] != reason(k) or d["attempts"] != MAX_ATTEMPTS:
            tally.fail(
                f"trial {trial}: dead letter {d} (want error {reason(k)!r}, {MAX_ATTEMPTS} attempts)"
            )
    for k in poison:
        if proc.deliveries[k] != MAX_ATTEMPTS:
            tally.fail(
                f"trial {trial}: poison {k} delivered {proc.deliveries[k]} times, not {MAX_ATTEMPTS}"
            )
    ok_keys = {r.k for r in rs.effects(engine, rnd.round_id) if r.ok}
    neighbours = {n for k in poison for n in (k - 1, k + 1)} - poison - skip - {0, 401}
    missing = sorted(n for n in neighbours if encode_key((n,)) not in ok_keys)
    if missing:
        tally.fail(f"trial {trial}: neighbours of poison items not processed: {missing}")
    cov = rs.check_round(
        engine,
        t.store,
        rnd.round_id,
        [encode_key((k,)) for k in all_ids],
        expect_dead={encode_key((k,)) for k in poison},
        expect_skipped={encode_key((k,)) for k in skip},
    )
    totals = t.close_round(rnd.round_id)
    expect = (400 - len(poison) - len(skip), len(skip), len(poison))
    if (totals.done, totals.skipped, totals.dead) != expect:
        cov.counter_errors.append(
            f"round totals {(totals.done, totals.skipped, totals.dead)} != {expect}"
        )
    tally.check(f"trial {trial}", cov, watcher)
    proc.poison = set()  # the cause is fixed: replay the letters
    replayed = t.replay_dead_letters(
        rnd.round_id, proc, chunk_size=20, item_retry_delay=0.01, lease_seconds=5
    )
    left = [d for r in rnd.ranges for d in t.dead_letters(rnd.round_id, r.range_id, limit=1000)]
    after = t.close_round(rnd.round_id)
    if (
        left
        or not all(r.complete for r in replayed)
        or (after.done, after.dead) != (expect[0] + len(poison), 0)
    ):
        tally.fail(f"trial {trial}: replay left {len(left)} letters, totals {after}")
    for k in poison:
        if proc.deliveries[k] != MAX_ATTEMPTS + 1:
            tally.fail(
                f"trial {trial}: poison {k} delivered {proc.deliveries[k]} times after the replay"
            )
    t.close()
    return len(letters)


def test_poison_items_are_dead_lettered_and_neighbours_finish(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE items (id bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(sa.text("INSERT INTO items SELECT g, 'p' FROM generate_series(1, 400) g"))
    rs.create_effects_table(pg_engine)
    tally = rs.Tally()
    letters = 0
    for trial in range(rs.trials(5, 300)):
        letters += _poison_trial(pg_engine, pg_schema_url, redis_url, key_prefix, trial, rng, tally)
        if tally.failures:
            break
    tally.record(
        "5 poison items",
        note=f"{letters} dead letters with the processor's error text after "
        f"{MAX_ATTEMPTS} attempts; all replayed after the fix (dead -> done)",
    )
    assert not tally.failures, tally.verdict(seed)
