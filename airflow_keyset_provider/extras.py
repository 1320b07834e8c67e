"""Optional dependencies: which ``pip`` extra brings which Airflow provider, and the error that
names the extra when one is missing.

Guarantee: ``provider_hook`` either returns the hook class or raises ``MissingExtraError`` whose
message names the connection type, the missing module and the exact ``pip install`` line; it never
lets a bare ``ModuleNotFoundError`` for ``airflow.providers.*`` reach the user.
"""

from __future__ import annotations

import importlib
from typing import Any

from .core.errors import ConfigurationError

DISTRIBUTION = "airflow-keyset-provider"

# connection type -> (hook module, hook class, extra that installs its provider and driver)
PROVIDER_HOOKS: dict[str, tuple[str, str, str]] = {
    "postgres": ("airflow.providers.postgres.hooks.postgres", "PostgresHook", "postgres"),
    "sqlite": ("airflow.providers.sqlite.hooks.sqlite", "SqliteHook", "sqlite"),
    "mysql": ("airflow.providers.mysql.hooks.mysql", "MySqlHook", "mysql"),
}


class MissingExtraError(ConfigurationError, ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def install_hint(extra: str) -> str:
    """The ``pip install`` line of one extra of this distribution."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def provider_hook(conn_type: str) -> Any:
    """The Airflow hook class for connections of ``conn_type`` (``postgres``, ``sqlite``,
    ``mysql``), imported on demand."""
    module, name, extra = PROVIDER_HOOKS[conn_type]
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise MissingExtraError(
            f"connections of type {conn_type!r} need Airflow's {conn_type} provider and its "
            f"driver, which are not installed ({exc}). Install them with: {install_hint(extra)}"
        ) from exc
