"""What the key checks, the planner's sampling and the dialects read of a source (``Relation``).

``SqlSource`` (``source.py``) satisfies this Protocol; ``key_checks``, ``sampling`` and every
``dialects`` module take a ``Relation``, never the source class. So this module sits below all
of them and imports none: the import graph of ``core/sql`` has no cycle (tests/test_architecture.py),
and a helper sees only the names listed here.

Guarantee: each member means what ``SqlSource`` documents; ``table`` and ``key_kinds`` are those
of a validated source (``key_checks.validate`` reads only the catalog members before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine

if TYPE_CHECKING:
    from .naming import ConnectionName


class Relation(Protocol):
    """One table keyed by one or more columns, as the helpers of ``core/sql`` see it."""

    #: TABLESAMPLE SYSTEM percent of the last plan (written by PostgreSQL's sampled cuts)
    last_sample_percent: float | None

    @property
    def engine(self) -> Engine: ...
    @property
    def dialect(self) -> str: ...  # SQLAlchemy's dialect name ("mysql" for MariaDB too)
    @property
    def schema(self) -> str | None: ...
    @property
    def table_name(self) -> str: ...
    @property
    def qualified_name(self) -> str: ...  # as the user wrote it, for messages
    @property
    def rel(self) -> str: ...  # the quoted ``schema.table`` for catalog queries
    @property
    def key_names(self) -> list[str]: ...
    @property
    def arity(self) -> int: ...
    @property
    def column_names(self) -> list[str]: ...
    @property
    def key_kinds(self) -> list[str]: ...
    @property
    def settle_seconds(self) -> float: ...
    @property
    def commit_wait_timeout(self) -> float: ...
    @property
    def table(self) -> sa.Table: ...
    @property
    def connection_name(self) -> ConnectionName | None: ...  # what its connections are called

    def range_filter(self, has_lo: bool, on: Any = None) -> list[Any]:
        """``lo < key <= hi [AND where]`` with bound parameters ``c<i>`` / ``h<i>``."""
        ...

    def key_params(self, encoded: str, prefix: str) -> dict[str, Any]:
        """An encoded key as the bound parameters ``<prefix><i>``."""
        ...

    def driver_call(self, stmt: Any) -> tuple[str, Callable[[dict[str, Any]], Any]]:
        """``stmt`` compiled once for the driver, and its parameter converter."""
        ...

    def probe(
        self,
        conn: sa.Connection,
        condition: str,
        params: dict[str, Any],
        select: str = "1",
        order: str = "",
    ) -> Any:
        """The first value of ``SELECT select FROM table WHERE condition [AND where] [ORDER BY
        order] LIMIT 1`` (None: no row); ``condition`` is trusted SQL, ``params`` bound."""
        ...

    def estimate_rows(self, lo: str, hi: str) -> int:
        """The planner's row estimate for ``lo < key <= hi``."""
        ...


__all__ = ["Relation"]
