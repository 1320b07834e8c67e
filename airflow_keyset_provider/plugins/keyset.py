"""``KeysetPlugin``: the Airflow 3 plugin that puts the keyset traversal page into the Airflow UI.

- ``fastapi_apps``: the page and its read-only JSON API, mounted by the API server at
  ``URL_PREFIX`` (``/keyset``) and protected by Airflow's own authentication (see ``app.py``).
- ``react_apps`` (Airflow 3.1+): the page itself, a React app the Airflow UI loads from
  ``BUNDLE_URL`` (relative to the UI's base URL, so it works behind a path prefix) and renders in
  its own layout, no iframe: a navigation entry under *Browse* at the UI route ``/plugin/keyset``,
  a "Keyset round" tab on every DAG run (destination ``dag_run``: the rounds that run planned)
  and a "Keyset range" tab on every task instance (``task_instance``: the same, its range
  highlighted). The bundle is built from ``ui/`` (``make ui``) and shipped in the wheel.

Every Airflow process that loads plugins imports this module (schedulers and task runners too),
so it stays cheap: the FastAPI app is built on its first request, inside the API server only.
"""

from __future__ import annotations

import threading
from importlib import resources
from typing import Any

# The Task SDK class is the one providers use (as apache-airflow-providers-common-compat does).
from airflow.sdk.plugins_manager import AirflowPlugin

from .routes import (  # re-exported: the page's places
    BUNDLE_FILE as BUNDLE_FILE,
)
from .routes import (
    REACT_APP_NAMES as REACT_APP_NAMES,
)
from .routes import (
    RUN_UI_ROUTE as RUN_UI_ROUTE,
)
from .routes import (
    TASK_UI_ROUTE as TASK_UI_ROUTE,
)
from .routes import (
    UI_ROUTE as UI_ROUTE,
)
from .routes import (
    URL_PREFIX as URL_PREFIX,
)


def _bundle_url() -> str:
    """``keyset/static/keyset-ui.js?v=<sources' hash>``: a rebuilt bundle is a new URL, so no
    browser keeps an old one from its cache."""
    try:
        digest = (resources.files(__package__) / "static" / "ui" / "SOURCE_SHA256").read_text()
    except OSError:
        digest = ""
    return f"{URL_PREFIX.lstrip('/')}/static/{BUNDLE_FILE}?v={digest.strip()[:12]}"


BUNDLE_URL = _bundle_url()
ICON = "keyset/icon.svg"


class LazyApp:
    """An ASGI app that builds the real FastAPI app (``app.create_app``) on its first call.

    Starlette's ``Mount`` only needs an ASGI callable, so the API server serves it like any
    FastAPI sub-app; lifespan events are not forwarded to mounted apps, and none are needed."""

    def __init__(self) -> None:
        self._app: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    from .app import create_app

                    self._app = create_app()
        return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._get()(scope, receive, send)


class KeysetPlugin(AirflowPlugin):
    """Registers the "Keyset traversals" page (see the module docstring)."""

    name = "keyset"
    fastapi_apps = [
        {"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "Keyset traversals"},
    ]
    react_apps = [
        {
            "name": REACT_APP_NAMES[0],
            "bundle_url": BUNDLE_URL,
            "url_route": UI_ROUTE,
            "destination": "nav",
            "category": "browse",
            "icon": ICON,
        },
        {
            "name": REACT_APP_NAMES[1],
            "bundle_url": BUNDLE_URL,
            "url_route": RUN_UI_ROUTE,
            "destination": "dag_run",
            "icon": ICON,
        },
        {
            "name": REACT_APP_NAMES[2],
            "bundle_url": BUNDLE_URL,
            "url_route": TASK_UI_ROUTE,
            "destination": "task_instance",
            "icon": ICON,
        },
    ]


def __getattr__(name: str) -> Any:
    """``EntryPointPlugin``: what the ``airflow.plugins`` entry point loads.

    Airflow loads a provider's ``plugins`` (``get_provider_info``) only when providers are
    discovered eagerly (``[core] lazy_discover_providers = False``); by default it does not, and
    the entry point is what puts the page in the UI. Were the entry point to return the plugin in
    eager mode too, Airflow would load it twice and record "Plugin 'keyset' already registered" as
    a plugin import error. So the entry point answers ``None`` (skipped silently, not a plugin)
    when the provider path will load it.
    """
    if name == "EntryPointPlugin":
        from airflow import settings

        return KeysetPlugin if settings.LAZY_LOAD_PROVIDERS else None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
