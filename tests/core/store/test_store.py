"""Cursor store (``core/store/cursor_store.py``), against real Redis (hypothesis).

- Watermark: random interleavings of completing ranges and closing rounds never move the
  watermark backwards or past a gap, and it is the end of the contiguous completed prefix.
- Advance refusals: random sequences of claims, heartbeats, releases and advances by current
  and stale tokens match a model of the fence exactly; the cursor never moves backwards or past
  ``hi``.

Short mode runs a hundred examples per property; long mode (``KEYSET_RELIABILITY_LONG=1``)
thousands.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import modes
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.core import CursorConflictError, LeaseLostError
from airflow_keyset_provider.core.keys import MIN_KEY, encode_key
from airflow_keyset_provider.core.store.cursor_store import Claim, Closed, CursorStore, Incomplete

REDIS_EXAMPLES = modes.trials(100, 2000)

# --------------------------------------------------------------------------- watermark


def _enc(n: int) -> str:
    return encode_key((n,))


def _complete_range(store: CursorStore, rid: str, i: int) -> None:
    token = f"t-{uuid.uuid4().hex[:8]}"
    claim = store.claim(rid, i, token, "", 60_000)
    assert isinstance(claim, Claim)
    if not claim.complete:
        hi = store.ranges(rid)[i]["hi"]
        a = store.advance(
            rid, i, token, claim.cursor, hi, done=1, skipped=0, lease_ms=60_000, max_item_attempts=3
        )
        assert a.complete
    store.release(rid, i, token)


@st.composite
def watermark_schedules(
    draw: st.DrawFn,
) -> tuple[list[int], list[list[int]], list[tuple[str, int, int]]]:
    """Consecutive rounds (-inf, b1], (b1, b2], ... each cut into ranges, and a random
    interleaving of 'complete range' and 'close round' operations."""
    bounds = sorted(draw(st.sets(st.integers(1, 1000), min_size=1, max_size=6)))
    cuts = [
        sorted(draw(st.sets(st.integers(lo + 1, hi - 1), max_size=2))) if hi - lo > 1 else []
        for lo, hi in zip([0, *bounds], bounds, strict=False)
    ]
    ops = [("complete", r, i) for r, c in enumerate(cuts) for i in range(len(c) + 1)]
    ops += [("close", r, 0) for r in range(len(bounds)) for _ in range(draw(st.integers(1, 2)))]
    ops = draw(st.permutations(ops))
    return bounds, cuts, ops


def _run_watermark_schedule(
    redis_client: redis.Redis,
    key_prefix: str,
    sched: tuple[list[int], list[list[int]], list[tuple[str, int, int]]],
) -> list[tuple]:
    """Returns (watermark, contiguous closed prefix, open gap start) after every operation."""
    bounds, cuts, ops = sched
    store = CursorStore(redis_client, f"wm-{uuid.uuid4().hex[:10]}", prefix=key_prefix)
    starts = [MIN_KEY] + [_enc(b) for b in bounds[:-1]]
    ids = []
    try:
        for r, b in enumerate(bounds):
            pts = [starts[r], *(_enc(c) for c in cuts[r]), _enc(b)]
            rid, created = store.create_round(
                idempotency_key=f"round-{r}",
                chained=False,
                start=starts[r],
                end=_enc(b),
                source="{}",
                arity=1,
                bounds=list(itertools.pairwise(pts)),
            )
            assert created
            ids.append(rid)
        completed: set[tuple[int, int]] = set()
        closed: set[int] = set()
        trace = []
        last_wm = None
        for op, r, i in ops:
            if op == "complete":
                _complete_range(store, ids[r], i)
                completed.add((r, i))
            else:
                res = store.close_round(ids[r])
                all_done = all((r, j) in completed for j in range(len(cuts[r]) + 1))
                assert isinstance(res, Closed if all_done else Incomplete), (res, r, completed)
                if all_done:
                    closed.add(r)
            wm = store.watermark()
            prefix = 0
            while prefix in closed:
                prefix += 1
            contiguous_end = _enc(bounds[prefix - 1]) if prefix else None
            assert last_wm is None or (wm is not None and wm >= last_wm), (
                f"watermark moved back {last_wm} -> {wm}"
            )
            last_wm = wm
            trace.append((wm, contiguous_end, op, r, i))
        return trace
    finally:
        store.delete_stream()


@settings(
    max_examples=REDIS_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(watermark_schedules())
def test_watermark_never_passes_a_gap_or_moves_back(
    redis_client: redis.Redis, key_prefix: str, sched: Any
) -> None:
    for wm, contiguous_end, *_ in _run_watermark_schedule(redis_client, key_prefix, sched):
        assert wm is None or (contiguous_end is not None and wm <= contiguous_end), (
            wm,
            contiguous_end,
        )


@settings(
    max_examples=REDIS_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(watermark_schedules())
def test_watermark_is_the_contiguous_completed_prefix(
    redis_client: redis.Redis, key_prefix: str, sched: Any
) -> None:
    """``watermark()`` is documented as "the end of the stream's contiguous completed prefix":
    once (-inf, b1] and (b1, b2] are both closed, in either order, it is b2."""
    for wm, contiguous_end, op, r, _i in _run_watermark_schedule(redis_client, key_prefix, sched):
        assert wm == contiguous_end, (
            f"after {op} round {r}: watermark {wm} but the closed rounds cover "
            f"(-inf, {contiguous_end}] contiguously"
        )


# --------------------------------------------------------------------------- advance refusals

LO, HI = 10, 50
KEY_CHOICES = [0, 5, 10, 11, 20, 30, 49, 50, 51, 99]

ops_strategy = st.lists(
    st.one_of(
        st.tuples(
            st.just("claim"), st.sampled_from(["L1", "L2", ""]), st.sampled_from([0, 60_000])
        ),
        st.tuples(
            st.just("advance"),
            st.integers(0, 9),
            st.sampled_from(["actual", *KEY_CHOICES]),
            st.sampled_from(KEY_CHOICES),
        ),
        st.tuples(st.just("heartbeat"), st.integers(0, 9), st.just(0)),
        st.tuples(st.just("release"), st.integers(0, 9), st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


@settings(
    max_examples=REDIS_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops_strategy)
def test_advance_refusals_match_the_fence_model(
    redis_client: redis.Redis, key_prefix: str, ops: list[tuple]
) -> None:
    store = CursorStore(redis_client, f"adv-{uuid.uuid4().hex[:10]}", prefix=key_prefix)
    rid, _ = store.create_round(
        idempotency_key=None,
        chained=False,
        start=_enc(LO),
        end=_enc(HI),
        source="{}",
        arity=1,
        bounds=[(_enc(LO), _enc(HI))],
    )
    tokens: list[str] = []
    m: dict[str, Any] = {
        "owner": "",
        "lineage": "",
        "valid": False,
        "cursor": _enc(LO),
        "complete": False,
    }
    hi = _enc(HI)
    try:
        for op in ops:
            before = store.ranges(rid)[0]["cursor"]
            if op[0] == "claim":
                _, lineage, lease = op
                token = f"{lineage or 'w'}#{len(tokens)}"
                tokens.append(token)
                res = store.claim(rid, 0, token, lineage, lease)
                if m["complete"]:
                    assert isinstance(res, Claim) and res.complete
                    # CLAIM drops the fields of an owner that completed the range and never
                    # released it (it died: its lease ran out, or a new try of its lineage
                    # claims): that owner's token is nobody's any more. A live owner of another
                    # lineage keeps them.
                    if m["owner"] and (not m["valid"] or (lineage and m["lineage"] == lineage)):
                        m.update(owner="", valid=False)
                elif m["owner"] and m["valid"] and (lineage == "" or m["lineage"] != lineage):
                    assert isinstance(res, tuple) and res[0] == m["owner"]
                else:
                    assert isinstance(res, Claim) and not res.complete and res.cursor == m["cursor"]
                    m.update(owner=token, lineage=lineage, valid=lease > 0)
            elif not tokens:
                continue  # nobody ever claimed: nothing to advance, beat or release with
            elif op[0] == "advance":
                _, ti, exp_choice, new_n = op
                token = tokens[ti % len(tokens)]
                expected = m["cursor"] if exp_choice == "actual" else _enc(exp_choice)
                new = _enc(new_n)
                if token != m["owner"] or not m["valid"]:
                    want: type[Exception] | None = LeaseLostError
                elif expected != m["cursor"] or not m["cursor"] <= new <= hi:
                    want = CursorConflictError
                else:
                    want = None
                try:
                    a = store.advance(
                        rid,
                        0,
                        token,
                        expected,
                        new,
                        done=1,
                        skipped=0,
                        lease_ms=60_000,
                        max_item_attempts=3,
                    )
                    got: type[Exception] | None = None
                except (LeaseLostError, CursorConflictError) as exc:
                    got = type(exc)
                assert got is want, (op, m, got)
                if want is None:
                    assert a.cursor == new
                    m.update(cursor=new, complete=m["complete"] or new == hi)
            elif op[0] == "heartbeat":
                token = tokens[op[1] % len(tokens)]
                assert store.heartbeat(rid, 0, token, 60_000) == (
                    token == m["owner"] and m["valid"]
                )
            else:
                token = tokens[op[1] % len(tokens)]
                released = store.release(rid, 0, token)
                assert released == (token == m["owner"])
                if released:
                    m.update(owner="", valid=False)
            after = store.ranges(rid)[0]["cursor"]
            assert before <= after <= hi and after == m["cursor"], (op, before, after, m)
    finally:
        store.delete_stream()
