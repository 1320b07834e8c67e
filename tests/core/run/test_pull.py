"""Pull mode (``KeysetTraversal.traverse_round``) and dynamic splitting, on real PostgreSQL and
Redis: many ranges over few workers, stragglers split for idle workers, a retry resumes what its
lineage held, the time budget yields and the next call resumes. Workers are threads, each with its
own traversal (its own source connections and Redis client), as separate processes would be."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from core_support import make_events, traversal

from airflow_keyset_provider import RetryableError
from airflow_keyset_provider.core import (
    DependencyFailedError,
    KeysetTraversal,
    RoundPullResult,
    TraverseOptions,
)
from airflow_keyset_provider.core.rounds.status import RangeState


class Deliveries:
    """Every delivery of every key, and which worker processed which range (thread safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: Counter[int] = Counter()
        self.by_worker: dict[str, set[int]] = {}
        self.order: list[tuple[str, int, int]] = []  # (worker, range, first key) per chunk

    def record(self, worker: str, chunk: Any) -> None:
        with self.lock:
            self.seen.update(chunk.keys)
            self.by_worker.setdefault(worker, set()).add(chunk.range_id)
            self.order.append((worker, chunk.range_id, chunk.keys[0]))


class RedisLoss:
    """Called with each chunk: the first time a chunk starts at key ``at``, every key under the
    test's prefix goes (Redis restarting without persistence); ``done`` says it happened."""

    def __init__(self, client: redis.Redis, prefix: str, at: int) -> None:
        self.client, self.prefix, self.at, self.done = client, prefix, at, False

    def __call__(self, chunk: Any) -> None:
        if chunk.keys[0] == self.at and not self.done:
            self.done = True
            for key in list(self.client.scan_iter(f"{self.prefix}:*")):
                self.client.delete(key)


def analyzed_events(engine: sa.Engine, keys: list[int]) -> None:
    make_events(engine, keys)
    with engine.begin() as c:
        c.execute(sa.text("ANALYZE events"))


def pull_workers(
    url: str,
    redis_url: str,
    key_prefix: str,
    round_id: str,
    n: int,
    processor: Callable[[str, Any], None],
    *,
    firsts: list[int] | None = None,
    tasks: int | None = None,
    split: bool = True,
    **options: Any,
) -> dict[str, RoundPullResult]:
    """``n`` workers pulling the round at the same time (worker ``i`` starting with range
    ``firsts[i]``, default ``i``; ``tasks``: coalescing, see ``traverse_round``); each result."""
    results: dict[str, RoundPullResult] = {}
    errors: list[BaseException] = []

    def work(name: str, first: int) -> None:
        t = traversal(url, redis_url, key_prefix)
        try:
            opts = TraverseOptions(owner_lineage=name, **options)
            results[name] = t.traverse_round(
                round_id,
                lambda chunk: processor(name, chunk),
                options=opts,
                first_range=first,
                split=split,
                tasks=tasks,
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            t.close()

    starts = firsts if firsts is not None else list(range(n))
    threads = [threading.Thread(target=work, args=(f"w{i}", f)) for i, f in enumerate(starts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert len(results) == len(starts)
    return results


def test_many_ranges_over_few_workers_process_every_key_exactly_once(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = [k for k in range(1, 20_001) if k % 13]
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=64, new_stream=True)
    assert len(rnd.ranges) == 64
    seen = Deliveries()
    results = pull_workers(
        pg_schema_url, redis_url, key_prefix, rnd.round_id, 4, seen.record, chunk_size=50
    )
    assert all(r.finished for r in results.values())
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    assert len(seen.by_worker) == 4  # every worker took part
    ran = [r.range_id for res in results.values() for r in res.ranges if r.rows_read]
    assert len(ran) == len(set(ran))  # no range was read by two workers
    totals = t.close_round(rnd.round_id)  # the barrier's proof: exact cover, all complete
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


@pytest.mark.parametrize("group", [1, 3])
def test_a_straggler_is_split_and_an_idle_worker_takes_the_new_range(
    pg_engine, pg_schema_url, redis_url, key_prefix, group
):
    keys = list(range(1, 2001))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=2, start_key=0, end_key=2000)
    slow_hi = rnd.ranges[0].hi  # range 0 is the straggler: 40 ms per chunk of 10 keys
    seen = Deliveries()

    def proc(worker: str, chunk: Any) -> None:
        if chunk.keys[0] <= slow_hi:
            time.sleep(0.04)
        seen.record(worker, chunk)

    results = pull_workers(
        pg_schema_url,
        redis_url,
        key_prefix,
        rnd.round_id,
        2,
        proc,
        chunk_size=10,
        group_commit_chunks=group,
    )
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    info = t.store.round_info(rnd.round_id)
    assert int(info["n_ranges"]) > 2 and int(info["splits"]) >= 1
    split_off = set(range(2, int(info["n_ranges"])))  # ranges 0 and 1 were planned
    # the worker of the fast range went idle, asked the straggler to split and processed the
    # range split off for it
    assert any(res.splits_won and seen.by_worker[name] & split_off for name, res in results.items())
    assert all(r.finished for r in results.values())
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


def test_a_retry_resumes_the_ranges_its_lineage_held(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 801))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=4, start_key=0, end_key=800)
    lineage = "dag/run/traverse/0"
    # a try of this lineage that died holding range 3: its lease still runs for a minute
    t.store.claim(rnd.round_id, 3, f"{lineage}#dead", lineage, 60_000, pull=True)
    seen = Deliveries()
    calls = Counter[int]()

    def fails_in_range_1(chunk: Any) -> None:
        calls[chunk.range_id] += 1
        if chunk.range_id == 1 and calls[1] == 3:
            raise RetryableError("the dependency went away")
        seen.record("try1", chunk)

    opts = TraverseOptions(owner_lineage=lineage, chunk_size=20, max_chunk_attempts=1)
    with pytest.raises(DependencyFailedError):
        t.traverse_round(rnd.round_id, fails_in_range_1, options=opts, first_range=1, split=False)
    # try 1 took range 3 over at once (same lineage), finished it, then failed in range 1: the
    # range its lineage last held and did not finish
    briefs = {b.range_id: b for b in t.store.range_briefs(rnd.round_id)}
    assert briefs[3].state == RangeState.COMPLETE and briefs[3].done == 200
    assert briefs[1].lineage == lineage and briefs[1].state != RangeState.COMPLETE
    assert not briefs[1].owner  # released when the try failed
    assert [b.range_id for b in briefs.values() if b.lineage == lineage] == [1]

    retry = t.traverse_round(
        rnd.round_id,
        lambda chunk: seen.record("try2", chunk),
        options=TraverseOptions(owner_lineage=lineage, chunk_size=20),
        split=False,
    )
    assert retry.finished
    first = next(o for o in seen.order if o[0] == "try2")
    lo_1 = rnd.ranges[1].lo
    assert first[1] == 1 and first[2] == lo_1 + 2 * 20 + 1  # resumed at range 1's cursor
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    assert t.close_round(rnd.round_id).done == len(keys)


def test_the_time_budget_yields_and_the_next_call_resumes(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 601))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=3, start_key=0, end_key=600)
    seen = Deliveries()

    def slow(chunk: Any) -> None:
        time.sleep(0.02)
        seen.record("w", chunk)

    opts = TraverseOptions(owner_lineage="w", chunk_size=10, max_task_seconds=0.3)
    calls: list[RoundPullResult] = []
    while not (calls and calls[-1].finished):
        res = t.traverse_round(rnd.round_id, slow, options=opts, split=False)
        calls.append(res)
        if res.yielded:
            assert res.yielded == "budget"
            held = [b for b in t.store.range_briefs(rnd.round_id) if b.lineage == "w"]
            assert all(not b.owner for b in held)  # released, lineage kept for the next call
        assert len(calls) < 200
    assert len(calls) >= 3
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1  # nothing replayed
    assert t.close_round(rnd.round_id).done == len(keys)


