"""The name every database connection of a traversal carries, so a person (and the plan's
commit-order wait) can tell whose it is.

Guarantees:

- the name is ``keyset:<stream>:<round>:<range>`` while a range runs and ``keyset:<stream>:plan``
  before (plan, barrier, probes): ASCII, at most ``LIMIT`` (63) bytes, PostgreSQL's limit for
  ``application_name``. It holds no secret and no row data: only the stream's name, the round id
  and the range number. A stream name with characters other than ``[A-Za-z0-9_.-]``, or longer
  than ``STREAM_CHARS``, is shown shortened, with 6 hex digits of its SHA-1 (``stream_tag``), so two
  streams never share a prefix by truncation;
- PostgreSQL (psycopg2 and psycopg 3): ``application_name`` (``pg_stat_activity``) is set when a
  connection opens and updated, with one ``set_config`` round trip, when a connection of the pool
  is checked out after the traversal moved to another range (``name_connections``), or before the
  next chunk read on the source's held read connection (``SqlSource.fetch``);
- MariaDB/MySQL with PyMySQL: the connection attribute ``program_name``
  (``performance_schema.session_connect_attrs``, when the server's performance schema is on), set
  when the connection opens. The protocol cannot change it later, so a pooled connection checked
  out after the traversal moved to another range is replaced by a new one (one connect per range
  and connection), and the source reopens its held read connection;
- MariaDB/MySQL with mysqlclient (``MySQLdb``, which cannot send connection attributes): the
  session user variable ``@keyset_program_name`` (``VARIABLE``), set by one ``SET`` with a bound
  value right after the connection opens, and again, in place, when a connection of the pool is
  checked out after the traversal moved to another range, or before the next chunk read on the
  source's held read connection. Other sessions see it in
  ``performance_schema.user_variables_by_thread`` when the performance schema is on. A
  user-supplied ``init_command`` (URL query or ``connect_args``) is passed on untouched: the
  name is its own statement, run after it;
- other drivers: not named;
- an ``Engine`` a caller passed in keeps its own settings (no listener is added to it).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import sqlalchemy as sa

PREFIX = "keyset:"
#: bytes of a name (PostgreSQL's NAMEDATALEN - 1; longer application names are truncated)
LIMIT = 63
#: characters of a stream's name shown as they are; a longer one is shortened (``stream_tag``)
STREAM_CHARS = 24
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_INFO = "keyset_name"  # the name a pooled DBAPI connection carries (its record's info)
_SETTER = "keyset_namer"  # how to rename it in place (its record's info; see ``rename``)
#: the session user variable naming a mysqlclient connection (MariaDB/MySQL fold its case)
VARIABLE = "keyset_program_name"


def stream_tag(stream: str) -> str:
    """The stream as it appears in names: itself if short and plain, else a readable prefix and
    6 hex digits of its SHA-1 (``orders~1a2b3c``)."""
    safe = _SAFE.sub("_", stream)
    if safe == stream and len(stream) <= STREAM_CHARS:
        return stream
    digest = hashlib.sha1(stream.encode("utf-8")).hexdigest()[:6]
    return f"{safe[: STREAM_CHARS - 7]}~{digest}"


def stream_prefix(stream: str) -> str:
    """What every name of the stream's connections starts with (``keyset:<tag>:``)."""
    return f"{PREFIX}{stream_tag(stream)}:"


def is_other_stream(app_name: str | None, own_prefix: str) -> bool:
    """``app_name`` names a connection of a traversal of another stream than the one whose
    names start with ``own_prefix`` (``stream_prefix``)."""
    app = app_name or ""
    return app.startswith(PREFIX) and not app.startswith(own_prefix)


class ConnectionName:
    """The current name of one traversal's connections (shared by its source, target and probe
    engines). ``at_range`` moves it; engines named by ``name_connections`` follow."""

    def __init__(self, stream: str) -> None:
        self.prefix = stream_prefix(stream)
        self.text = self._cap(self.prefix + "plan")

    def at_range(self, round_id: str, range_id: int) -> None:
        """The traversal now works on ``range_id`` of ``round_id``."""
        self.text = self._cap(f"{self.prefix}{_SAFE.sub('_', str(round_id))}:{int(range_id)}")

    @staticmethod
    def _cap(text: str) -> str:
        return text.encode("ascii", "replace")[:LIMIT].decode("ascii")


