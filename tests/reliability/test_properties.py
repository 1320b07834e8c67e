"""Property-based tests (hypothesis) of the pieces whose invariants carry the proof.

- Key encoding: ``encode(a) < encode(b)`` iff ``a < b`` (plain string comparison, what the Lua
  fence uses), and ``decode(encode(a))`` is ``a`` exactly: same types, decimals with their
  scale, aware timestamps as the same instant, UUIDs, unicode with NUL, tuples of mixed types.
  And the database agrees: a real traversal returns the keys of every supported column type in
  the encoding's order, each exactly once.
- Planner: ``split`` covers ``(start, end]`` exactly with at most ``max_ranges`` disjoint
  half-open ranges whose inner boundaries are cut keys.
- Watermark: random interleavings of completing ranges and closing rounds never move the
  watermark backwards or past a gap, and it is the end of the contiguous completed prefix.
- Advance refusals: random sequences of claims, heartbeats, releases and advances by current
  and stale tokens match a model of the fence exactly; the cursor never moves backwards or past
  ``hi``.

Short mode runs a few hundred examples per property; long mode thousands.
"""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from decimal import Decimal
from typing import Any

import pytest
import redis
import reliability_support as rs
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.core import (
    CursorConflictError,
    KeysetTraversal,
    LeaseLostError,
)
from airflow_keyset_provider.core.keys import MIN_KEY, decode_key, encode_key
from airflow_keyset_provider.core.planner import split
from airflow_keyset_provider.core.store import Claim, Closed, CursorStore, Incomplete

EXAMPLES = rs.trials(300, 5000)
DB_EXAMPLES = rs.trials(10, 200)
REDIS_EXAMPLES = rs.trials(100, 2000)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

_counts: dict[str, int] = {}


def _count(name: str) -> None:
    _counts[name] = _counts.get(name, 0) + 1


# --------------------------------------------------------------------------- key encoding

aware = st.datetimes(
    min_value=dt.datetime(1, 1, 2),
    max_value=dt.datetime(9999, 12, 30),
    timezones=st.one_of(
        st.timezones(),
        st.builds(
            dt.timezone,
            st.timedeltas(min_value=dt.timedelta(hours=-23), max_value=dt.timedelta(hours=23)),
        ),
    ),
)
text = st.one_of(
    st.text(), st.text(alphabet=st.sampled_from(["\x00", "\x01", "a", "b", "\x7f", "é", "😀"]))
)
big_int = st.one_of(st.integers(-(2**70), 2**70), st.integers(-(2**2000), 2**2000))


def fixed_scale_decimals(places: int) -> st.SearchStrategy[Decimal]:
    return st.decimals(
        places=places,
        allow_nan=False,
        allow_infinity=False,
        min_value=Decimal("-1e30"),
        max_value=Decimal("1e30"),
    )


# a column type: (name, value strategy); decimals have one scale per column, like numeric(p, s)
COLUMN_TYPES = st.one_of(
    st.just(("int", big_int)),
    st.just(("text", text)),
    st.integers(0, 6).map(lambda p: (f"decimal({p})", fixed_scale_decimals(p))),
    st.just(("timestamptz", aware)),
    st.just(("timestamp", st.datetimes())),
    st.just(("date", st.dates())),
    st.just(("uuid", st.uuids())),
)


def model_key(v: Any) -> Any:
    """The order the database uses: instants for aware timestamps, values otherwise."""
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v - _EPOCH
    if isinstance(v, uuid.UUID):
        return v.int
    return v


def cmp(a: Any, b: Any) -> int:
    return (a > b) - (a < b)


@st.composite
def two_keys_of_one_schema(draw: st.DrawFn) -> tuple[tuple, tuple]:
    schema = draw(st.lists(COLUMN_TYPES, min_size=1, max_size=4))
    a = tuple(draw(s) for _, s in schema)
    if draw(st.booleans()):  # share a prefix: the interesting comparisons are on later columns
        cut = draw(st.integers(0, len(schema)))
        b = a[:cut] + tuple(draw(s) for _, s in schema[cut:])
    else:
        b = tuple(draw(s) for _, s in schema)
    return a, b


def same_value(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, Decimal):
        return x == y and (x.as_tuple().exponent == y.as_tuple().exponent)
    if isinstance(x, dt.datetime) and x.tzinfo is not None:
        # the same instant; not ``x == y``, which PEP 495 makes False across zones for a local
        # time in a DST gap or fold
        return y.tzinfo is not None and x - _EPOCH == y - _EPOCH
    return x == y


@settings(max_examples=EXAMPLES, deadline=None)
@given(two_keys_of_one_schema())
def test_key_encoding_preserves_order_and_round_trips(pair: tuple[tuple, tuple]) -> None:
    a, b = pair
    ea, eb = encode_key(a), encode_key(b)
    assert ea == ea.lower() and all(c in "0123456789abcdef" for c in ea)
    model = cmp(tuple(map(model_key, a)), tuple(map(model_key, b)))
    assert cmp(ea, eb) == model, (a, b, ea, eb)
    for k, e in ((a, ea), (b, eb)):
        back = decode_key(e)
        assert len(back) == len(k) and all(
            same_value(x, y) for x, y in zip(k, back, strict=True)
        ), (k, back)
    _count("key encoding")


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.decimals(allow_nan=False, allow_infinity=False),
    st.decimals(allow_nan=False, allow_infinity=False),
)
def test_decimals_of_any_scale_keep_value_order_and_scale(a: Decimal, b: Decimal) -> None:
    """Across scales: distinct values keep their order; equal values with another scale (1.5 and
    1.50, which a unique numeric column cannot hold both of) encode differently; the scale
    round-trips (only the sign of a negative zero is dropped: numeric has no -0)."""
    ea, eb = encode_key((a,)), encode_key((b,))
    if a != b:
        assert cmp(ea, eb) == cmp(a, b), (a, b)
    else:
        assert (ea == eb) == (a.as_tuple().exponent == b.as_tuple().exponent)
    back = decode_key(ea)[0]
    assert back == a and back.as_tuple().exponent == a.as_tuple().exponent
    _count("key encoding")