def test_plain_traverse_honours_the_budget_and_declines_splits(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=400)
    asker = traversal(pg_schema_url, redis_url, key_prefix)
    answers: list[str | None] = []

    def slow(chunk: Any) -> None:
        time.sleep(0.05)
        if chunk.keys[0] == 11:  # an idle pull worker asks this (one-range) task to split
            assert asker.store.request_split(rnd.round_id, 0, "idle#1") == "asked"
        if chunk.keys[0] == 51:
            answers.append(asker.store.split_answer(rnd.round_id, 0, "idle#1"))

    budget = TraverseOptions(chunk_size=10, max_task_seconds=0.8)
    res = t.traverse(rnd.round_id, 0, slow, options=budget)
    assert res.yielded == "budget" and not res.complete and 0 < res.rows_read < 400
    assert answers == ["no"]  # a plain traverse never splits: nobody would own the new half
    assert int(t.store.round_info(rnd.round_id)["n_ranges"]) == 1
    rest = t.traverse(rnd.round_id, 0, lambda chunk: None, chunk_size=10)
    assert rest.complete and rest.done == 400


def test_the_owner_declines_when_under_two_chunks_are_left(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 201))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=200)
    asker: KeysetTraversal = traversal(pg_schema_url, redis_url, key_prefix)
    answers: list[str | None] = []

    def proc(chunk: Any) -> None:
        if chunk.keys[0] == 161:  # 20 keys (< 2 chunks of 20) left after this chunk
            assert asker.store.request_split(rnd.round_id, 0, "idle#1") == "asked"
        if chunk.keys[0] == 181:
            answers.append(asker.store.split_answer(rnd.round_id, 0, "idle#1"))

    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=20)
    )
    assert res.finished and answers == ["no"]
    assert int(t.store.round_info(rnd.round_id)["n_ranges"]) == 1


