"""Key encoding (``core/keys.py``): the order the Lua fence compares is the key order.

- ``encode(a) < encode(b)`` iff ``a < b`` (plain string comparison, what the Lua fence uses), and
  ``decode(encode(a))`` is ``a`` exactly: same types, decimals as the same value (normalised:
  the scale is not kept, so ``1.5`` and ``1.50`` encode equal, as PostgreSQL compares them), aware
  timestamps as the same instant, UUIDs, unicode with NUL, tuples of mixed types (hypothesis).
- The database agrees: a real traversal returns the keys of every supported column type in the
  encoding's order, each exactly once.
- One decode, one label and one bound reader serve the engine, the operators and the CLI.

Short mode runs a few hundred examples per property; long mode (``KEYSET_RELIABILITY_LONG=1``)
thousands.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import modes
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from airflow_keyset_provider.core import ConfigurationError, KeysetTraversal
from airflow_keyset_provider.core.keys import (
    MIN_KEY,
    coerce_bound,
    decode_key,
    decode_user_key,
    display_key,
    encode_key,
    key_label,
    parse_bound,
    to_json,
)

EXAMPLES = modes.trials(300, 5000)
DB_EXAMPLES = modes.trials(10, 200)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

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


def any_scale_decimals() -> st.SearchStrategy[Decimal]:
    """An unconstrained ``numeric`` column: each value keeps its own scale, often an equal value
    at another scale (``1.5``, ``1.50``)."""
    return st.integers(0, 4).flatmap(fixed_scale_decimals) | st.sampled_from(
        [Decimal("1.5"), Decimal("1.50"), Decimal("1.500"), Decimal("2"), Decimal("2.0")]
    )


# a column type: (name, value strategy); decimals of one scale per column, like numeric(p, s),
# or of mixed scales, like an unconstrained numeric
COLUMN_TYPES = st.one_of(
    st.just(("int", big_int)),
    st.just(("text", text)),
    st.integers(0, 6).map(lambda p: (f"decimal({p})", fixed_scale_decimals(p))),
    st.just(("numeric", any_scale_decimals())),
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


def normalised(d: Decimal) -> bool:
    """No trailing zero after the point and no positive exponent: what a key decodes to."""
    _, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    return exponent <= 0 and (exponent == 0 or digits[-1] != 0)


def same_value(x: Any, y: Any) -> bool:
    """``y`` (decoded) is ``x``: same type and value; a decimal in its normalised form."""
    if type(x) is not type(y):
        return False
    if isinstance(x, Decimal):
        return x == y and normalised(y)
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


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.decimals(allow_nan=False, allow_infinity=False) | any_scale_decimals(),
    st.decimals(allow_nan=False, allow_infinity=False) | any_scale_decimals(),
)
def test_decimals_of_any_scale_encode_by_value(a: Decimal, b: Decimal) -> None:
    """Across scales the encoding orders by value alone: ``1.5`` and ``1.50`` encode equal (as
    PostgreSQL compares them), distinct values keep their order; a decimal decodes to its
    normalised value (``1.50`` -> ``1.5``, ``1E+2`` -> ``100``; a negative zero to ``0``)."""
    ea, eb = encode_key((a,)), encode_key((b,))
    assert cmp(ea, eb) == cmp(a, b), (a, b, ea, eb)
    back = decode_key(ea)[0]
    assert back == a and normalised(back), (a, back)
    assert encode_key((back,)) == ea


@pytest.mark.parametrize(
    ("value", "decoded"),
    [
        ("1.50", "1.5"),
        ("1.5", "1.5"),
        ("100", "100"),
        ("1E+2", "100"),
        ("100.00", "100"),
        ("-0.0100", "-0.01"),
        ("0.000", "0"),
        ("-0", "0"),
    ],
)
def test_a_decimal_decodes_to_its_normalised_value(value: str, decoded: str) -> None:
    back = decode_key(encode_key((Decimal(value), 7)))
    assert str(back[0]) == decoded and back[1] == 7


@pytest.mark.parametrize(
    ("old_hex", "value"),
    [
        # encode_key((Decimal("1.50"), 7)) before the fix: code 0x32, point, digits, scale -2
        ("3215013135" + "00" + "13fd" + "1507", (Decimal("1.5"), 7)),
        ("31" + "14" + "1507", (Decimal(0), 7)),  # Decimal("0") with scale 0
        ("3013fececaff" + "13fe" + "1507", (Decimal("-1.5"), 7)),  # Decimal("-1.5"), scale -1
    ],
)
def test_keys_of_the_old_decimal_format_still_decode(old_hex: str, value: tuple) -> None:
    """Watermarks and bounds stored by a version that appended the scale (codes 0x30-0x32)
    decode to the normalised value, and sort below every key of the new format, so the next
    round may start from an old watermark."""
    assert decode_key(old_hex) == value
    assert old_hex < encode_key((Decimal("-1e30"), 0)) < encode_key(value)


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
    "numeric_mixed_scale": ("numeric", any_scale_decimals()),
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
        rnd = t.plan(
            max_ranges=3, end_key=max(vals, key=lambda v: encode_key((v,))), new_stream=True
        )
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
            # the database returns each value with its stored scale
            (isinstance(x, (dt.datetime, Decimal)) and type(x) is type(y) and x == y)
            or same_value(x, y)
            for x, y in zip(seen, sorted(vals, key=lambda v: encode_key((v,))), strict=True)
        )

    try:
        check()
    finally:
        t.close()


@pytest.mark.parametrize(
    "rows",
    [
        [(Decimal("1.5"), 1), (Decimal("1.50"), 2)],
        [(Decimal("1.50"), 1), (Decimal("1.5"), 2)],
        [
            (Decimal("1.5"), 1),
            (Decimal("1.50"), 2),
            (Decimal("1.500"), 3),
            (Decimal("1.50"), 4),
            (Decimal("1.5"), 5),
            (Decimal("2"), 1),
            (Decimal("2.0"), 2),
            (Decimal("0.00"), 1),
            (Decimal("0"), 2),
        ],
    ],
    ids=["1.5,1.50", "1.50,1.5", "many"],
)
def test_equal_numerics_of_another_scale_traverse_in_database_order(
    rows: list[tuple[Decimal, int]],
    pg_engine: sa.Engine,
    pg_schema_url: str,
    redis_url: str,
    key_prefix: str,
) -> None:
    """Issue #10 item 8. Key ``(n numeric, id int)`` with rows ``(1.5, 1)`` and ``(1.50, 2)``:
    PostgreSQL orders them by ``id`` (``1.5 = 1.50``). The old encoding ordered by the scale of
    ``n`` first (``1.50`` below ``1.5``), so after the cursor reached ``(1.5, 1)`` the advance to
    ``(1.50, 2)`` was refused as "backwards" and the range never completed. Now the round
    traverses to completion, one chunk per row (every cursor a real key), each row once."""
    with pg_engine.begin() as c:
        c.execute(
            sa.text("CREATE TABLE kn (n numeric NOT NULL, id int NOT NULL, PRIMARY KEY (n, id))")
        )
        c.execute(sa.text("INSERT INTO kn VALUES (:n, :id)"), [{"n": n, "id": i} for n, i in rows])
        in_db_order = [tuple(r) for r in c.execute(sa.text("SELECT n, id FROM kn ORDER BY n, id"))]
    t = KeysetTraversal(
        pg_schema_url,
        table="kn",
        key=["n", "id"],
        redis_url=redis_url,
        stream="numeric-scale",
        key_prefix=key_prefix,
    )
    try:
        rnd = t.plan(max_ranges=1, end_key=in_db_order[-1], new_stream=True)
        seen: list[tuple[Any, ...]] = []
        for r in rnd.ranges:
            result = t.traverse(
                rnd.round_id,
                r.range_id,
                lambda ch: seen.extend(ch.keys),
                chunk_size=1,
                max_chunk_attempts=1,
                lease_seconds=5,
            )
            assert result.complete, result
        assert [tuple(k) for k in seen] == in_db_order
        assert t.close_round(rnd.round_id) is not None
    finally:
        t.close()


def old_format_key(values: tuple[Any, ...]) -> str:
    """A key as versions before the fix encoded it: decimal codes 0x30-0x32, scale appended."""
    from airflow_keyset_provider.core import keys

    out = bytearray()
    for v in values:
        if isinstance(v, Decimal):
            part = bytearray()
            keys._encode_decimal(v, part)
            part[0] -= 7
            exponent = v.as_tuple().exponent
            assert isinstance(exponent, int)
            keys._encode_int(exponent, part)
            out += part
        else:
            keys._encode_component(v, out)
    return out.hex()


def test_a_watermark_stored_in_the_old_format_starts_the_next_round(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """Upgrade path: the stream's watermark was written by an older version (scale appended).
    The next chained round starts from it: the old key decodes, every new key sorts above it,
    and the round delivers exactly the rows above the watermark, each once."""
    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE kn (n numeric, id int, PRIMARY KEY (n, id))"))
        c.execute(sa.text("INSERT INTO kn VALUES (1.5, 1), (1.50, 2), (2, 1)"))
    t = KeysetTraversal(
        pg_schema_url,
        table="kn",
        key=["n", "id"],
        redis_url=redis_url,
        stream="upgrade",
        key_prefix=key_prefix,
    )
    try:
        first = t.plan(max_ranges=1, end_key=(Decimal("1.50"), 2), new_stream=True)
        t.traverse(first.round_id, 0, lambda ch: None, chunk_size=1, max_chunk_attempts=1)
        t.close_round(first.round_id)
        assert t.store.watermark() == encode_key((Decimal("1.5"), 2))
        old = old_format_key((Decimal("1.50"), 2))
        assert old == "32150131350013fd1502" and decode_key(old) == (Decimal("1.5"), 2)
        t.store.client.set(t.store.watermark_key, old)  # as the old version left it

        with pg_engine.begin() as c:
            c.execute(sa.text("INSERT INTO kn VALUES (1.5, 3), (3, 0), (1.5, 0)"))
        nxt = t.plan(max_ranges=2, new_stream=True)
        assert nxt.ranges[0].lo == (Decimal("1.5"), 2)
        seen: list[tuple[Any, ...]] = []
        for r in nxt.ranges:
            res = t.traverse(
                nxt.round_id,
                r.range_id,
                lambda ch: seen.extend(ch.keys),
                chunk_size=1,
                max_chunk_attempts=1,
            )
            assert res.complete, res
        assert [tuple(k) for k in seen] == [
            (Decimal("1.5"), 3),
            (Decimal("2"), 1),
            (Decimal("3"), 0),
        ]
        assert t.close_round(nxt.round_id).done == 3
    finally:
        t.close()


def test_a_round_planned_in_the_old_format_is_refused_not_skipped(
    pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> None:
    """Why rounds planned before the upgrade must be closed first: a range whose ``hi`` was
    stored in the old format compares above-or-below new cursors by type code, so the fence
    refuses the advance (``past_hi``) and the range stops with its cursor in place: nothing is
    marked done that was not delivered."""
    from airflow_keyset_provider.core.errors import CursorConflictError

    with pg_engine.begin() as c:
        c.execute(sa.text("CREATE TABLE kn (n numeric, id int, PRIMARY KEY (n, id))"))
        c.execute(sa.text("INSERT INTO kn VALUES (1.5, 1), (1.50, 2), (2, 1)"))
    t = KeysetTraversal(
        pg_schema_url,
        table="kn",
        key=["n", "id"],
        redis_url=redis_url,
        stream="inflight",
        key_prefix=key_prefix,
    )
    try:
        rnd = t.plan(max_ranges=1, end_key=(Decimal("2"), 1), new_stream=True)
        old_hi = old_format_key((Decimal("2"), 1))
        t.store.client.hset(t.store.range_key(rnd.round_id, 0), "hi", old_hi)  # as stored before
        seen: list[Any] = []
        with pytest.raises(CursorConflictError, match="passes hi"):
            t.traverse(
                rnd.round_id, 0, lambda ch: seen.extend(ch.keys), chunk_size=1, max_chunk_attempts=1
            )
        [status] = t.range_status(rnd.round_id)
        assert status["state"] != "complete" and status["done"] == 0
    finally:
        t.close()


# --------------------------------------------------------------------------- decode and labels

UTC_NOON = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("value", "arity", "label"),
    [
        (None, 1, "-inf"),
        (42, 1, "42"),
        ("abc", 1, "abc"),
        (Decimal("1.5"), 1, "1.5"),  # a decimal decodes normalised: 1.50 -> 1.5
        (UTC_NOON, 1, "2024-01-01T12:00:00+00:00"),
        (dt.date(2024, 1, 2), 1, "2024-01-02"),
        (uuid.UUID(int=1), 1, "00000000-0000-0000-0000-000000000001"),
        ((UTC_NOON, 7), 2, "(2024-01-01T12:00:00+00:00, 7)"),
    ],
    ids=["open", "int", "text", "decimal", "timestamptz", "date", "uuid", "composite"],
)
def test_one_label_for_encoded_decoded_and_json_keys(value: Any, arity: int, label: str) -> None:
    """The engine's logs (encoded keys), the operators (decoded keys, or their JSON form from
    XCom) and the CLI render a key the same way."""
    encoded = MIN_KEY if value is None else encode_key(value if arity > 1 else (value,))
    assert decode_user_key(encoded, arity) == value
    assert display_key(encoded, arity) == label
    assert key_label(value) == label
    assert key_label(to_json(value)) == label


# --------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    ("rendered", "parsed"),
    [
        (None, None),
        ("", None),
        ("None", None),
        ("null", None),
        ("1000", "1000"),
        ('"abc"', "abc"),
        ('["2024-01-01T00:00:00+00:00", 0]', ["2024-01-01T00:00:00+00:00", 0]),
        ((1, 2), [1, 2]),
        (7, 7),
    ],
)
def test_parse_bound_reads_rendered_templates(rendered: Any, parsed: Any) -> None:
    assert parse_bound(rendered) == parsed


def test_parse_bound_refuses_broken_json() -> None:
    with pytest.raises(ConfigurationError, match="looks like JSON"):
        parse_bound("[1, ")


@pytest.mark.parametrize(
    ("value", "kinds", "from_text", "expected"),
    [
        (5, ["int"], False, (5,)),
        ("5", ["int"], True, (5,)),
        (" -5 ", ["int"], True, (-5,)),
        ("1.50", ["decimal"], True, (Decimal("1.50"),)),
        (3, ["decimal"], False, (Decimal(3),)),
        ("2024-01-01T12:00:00+00:00", ["timestamptz"], False, (UTC_NOON,)),
        ("2024-01-02", ["date"], False, (dt.date(2024, 1, 2),)),
        (str(uuid.UUID(int=1)), ["uuid"], False, (uuid.UUID(int=1),)),
        ([UTC_NOON.isoformat(), "7"], ["timestamptz", "int"], True, (UTC_NOON, 7)),
        ((UTC_NOON, 7), ["timestamptz", "int"], False, (UTC_NOON, 7)),
    ],
)
def test_coerce_bound_types_a_bound_by_its_key_columns(
    value: Any, kinds: list[str], from_text: bool, expected: tuple
) -> None:
    assert coerce_bound("start_key", value, kinds, from_text=from_text) == expected


@pytest.mark.parametrize(
    ("value", "kinds", "from_text", "message"),
    [
        ("ten", ["int"], False, "start_key='ten' .* does not fit a int key column"),
        ("5", ["int"], False, "does not fit a int"),
        (True, ["int"], False, "does not fit a int"),
        ("x", ["decimal"], True, "not a number"),
        (
            dt.datetime(2024, 1, 1),
            ["timestamptz"],
            False,
            "naive but the key column is timestamp with",
        ),
        (UTC_NOON, ["timestamp"], False, "timezone-aware but the key column is timestamp without"),
        ([1], ["int", "int"], True, r"has 1 part\(s\); the key has 2"),
        (1, ["int", "int"], False, "start_key: key 1 must be a tuple of 2 values"),
        ((1, "x"), ["int", "int"], False, r"start_key\[1\]='x'"),
    ],
)
def test_coerce_bound_refusals_name_the_bound_and_the_fix(
    value: Any, kinds: list[str], from_text: bool, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        coerce_bound("start_key", value, kinds, from_text=from_text)
