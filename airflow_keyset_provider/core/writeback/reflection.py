"""Tables passed by name, reflected once per engine and name and cached.

The cache is keyed weakly by the ``Engine``, so a disposed and dropped engine takes its tables
with it; :func:`clear_table_cache` forgets every table (after a migration changed one).
"""

from __future__ import annotations

import threading
import weakref

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from airflow_keyset_provider.core.errors import ConfigurationError, KeyValidationError

TableRef = sa.Table | str

_TABLE_CACHE: weakref.WeakKeyDictionary[Engine, dict[tuple[str | None, str], sa.Table]] = (
    weakref.WeakKeyDictionary()
)
_CACHE_LOCK = threading.Lock()


def clear_table_cache() -> None:
    """Forget reflected tables (after a migration changed a table that was passed by name)."""
    with _CACHE_LOCK:
        _TABLE_CACHE.clear()


def reflect(conn: Connection, ref: TableRef) -> sa.Table:
    """``ref`` itself if it is a ``Table``; else the table named ``"name"`` or ``"schema.name"``
    (the part before the first dot is the schema), reflected through ``conn`` on first use."""
    if isinstance(ref, sa.Table):
        return ref
    if not isinstance(ref, str) or not ref:
        raise ConfigurationError(f"table must be a sqlalchemy.Table or a name, got {ref!r}.")
    schema, dot, name = ref.partition(".")
    cache_key = (schema, name) if dot else (None, ref)
    engine = conn.engine
    with _CACHE_LOCK:
        found = _TABLE_CACHE.get(engine, {}).get(cache_key)
    if found is not None:
        return found
    try:
        reflected = sa.Table(cache_key[1], sa.MetaData(), schema=cache_key[0], autoload_with=conn)
    except sa.exc.NoSuchTableError:
        raise KeyValidationError(
            f"table {ref!r} not found (names are case-sensitive; the part before the first dot "
            "is the schema). Pass a sqlalchemy.Table for names that contain a dot."
        ) from None
    with _CACHE_LOCK:
        _TABLE_CACHE.setdefault(engine, {})[cache_key] = reflected
    return reflected
