"""The database families the write-back helpers support, one module each, chosen by the
SQLAlchemy dialect name of the connection. See ``base.py`` for the interface."""

from __future__ import annotations

import importlib

from sqlalchemy.engine import Connection

from airflow_keyset_provider.core.errors import ConfigurationError

from .base import Backend, BatchWrite, Builder, KeyIn, Plan, returning

__all__ = ["Backend", "BatchWrite", "Builder", "KeyIn", "Plan", "backend_for", "returning"]

# dialect name -> module of this package that defines ``BACKEND``
_MODULES = {"postgresql": "postgresql", "sqlite": "sqlite"}
_LOADED: dict[str, Backend] = {}


def backend_for(conn: Connection) -> Backend:
    """The backend of ``conn``'s database, after its checks (e.g. SQLite's version) passed."""
    name = conn.dialect.name
    backend = _LOADED.get(name)
    if backend is None:
        module = _MODULES.get(name)
        if module is None:
            raise ConfigurationError(
                f"write-back helpers support PostgreSQL and SQLite, not {name!r}."
            )
        backend = _LOADED[name] = importlib.import_module(f"{__name__}.{module}").BACKEND
    backend.check(conn)
    return backend
