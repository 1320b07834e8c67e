"""MySQL / MariaDB catalog reads for the key checks (``information_schema`` only, never a row).

- ``indexes``: every index of the table from ``information_schema.STATISTICS``: unique or not,
  its key parts in order, a prefix part (``SUB_PART``), a functional key part (``EXPRESSION``,
  MySQL 8.0.13+; MariaDB has none and no such column) and whether it is ordered (``BTREE``; a
  ``HASH`` index, e.g. MariaDB's long unique on a TEXT column, proves uniqueness but gives no
  order to page by);
- ``text_columns``: character set, collation and data type of text key columns;
- ``column_types``: the data type of each key column (its rule in ``key_types``);
- ``table_engine``: the storage engine (only InnoDB's transactions are listed in ``INNODB_TRX``).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from ..catalog import IndexInfo

_WHERE = "WHERE TABLE_SCHEMA = COALESCE(:schema, DATABASE()) AND TABLE_NAME = :table "


def _has_expression_column(conn: sa.Connection) -> bool:
    return bool(
        conn.execute(
            sa.text(
                "SELECT COUNT(*) FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = "
                "'information_schema' AND TABLE_NAME = 'STATISTICS' AND COLUMN_NAME = 'EXPRESSION'"
            )
        ).scalar()
    )


def indexes(conn: sa.Connection, schema: str | None, table: str) -> list[IndexInfo]:
    """Every index of ``schema.table`` (the connection's database when ``schema`` is None)."""
    expr = "EXPRESSION" if _has_expression_column(conn) else "NULL"
    rows = conn.execute(
        sa.text(
            f"SELECT INDEX_NAME, NON_UNIQUE, COLUMN_NAME, SUB_PART, INDEX_TYPE, {expr} "
            f"FROM information_schema.STATISTICS {_WHERE}ORDER BY INDEX_NAME, SEQ_IN_INDEX"
        ),
        {"schema": schema, "table": table},
    ).all()
    by_name: dict[str, list[tuple]] = {}
    for row in rows:
        by_name.setdefault(str(row[0]), []).append(tuple(row))
    out = []
    for name, parts in by_name.items():
        cols = tuple(None if p[2] is None or p[5] is not None else str(p[2]) for p in parts)
        out.append(
            IndexInfo(
                name,
                cols,
                unique=not int(parts[0][1]),
                partial=False,
                prefix=any(p[3] is not None for p in parts),
                ordered=str(parts[0][4]).upper() == "BTREE",
            )
        )
    return out


@dataclass(frozen=True)
class TextColumn:
    column: str
    data_type: str  # varchar, char, text, ...
    charset: str | None
    collation: str | None


def text_columns(
    conn: sa.Connection, schema: str | None, table: str, columns: list[str]
) -> list[TextColumn]:
    rows = conn.execute(
        sa.text(
            "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME, COLLATION_NAME "
            f"FROM information_schema.COLUMNS {_WHERE}AND COLUMN_NAME IN :cols "
            "ORDER BY ORDINAL_POSITION"
        ).bindparams(sa.bindparam("cols", expanding=True)),
        {"schema": schema, "table": table, "cols": columns},
    )
    return [TextColumn(str(c), str(t).lower(), cs, co) for c, t, cs, co in rows]


def table_engine(conn: sa.Connection, schema: str | None, table: str) -> str:
    found = conn.execute(
        sa.text(f"SELECT ENGINE FROM information_schema.TABLES {_WHERE}"),
        {"schema": schema, "table": table},
    ).scalar()
    return str(found or "")


def column_types(
    conn: sa.Connection, schema: str | None, table: str, columns: list[str]
) -> list[tuple[str, str, str]]:
    """(column, ``DATA_TYPE`` lowercased, ``COLUMN_TYPE``) of the given columns."""
    rows = conn.execute(
        sa.text(
            "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE "
            f"FROM information_schema.COLUMNS {_WHERE}AND COLUMN_NAME IN :cols "
            "ORDER BY ORDINAL_POSITION"
        ).bindparams(sa.bindparam("cols", expanding=True)),
        {"schema": schema, "table": table, "cols": columns},
    )
    return [(str(c), str(t).lower(), str(ct)) for c, t, ct in rows]


def table_figure(conn: sa.Connection, schema: str | None, table: str, figure: str) -> float:
    """``TABLE_ROWS`` or ``AVG_ROW_LENGTH`` of the table (InnoDB estimates; 0 when unknown)."""
    if figure not in ("TABLE_ROWS", "AVG_ROW_LENGTH"):
        raise ValueError(figure)
    found = conn.execute(
        sa.text(f"SELECT {figure} FROM information_schema.TABLES {_WHERE}"),
        {"schema": schema, "table": table},
    ).scalar()
    return float(found or 0)