def test_troubleshooting_quotes_the_split_log_lines():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    doc = (repo / "docs" / "troubleshooting.md").read_text()
    code = (repo / "airflow_keyset_provider" / "core" / "run" / "split.py").read_text()
    for phrase in (
        "declined to split for",
        ": keeps up to ",
        ", new range ",
        "rows were left",
        "the store refused the split at",
    ):
        assert phrase in code and phrase in doc, phrase


def test_a_range_split_for_a_requester_that_vanished_is_rescued(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=400)
    ghost = traversal(pg_schema_url, redis_url, key_prefix)
    seen = Deliveries()

    answers: list[str | None] = []

    def proc(chunk: Any) -> None:
        if chunk.keys[0] == 11:  # an idle task asks, then dies before it claims the new range
            assert ghost.store.request_split(rnd.round_id, 0, "ghost#1") == "asked"
        if chunk.keys[0] == 101:
            answers.append(ghost.store.split_answer(rnd.round_id, 0, "ghost#1"))
        seen.record("w", chunk)

    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10)
    )
    assert res.finished
    assert int(t.store.round_info(rnd.round_id)["n_ranges"]) == 2
    assert answers == ["1"]  # split for the ghost, who never claimed range 1
    assert [r.range_id for r in res.ranges if r.rows_read] == [0, 1]  # range 1: rescued
    assert set(seen.seen) == set(keys) and max(seen.seen.values()) == 1
    assert t.close_round(rnd.round_id).done == len(keys)


