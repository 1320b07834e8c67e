"""Canonical key encoding: exact, JSON-safe, and order-preserving as plain ASCII.

A key is a tuple of column values (a one-column key is a 1-tuple here; the public API unwraps it).
``encode_key`` turns it into a lowercase hex string such that, for keys of the same column types,

    encode_key(a) < encode_key(b)   <=>   a < b          (plain string comparison)
    decode_key(encode_key(a)) == a  and has the same type

so Redis Lua scripts can refuse a cursor that moves backwards or past ``hi`` with a string
comparison, and keys travel through XCom and Redis without float or timezone accidents.

Decimals are encoded by value only, so equal values of another scale (``1.5``, ``1.50``) encode
equal, as PostgreSQL compares them: in a composite key ``(n numeric, id int)`` the rows
``(1.5, 1)`` and ``(1.50, 2)`` are ordered by ``id``, never by the scale of ``n``. A decimal
therefore decodes to its *normalised* value: trailing zeros after the point dropped, never an
exponent above zero (``Decimal("1.50")`` -> ``Decimal("1.5")``, ``Decimal("1E+2")`` ->
``Decimal("100")``, what PostgreSQL's ``trim_scale`` gives), which PostgreSQL compares equal to
the stored value. Only the scale is lost, never the value or the order.

Compatibility with keys stored by versions before 0x37-0x39 (they used codes 0x30-0x32 and
appended the scale, which ordered ``1.50`` before ``1.5`` and so could refuse a legitimate advance
as "backwards"): such keys still decode (to the normalised value), and every new decimal code
sorts above every old one, so a stream's old watermark is a valid start for the next round.
Rounds planned before the upgrade whose range bounds hold a decimal must be closed (their
DAG runs finished) before upgrading: comparing a new cursor with an old ``hi`` of equal prefix
refuses the advance (``CursorConflictError``: "passes hi") and the range stops with its cursor in
place; it never marks a key done that was not delivered (``tests/core/test_keys.py``).

The empty string is ``MIN_KEY``: below every key, it stands for "no lower bound".

The byte layout follows FoundationDB's tuple layer: each component is a type code followed by
an order-preserving body; the bytes are rendered as hex (hex digits sort like the bytes they
encode).

=========  ======  ====================================================================
type       code    body
=========  ======  ====================================================================
str        0x02    UTF-8, 0x00 escaped as 0x00 0xFF, terminated by 0x00
int        0x0b-   sign and length in the code (0x14 is zero), big-endian magnitude,
           0x1d    negatives one's-complemented; > 8 bytes carry an explicit length byte
Decimal    0x37-   sign code (negative, zero, positive), order-preserving exponent of the
           0x39    normalised value, significant digits, terminator; no scale
datetime   0x33    aware: microseconds since the Unix epoch in UTC, as an int component
datetime   0x34    naive (``timestamp without time zone``): microseconds since the epoch
date       0x35    proleptic ordinal, as an int component
UUID       0x36    the 16 bytes
=========  ======  ====================================================================

Components of one column always share a type, so codes only need to order within a type.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from .errors import ConfigurationError

MIN_KEY = ""

_STR, _INT_ZERO, _INT_BIG_NEG, _INT_BIG_POS = 0x02, 0x14, 0x0B, 0x1D
_DEC_NEG, _DEC_ZERO, _DEC_POS = 0x37, 0x38, 0x39
# codes of the old, scale-carrying decimal encoding: decoded, never written
_OLD_DEC_NEG, _OLD_DEC_ZERO, _OLD_DEC_POS = 0x30, 0x31, 0x32
_OLD_DEC = {_OLD_DEC_NEG: _DEC_NEG, _OLD_DEC_ZERO: _DEC_ZERO, _OLD_DEC_POS: _DEC_POS}
_TS_AWARE, _TS_NAIVE, _DATE, _UUID = 0x33, 0x34, 0x35, 0x36

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EPOCH_NAIVE = dt.datetime(1970, 1, 1)
_US = dt.timedelta(microseconds=1)


class KeyEncodingError(ValueError):
    """A value that cannot be part of a key (None, float, bool, NaN, an unknown type)."""


def _encode_int(n: int, out: bytearray) -> None:
    if n == 0:
        out.append(_INT_ZERO)
        return
    magnitude = abs(n)
    length = (magnitude.bit_length() + 7) // 8
    if length > 255:
        raise KeyEncodingError(f"integer key component too large: {length} bytes")
    body = magnitude.to_bytes(length, "big")
    if n < 0:
        body = bytes(0xFF - b for b in body)
    if length <= 8:
        out.append(_INT_ZERO + length if n > 0 else _INT_ZERO - length)
    elif n > 0:
        out += bytes((_INT_BIG_POS, length))
    else:
        out += bytes((_INT_BIG_NEG, 0xFF - length))
    out += body


def _decode_int(b: bytes, i: int) -> tuple[int, int]:
    code = b[i]
    i += 1
    if code == _INT_ZERO:
        return 0, i
    if code == _INT_BIG_POS:
        length, negative = b[i], False
        i += 1
    elif code == _INT_BIG_NEG:
        length, negative = 0xFF - b[i], True
        i += 1
    elif _INT_ZERO < code < _INT_BIG_POS:
        length, negative = code - _INT_ZERO, False
    elif _INT_BIG_NEG < code < _INT_ZERO:
        length, negative = _INT_ZERO - code, True
    else:
        raise KeyEncodingError(f"not an integer code: {code:#x}")
    body = b[i : i + length]
    if len(body) != length:
        raise KeyEncodingError("truncated integer")
    if negative:
        return -int.from_bytes(bytes(0xFF - x for x in body), "big"), i + length
    return int.from_bytes(body, "big"), i + length


def _encode_decimal(d: Decimal, out: bytearray) -> None:
    """The value only: equal decimals of any scale give the same bytes (see the module doc)."""
    if not d.is_finite():
        raise KeyEncodingError(f"decimal key component must be finite, got {d}")
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    if not any(digits):
        out.append(_DEC_ZERO)
        return
    # value = 0.d1d2...dn * 10**point with d1 != 0 and trailing zeros dropped
    first = next(i for i, x in enumerate(digits) if x)
    sig = list(digits[first:])
    while sig[-1] == 0:
        sig.pop()
    point = len(digits) - first + exponent
    ascii_digits = bytes(0x30 + x for x in sig)
    exp_part = bytearray()
    if sign:  # larger magnitude sorts lower: complement exponent and digits, end high
        _encode_int(-point, exp_part)
        out.append(_DEC_NEG)
        out += exp_part
        out += bytes(0xFF - x for x in ascii_digits) + b"\xff"
    else:
        _encode_int(point, exp_part)
        out.append(_DEC_POS)
        out += exp_part
        out += ascii_digits + b"\x00"


def _decode_decimal(b: bytes, i: int) -> tuple[Decimal, int]:
    """The normalised value (no trailing fractional zeros, exponent <= 0); old-format keys
    (codes 0x30-0x32) also carry a scale after the value, which is read and dropped."""
    code = b[i]
    old = code in _OLD_DEC
    code = _OLD_DEC.get(code, code)
    i += 1
    if code == _DEC_ZERO:
        if old:
            _, i = _decode_int(b, i)
        return Decimal(0), i
    point, i = _decode_int(b, i)
    end = b.index(0xFF if code == _DEC_NEG else 0x00, i)
    raw = b[i:end]
    i = end + 1
    negative = code == _DEC_NEG
    if negative:
        point, raw = -point, bytes(0xFF - x for x in raw)
    if old:
        _, i = _decode_int(b, i)
    sig = tuple(x - 0x30 for x in raw)
    # 0.d1..dn * 10**point: integral values get their zeros back (exponent 0, never E+n)
    exponent = point - len(sig)
    if exponent > 0:
        sig, exponent = sig + (0,) * exponent, 0
    return Decimal((int(negative), sig, exponent)), i


def _encode_component(v: Any, out: bytearray) -> None:
    # bool is an int subclass; a boolean "key" is never unique enough to be one.
    if isinstance(v, bool) or v is None or isinstance(v, float):
        raise KeyEncodingError(
            f"unsupported key value {v!r} ({type(v).__name__}): keys are NOT NULL "
            "and exact (int, str, Decimal, datetime, date, UUID)"
        )
    if isinstance(v, int):
        _encode_int(v, out)
    elif isinstance(v, str):
        out.append(_STR)
        out += v.encode("utf-8").replace(b"\x00", b"\x00\xff") + b"\x00"
    elif isinstance(v, Decimal):
        _encode_decimal(v, out)
    elif isinstance(v, dt.datetime):
        if v.tzinfo is None:
            out.append(_TS_NAIVE)
            _encode_int((v - _EPOCH_NAIVE) // _US, out)
        else:
            out.append(_TS_AWARE)
            _encode_int((v - _EPOCH) // _US, out)
    elif isinstance(v, dt.date):
        out.append(_DATE)
        _encode_int(v.toordinal(), out)
    elif isinstance(v, uuid.UUID):
        out.append(_UUID)
        out += v.bytes
    else:
        raise KeyEncodingError(f"unsupported key value {v!r} of type {type(v).__name__}")


def _decode_component(b: bytes, i: int) -> tuple[Any, int]:
    code = b[i]
    if code == _STR:
        out = bytearray()
        i += 1
        while True:
            j = b.index(0, i)
            out += b[i:j]
            if j + 1 < len(b) and b[j + 1] == 0xFF:
                out.append(0)
                i = j + 2
            else:
                return out.decode("utf-8"), j + 1
    if _INT_BIG_NEG <= code <= _INT_BIG_POS:
        return _decode_int(b, i)
    if code in (_DEC_NEG, _DEC_ZERO, _DEC_POS) or code in _OLD_DEC:
        return _decode_decimal(b, i)
    if code == _TS_AWARE:
        us, i = _decode_int(b, i + 1)
        return _EPOCH + us * _US, i
    if code == _TS_NAIVE:
        us, i = _decode_int(b, i + 1)
        return _EPOCH_NAIVE + us * _US, i
    if code == _DATE:
        n, i = _decode_int(b, i + 1)
        return dt.date.fromordinal(n), i
    if code == _UUID:
        return uuid.UUID(bytes=bytes(b[i + 1 : i + 17])), i + 17
    raise KeyEncodingError(f"unknown type code {code:#x} at byte {i}")


def encode_key(values: Sequence[Any]) -> str:
    """Encode a key tuple as an order-preserving lowercase hex string."""
    out = bytearray()
    for v in values:
        _encode_component(v, out)
    return out.hex()


def decode_key(encoded: str) -> tuple[Any, ...]:
    """Inverse of ``encode_key``. ``MIN_KEY`` decodes to the empty tuple."""
    try:
        b = bytes.fromhex(encoded)
    except ValueError as exc:
        raise KeyEncodingError(f"not an encoded key: {encoded!r}") from exc
    values = []
    i = 0
    try:
        while i < len(b):
            v, i = _decode_component(b, i)
            values.append(v)
    except (IndexError, ValueError) as exc:
        raise KeyEncodingError(f"corrupt encoded key {encoded!r}: {exc}") from exc
    return tuple(values)


def as_tuple(key: Any, arity: int) -> tuple[Any, ...]:
    """Normalise a user-facing key (scalar for one column, sequence for several) to a tuple."""
    if arity == 1:
        if isinstance(key, (tuple, list)):
            if len(key) != 1:
                raise KeyEncodingError(f"key {key!r} has {len(key)} values, the key has 1 column")
            return tuple(key)
        return (key,)
    if not isinstance(key, (tuple, list)) or len(key) != arity:
        raise KeyEncodingError(
            f"key {key!r} must be a tuple of {arity} values (one per key column)"
        )
    return tuple(key)


def from_tuple(values: tuple[Any, ...], arity: int) -> Any:
    """Inverse of ``as_tuple``: a scalar for a one-column key."""
    return values[0] if arity == 1 else values


def to_json(value: Any) -> Any:
    """A decoded key (scalar or tuple) as JSON: tuples -> lists, dates and times -> ISO 8601,
    decimals and UUIDs -> strings; ``None`` (the open lower bound) stays ``None``."""
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, (Decimal, uuid.UUID)):
        return str(value)
    return value


def decode_user_key(encoded: str, arity: int) -> Any:
    """Encoded key -> the user's value: a scalar for a one-column key, a tuple otherwise;
    ``None`` for ``MIN_KEY`` (the open lower bound). The one decode every reader uses."""
    return None if encoded == MIN_KEY else from_tuple(decode_key(encoded), arity)


def key_label(value: Any) -> str:
    """A key as logs, task labels and the UI show it: ``None`` -> ``-inf``, a tuple or list ->
    ``(a, b)``, anything else -> its JSON rendering (``42``, ``2024-01-01T00:00:00+00:00``).
    Accepts decoded keys and their JSON form (XCom) alike, and renders both the same."""
    if value is None:
        return "-inf"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(str(to_json(v)) for v in value) + ")"
    return str(to_json(value))


def display_key(encoded: str, arity: int) -> str:
    """``key_label`` of an encoded key."""
    return key_label(decode_user_key(encoded, arity))


# --------------------------------------------------------------------------- user-supplied bounds

_INT_RE = re.compile(r"^[+-]?\d+$")


def parse_bound(value: Any) -> Any:
    """A bound as a template renders it: native values pass through (tuples become lists); a
    string that is JSON (``"[\\"2024-01-01T00:00:00+00:00\\", 0]"``, ``"\\"abc\\""``) is decoded;
    ``""``/``"None"``/``"null"`` mean None. Other strings (``"1000"``, ISO timestamps, text keys)
    are passed on for ``coerce_bound`` to read against the key columns."""
    if not isinstance(value, str):
        return list(value) if isinstance(value, tuple) else value
    text = value.strip()
    if text in ("", "None", "null"):
        return None
    if text[0] in '["':
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(
                f"bound {value!r} looks like JSON but does not parse: {exc}"
            ) from exc
    return value


def coerce_bound(
    name: str, value: Any, kinds: Sequence[str], *, from_text: bool = False
) -> tuple[Any, ...]:
    """A user-supplied bound (scalar, or tuple/list for a composite key) as a key tuple, checked
    against the key columns' kinds (``SqlSource.key_kinds``); refusals name ``name`` and the fix.

    ``from_text`` (rendered templates) also reads ``"1000"`` as an integer for integer columns and
    ``"1.5"``/``7`` as a ``Decimal`` for numeric ones. ISO 8601 strings are accepted for timestamp,
    date and UUID columns either way."""
    arity = len(kinds)
    if from_text:
        parts = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(parts) != arity:
            raise ConfigurationError(
                f"{name}={value!r} has {len(parts)} part(s); the key has {arity} column(s)"
            )
        value = [_from_text(name, part, kind) for part, kind in zip(parts, kinds, strict=True)]
    try:
        values = as_tuple(value, arity)
    except KeyEncodingError as exc:
        raise ConfigurationError(f"{name}: {exc}") from exc
    return tuple(
        _coerce_component(f"{name}[{i}]" if arity > 1 else name, v, kind)
        for i, (v, kind) in enumerate(zip(values, kinds, strict=True))
    )


def _from_text(name: str, part: Any, kind: str) -> Any:
    if isinstance(part, str) and kind == "int" and _INT_RE.match(part.strip()):
        return int(part)
    if isinstance(part, (str, int)) and not isinstance(part, bool) and kind == "decimal":
        try:
            return Decimal(str(part).strip())
        except ArithmeticError as exc:
            raise ConfigurationError(f"{name}: {part!r} is not a number") from exc
    return part


def _coerce_component(name: str, v: Any, kind: str) -> Any:
    """One bound value, checked against its key column's kind."""
    if kind == "int" and isinstance(v, int) and not isinstance(v, bool):
        return v
    if kind == "text" and isinstance(v, str):
        return v
    if kind == "decimal" and isinstance(v, (Decimal, int)) and not isinstance(v, bool):
        return Decimal(v)
    if kind in ("timestamp", "timestamptz") and isinstance(v, str):
        with contextlib.suppress(ValueError):
            v = dt.datetime.fromisoformat(v)
    if kind in ("timestamp", "timestamptz") and isinstance(v, dt.datetime):
        aware = v.tzinfo is not None and v.utcoffset() is not None
        if aware == (kind == "timestamptz"):
            return v
        want = (
            "timestamp with time zone: give an aware datetime (e.g. tzinfo=UTC)"
            if kind == "timestamptz"
            else "timestamp without time zone: give a naive datetime"
        )
        raise ConfigurationError(
            f"{name}={v!r} is {'timezone-aware' if aware else 'naive'} but the key column is {want}"
        )
    if kind == "date" and isinstance(v, dt.date) and not isinstance(v, dt.datetime):
        return v
    if kind == "date" and isinstance(v, str):
        with contextlib.suppress(ValueError):
            return dt.date.fromisoformat(v)
    if kind == "uuid" and isinstance(v, (uuid.UUID, str)):
        with contextlib.suppress(ValueError):
            return v if isinstance(v, uuid.UUID) else uuid.UUID(v)
    raise ConfigurationError(f"{name}={v!r} ({type(v).__name__}) does not fit a {kind} key column")