def _set_pg_name(dbapi_conn: Any, text: str) -> None:
    """``application_name`` of an open PostgreSQL connection (psycopg2 or psycopg 3): a bound
    value (``SET`` takes none), committed unless the connection is in autocommit."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute("SELECT set_config('application_name', %s, false)", (text,))
    finally:
        cur.close()
    if not getattr(dbapi_conn, "autocommit", False):
        dbapi_conn.commit()


def _set_my_name(dbapi_conn: Any, text: str) -> None:
    """``@keyset_program_name`` of an open MariaDB/MySQL connection (mysqlclient): a bound
    value. Setting a user variable opens no transaction, so nothing is committed."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"SET @{VARIABLE} = %s", (text,))
    finally:
        cur.close()


def _names_by_variable(engine: sa.Engine) -> bool:
    return engine.dialect.name == "mysql" and engine.dialect.driver == "mysqldb"


def renames_in_place(engine: sa.Engine) -> bool:
    """The engine's connections take a new name without reconnecting (PostgreSQL; MariaDB/MySQL
    with mysqlclient)."""
    return engine.dialect.name == "postgresql" or _names_by_variable(engine)


def names_at_connect(engine: sa.Engine) -> bool:
    """The engine's connections are named only when they open (MariaDB/MySQL with PyMySQL)."""
    return engine.dialect.name == "mysql" and engine.dialect.driver == "pymysql"


def rename(pooled: Any, name: ConnectionName) -> None:
    """Bring one pooled connection of an engine that ``renames_in_place`` (a
    ``PoolProxiedConnection`` or the record's ``info`` holder) to the current name; nothing if
    it carries it already."""
    info = pooled.info
    if info.get(_INFO) != name.text:
        text = name.text
        info.get(_SETTER, _set_pg_name)(pooled.dbapi_connection, text)
        info[_INFO] = text


def name_connections(engine: sa.Engine, name: ConnectionName) -> None:
    """Name every connection ``engine`` opens from now on (see module doc)."""
    if engine.dialect.name == "postgresql":

        @sa.event.listens_for(engine, "do_connect")
        def _pg_connect(_d: Any, record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
            cparams["application_name"] = name.text
            record.info[_INFO] = name.text

        _follow(engine, name, _set_pg_name)

    elif _names_by_variable(engine):

        @sa.event.listens_for(engine, "connect")
        def _var_connect(dbapi_conn: Any, record: Any) -> None:
            # after the connection's own init_command, if any (left as the user gave it)
            text = name.text
            _set_my_name(dbapi_conn, text)
            record.info[_INFO] = text
            record.info[_SETTER] = _set_my_name

        _follow(engine, name, _set_my_name)

    elif names_at_connect(engine):

        @sa.event.listens_for(engine, "do_connect")
        def _my_connect(_d: Any, record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
            cparams["program_name"] = name.text
            record.info[_INFO] = name.text

        @sa.event.listens_for(engine, "checkout")
        def _my_checkout(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
            if record.info.get(_INFO) != name.text:
                # the attribute cannot change on an open connection: the pool opens a new one
                raise sa.exc.DisconnectionError("renamed: reconnect with the range's name")


def _follow(engine: sa.Engine, name: ConnectionName, setter: Any) -> None:
    """Rename in place, with ``setter``, a connection checked out under an older name."""

    @sa.event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if record.info.get(_INFO) != name.text:
            text = name.text
            setter(dbapi_conn, text)
            record.info[_INFO] = text


__all__ = [
    "LIMIT",
    "PREFIX",
    "VARIABLE",
    "ConnectionName",
    "is_other_stream",
    "name_connections",
    "rename",
    "stream_prefix",
    "stream_tag",
]