DB_TYPES = {
    "bigint": ("bigint", st.integers(-(2**63), 2**63 - 1)),
    "text": (
        'text COLLATE "C"',
        st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
    ),
    "numeric": (
        "numeric",
        st.decimals(
            places=3,
            allow_nan=False,
            allow_infinity=False,
            min_value=Decimal("-1e12"),
            max_value=Decimal("1e12"),
        ),
    ),
    "timestamptz": (
        "timestamptz",
        st.datetimes(
            min_value=dt.datetime(1900, 1, 1),
            max_value=dt.datetime(2200, 1, 1),
            timezones=st.just(dt.UTC),
        ),
    ),
    "date": ("date", st.dates(min_value=dt.date(1, 1, 1), max_value=dt.date(9999, 12, 31))),
    "uuid": ("uuid", st.uuids()),
}


@pytest.mark.parametrize("kind", sorted(DB_TYPES))
def test_database_order_is_the_encoding_order(
    kind: str, pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """Keys of each supported column type, inserted in random order, come back from a real
    traversal (chunk size 3, so every cursor is a real key) in encoding order, each once."""
    ddl, values = DB_TYPES[kind]
    with pg_engine.begin() as c:
        c.execute(sa.text(f"CREATE TABLE k (v {ddl} PRIMARY KEY)"))
    t = KeysetTraversal(
        pg_schema_url,
        table="k",
        key="v",
        redis_url=redis_url,
        stream=f"db-{kind}",
        key_prefix=key_prefix,
    )

    # no shrinking: a failing example costs a round trip per key, and any example shows the fault
    @settings(
        max_examples=DB_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    @given(st.lists(values, min_size=1, max_size=25, unique_by=lambda v: encode_key((v,))))
    def check(vals: list[Any]) -> None:
        with pg_engine.begin() as c:
            c.execute(sa.text("TRUNCATE k"))
            c.execute(sa.text("INSERT INTO k VALUES (:v)"), [{"v": v} for v in vals])
        t.store.delete_stream()  # a fresh stream: the round starts below every key
        # an explicit end: this property is about order, not about the commit-order wait
        rnd = t.plan(max_ranges=3, end_key=max(vals, key=lambda v: encode_key((v,))))
        seen: list[Any] = []
        for r in rnd.ranges:
            t.traverse(
                rnd.round_id,
                r.range_id,
                lambda ch: seen.extend(ch.keys),
                chunk_size=3,
                max_chunk_attempts=1,
                lease_seconds=5,
            )
        assert [encode_key((v,)) for v in seen] == sorted(encode_key((v,)) for v in vals)
        assert all(
            same_value(x, y) or (isinstance(x, dt.datetime) and x == y)
            for x, y in zip(seen, sorted(vals, key=lambda v: encode_key((v,))), strict=True)
        )
        _count(f"db order {kind}")

    try:
        check()
    finally:
        t.close()


# --------------------------------------------------------------------------- planner


@st.composite
def split_inputs(draw: st.DrawFn) -> tuple[str, str, list[str], int, list[str]]:
    universe = sorted(
        {
            encode_key((n,))
            for n in draw(st.lists(st.integers(-1000, 1000), min_size=1, max_size=60))
        }
    )
    start = draw(st.sampled_from([MIN_KEY, *universe]))
    end = draw(st.sampled_from([u for u in universe if u >= start] or [start]))
    cuts = draw(st.lists(st.sampled_from(universe), max_size=80))  # may repeat, may fall outside
    return start, end, cuts, draw(st.integers(1, 40)), universe


@settings(max_examples=EXAMPLES, deadline=None)
@given(split_inputs())
def test_planner_split_is_an_exact_disjoint_cover(
    inp: tuple[str, str, list[str], int, list[str]],
) -> None:
    start, end, cuts, max_ranges, universe = inp
    ranges = split(start, end, cuts, max_ranges)
    assert 1 <= len(ranges) <= max_ranges
    assert ranges[0][0] == start and ranges[-1][1] == end
    for (_lo1, hi1), (lo2, _hi2) in itertools.pairwise(ranges):
        assert hi1 == lo2  # adjacent: no gap, no overlap (half-open)
    inner = [hi for _, hi in ranges[:-1]]
    assert all(c in cuts and start < c < end for c in inner)
    assert inner == sorted(set(inner))
    if start != end:
        assert all(lo < hi for lo, hi in ranges)
    # every key of the universe in (start, end] lies in exactly one range, none outside does
    for k in universe:
        owners = [i for i, (lo, hi) in enumerate(ranges) if lo < k <= hi]
        assert len(owners) == (1 if start < k <= end else 0), (k, ranges)
    # as many ranges as the distinct usable cuts allow, up to max_ranges
    usable = {c for c in cuts if start < c < end}
    assert len(ranges) == min(max_ranges, len(usable) + 1)
    _count("planner split")


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
    _count("watermark")


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
    _count("watermark")


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
    _count("advance refusals")


def test_zz_record_property_counts() -> None:
    """Adds the properties' example counts to the summary table (runs after them)."""
    groups: dict[str, int] = {}
    for name, n in _counts.items():
        label = "db order = encoding order" if name.startswith("db order") else name
        groups[label] = groups.get(label, 0) + n
    for label, n in sorted(groups.items()):
        rs.record(f"P {label}", trials=n, note="hypothesis examples")
