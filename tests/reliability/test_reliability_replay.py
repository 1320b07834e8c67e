"""A reply lost after the server ran a script: redis-py's ``Retry`` runs the script again (issue #18,
item 2). Every state-changing script must be safe to run twice; these are the two reproductions
of the issue, through the engine, on SQLite and the real Redis with the fault layer
(``redis_faults.py``) under the client and redis-py's retry on.

1. ADVANCE of an item-retry pass: 100 keys, 30 always bad, 3 attempts. The pass's reply is lost
   once; its replay must not count the failures again (before: done=70, dead=40, 10 keys
   dead-lettered twice).
2. CREATE_ROUND of an explicit plan (``start_key`` given, no ``round_key``): the reply is lost
   once; the replay must return the round the first run created (before: the replay read
   ``'taken'``, a second round was created and the first stayed open for ever).

Plus every other kind of fault on the same two calls (reset, timeout before sending), and a
lost reply of the chunk ADVANCE, of CLAIM and of CLOSE_ROUND: the round ends exact
(every script, one by one at the store's API: ``test_reliability_replay_store.py``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
import redis_faults as rf
import sqlalchemy as sa

from airflow_keyset_provider.core import ChunkResult, KeysetTraversal
from airflow_keyset_provider.core.keys import decode_key

BAD = frozenset(range(1, 101, 10)) | frozenset(range(2, 101, 10)) | frozenset(range(3, 101, 10))


def _source(tmp_path: Path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{tmp_path / 'src.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)"))
        c.execute(
            sa.text("INSERT INTO events VALUES (:s, :p)"),
            [{"s": k, "p": f"e{k}"} for k in range(1, 101)],
        )
    engine.dispose()
    return url


def _traversal(url: str, client: redis.Redis, prefix: str) -> KeysetTraversal:
    return KeysetTraversal(
        url, table="events", key="seq", redis_client=client, stream="replay", key_prefix=prefix
    )


class BadItems:
    """30 of the 100 keys always fail (an item failure, never a dependency failure)."""

    def __init__(self) -> None:
        self.seen: Counter = Counter()

    def __call__(self, chunk: Any) -> ChunkResult:
        self.seen.update(chunk.keys)
        return ChunkResult(failed={k: "bad row" for k in chunk.keys if k in BAD})


def _retry_pass(args: tuple[Any, ...]) -> bool:
    """An ADVANCE whose new cursor (ARGV[3]) is the expected one (ARGV[2]): a retry pass."""
    argv = rf.script_argv(args)
    return argv[1] == argv[2]


def _round(
    tmp_path: Path, redis_url: str, prefix: str, fault: dict[str, Any] | None, ranges: int = 2
) -> tuple[Any, list[int], Counter, rf.FaultPlan]:
    """One round of the 100 keys in ``ranges`` ranges (chunks of 25, 3 attempts), with ``fault`` (the
    kwargs of ``FaultPlan.fail`` plus ``attr``, the store's script) under the client: the totals,
    the dead-lettered keys, the deliveries per key and the plan."""
    plan = rf.FaultPlan()
    client = rf.faulty_client(redis_url, plan)
    t = _traversal(_source(tmp_path), client, prefix)
    rf.load_scripts(t.store)
    if fault:
        fault = dict(fault)
        plan.fail(fault.pop("kind"), sha=rf.sha_of(t.store, fault.pop("attr")), **fault)
    rnd = t.plan(max_ranges=ranges, new_stream=True)
    proc = BadItems()
    for r in rnd.ranges:
        t.traverse(
            rnd.round_id, r.range_id, proc, chunk_size=25, max_item_attempts=3, item_retry_delay=0
        )
    totals = t.close_round(rnd.round_id)
    letters = [
        json_key(x)
        for r in rnd.ranges
        for x in t.store.dead_letters(rnd.round_id, r.range_id, limit=1000)
    ]
    t.store.delete_stream()
    client.close()
    return totals, letters, proc.seen, plan


def json_key(letter: dict[str, Any]) -> int:
    return int(decode_key(letter["key"])[0])


@pytest.mark.parametrize("kind", [rf.LOST_REPLY, rf.LOST_REPLY_TIMEOUT, rf.RESET])
@pytest.mark.parametrize("nth", [1, 2, 4], ids=["first-pass", "dead-letter-pass", "releasing-pass"])
def test_a_retry_pass_whose_reply_is_lost_is_counted_once(
    tmp_path: Path, redis_url: str, key_prefix: str, kind: str, nth: int
) -> None:
    """One range: four retry passes (25 keys failing, 25, then the last chunk's 5 twice). The
    second dead-letters the keys that failed 3 times: before the fix its replay dead-lettered
    them again (dead=55 of 30 bad keys); the first pass's replay counted an attempt the
    processor never made (keys dead after 2 deliveries); the last one's replay, after it had
    released the range, was refused as not the owner (``LeaseLostError``)."""
    _, _, baseline, _ = _round(tmp_path / "a", redis_url, key_prefix, None, ranges=1)
    fault = {"kind": kind, "attr": "_advance", "where": _retry_pass, "nth": nth}
    totals, dead, seen, plan = _round(tmp_path / "b", redis_url, key_prefix, fault, ranges=1)
    assert plan.count() == 1, plan.faulted
    assert (totals.done, totals.skipped, totals.dead) == (70, 0, 30)
    assert sorted(dead) == sorted(BAD), "a key dead-lettered twice"
    assert seen == baseline, "the replay changed what the processor was given"
    assert all(seen[k] == 3 for k in BAD)


@pytest.mark.parametrize(
    "kind", [rf.LOST_REPLY, rf.LOST_REPLY_TIMEOUT, rf.RESET, rf.TIMEOUT_BEFORE_SEND]
)
def test_an_explicit_plan_whose_reply_is_lost_returns_the_round_it_created(
    tmp_path: Path, redis_url: str, key_prefix: str, kind: str
) -> None:
    plan = rf.FaultPlan()
    client = rf.faulty_client(redis_url, plan)
    t = _traversal(_source(tmp_path), client, key_prefix)
    rf.load_scripts(t.store)
    plan.fail(kind, sha=rf.sha_of(t.store, "_create"))
    rnd = t.plan(start_key=0, end_key=100, max_ranges=2)
    assert plan.count() == 1
    assert t.store.open_rounds() == [rnd.round_id], "a second round was created"
    for r in rnd.ranges:
        t.traverse(rnd.round_id, r.range_id, lambda chunk: None, chunk_size=30)
    totals = t.close_round(rnd.round_id)
    assert (totals.done, totals.dead) == (100, 0)
    assert t.store.open_rounds() == []


@pytest.mark.parametrize(
    ("attr", "where"),
    [
        ("_advance", lambda a: not _retry_pass(a)),  # a chunk's advance
        ("_claim", None),
        ("_close", None),
    ],
    ids=["advance", "claim", "close_round"],
)
def test_every_lost_reply_of_a_round_replays_to_the_same_outcome(
    tmp_path: Path, redis_url: str, key_prefix: str, attr: str, where: Any
) -> None:
    _, _, baseline, _ = _round(tmp_path / "a", redis_url, key_prefix, None)
    fault = {"kind": rf.LOST_REPLY, "attr": attr, "where": where, "times": 2}
    totals, dead, seen, plan = _round(tmp_path / "b", redis_url, key_prefix, fault)
    assert plan.count() == 2, plan.faulted
    assert (totals.done, totals.skipped, totals.dead) == (70, 0, 30)
    assert sorted(dead) == sorted(BAD)
    assert seen == baseline, "a chunk came again"
