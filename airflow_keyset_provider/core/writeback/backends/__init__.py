"""The database families the write-back helpers support, one module each, chosen by the
SQLAlchemy dialect name of the connection. See ``base.py`` for the interface."""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from airflow_keyset_provider.core.errors import ConfigurationError

from ..failures import Fault, fault_of
from .base import Backend, BatchWrite, Builder, ColumnarPlan, KeyIn, Plan, returning

__all__ = [
    "Backend",
    "BatchWrite",
    "Builder",
    "ColumnarPlan",
    "KeyIn",
    "Plan",
    "backend_for",
    "fault_in",
    "load",
    "returning",
]

# dialect name -> module of this package that defines ``BACKEND``
_MODULES = {"postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}
_LOADED: dict[str, Backend] = {}


def backend_for(conn: Connection) -> Backend:
    """The backend of ``conn``'s database, after its checks (e.g. SQLite's version) passed."""
    backend = load(conn.dialect.name)
    if backend is None:
        raise ConfigurationError(
            f"write-back helpers support PostgreSQL, SQLite, MySQL and MariaDB, not "
            f"{conn.dialect.name!r}."
        )
    backend.check(conn)
    return backend


def fault_in(dialect_name: str, exc: sa.exc.DBAPIError) -> Fault:
    """Whose fault ``exc`` is on that database (see ``failures.py``)."""
    backend = load(dialect_name)
    return backend.fault(exc) if backend is not None else fault_of(exc)


def load(name: str) -> Backend | None:
    """The backend of the dialect ``name`` (unchecked), None if it is not supported."""
    backend = _LOADED.get(name)
    if backend is None:
        module = _MODULES.get(name)
        if module is None:
            return None
        backend = _LOADED[name] = importlib.import_module(f"{__name__}.{module}").BACKEND
    return backend
