"""PostgreSQL (psycopg2 and psycopg 3): each column of a batch travels as one bound array.

``unnest`` of the arrays is a derived table with one row per batch row, so a statement has the
same text whatever the batch size and SQLAlchemy compiles it once. Columns that cannot travel
as an array (array-typed, or of a type SQLAlchemy does not know) fall back to a multi-row
``VALUES`` (updates) or "insertmanyvalues" (upserts). Every statement runs in a SAVEPOINT, as
an error aborts the whole transaction on PostgreSQL.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from ..batching import guard_params
from ..columns import positions
from ..direct import cursor_of, execute, send, wrap
from ..target import Guard, Key, Target
from .base import Backend, Builder, ColumnarPlan, KeyIn, Plan, returning
from .case_when import TemplateCache
from .on_conflict import insert_many, on_conflict

# PostgreSQL's wire protocol counts bind parameters in an int16 (psycopg 3 binds server-side;
# psycopg2 interpolates client-side and has no limit, the same cap keeps statements sane).
_POSTGRES_MAX_PARAMS = 65_535


class PostgresBackend(Backend):
    name = "postgresql"

    def max_params(self, conn: Connection) -> int:
        return _POSTGRES_MAX_PARAMS

    def key_in(self, target: Target) -> KeyIn:
        return KeyIn(target) if target.composite else _ArrayKeyIn(target)

    def update_rows(
        self,
        target: Target,
        value_cols: list[str],
        guard: ColumnElement[bool] | None,
        expected: Guard,
    ) -> Plan:
        fixed = guard_params(expected)
        if _arrays_fit(target.table, [*target.key_names, *value_cols]):
            return Plan(returning(target, _update_from_arrays(target, value_cols, guard)), 0, fixed)
        build = _update_from_values(target, value_cols, guard)
        return Plan(returning(target, build), len(target.key_cols) + len(value_cols), fixed)

    def upsert(
        self,
        target: Target,
        columns: list[str],
        conflict_cols: Sequence[str],
        update_cols: list[str],
        batch_size: int,
    ) -> Plan:
        table = target.table
        if _arrays_fit(table, columns) and not _python_defaults_needed(table, columns):
            build = _insert_from_arrays(target, columns, conflict_cols, update_cols)
            return Plan(returning(target, build), 0)
        build = insert_many(
            postgresql.insert, target, conflict_cols, update_cols, batch_size, json_text=True
        )
        return Plan(returning(target, build), len(columns))

    def lock_for_claim(self, stmt: sa.Select) -> sa.Select:
        return stmt.with_for_update(skip_locked=True)

    def columnar_update(
        self,
        conn: Connection,
        target: Target,
        value_cols: Sequence[str],
        constants: Mapping[str, Any],
        expected: Guard,
        isolate: bool,
    ) -> ColumnarPlan | None:
        """``UPDATE t SET c = v.c, d = :d FROM unnest(:k::K[], :c::C[]) WITH ORDINALITY AS
        v(k, c, n) WHERE t.k = v.k AND <guard> RETURNING v.n``: one array per column, one
        text (and one server plan) for any batch size; the positions come back, not the keys."""
        table, dialect = target.table, conn.dialect
        arrays = [*target.key_names, *value_cols]
        guard = _mapping_guard(expected)
        if (
            guard is None
            or any(isinstance(v, sa.sql.ClauseElement) for v in constants.values())
            or not _arrays_fit(table, arrays)
            or not _plain(dialect, table, [*arrays, *constants, *guard])
        ):
            return None
        shape = (table, dialect.driver, target.key_names, tuple(value_cols), tuple(constants))
        sql = _STATEMENTS.get(
            (*shape, _guard_shape(guard)),
            lambda: _columnar_update_sql(dialect, target, value_cols, list(constants), guard),
        )
        fixed = {f"keyset_set_{i}": v for i, v in enumerate(constants.values())}
        fixed.update(_guard_params(guard))
        names = [(f"keyset_col_{i}", n) for i, n in enumerate(arrays)]
        one_trip = _one_round_trip(dialect, isolate)
        with_w = f"WITH keyset_w AS ({sql}) "
        agg = _aggregated(with_w, "keyset_w", "keyset_w.keyset_n") if one_trip else ""

        def write(conn: Connection, data: dict[str, list], n: int) -> list[int]:
            params = {param: data[name] for param, name in names}
            params.update(fixed)
            if one_trip:
                return run_positions(conn, sql, agg, params)
            return [r[0] - 1 for r in run(conn, sql, params, isolate)]

        return ColumnarPlan(write)

    def columnar_upsert(
        self,
        conn: Connection,
        target: Target,
        columns: Sequence[str],
        conflict_cols: Sequence[str],
        update_cols: Sequence[str],
        isolate: bool,
    ) -> ColumnarPlan | None:
        """``INSERT INTO t (cols) SELECT * FROM unnest(...) ON CONFLICT ... RETURNING key``,
        the statement of :meth:`upsert` run on the driver's cursor."""
        table, dialect = target.table, conn.dialect
        if (
            not _arrays_fit(table, columns)
            or _python_defaults_needed(table, columns)
            or not _plain(dialect, table, columns)
        ):
            return None
        key = (table, dialect.driver, target.key_names, tuple(columns), tuple(conflict_cols))
        sql = _STATEMENTS.get(
            (*key, tuple(update_cols)),
            lambda: _compile(
                dialect,
                _insert_from_arrays(target, list(columns), conflict_cols, list(update_cols))([])[0],
            ),
        )
        names = [(f"keyset_col_{i}", n) for i, n in enumerate(columns)]
        nkey = len(target.key_names)
        if _one_round_trip(dialect, isolate) and set(target.key_names) <= set(columns):
            agg = _STATEMENTS.get(
                ("positions", *key, tuple(update_cols)),
                lambda: _upsert_positions_sql(
                    dialect, target, list(columns), conflict_cols, list(update_cols)
                ),
            )

            def write_one_trip(conn: Connection, data: dict[str, list], n: int) -> list[int]:
                params = {param: data[name] for param, name in names}
                return run_positions(conn, sql, agg, params)

            return ColumnarPlan(write_one_trip)

        def write(conn: Connection, data: dict[str, list], n: int) -> list[int]:
            rows = run(conn, sql, {param: data[name] for param, name in names}, isolate)
            found = (tuple(r[:nkey]) for r in rows) if target.composite else (r[0] for r in rows)
            return positions(target, data, found)

        return ColumnarPlan(write)


