"""The key a stream's watermark is encoded with, and the refusal of a plan whose key changed.

A watermark is an encoded key, and the key encoding (``core/keys.py``) orders values of one kind
only: after ``ALTER COLUMN k TYPE timestamptz`` (from ``timestamp``), ``numeric -> bigint``, or a
DAG that changes ``key=`` on the same stream, every new key may encode *below* the old watermark.
A plan would read "max(key) is below the watermark" as "nothing new" and plan ``(w, w]`` for
ever: empty rounds that close at once while the new rows are never delivered.

So the stream records its key's fingerprint: the key column names and their kinds as the key codec
sees them (``SqlSource.key_kinds``: ``int``, ``decimal``, ``text``, ``timestamp``,
``timestamptz``, ``date``, ``uuid``), in Redis (``P:{S}:key``) and, when a checkpoint mirror is
configured, in the mirror next to the watermark, so a Redis that lost the stream gets both back
(``StreamControl.recover_stream``).

Guarantees (``tests/core/rounds/test_key_fingerprint.py``):

- ``check`` runs before a plan writes anything, and refuses (``ConfigurationError``) a stream
  whose recorded key differs from the source's: the error names the stream, the old and the new
  key (columns and kinds) and the fix. A widened type of the same kind (``varchar(50)`` ->
  ``text``, ``int`` -> ``bigint``) keeps the fingerprint: its keys encode as before.
- A stream planned before fingerprints existed has none: its plan adopts the current key, once
  the watermark is seen to fit it (each component decodes to the current kind's type); a
  watermark that does not fit is refused the same way. Never an empty round from a foreign
  watermark.
- ``record`` stores the fingerprint when a plan creates a round (``SET NX``; a concurrent plan
  with another key that recorded first makes this one refuse).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from ..errors import ConfigurationError
from ..keys import decode_key
from ..store.cursor_store import CursorStore
from .mirror import CheckpointMirror

_FITS: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "decimal": lambda v: isinstance(v, Decimal),
    "text": lambda v: isinstance(v, str),
    "timestamp": lambda v: isinstance(v, dt.datetime) and v.utcoffset() is None,
    "timestamptz": lambda v: isinstance(v, dt.datetime) and v.utcoffset() is not None,
    "date": lambda v: isinstance(v, dt.date) and not isinstance(v, dt.datetime),
    "uuid": lambda v: isinstance(v, uuid.UUID),
}


def fingerprint(names: Sequence[str], kinds: Sequence[str]) -> str:
    """The canonical fingerprint of a key: its columns and their codec kinds, in key order."""
    return json.dumps({"key": list(names), "kinds": list(kinds)}, sort_keys=True)


def describe(fp: str) -> str:
    """``created_at (timestamp), id (int)``: a fingerprint as an error shows it."""
    doc = json.loads(fp)
    return ", ".join(f"{n} ({k})" for n, k in zip(doc["key"], doc["kinds"], strict=True))


def _fix(stream: str) -> str:
    return (
        f"Fix: plan under a new stream name (e.g. stream='{stream}-v2'): its first round starts below "
        "every key and covers the whole table under the new key; the old stream's state stays "
        f"readable. The watermark of stream {stream!r} cannot be carried over: it is encoded with the "
        "old key's kinds, which do not order against the new ones."
    )


def check(store: CursorStore, mirror: CheckpointMirror | None, current: str) -> None:
    """Refuse a plan of ``store``'s stream under a key other than the one its state holds (module
    docstring). Reads only."""
    recorded = store.key_fingerprint()
    if recorded is None and mirror is not None:
        recorded = mirror.load_key_fingerprint(store.stream)
    if recorded is not None:
        if json.loads(recorded) != json.loads(current):
            raise ConfigurationError(
                f"stream {store.stream!r} was traversed with key {describe(recorded)}; the source "
                f"now has key {describe(current)} (the key columns or their types changed). Its "
                "watermark and rounds are encoded with the old key, so no round can be planned "
                f"from them. {_fix(store.stream)}"
            )
        return
    wm = store.watermark()
    kinds = json.loads(current)["kinds"]
    values = decode_key(wm) if wm else ()
    if wm and (
        len(values) != len(kinds)
        or not all(_FITS[k](v) for k, v in zip(kinds, values, strict=True))
    ):
        found = ", ".join(type(v).__name__ for v in values)
        raise ConfigurationError(
            f"stream {store.stream!r} has a watermark of ({found}) that does not fit its key "
            f"{describe(current)}: the key columns or their types changed since its last round "
            f"(the stream records no key fingerprint, it was planned by an older version). "
            f"{_fix(store.stream)}"
        )


def record(store: CursorStore, mirror: CheckpointMirror | None, current: str) -> None:
    """Record ``current`` as the stream's key (when none is), in Redis and in the mirror. Refuses
    like ``check`` when another plan recorded a different key first."""
    if not store.record_key_fingerprint(current):
        check(store, None, current)
    if mirror is not None:
        mirror.save_key_fingerprint(store.stream, current)
