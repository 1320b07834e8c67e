"""The SQLAlchemy URL of an Airflow ``mysql`` connection (MySQL 8.0 or MariaDB).

Built from the connection's fields, not through ``MySqlHook``: the mysql provider requires
mysqlclient, which builds from source, and a PyMySQL deployment needs neither. Guarantees:

- the driver is the connection extra's ``driver`` (``"mysqldb"`` for mysqlclient, ``"pymysql"``),
  else mysqlclient when it is importable, else PyMySQL; a driver that is not installed raises
  ``MissingExtraError`` naming the extra that installs it;
- host, port, login, password and schema (the database) come from the connection; the extra's
  ``charset`` (default ``utf8mb4``) becomes the URL's ``charset``;
- the result is a ``sqlalchemy.URL`` object, whose rendering hides the password.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import sqlalchemy as sa

from airflow_keyset_provider.extras import MissingExtraError, install_hint

#: driver name in the connection extra -> (DBAPI module, extra that installs it)
DRIVERS = {"mysqldb": ("MySQLdb", "mysql-native"), "pymysql": ("pymysql", "mysql")}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mysql_driver(extra: dict[str, Any]) -> str:
    """The SQLAlchemy driver name for a connection whose extra is ``extra`` (see module doc)."""
    driver = str(extra.get("driver") or "").lower().removeprefix("mysql+")
    if not driver:
        return "mysqldb" if _installed("MySQLdb") else "pymysql"
    if driver not in DRIVERS:
        raise MissingExtraError(
            f"mysql connection extra names driver {driver!r}; supported: {', '.join(DRIVERS)}"
        )
    module, extra_name = DRIVERS[driver]
    if not _installed(module):
        raise MissingExtraError(
            f"mysql connection extra names driver {driver!r}, whose module {module} is not "
            f"installed. Install it with: {install_hint(extra_name)}"
        )
    return driver


def mysql_url(conn: Any) -> sa.URL:
    """The URL of the Airflow ``Connection`` ``conn`` (see module doc)."""
    extra = conn.extra_dejson or {}
    driver = mysql_driver(extra)
    if driver == "pymysql" and not _installed("pymysql"):
        raise MissingExtraError(
            "mysql connections need a driver: neither mysqlclient nor PyMySQL is installed. "
            f"Install one with: {install_hint('mysql')} (PyMySQL) or "
            f"{install_hint('mysql-native')} (mysqlclient)"
        )
    return sa.URL.create(
        f"mysql+{driver}",
        username=conn.login or None,
        password=conn.password or None,
        host=conn.host or None,
        port=int(conn.port) if conn.port else None,
        database=conn.schema or None,
        query={"charset": str(extra.get("charset") or "utf8mb4")},
    )


__all__ = ["DRIVERS", "mysql_driver", "mysql_url"]