_STATEMENTS = TemplateCache(128)
_SAVEPOINT = "keyset_wb"


def run(conn: Connection, sql: str, params: dict[str, Any], isolate: bool) -> list:
    """Run ``sql`` and return its rows; with ``isolate``, inside a savepoint (psycopg2: sent in
    the same text as the statement), released after, and rolled back if the statement fails, so
    the caller's transaction stays usable."""
    cursor = cursor_of(conn)
    try:
        if not isolate:
            return execute(conn, cursor, sql, params, fetch=True)
        try:
            if conn.dialect.driver == "psycopg2":
                prefix = f"SAVEPOINT {_SAVEPOINT}; "
                rows = execute(conn, cursor, sql, params, fetch=True, prefix=prefix)
            else:
                return _pipelined(conn, cursor, sql, params)
            send(conn, cursor, f"RELEASE SAVEPOINT {_SAVEPOINT}")
            return rows
        except BaseException:
            _rollback_to_savepoint(conn)
            raise
    finally:
        cursor.close()


#: the transaction-local setting that carries a batch's positions past ``RELEASE SAVEPOINT``
_OUT = "keyset.wb_positions"


def _one_round_trip(dialect: sa.Dialect, isolate: bool) -> bool:
    """psycopg2 sends several statements in one text but returns only the last one's rows:
    with a savepoint, the positions travel in a setting (``run_positions``)."""
    return isolate and dialect.driver == "psycopg2"


def _aggregated(with_clause: str, from_: str, position: str) -> str:
    """``<with_clause> SELECT set_config(_OUT, '<positions, 0-based, comma-separated>', true)
    FROM <from_>``: a data-modifying CTE stays at the top level, as PostgreSQL requires."""
    return (
        f"{with_clause}SELECT set_config('{_OUT}', "
        f"coalesce(string_agg(CAST({position} - 1 AS text), ','), ''), true) FROM {from_}"
    )


