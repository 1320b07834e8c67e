"""Key encoding (``core/keys.py``): the order the Lua fence compares is the key order.

- ``encode(a) < encode(b)`` iff ``a < b`` (plain string comparison, what the Lua fence uses), and
  ``decode(encode(a))`` is ``a`` exactly: same types, decimals with their scale, aware timestamps
  as the same instant, UUIDs, unicode with NUL, tuples of mixed types (hypothesis).
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

    try:
        check()
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
        (Decimal("1.50"), 1, "1.50"),
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
