"""The one list of key column types each database may page by, and why every other type is refused.

Guarantee: a key column is accepted only when its *catalog* type (PostgreSQL: the base type of a
domain, by ``pg_type``; MySQL/MariaDB: ``information_schema.COLUMNS.DATA_TYPE``; SQLite: the
declared type's affinity and whether the table is ``STRICT``) is listed here with a key codec kind
(``core.keys``), i.e. the database orders its values exactly as their encodings compare. Every
other type is refused at plan time by ``refuse`` with a message naming the column, the type, why
its order differs from the encoding's and the fix. Values a listed type may hold but the codec
cannot (``'infinity'``, years past 9999, ``NaN``, zero dates, a value of another storage class in a
non-``STRICT`` SQLite column) are refused at plan time by the dialect's ``check_key_values`` when
the leading key column holds them, found by index probes where they sort (its edges; MariaDB's
zero-month/zero-day dates: the gap before each month); see ``VALUE_RULES``. A later key column
is not probed (it would take a scan): ``docs/key-types.md`` lists that gap.

The plan's validation (``key_checks``, through each ``Dialect.key_types``) and the documentation's
table (``docs/key-types.md``, rendered by ``docs_table`` and compared by a test) both read these
tables, so the docs cannot list a type the code refuses or miss one it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedKeyTypeError

__all__ = [
    "MYSQL",
    "POSTGRESQL",
    "SQLITE",
    "VALUE_RULES",
    "KeyType",
    "docs_table",
    "refuse",
    "rule",
]

_GENERIC_FIX = (
    "key by a column of an accepted type (docs/key-types.md), usually the primary key, or add one: "
    "a generated or backfilled column with a unique index"
)


@dataclass(frozen=True)
class KeyType:
    """``kind`` the key codec's kind (None: refused); ``why`` what holds (accepted) or why the
    database's order differs from the encoding's (refused); ``fix`` what to do instead."""

    kind: str | None
    why: str
    fix: str = ""


def _ok(kind: str, why: str = "") -> KeyType:
    return KeyType(kind, why)


def _no(why: str, fix: str = _GENERIC_FIX) -> KeyType:
    return KeyType(None, why, fix)


_FLOAT = _no(
    "floating point: values are not exact (0.1 + 0.2 <> 0.3) and NaN sorts above every number",
    "key by an integer or numeric/decimal column",
)
_BOOL = _no("two values cannot tell rows apart", "key by the primary key")
_NO_BYTES = "the key codec has no byte-string type"
_PG_TEXT_FIX = 'ALTER TABLE {table} ALTER COLUMN {column} TYPE text COLLATE "C"'
_PG_TIME = (
    "'infinity', '-infinity', years past 9999 and BC years, which Python's datetime cannot "
    "hold, are refused at plan time when the key's leading column holds them"
)

#: PostgreSQL, by the base type's ``pg_type.typname`` (a domain takes its base type's rule)
POSTGRESQL: dict[str, KeyType] = {
    "int2": _ok("int"),
    "int4": _ok("int"),
    "int8": _ok("int"),
    "numeric": _ok(
        "decimal",
        "by value ('1.5' = '1.50'); 'NaN' and '+/-Infinity' are refused at plan time when the "
        "key's leading column holds them",
    ),
    "text": _ok("text", 'with a collation that sorts by code point ("C", "POSIX", C.UTF-8)'),
    "varchar": _ok("text", 'with a collation that sorts by code point ("C", "POSIX", C.UTF-8)'),
    "timestamp": _ok("timestamp", _PG_TIME),
    "timestamptz": _ok("timestamptz", _PG_TIME),
    "date": _ok("date", _PG_TIME),
    "uuid": _ok("uuid", "PostgreSQL sorts uuid by its 16 bytes, as the encoding does"),
    "bpchar": _no(
        "character(n) compares ignoring trailing spaces ('b\\t' sorts before 'b') and is read back "
        "padded",
        'ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar COLLATE "C"',
    ),
    "char": _no(
        "\"char\" is one byte; bytes above 127 are read back as an octal escape ('\\200'), so a "
        "key would not round-trip",
        _PG_TEXT_FIX + " (or smallint)",
    ),
    "name": _no("the 63-byte identifier type", _PG_TEXT_FIX),
    "bool": _BOOL,
    "float4": _FLOAT,
    "float8": _FLOAT,
    "money": _no(
        "read back as locale-formatted text ('$1,000.00')", "key by a numeric or bigint column"
    ),
    "bytea": _no(
        _NO_BYTES,
        "key by an integer or a text column, e.g. a generated column encode({column}, 'hex') "
        'COLLATE "C" with a unique index',
    ),
    "citext": _no(
        "citext compares case-insensitively ('A' = 'a')",
        _PG_TEXT_FIX + " (and a unique index on it)",
    ),
    "interval": _no("'1 day' and '24 hours' compare equal but are different values"),
    "time": _no("no key encoding for a time of day"),
    "timetz": _no("no key encoding for a time of day with a zone"),
    "oid": _no("a system identifier (unsigned, wraps around)"),
}
#: PostgreSQL, by ``pg_type.typtype`` / category, before the base type's name is looked up
POSTGRESQL_KINDS: dict[str, KeyType] = {
    "e": _no(
        "an enum sorts by its declaration (pg_enum.enumsortorder), not by its label, so a label "
        "added later sorts where the cursors have already passed",
        "key by another column (usually the primary key), or "
        + _PG_TEXT_FIX
        + " (the labels then sort as text)",
    ),
    "r": _no("a range sorts by its bounds and flags, which no key encoding keeps"),
    "m": _no("a multirange has no key encoding"),
    "c": _no(
        "a composite value has no key encoding",
        "key by its fields stored as columns: key=['a', 'b']",
    ),
    "A": _no("an array has no key encoding"),
    "p": _no("a pseudo-type holds no stored values"),
}
_PG_KIND_NAMES = {
    "e": "any enum",
    "r": "any range",
    "m": "any multirange",
    "c": "any composite type",
    "A": "any array",
    "p": "any pseudo-type",
}
_PG_DEFAULT = _no("no key encoding for this type (its order is its own)")

_MY_TEXT = (
    "with a NO PAD binary collation of UTF-8 (utf8mb4_nopad_bin on MariaDB, utf8mb4_0900_bin on "
    "MySQL 8) and an ordered (BTREE) unique index on the whole column"
)
_MY_TIME = (
    "zero dates ('0000-00-00', legal under the default sql_mode) and dates with a zero month or "
    "day ('2022-00-00', '2022-05-00') are refused at plan time when the key's leading column "
    "holds them"
)
_MY_VARCHAR_FIX = (
    "ALTER TABLE {table} MODIFY {column} VARCHAR(255) CHARACTER SET utf8mb4 COLLATE "
    "{collation} NOT NULL"
)

#: MySQL and MariaDB, by ``information_schema.COLUMNS.DATA_TYPE``
MYSQL: dict[str, KeyType] = {
    **{t: _ok("int") for t in ("tinyint", "smallint", "mediumint", "int", "bigint")},
    "decimal": _ok("decimal", "exact; no NaN or infinity exists"),
    **{t: _ok("text", _MY_TEXT) for t in ("varchar", "tinytext", "text", "mediumtext", "longtext")},
    "date": _ok("date", _MY_TIME),
    "datetime": _ok("timestamp", _MY_TIME),
    "timestamp": _ok(
        "timestamp", "read in the session time zone, which must be a fixed offset; " + _MY_TIME
    ),
    "char": _no(
        "fixed-width CHAR is stored padded with spaces, so 'a\\t' sorts before 'a' whatever the "
        "collation",
        _MY_VARCHAR_FIX,
    ),
    "enum": _no(
        "ENUM sorts by the members' ordinal (their declaration), not by their text",
        "key by another column (usually the primary key), or " + _MY_VARCHAR_FIX,
    ),
    "set": _no("SET sorts by the members' bitmask, not by their text", _MY_VARCHAR_FIX),
    "uuid": _no(
        "MariaDB's UUID stores and sorts by swapped segments (time-low last), not by the bytes "
        "or the text of the value",
        "store UUIDs as VARCHAR(36) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin (their text "
        "sorts as their bytes), or key by an integer",
    ),
    **{
        t: _no(_NO_BYTES, "key by an integer or a VARCHAR column COLLATE {collation}")
        for t in ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob")
    },
    "float": _FLOAT,
    "double": _FLOAT,
    "bit": _no("a bit string has no key encoding", "key by an integer column"),
    "year": _no("YEAR holds 0000 besides 1901-2155 and has no key kind", "key by an integer"),
    "time": _no("no key encoding for a time of day or a duration"),
    "inet4": _no("an address type has no key encoding"),
    "inet6": _no("an address type has no key encoding"),
}
_MY_DEFAULT = _no("no key encoding for this type")

_SQLITE_NOT_STRICT = (
    "a column of a table that is not STRICT holds any storage class (typeof()); SQLite sorts "
    "integers and reals < text < blobs, so a value of another class at the leading column's "
    "edge is refused at plan time (a real among integers is refused when read)"
)
#: SQLite, by declared type affinity (``STRICT`` tables: their declared type), see
#: https://www.sqlite.org/datatype3.html#determination_of_column_affinity
SQLITE: dict[str, KeyType] = {
    "INTEGER PRIMARY KEY": _ok("int", "the rowid itself: never NULL, always an integer"),
    "STRICT INTEGER": _ok("int"),
    "STRICT INT": _ok("int"),
    "STRICT TEXT": _ok("text", "with the BINARY collation (NOCASE and RTRIM are refused)"),
    "INTEGER": _ok(
        "int",
        "NOT NULL declared (only exactly INTEGER PRIMARY KEY is the rowid); " + _SQLITE_NOT_STRICT,
    ),
    "TEXT": _ok("text", "with the BINARY collation; " + _SQLITE_NOT_STRICT),
    "NUMERIC": _no(
        "NUMERIC affinity (DECIMAL, DATETIME, DATE, BOOLEAN, UUID...) stores integers, reals "
        "or text in whatever form the writer chose; reals are inexact and text dates sort by "
        "their format",
        "key by an INTEGER column (an epoch for times), or a TEXT column in one fixed format",
    ),
    "REAL": _FLOAT,
    "BLOB": _no(
        _NO_BYTES + " (BLOB affinity, or no declared type)", "key by an INTEGER or TEXT column"
    ),
    "STRICT REAL": _FLOAT,
    "STRICT BLOB": _no(_NO_BYTES, "key by an INTEGER or TEXT column"),
    "STRICT ANY": _no("ANY holds every storage class", "declare the column INTEGER or TEXT"),
    "SQLAlchemy type": _no(
        "SQLAlchemy reads and binds this declared type (e.g. DATE_CHAR) as another Python type "
        "than its affinity's",
        "declare the column INTEGER or TEXT",
    ),
}

#: values an accepted kind may hold in the database but not in the key codec, refused at plan time
VALUE_RULES: dict[str, str] = {
    "postgresql": "timestamp, timestamptz, date: 'infinity', '-infinity', years past 9999 and BC; "
    "numeric: 'NaN', 'Infinity', '-Infinity' (leading key column, honouring where)",
    "mysql": "date, datetime, timestamp: dates below 0001-01-01 (zero dates included) and dates "
    "with a zero month or day (leading key column, honouring where; one index query per year "
    "that holds keys)",
    "sqlite": "a value of another storage class than the kind's (typeof) in a column of a table "
    "that is not STRICT (leading key column, honouring where)",
}

_TABLES = {
    "postgresql": (POSTGRESQL, _PG_DEFAULT),
    "mysql": (MYSQL, _MY_DEFAULT),
    "sqlite": (SQLITE, SQLITE["BLOB"]),
}


def rule(dialect: str, type_name: str, category: str = "") -> KeyType:
    """The rule for a catalog type: ``category`` (PostgreSQL's typtype or 'A' for an array) first,
    then the type's name, then the dialect's default refusal."""
    if dialect == "postgresql" and category in POSTGRESQL_KINDS:
        return POSTGRESQL_KINDS[category]
    table, default = _TABLES[dialect]
    return table.get(type_name, default)


def refuse(
    column: str, table: str, type_label: str, r: KeyType, **fmt: str
) -> UnsupportedKeyTypeError:
    """The refusal for a column whose type's rule has no kind."""
    fix = r.fix.format(table=table, column=column, **fmt)
    return UnsupportedKeyTypeError(
        f"key column {column!r} of {table!r} has type {type_label}, which cannot be a key: "
        f"{r.why}. Fix: {fix}."
    )


def docs_table() -> str:
    """The Markdown tables of ``docs/key-types.md`` (between its generated markers)."""
    out: list[str] = []
    sections = [
        (
            "PostgreSQL",
            [
                *POSTGRESQL.items(),
                *((_PG_KIND_NAMES[k], v) for k, v in POSTGRESQL_KINDS.items()),
            ],
            _PG_DEFAULT,
        ),
        ("MySQL and MariaDB", list(MYSQL.items()), _MY_DEFAULT),
        ("SQLite", list(SQLITE.items()), None),
    ]
    for title, items, default in sections:
        out += [
            f"## {title}",
            "",
            "| type | key kind | why / condition | fix when refused |",
            "|---|---|---|---|",
        ]
        for name, r in sorted(items, key=lambda kv: (kv[1].kind is None, kv[0])):
            fix = (
                r.fix.format(table="t", column="k", collation="utf8mb4_nopad_bin")
                if r.kind is None
                else ""
            )
            out.append(f"| `{name}` | {r.kind or 'refused'} | {_md(r.why)} | {_md(fix)} |")
        if default is not None:
            out.append(
                f"| any other type | refused | {_md(default.why)} | {_md(default.fix.format(table='t', column='k'))} |"
            )
        out.append("")
    out += ["Values refused at plan time although the type is accepted:", ""]
    out += [f"- {d}: {v}" for d, v in VALUE_RULES.items()]
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")