def run_positions(conn: Connection, sql: str, agg: str, params: dict[str, Any]) -> list[int]:
    """psycopg2, in a savepoint, in one round trip: ``SAVEPOINT; <agg>; RELEASE SAVEPOINT;
    SELECT current_setting(_OUT)`` (``agg``, the write ``sql`` framed as a CTE, stores the
    written rows' positions in ``_OUT``, local to the transaction, which the release keeps;
    listeners see ``sql``). The 0-based positions; on an error the savepoint is rolled back
    and released (the caller's transaction stays usable) and the error raised, as ``run``
    does."""
    cursor = cursor_of(conn)
    try:
        try:
            rows = execute(
                conn,
                cursor,
                sql,
                params,
                fetch=True,
                sent=agg,
                prefix=f"SAVEPOINT {_SAVEPOINT}; ",
                suffix=f"; RELEASE SAVEPOINT {_SAVEPOINT}; SELECT current_setting('{_OUT}')",
            )
        except BaseException:
            _rollback_to_savepoint(conn)
            raise
    finally:
        cursor.close()
    text = rows[0][0]
    return list(map(int, text.split(","))) if text else []


def _upsert_positions_sql(
    dialect: sa.Dialect,
    target: Target,
    columns: list[str],
    conflict_cols: Sequence[str],
    update_cols: list[str],
) -> str:
    """The upsert as one statement that stores the written rows' positions in ``_OUT`` (as
    ``_aggregated`` does):
    the batch's arrays are unnested once ``WITH ORDINALITY`` (``keyset_k``), the ``INSERT ...
    SELECT ... FROM keyset_k ON CONFLICT ... RETURNING key`` is a CTE (``keyset_w``), and its
    returned keys are joined to ``keyset_k`` for their positions (the input's keys are unique,
    and so is each returned row's match). Each array is sent and parsed once: binding the key
    arrays a second time for the join cost a composite key's timestamps twice (issue 29)."""
    table = target.table
    v, _bind = _rows_as_arrays(table, columns, ordinality="keyset_n")
    k = sa.select(v).cte("keyset_k")
    insert = postgresql.insert(table).from_select(columns, sa.select(*(k.c[n] for n in columns)))
    insert = on_conflict(insert, table, True, conflict_cols, update_cols)
    w = insert.returning(*target.key_cols).cte("keyset_w")
    on = sa.and_(*(w.c[n] == k.c[n] for n in target.key_names))
    listed = sa.func.string_agg(
        sa.cast(k.c.keyset_n - sa.literal_column("1"), sa.Text), sa.literal_column("','")
    )
    stored = sa.func.set_config(
        sa.literal_column(f"'{_OUT}'"),
        sa.func.coalesce(listed, sa.literal_column("''")),
        sa.true(),
    )
    return _compile(dialect, sa.select(stored).select_from(w.join(k, on)))


def _pipelined(conn: Connection, cursor: Any, sql: str, params: dict[str, Any]) -> list:
    """psycopg 3 binds on the server, one statement per execute: ``SAVEPOINT``, the statement
    and ``RELEASE`` go in one pipeline (one round trip). The savepoint statements are never
    prepared: psycopg would count one that the server skipped after the error as prepared
    ("prepared statement _pg3_N does not exist" on its next use)."""
    raw = conn.connection.dbapi_connection
    if (
        getattr(raw, "pipeline", None) is None or not _pipeline_supported()
    ):  # libpq < 14: three round trips
        send(conn, cursor, f"SAVEPOINT {_SAVEPOINT}")
        rows = execute(conn, cursor, sql, params, fetch=True)
        send(conn, cursor, f"RELEASE SAVEPOINT {_SAVEPOINT}")
        return rows
    dispatch = conn.dispatch
    for fn in dispatch.before_cursor_execute:
        fn(conn, cursor, sql, params, None, False)
    try:
        with raw.pipeline():  # type: ignore[union-attr]
            cursor.execute(f"SAVEPOINT {_SAVEPOINT}", prepare=False)
            cursor.execute(sql, params)
            with raw.cursor() as release:  # type: ignore[union-attr]
                release.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}", prepare=False)
        rows = cursor.fetchall()
    except Exception as exc:
        raise wrap(conn, cursor, sql, params, exc) from exc
    for fn in dispatch.after_cursor_execute:
        fn(conn, cursor, sql, params, None, False)
    return rows