def test_a_split_round_restored_from_the_mirror_is_still_a_partition(
    pg_engine, pg_schema_url, redis_url, key_prefix, redis_client
):
    """Redis loses the round after a split: the mirror recorded the split (round info with the
    grown ``n_ranges``, both ranges) in one transaction, so the restored round still partitions
    ``(start, end]`` and closes; keys after the last checkpoint are delivered again."""
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix, checkpoint_url=pg_schema_url)
    t.checkpoint_seconds = 0
    rnd = t.plan(max_ranges=1, start_key=0, end_key=400)
    ghost = traversal(pg_schema_url, redis_url, key_prefix)
    seen = Deliveries()
    redis_loss = RedisLoss(redis_client, key_prefix, at=101)

    def proc(chunk: Any) -> None:
        if chunk.keys[0] == 11:  # an idle task asks, then dies before it claims the new range
            assert ghost.store.request_split(rnd.round_id, 0, "ghost#1") == "asked"
        seen.record("w", chunk)
        redis_loss(chunk)  # Redis restarts without persistence

    res = t.traverse_round(
        rnd.round_id, proc, options=TraverseOptions(owner_lineage="w", chunk_size=10)
    )
    assert redis_loss.done and res.finished
    assert int(t.store.round_info(rnd.round_id)["n_ranges"]) == 2
    assert set(seen.seen) == set(keys)
    assert max(seen.seen.values()) == 2 and seen.seen[101] == 2  # the chunk in hand, again
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)


def test_a_requester_rescues_a_range_whose_owner_died_before_answering(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    keys = list(range(1, 401))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=1, start_key=0, end_key=400)
    # another task claimed the range with a 2 s lease, committed one chunk, and died
    claim = t.store.claim(rnd.round_id, 0, "dead#1", "elsewhere", 2000)
    t.store.advance(
        rnd.round_id,
        0,
        "dead#1",
        claim.cursor,
        t.source.encode([10]),
        done=10,
        skipped=0,
        lease_ms=2000,
        max_item_attempts=3,
    )
    seen = Deliveries()
    res = t.traverse_round(
        rnd.round_id,
        lambda chunk: seen.record("w", chunk),
        options=TraverseOptions(owner_lineage="w", chunk_size=10),
    )
    # range 0 looked alive: the requester asked it to split (or, on a loaded machine, found its
    # lease already run out and asked nothing); the dead owner never answers. Which way the
    # requester learns that the owner is gone (its owner check logging "its owner is gone", or
    # an answer or refusal from the store) is a race with the lease's end; every way ends with
    # the requester taking the range over, which is what the test asserts.
    assert res.finished and res.splits_asked <= 1 and res.splits_won == 0
    ran = [r for r in res.ranges if r.rows_read]
    assert ran[0].range_id == 0 and ran[0].takeover
    # the request it left pending is answered by the new owner at its first commit: a split
    # nobody waits for, whose new range the rescue step then runs (still exactly once)
    assert set(seen.seen) == set(keys[10:]) and max(seen.seen.values()) == 1
    assert t.close_round(rnd.round_id).done == len(keys)


def test_one_pull_call_keeps_each_lease_alive_with_one_heartbeat_thread_and_one_poller(
    pg_engine, pg_schema_url, redis_url, key_prefix
):
    """A pull call runs its ranges one after the other with one heartbeat thread and one control
    poller (not two threads per range), and every range's lease is still renewed while it runs:
    with a 1 s lease and a processor that takes 1.5 s per chunk, an advance after an unrenewed
    lease would be refused (``LeaseLostError``)."""
    keys = list(range(1, 31))
    analyzed_events(pg_engine, keys)
    t = traversal(pg_schema_url, redis_url, key_prefix)
    rnd = t.plan(max_ranges=3, start_key=0, end_key=30)
    threads: dict[str, set[threading.Thread]] = {"keyset-heartbeat": set(), "keyset-control": set()}

    def proc(chunk: Any) -> None:
        for th in threading.enumerate():
            for prefix, seen in threads.items():
                if th.name.startswith(prefix):
                    seen.add(th)
        time.sleep(1.5)

    opts = TraverseOptions(owner_lineage="w", chunk_size=100, lease_seconds=1)
    res = t.traverse_round(rnd.round_id, proc, options=opts, first_range=0)
    assert res.finished and len([r for r in res.ranges if r.complete]) == len(rnd.ranges) >= 3
    assert not any(r.takeover for r in res.ranges)
    assert len(threads["keyset-heartbeat"]) == 1 and len(threads["keyset-control"]) == 1
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.skipped, totals.dead) == (len(keys), 0, 0)
