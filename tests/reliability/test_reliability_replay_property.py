"""Property: random rounds driven through the store under random lost replies, with redis-py's
retry on, end exact (issue #18, item 2).

Each example plans a round of ``K`` keys in several ranges (``create_round`` with a round key,
the ids handed out by ``next_unclaimed``), and runs each range as ``run_range`` does: claim,
chunks (each committed by ADVANCE with its item failures), retry passes until the retry set is
empty, the last step releasing the range; heartbeats now and then; then ``close_round``. Keys
are done, skipped (a processor's verdict), flaky (fail a few times, fewer than the attempts) or
bad (always fail: dead-lettered after ``max_item_attempts``). Workers of different ranges
interleave in a random order. Under the client, the fault layer (``redis_faults.py``) loses the
reply of a random share of the calls (EVALSHA, INCRBY, HSETNX) after the server ran them, or times
out or resets before sending; redis-py retries (3 retries, no backoff). A call whose retries run
out (``StoreUnavailableError``) is a crash of its worker, and so is a random crash between a
chunk's processing and its commit: the worker abandons its range (no release) and a new try of
its lineage takes it over at once, sometimes after the dead worker's late advance (refused).

``next_unclaimed`` hands out each id exactly once, unless one of its calls ran out of retries:
the next call is a new call, so the id the lost one took may be skipped (a hint; the range is
still run), never handed out twice.

Checked on every example: no key lost and totals exact (done + skipped + dead = K, each kind
its own count), every bad key dead-lettered exactly once, no other key dead, a current owner is
never refused (a replay never reads as a cursor conflict or a lost lease), a dead worker's late
advance always is, at most one chunk per range per crash delivered again (none without a
crash), and the stream's keys do not grow with the keys (at most ``3 * ranges + 8``).

Short mode: ``trials(40, 2000)`` examples (a few seconds); ``KEYSET_RELIABILITY_LONG=1`` for the
long mode. Figures go to the reliability summary (``reliability_support.record``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis_faults as rf
import reliability_support as rs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.core.errors import (
    CursorConflictError,
    LeaseLostError,
    StoreUnavailableError,
)
from airflow_keyset_provider.core.keys import decode_key, encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, Closed, CursorStore

SCENARIO = "lost replies x every store call (property)"
LEASE = 60_000
KINDS = (rf.LOST_REPLY, rf.LOST_REPLY, rf.LOST_REPLY_TIMEOUT, rf.RESET, rf.TIMEOUT_BEFORE_SEND)
TOTAL: Counter = Counter()


def _e(k: int) -> str:
    return encode_key((k,))


def _d(encoded: str) -> int:
    return int(decode_key(encoded)[0])


@dataclass
class World:
    """One example's keys and their fate, and the knobs of its run."""

    keys: list[int]
    bounds: list[int]  # range i is (bounds[i], bounds[i + 1]]
    bad: set[int]
    flaky: dict[int, int]  # key -> failing deliveries before it succeeds (< max_attempts)
    skip: set[int]
    chunk: int
    max_attempts: int
    p_crash: float
    delivered: Counter = field(default_factory=Counter)  # every delivery (main and retry)
    main: list[Counter] = field(default_factory=list)  # per range: first-pass deliveries
    crashes: Counter = field(default_factory=Counter)

    def verdict(self, keys: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Deliver ``keys`` to the processor: (done, skipped, failed)."""
        done, skipped, failed = [], [], []
        for k in keys:
            self.delivered[k] += 1
            if k in self.bad or self.delivered[k] <= self.flaky.get(k, 0):
                failed.append(k)
            elif k in self.skip:
                skipped.append(k)
            else:
                done.append(k)
        return done, skipped, failed


@st.composite
def worlds(draw: Any) -> tuple[World, float, int]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(8, 120))
    n_ranges = draw(st.integers(1, 5))
    max_attempts = draw(st.integers(2, 4))
    keys = sorted(rng.sample(range(1, 20 * n), n))
    cuts = sorted(rng.sample(keys[:-1], min(n_ranges - 1, n - 1)))
    bad = {k for k in keys if rng.random() < 0.15}
    flaky = {
        k: rng.randint(1, max_attempts - 1) for k in keys if k not in bad and rng.random() < 0.15
    }
    skip = {k for k in keys if k not in bad and k not in flaky and rng.random() < 0.1}
    world = World(
        keys=keys,
        bounds=[0, *cuts, keys[-1]],
        bad=bad,
        flaky=flaky,
        skip=skip,
        chunk=draw(st.integers(1, 12)),
        max_attempts=max_attempts,
        p_crash=draw(st.sampled_from([0.0, 0.05, 0.15])),
    )
    world.main = [Counter() for _ in range(len(world.bounds) - 1)]
    return world, draw(st.sampled_from([0.05, 0.15, 0.3])), rng.randrange(2**32)


class RangeWorker:
    """One range, run as ``run_range`` runs it, by successive tries of one lineage."""

    def __init__(self, store: CursorStore, rid: str, i: int, w: World, rng: random.Random):
        self.store, self.rid, self.i, self.w, self.rng = store, rid, i, w, rng
        self.lineage = f"task/{i}"
        self.tries = 0
        self.token: str | None = None
        self.cursor = 0
        self.hi = w.bounds[i + 1]
        self.complete = False
        self.zombie: tuple[str, int, int] | None = None  # a dead try's token and chunk in hand
        self.late_refused = 0

    def _keys(self) -> list[int]:
        return [k for k in self.w.keys if self.cursor < k <= self.hi][: self.w.chunk]

    def crash(self, chunk_end: int | None = None) -> None:
        """This try dies: no release; the next step of the range is a new try's takeover."""
        if self.token and chunk_end is not None:
            self.zombie = (self.token, self.cursor, chunk_end)
        self.token = None
        self.w.crashes[self.i] += 1
        TOTAL["crashes"] += 1

    def step(self) -> None:
        try:
            if self.token is None:
                self._claim()
            elif self.rng.random() < 0.1:
                assert self.store.heartbeat(self.rid, self.i, self.token, LEASE)
            else:
                self._work()
        except StoreUnavailableError:
            TOTAL["unavailable"] += 1
            self.crash()

    def _claim(self) -> None:
        self.tries += 1
        token = f"{self.lineage}#{self.tries}"
        c = self.store.claim(self.rid, self.i, token, self.lineage, LEASE)
        assert isinstance(c, Claim), c  # a new try of the lineage never meets 'held'
        self.token = token
        if c.takeover:
            TOTAL["takeovers"] += 1
        if c.complete:
            self.complete = True
            return
        self.cursor = _d(c.cursor) if c.cursor else 0
        assert c.hi == _e(self.hi)
        if self.zombie and self.rng.random() < 0.5:
            self._late_advance(*self.zombie)
        self.zombie = None

    def _late_advance(self, token: str, frm: int, to: int) -> None:
        """The dead try wakes up and commits the chunk it had: refused, nothing written."""
        before = self.store.range(self.rid, self.i)
        try:
            self._advance(token, frm, to, done=1)
        except (LeaseLostError, CursorConflictError):
            self.late_refused += 1
            TOTAL["late advances refused"] += 1
        except StoreUnavailableError:
            pass
        else:
            raise AssertionError(f"range {self.i}: a dead try's advance was accepted")
        assert self.store.range(self.rid, self.i)["cursor"] == before["cursor"]

    def _advance(self, token: str, frm: int, to: int, **kw: Any) -> Any:
        kw.setdefault("done", 0)
        kw.setdefault("skipped", 0)
        return self.store.advance(
            self.rid,
            self.i,
            token,
            _e(frm),
            _e(to),
            lease_ms=LEASE,
            max_item_attempts=self.w.max_attempts,
            release=True,
            **kw,
        )

    def _work(self) -> None:
        assert self.token is not None
        chunk = self._keys()
        if chunk:
            self.w.main[self.i].update(chunk)
            done, skipped, failed = self.w.verdict(chunk)
            if self.rng.random() < self.w.p_crash:
                self.crash(chunk[-1])
                return
            failures = [(_e(k), "bad") for k in failed]
            a = self._commit(chunk[-1], done=len(done), skipped=len(skipped), failed=failures)
            self.cursor = chunk[-1]
        else:
            entries = self.store.retry_entries(self.rid, self.i, 1000)
            keys = [_d(k) for k, _, _ in entries]
            done, skipped, failed = self.w.verdict(keys)
            if keys and self.rng.random() < self.w.p_crash:
                self.crash()
                return
            resolved = [(_e(k), "d") for k in done] + [(_e(k), "s") for k in skipped]
            a = self._commit(self.hi, resolved=resolved, failed=[(_e(k), "bad") for k in failed])
            self.cursor = self.hi
        if a.complete:
            assert a.released
            self.complete = True

    def _commit(self, to: int, **kw: Any) -> Any:
        assert self.token is not None
        try:
            return self._advance(self.token, self.cursor, to, **kw)
        except (LeaseLostError, CursorConflictError) as exc:
            raise AssertionError(f"range {self.i}: the current owner was refused: {exc}") from exc


def _plan(store: CursorStore, w: World, key: str) -> str:
    for _ in range(20):
        try:
            rid, _ = store.create_round(
                idempotency_key=key,
                chained=False,
                start=_e(0),
                end=_e(w.keys[-1]),
                source="{}",
                arity=1,
                bounds=[(_e(w.bounds[i]), _e(w.bounds[i + 1])) for i in range(len(w.bounds) - 1)],
            )
            return rid
        except StoreUnavailableError:
            TOTAL["unavailable"] += 1  # planning again with the same round key finds it
    raise AssertionError("20 plans in a row ran out of retries")


def _retrying(call: Any) -> Any:
    for _ in range(20):
        try:
            return call()
        except StoreUnavailableError:
            TOTAL["unavailable"] += 1
    raise AssertionError("20 calls in a row ran out of retries")


def _run(store: CursorStore, plan: rf.FaultPlan, w: World, rng: random.Random) -> None:
    n = len(w.bounds) - 1
    rid = _plan(store, w, f"dag/run-{rng.randrange(10**9)}/plan")
    assert store.open_rounds() == [rid], "a second round was created"
    handed, before = [], TOTAL["unavailable"]
    while (nxt := _retrying(lambda: store.next_unclaimed(rid))) is not None:
        handed.append(nxt)
    if TOTAL["unavailable"] == before:  # every call answered: exactly each id once
        assert handed == list(range(n)), f"next_unclaimed handed out {handed}"
    else:  # a call whose retries ran out may have handed out an id nobody heard of: a hint
        # skipped (the pull loop rescues that range); never an id twice
        assert handed == sorted(set(handed)) and set(handed) <= set(range(n)), handed
    workers = [RangeWorker(store, rid, i, w, rng) for i in range(n)]
    for _ in range(100_000):
        live = [x for x in workers if not x.complete]
        if not live:
            break
        rng.choice(live).step()
    else:
        raise AssertionError("the round did not finish")
    res = _retrying(lambda: store.close_round(rid))
    plan.enabled = False
    dead = [_d(x["key"]) for i in range(n) for x in store.dead_letters(rid, i, limit=10_000)]
    lost = len(w.keys) - (res.done + res.skipped + res.dead) if isinstance(res, Closed) else -1
    again = [sum(c - 1 for c in w.main[i].values()) for i in range(n)]
    # chunks delivered again per crash of the range (the worst range)
    replay = max(-(-a // w.chunk) / max(w.crashes[i], 1) for i, a in enumerate(again))
    rs.record(SCENARIO, trials=1, keys_lost=max(lost, 0), max_replay=-int(-replay // 1))
    assert isinstance(res, Closed), res
    assert lost == 0
    assert (res.skipped, res.dead) == (len(w.skip), len(w.bad))
    assert sorted(dead) == sorted(w.bad), "a key dead-lettered twice, or a good key dead"
    for i in range(n):
        assert again[i] <= w.chunk * w.crashes[i], (i, again[i], w.crashes[i])
    keys = list(store.client.scan_iter(match=f"{store.base}:*", count=1000))
    assert len(keys) <= 3 * n + 8, sorted(keys)
    TOTAL["examples"] += 1
    TOTAL["faults"] += plan.count()
    TOTAL["keys"] += len(w.keys)
    TOTAL["redelivered keys"] += sum(again)


@pytest.fixture(scope="module", autouse=True)
def _figures() -> Iterator[None]:
    """Once the examples ran: their totals printed and noted in the reliability summary."""
    yield
    if TOTAL["examples"]:
        note = ", ".join(f"{k} {v}" for k, v in sorted(TOTAL.items()))
        print(f"\n{SCENARIO}: {note}")
        rs.record(SCENARIO, note=note)
        assert TOTAL["examples"] < 10 or TOTAL["faults"] > TOTAL["examples"], "faults too rare"


@settings(
    max_examples=rs.trials(40, 2000),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(example=worlds())
def test_random_rounds_under_random_lost_replies_end_exact(
    redis_url: str, key_prefix: str, example: tuple[World, float, int]
) -> None:
    w, p, seed = example
    rng = random.Random(seed)
    plan = rf.FaultPlan(chooser=rf.random_chooser(random.Random(seed + 1), p, KINDS))
    store = CursorStore(rf.faulty_client(redis_url, plan, retries=3), f"p{seed}", key_prefix)
    rf.load_scripts(store)
    try:
        _run(store, plan, w, rng)
    finally:
        plan.enabled = False
        store.delete_stream()
        store.close()