def _pipeline_supported() -> bool:
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def _rollback_to_savepoint(conn: Connection) -> None:
    """Undo the failed statement (the savepoint's work) and drop the savepoint. Best effort: on
    a lost connection, or when the savepoint was never made, the statement's own error is the
    one raised."""
    if conn.invalidated:
        return
    try:
        with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
            send(conn, cursor, f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            send(conn, cursor, f"RELEASE SAVEPOINT {_SAVEPOINT}")
    except sa.exc.DBAPIError:
        pass


def _mapping_guard(expected: Guard) -> dict[str, Any] | None:
    """A ``{column: value}`` guard as a dict ({} for none); None for a guard expression (which
    takes the row path: its bound values are not known by name here)."""
    if expected is None:
        return {}
    return dict(expected) if isinstance(expected, Mapping) else None


def _guard_shape(guard: Mapping[str, Any]) -> tuple:
    return tuple((name, value is None) for name, value in guard.items())


def _guard_params(guard: Mapping[str, Any]) -> dict[str, Any]:
    return {f"keyset_guard_{i}": v for i, v in enumerate(guard.values()) if v is not None}


def _plain(dialect: sa.Dialect, table: sa.Table, names: Iterable[str]) -> bool:
    """Do values of these columns go to the driver as they are (no SQLAlchemy bind processor:
    JSON, enums of Python classes, type decorators take the row path)? Asked once per table
    object, dialect and columns (the answer depends on nothing else)."""
    return _plain_cached(dialect, table, tuple(names))


@functools.lru_cache(maxsize=256)
def _plain_cached(dialect: sa.Dialect, table: sa.Table, names: tuple[str, ...]) -> bool:
    for name in names:
        type_ = _unbounded(table.c[name].type)
        if type_.dialect_impl(dialect).bind_processor(dialect) is not None:
            return False
    return True


def _compile(dialect: sa.Dialect, stmt: Any) -> str:
    return str(stmt.compile(dialect=dialect))


def _columnar_update_sql(
    dialect: sa.Dialect,
    target: Target,
    value_cols: Sequence[str],
    constants: list[str],
    guard: Mapping[str, Any],
) -> str:
    table = target.table
    v, _ = _rows_as_arrays(table, [*target.key_names, *value_cols], ordinality="keyset_n")
    sets: dict[Any, Any] = {table.c[n]: v.c[n] for n in value_cols}
    for i, name in enumerate(constants):
        sets[table.c[name]] = sa.bindparam(f"keyset_set_{i}", type_=_unbounded(table.c[name].type))
    stmt = (
        sa.update(table)
        .values(sets)
        .where(*(table.c[n] == v.c[n] for n in target.key_names))
        .returning(v.c.keyset_n)
    )
    for i, (name, value) in enumerate(guard.items()):
        col = table.c[name]
        stmt = stmt.where(
            col.is_(None)
            if value is None
            else col == sa.bindparam(f"keyset_guard_{i}", type_=_unbounded(col.type))
        )
    return _compile(dialect, stmt)


class _ArrayKeyIn(KeyIn):
    """``key = ANY(:array)`` for a one-column key: one parameter, one plan for every batch
    size."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.params_per_key = 0
        self._array_type = postgresql.ARRAY(_unbounded(target.key_cols[0].type))

    def __call__(self, batch: list[Key]) -> ColumnElement[bool]:
        param = sa.bindparam("keys", list(batch), type_=self._array_type, unique=True)
        return self.target.key_cols[0] == sa.any_(_cast(param, self._array_type))


def _unbounded(type_: sa.types.TypeEngine) -> sa.types.TypeEngine:
    """The type without length/precision, for CASTs: ``CAST(x AS VARCHAR(3))`` would silently
    truncate a value that the column must reject, and a truncated key could match another row."""
    if isinstance(type_, sa.Enum):
        return type_
    if isinstance(type_, sa.String):
        return sa.Text()
    if isinstance(type_, sa.Numeric) and not isinstance(type_, sa.Float):
        return sa.Numeric(asdecimal=True) if type_.asdecimal else sa.Numeric(asdecimal=False)
    if isinstance(type_, sa.DateTime):
        return sa.DateTime(timezone=type_.timezone)
    if isinstance(type_, sa.Time):
        return sa.Time(timezone=type_.timezone)
    return type_


def _cast(expr: Any, type_: sa.types.TypeEngine) -> Any:
    if isinstance(type_, sa.types.NullType):  # unknown to SQLAlchemy: let the database decide
        return expr
    return sa.cast(expr, type_)


def _arrays_fit(table: sa.Table, names: Iterable[str]) -> bool:
    """Can these columns travel as one PostgreSQL array each? Not if a column is itself an array
    (``unnest`` would flatten it) or of a type SQLAlchemy does not know (no array type to cast)."""
    return not any(isinstance(table.c[n].type, sa.ARRAY | sa.types.NullType) for n in names)


def _python_defaults_needed(table: sa.Table, columns: Iterable[str]) -> bool:
    """Does a column the rows leave out get a per-row Python default (``default=uuid4``)? An
    ``INSERT ... SELECT`` would call it once for the whole batch."""
    given = set(columns)
    return any(
        col.default is not None and getattr(col.default, "is_callable", False)
        for name, col in table.c.items()
        if name not in given
    )


def _rows_as_arrays(
    table: sa.Table, names: list[str], ordinality: str | None = None
) -> tuple[Any, Callable[[list[Mapping[str, Any]]], dict[str, list]]]:
    """``unnest(CAST(:a AS T1[]), CAST(:b AS T2[])) AS keyset_rows(a, b)``, a derived table with
    one row per batch row and one bound array per column: SQLAlchemy compiles the statement once
    whatever the batch size (measured, 10k rows: update_rows 75-90k rows/s on psycopg2,
    100-130k on psycopg 3; a multi-row VALUES was 15k, nearly all compile time)."""
    alias = "keyset_rows" if table.name != "keyset_rows" else "keyset_rows_v"
    args, cols, params = [], [], []
    for i, name in enumerate(names):
        element = _unbounded(table.c[name].type)
        array = postgresql.ARRAY(element)
        param = f"keyset_col_{i}"
        params.append((param, name))
        args.append(sa.cast(sa.bindparam(param, type_=array), array))
        cols.append(sa.column(name, element))
    derived = (
        sa.func.unnest(*args)
        .table_valued(*cols, with_ordinality=ordinality)
        .render_derived(name=alias)
    )

    def bind(batch: list[Mapping[str, Any]]) -> dict[str, list]:
        return {param: [row[name] for row in batch] for param, name in params}

    return derived, bind


def _update_from_arrays(
    target: Target, value_cols: list[str], guard: ColumnElement[bool] | None
) -> Builder:
    """``UPDATE t SET c = v.c FROM unnest(...) AS v(k, c) WHERE t.k = v.k``."""
    table = target.table
    v, bind = _rows_as_arrays(table, [*target.key_names, *value_cols])
    stmt = (
        sa.update(table)
        .values({table.c[n]: v.c[n] for n in value_cols})
        .where(*(table.c[n] == v.c[n] for n in target.key_names))
        .returning(*target.key_cols)
    )
    if guard is not None:
        stmt = stmt.where(guard)
    return lambda batch: (stmt, bind(batch))


def _update_from_values(
    target: Target, value_cols: list[str], guard: ColumnElement[bool] | None
) -> Builder:
    """For array-typed columns: ``UPDATE t SET c = v.c FROM (VALUES ...) AS v(k, c)``. Correct
    for every type, but compiled anew for each batch (slow)."""
    table = target.table
    names = [*target.key_names, *value_cols]
    types = {n: _unbounded(table.c[n].type) for n in names}
    alias = "keyset_rows" if table.name != "keyset_rows" else "keyset_rows_v"

    def build(batch: list[Mapping[str, Any]]) -> tuple[sa.Update, None]:
        v = sa.values(*(sa.column(n, types[n]) for n in names), name=alias).data(
            [tuple(row[n] for n in names) for row in batch]
        )
        # psycopg2 sends untyped literals: the VALUES columns may come out as text, so cast
        # them to the target's type (without length, see _unbounded) before comparing/assigning.
        stmt = (
            sa.update(table)
            .values({table.c[n]: _cast(v.c[n], types[n]) for n in value_cols})
            .where(*(table.c[n] == _cast(v.c[n], types[n]) for n in target.key_names))
            .returning(*target.key_cols)
        )
        return (stmt.where(guard) if guard is not None else stmt), None

    return build


def _insert_from_arrays(
    target: Target, columns: list[str], conflict_cols: Sequence[str], update_cols: list[str]
) -> Builder:
    """``INSERT INTO t (cols) SELECT * FROM unnest(...) ON CONFLICT ...``."""
    table = target.table
    v, bind = _rows_as_arrays(table, columns)
    stmt = postgresql.insert(table).from_select(columns, sa.select(*(v.c[n] for n in columns)))
    stmt = on_conflict(stmt, table, True, conflict_cols, update_cols).returning(*target.key_cols)
    return lambda batch: (stmt, bind(batch))


BACKEND = PostgresBackend()
