"""One module per database behind one interface (``base.Dialect``), Django's db/backends shape.

``for_engine`` returns the ``Dialect`` of an engine, or None for a database no module
implements (``key_checks`` refuses it by name). Adding a database is adding a module here and a
line in ``_DIALECTS``.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from .base import Dialect, RowErrorKind
from .mysql import MysqlDialect
from .postgresql import PostgresqlDialect
from .sqlite import SqliteDialect

_DIALECTS: dict[str, Callable[[sa.Dialect], Dialect]] = {
    "postgresql": lambda _d: PostgresqlDialect(),
    "sqlite": lambda _d: SqliteDialect(),
    "mysql": MysqlDialect,  # MySQL 8.0+ and MariaDB (SQLAlchemy names both "mysql")
}

SUPPORTED_DIALECTS = tuple(_DIALECTS)


def for_engine(sa_dialect: sa.Dialect) -> Dialect | None:
    """A fresh ``Dialect`` for one source (it may keep what its checks learned), or None."""
    make = _DIALECTS.get(sa_dialect.name)
    return None if make is None else make(sa_dialect)


__all__ = ["SUPPORTED_DIALECTS", "Dialect", "RowErrorKind", "for_engine"]
