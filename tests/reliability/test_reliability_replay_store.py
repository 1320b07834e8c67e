"""Each state-changing script of the store, run twice by redis-py after a lost reply: the caller
gets the answer of the first run and nothing is written twice (issue #18, item 2).

One test per script, at the store's API on the real Redis: the fault layer (``redis_faults.py``)
drops the reply of exactly that script's next call after the server ran it, redis-py's ``Retry``
sends it again, and the test compares the outcome with what one fault-free run gives (the
twin store ``clean`` on the same keys, run first on its own stream). The header of each script
(``core/store/lua/*.lua``) says why it is safe to run twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis_faults as rf

from airflow_keyset_provider.core.errors import StoreUnavailableError
from airflow_keyset_provider.core.keys import encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, Closed, CursorStore

LEASE = 60_000
N = 4


def _k(i: int) -> str:
    return "" if i == 0 else encode_key((i * 100,))


@pytest.fixture
def faulty(redis_url: str, key_prefix: str) -> Iterator[tuple[CursorStore, rf.FaultPlan]]:
    plan = rf.FaultPlan()
    store = CursorStore(rf.faulty_client(redis_url, plan), "replay", key_prefix)
    rf.load_scripts(store)
    yield store, plan
    store.close()


def _plan(store: CursorStore, **kw: Any) -> str:
    kw.setdefault("idempotency_key", None)
    kw.setdefault("chained", False)
    rid, created = store.create_round(
        start=_k(0),
        end=_k(N),
        source="{}",
        arity=1,
        bounds=[(_k(i), _k(i + 1)) for i in range(N)],
        **kw,
    )
    assert created
    return rid


def _lose(
    store: CursorStore, plan: rf.FaultPlan, attr: str, times: int = 1, between: Any = None
) -> None:
    """The next ``times`` calls of this script lose their reply after the server ran them
    (``between``: what another client does before redis-py sends the call again)."""
    plan.fail(rf.LOST_REPLY, sha=rf.sha_of(store, attr), times=times, between=between)


def _fault_count(store: CursorStore, plan: rf.FaultPlan, attr: str) -> int:
    return plan.count(rf.sha_of(store, attr))


@pytest.mark.parametrize("key", [None, "dag/run-1/plan"], ids=["explicit", "round_key"])
def test_create_round(faulty: tuple[CursorStore, rf.FaultPlan], key: str | None) -> None:
    store, plan = faulty
    _lose(store, plan, "_create")
    rid = _plan(store, idempotency_key=key)  # asserts created: the caller mirrors it
    assert _fault_count(store, plan, "_create") == 1
    assert store.open_rounds() == [rid]


def test_claim_reports_the_takeover_and_the_epoch_once(
    faulty: tuple[CursorStore, rf.FaultPlan],
) -> None:
    store, plan = faulty
    rid = _plan(store)
    first = store.claim(rid, 0, "a#1", "task-a", LEASE)
    assert isinstance(first, Claim)
    _lose(store, plan, "_claim")
    again = store.claim(rid, 0, "a#2", "task-a", LEASE)  # a new try of the lineage takes over
    assert isinstance(again, Claim)
    assert (again.epoch, again.takeover) == (2, True)
    assert store.range(rid, 0)["epoch"] == "2" and store.range(rid, 0)["takeovers"] == "1"


def test_claim_reports_the_ranges_it_absorbed(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    _lose(store, plan, "_claim")
    c = store.claim(rid, 0, "a#1", "task-a", LEASE, coalesce=2, pull=True, mirror=True)
    assert isinstance(c, Claim)
    assert (c.absorbed, c.hi, c.epoch) == (2, _k(3), 1)
    assert store.next_unclaimed(rid) == 3


def _advance(store: CursorStore, rid: str, token: str, frm: str, to: str, **kw: Any) -> Any:
    kw.setdefault("done", 0)
    kw.setdefault("max_item_attempts", 2)
    return store.advance(rid, 0, token, frm, to, skipped=0, lease_ms=LEASE, **kw)


def test_advance_of_a_chunk_is_committed_once(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    _lose(store, plan, "_advance")
    a = _advance(store, rid, "a#1", _k(0), encode_key((50,)), done=40, failed=[("k1", "bad")])
    assert (a.cursor, a.done, a.retries, a.complete) == (encode_key((50,)), 40, 1, False)
    r = store.range(rid, 0)
    assert (r["done"], r["chunks"], r["retries"]) == ("40", "1", "1")
    assert store.retry_states(rid, 0, ["k1"]) == ["1|bad"]


def test_a_retry_pass_dead_letters_once(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    _advance(store, rid, "a#1", _k(0), _k(1), done=98, failed=[("k1", "bad"), ("k2", "bad")])
    _lose(store, plan, "_advance", times=2)
    a = _advance(
        store,
        rid,
        "a#1",
        _k(1),
        _k(1),
        resolved=[("k2", "d")],
        failed=[("k1", "bad")],
        release=True,
    )
    assert _fault_count(store, plan, "_advance") == 2
    assert (a.done, a.dead, a.retries, a.complete, a.released) == (99, 1, 0, True, True)
    assert [x["key"] for x in store.dead_letters(rid, 0)] == ["k1"]
    assert store.range(rid, 0)["owner"] == ""


def test_release_answers_released(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    _lose(store, plan, "_release")
    assert store.release(rid, 0, "a#1")
    assert store.range(rid, 0)["state"] == "pending"
    assert not store.release(rid, 0, "a#1"), "a new call of a non-owner is still refused"


def test_requeue_moves_the_letters_asked_for_once(
    faulty: tuple[CursorStore, rf.FaultPlan],
) -> None:
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    bad = [(f"k{i}", "bad") for i in range(4)]
    _advance(store, rid, "a#1", _k(0), _k(1), max_item_attempts=1, failed=bad)  # 4 dead
    store.release(rid, 0, "a#1")
    _lose(store, plan, "_requeue")
    assert store.requeue_dead(rid, 0, 2) == 2
    r = store.range(rid, 0)
    assert (r["dead"], r["retries"]) == ("2", "2")


def test_split_returns_the_new_range(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    assert store.request_split(rid, 0, "b#1") == "asked"
    _lose(store, plan, "_split")
    at = encode_key((50,))
    assert store.split(rid, 0, "a#1", at) == N
    assert store.range(rid, 0)["hi"] == at and store.range(rid, N)["lo"] == at
    assert store.round_info(rid)["n_ranges"] == str(N + 1)
    assert store.split_answer(rid, 0, "b#1") == str(N)


def test_request_split_keeps_the_owners_answer(
    faulty: tuple[CursorStore, rf.FaultPlan], redis_url: str, key_prefix: str
) -> None:
    """The owner answers between the request and its replay: the replay must not clear the
    answer and ask again (before: the requester never learnt of the range split off for it)."""
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    owner = CursorStore(redis.Redis.from_url(redis_url), "replay", key_prefix)
    at = encode_key((50,))
    _lose(store, plan, "_ask_split", between=lambda: owner.split(rid, 0, "a#1", at))
    assert store.request_split(rid, 0, "b#1") == "asked"
    assert store.split_answer(rid, 0, "b#1") == str(N)
    assert store.range(rid, 0)["split_req"] == ""
    owner.close()


def test_advance_replay_after_a_split_request_reports_it(
    faulty: tuple[CursorStore, rf.FaultPlan], redis_url: str, key_prefix: str
) -> None:
    """A split request lands between a step and its replay: the replay is still the step's
    success (not a cursor conflict) and hands the owner the request to answer."""
    store, plan = faulty
    rid = _plan(store)
    store.claim(rid, 0, "a#1", "task-a", LEASE)
    other = CursorStore(redis.Redis.from_url(redis_url), "replay", key_prefix)
    _lose(store, plan, "_advance", between=lambda: other.request_split(rid, 0, "b#1"))
    a = _advance(store, rid, "a#1", _k(0), encode_key((50,)), done=50)
    assert (a.cursor, a.done, a.split_req) == (encode_key((50,)), 50, "b#1")
    assert store.range(rid, 0)["chunks"] == "1"
    other.close()


def test_next_unclaimed_skips_no_id(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    _lose(store, plan, "_next", times=2)
    assert [store.next_unclaimed(rid) for _ in range(N + 1)] == [0, 1, 2, 3, None]


def test_heartbeat_and_close(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    for i in range(N):
        store.claim(rid, i, f"a#{i}", "task-a", LEASE)
        _lose(store, plan, "_heartbeat")
        assert store.heartbeat(rid, i, f"a#{i}", LEASE)
        store.advance(
            rid, i, f"a#{i}", _k(i), _k(i + 1), done=100, skipped=0, lease_ms=LEASE,
            max_item_attempts=2, release=True,
        )  # fmt: skip
    _lose(store, plan, "_close")
    res = store.close_round(rid)
    assert isinstance(res, Closed) and (res.done, res.watermark) == (N * 100, _k(N))
    assert _fault_count(store, plan, "_close") == 1


def test_restore_reports_what_it_rewrote(faulty: tuple[CursorStore, rf.FaultPlan]) -> None:
    store, plan = faulty
    rid = _plan(store)
    info = store.round_info(rid)
    ranges = store.snapshot_ranges(rid, range(N))
    store.client.delete(store.round_key(rid), store.range_key(rid, 1))
    _lose(store, plan, "_restore")
    assert store.restore_round(info, ranges)
    assert store.range(rid, 1)["lo"] == _k(1)
    assert not store.restore_round(info, ranges), "a new call finds the round intact"


def test_a_plan_whose_retries_run_out_names_the_round_it_may_have_created(
    faulty: tuple[CursorStore, rf.FaultPlan],
) -> None:
    """Every attempt's reply is lost (the first created the round): the error does not say
    "nothing was written"; it names the round, which exists."""
    store, plan = faulty
    _lose(store, plan, "_create", times=4)  # the first run and redis-py's 3 retries
    with pytest.raises(StoreUnavailableError) as err:
        _plan(store)
    assert "round r1" in str(err.value) and "may exist" in str(err.value)
    assert "nothing was written" not in str(err.value)
    assert store.open_rounds() == ["r1"]
