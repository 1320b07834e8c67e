"""The FastAPI app behind the Airflow UI page: the page's bundle and a read-only JSON API.

Mounted by the Airflow API server under ``/keyset`` (see ``keyset.py``); imported only there, on
the first request, so other Airflow processes that load plugins never import FastAPI or the API
server's security module because of this provider. The page itself is a React app the Airflow UI
renders (``react_apps``), built from ``ui/`` into ``static/ui/keyset-ui.js``.

Routes (relative to the mount point)::

    GET /                                        the page in the Airflow UI: a redirect to the
                                                 UI route ``plugin/keyset`` with the same query
                                                 (``?stream=..&round=..``: the extra links')
    GET /static/keyset-ui.js                     the page's bundle (public, static: no data)
    GET /icon.svg                                navigation icon (public, static)
    GET /api/connections                         the Redis connections the page may read: the
                                                 configured default first, then every Airflow
                                                 connection of type redis (metadata DB and
                                                 AIRFLOW_CONN_* variables)
    GET /api/streams                             streams under the key prefix
    GET /api/streams/{stream}?closed=3           watermark, retention floor, open + recent rounds
    GET /api/streams/{stream}/rounds/{round_id}?dead=3
                                                 one round: ranges, progress, lag, dead letters,
                                                 why unfinished ranges stopped
    GET /api/runs/{dag_id}/{run_id}              the rounds that DAG run planned, from Redis and
                                                 from the run's XComs; lost or never planned
                                                 (``runs.py``)
    GET /run/{dag_id}/{run_id}                   that run's round on the page: a redirect to
                                                 ``?stream=..&round=..`` (one round), a list
                                                 (several), 404 saying why there is none
    POST /api/streams/{stream}/pause  {"reason"}  pause the stream (edit rights on DAGs)
    POST /api/streams/{stream}/resume             resume it (edit rights on DAGs)
    POST /api/streams/{stream}/rounds/{round_id}/ranges/{range_id}/requeue-dead  {}
                                                 move the range's dead letters back to its retry
                                                 set (open rounds; edit rights on DAGs); the
                                                 answer says which traverse try will run them
    POST /api/streams/{stream}/rounds/{round_id}/ranges/{range_id}/replay-dead  {}
                                                 replay them now through the DAG's own traverse
                                                 task (``replays.py``; open and closed rounds;
                                                 edit rights on that DAG): 200 ``succeeded`` /
                                                 ``failed`` (letters put back) / ``nothing``,
                                                 202 ``running``, 429 every slot busy

Every ``/api`` route takes ``?conn=<connection id>``: which Redis connection to read (default
``[keyset] redis_conn_id``). It is a connection id, validated by full match
(``core/names.py``), never a URL; the connection must exist and be of type redis (else status.HTTP_404_NOT_FOUND
naming it; 503 for the configured default), so the page reads only Redis servers an admin
defined as Airflow connections.

Guarantees:

- **Airflow's authentication**: every route but the icon requires what the Airflow UI and REST
  API require, through the API server's own dependency (``GetUserDep``: the ``Authorization:
  Bearer <JWT>`` header, else the ``_token`` cookie the Airflow UI sets at login). No credential:
  401; an invalid or expired token: 401/403; a user the auth manager does not authorize for the
  custom view ``RESOURCE_NAME`` with method ``GET``: 403. An unauthenticated browser on the page
  gets a 401 page with a link to Airflow's login that returns here.
- **Read-only but for pause/resume, requeue and replay**: ``GET`` routes only read Redis (see
  ``status.py``). Pause and resume write the stream's control hash only (pause, reason, who),
  never a cursor, a round or a watermark; requeue moves a range's dead letters back to its retry
  set through the engine's fenced script (``status.requeue_dead``: the cursor does not move, the
  letters are processed by the DAG's own traverse task on its next try, never here, so the
  processor, target and ``where`` come from the DAG, never from Redis or the client). Replay
  runs the DAG's traverse task over the range's letters in this server (``replays.py``: the
  CLI's ``DagReplay``, in a bounded pool off the request thread), writing what the engine's
  replay writes: the range's cursor state and counters, the processor's own writes through the
  DAG's target connection. The ``POST`` routes are allowed only to users the auth manager lets
  edit DAGs (``is_authorized_dag(method="PUT")``), a replay also to edit the DAG that planned the
  round; others get 403. The stream JSON says ``can_edit`` so the
  page shows the buttons only to them.
- **No cross-site writes** (``same_origin_json``): every ``POST`` route take only a JSON body
  with ``Content-Type: application/json`` (else 415: a plain HTML form cannot send it, and a
  script of another origin cannot without a CORS preflight), and refuse with 403 a request whose
  ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` or whose ``Origin`` is not the server's
  own (its ``Host``, ``X-Forwarded-Host`` or ``[api] base_url``). A client that sends neither
  header (curl, a script with a token) is not a browser acting for a user and is let through.
- **Names checked first**: every path parameter (stream, round id, DAG id, run id) is validated
  by its rule (``core/names.py``, a full match) before anything is read: a malformed one gets 400
  with the rule, never a 500.
- **No credentials leave the server**: the Redis client is built from the Airflow connection
  ``[keyset] redis_conn_id`` (default ``redis_default``); responses name the connection id and the
  key prefix (``[keyset] key_prefix``, default ``ks``), never a host password or URI.
"""

from __future__ import annotations

import contextlib
import html
import threading
from importlib import resources
from typing import Annotated, Any
from urllib.parse import quote, urlencode, urlsplit

import redis
from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.core_api.security import GetUserDep
from airflow.configuration import conf
from fastapi import Body, Depends, FastAPI, HTTPException, Path, Query, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..common import PREVIEW_XCOM_KEY, ROUND_XCOM_KEY
from ..core import names
from ..core.errors import ConfigurationError, InvalidNameError, StoreUnavailableError
from ..core.redaction import scrub
from . import replays, runs
from . import status as view
from .routes import BUNDLE_FILE, UI_ROUTE, URL_PREFIX

#: The custom view name the auth manager is asked about (method ``GET``). SimpleAuthManager lets
#: every role from viewer up see it; with another auth manager, grant read on this resource.
RESOURCE_NAME = "Keyset"
CONFIG_SECTION = "keyset"
DEFAULT_REDIS_CONN_ID = "redis_default"
DEFAULT_KEY_PREFIX = "ks"

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def settings() -> tuple[str, str]:
    """``(redis_conn_id, key_prefix)`` from the Airflow configuration section ``[keyset]``
    (environment: ``AIRFLOW__KEYSET__REDIS_CONN_ID``, ``AIRFLOW__KEYSET__KEY_PREFIX``)."""
    conn_id = (
        conf.get(CONFIG_SECTION, "redis_conn_id", fallback=DEFAULT_REDIS_CONN_ID)
        or DEFAULT_REDIS_CONN_ID
    )
    prefix = (
        conf.get(CONFIG_SECTION, "key_prefix", fallback=DEFAULT_KEY_PREFIX) or DEFAULT_KEY_PREFIX
    )
    return conn_id, prefix


def _client(conn_id: str) -> redis.Redis:
    """One pooled client per connection id, built through ``KeysetHook`` (so it has the same
    socket timeouts, TLS and AUTH handling as the operators)."""
    with _clients_lock:
        client = _clients.get(conn_id)
        if client is None:
            from ..hooks.keyset import KeysetHook

            client = KeysetHook(redis_conn_id=conn_id).redis_client()
            _clients[conn_id] = client
        return client


def _forget(conn_id: str) -> None:
    """Drop a client after a Redis error, so a fixed connection is picked up on the next call."""
    with _clients_lock:
        client = _clients.pop(conn_id, None)
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def authorized_user(user: GetUserDep) -> BaseUser:
    """The signed-in user, if the auth manager lets them read the ``RESOURCE_NAME`` view."""
    if not get_auth_manager().is_authorized_custom_view(
        method="GET", resource_name=RESOURCE_NAME, user=user
    ):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"not authorized to read the {RESOURCE_NAME} view"
        )
    return user


AuthorizedUser = Annotated[BaseUser, Depends(authorized_user)]


def can_edit(user: BaseUser) -> bool:
    """May this user pause and resume streams? Those who may edit DAGs (method ``PUT``)."""
    return bool(get_auth_manager().is_authorized_dag(method="PUT", user=user))


def editor_user(user: AuthorizedUser) -> BaseUser:
    """The signed-in user, if they may also edit DAGs (pausing a stream stops DAG runs' work)."""
    if not can_edit(user):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "pausing and resuming a stream needs edit rights on DAGs"
        )
    return user


EditorUser = Annotated[BaseUser, Depends(editor_user)]


class PauseRequest(BaseModel):
    reason: str = Field(default="", max_length=500)


class ResumeRequest(BaseModel):
    pass


class RequeueRequest(BaseModel):
    pass


class ReplayRequest(BaseModel):
    pass


def _may_edit_dag(user: BaseUser, dag_id: str) -> None:
    """403 unless the auth manager lets ``user`` edit DAG ``dag_id`` (a replay runs its task)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    if not get_auth_manager().is_authorized_dag(
        method="PUT", details=DagDetails(id=dag_id), user=user
    ):
        raise view.Forbidden(f"replaying through DAG {dag_id} needs edit rights on that DAG")


#: ``?conn=``: the Redis connection id to read (validated by ``_conn``), default the configured.
ConnParam = Annotated[str | None, Query(max_length=250)]


def _conn(conn: str | None) -> str:
    """The connection id to read: ``conn`` (full match of ``names.CONN_ID``, else 400) or the
    configured default."""
    if conn is None or conn == "":
        return settings()[0]
    try:
        return names.conn_id(conn)
    except InvalidNameError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc


#: ``Sec-Fetch-Site`` values of a request the page itself made (or a user typed).
SAME_SITE_FETCH = frozenset({"same-origin", "none"})


def _own_hosts(request: Request) -> set[str]:
    hosts = {request.headers.get("host", ""), request.headers.get("x-forwarded-host", "")}
    base_url = conf.get("api", "base_url", fallback="") or ""
    hosts.add(urlsplit(base_url).netloc)
    return {h.strip().lower() for h in hosts if h and h.strip()}


def same_origin_json(request: Request) -> None:
    """Refuse a state-changing request that is not JSON (415) or comes from another site (403);
    see the module docstring (**No cross-site writes**)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            "send a JSON body with Content-Type: application/json",
        )
    fetch_site = request.headers.get("sec-fetch-site", "").strip().lower()
    if fetch_site and fetch_site not in SAME_SITE_FETCH:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"cross-site request refused (Sec-Fetch-Site: {fetch_site})"
        )
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc.lower() not in _own_hosts(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "cross-site request refused (Origin is not this server)"
        )


def json_editor(request: Request, user: EditorUser) -> BaseUser:
    """An editor (``editor_user``: 401/403 first) whose request passes ``same_origin_json``."""
    same_origin_json(request)
    return user


JsonEditor = Annotated[BaseUser, Depends(json_editor)]


def _checked(**values: str) -> None:
    """Validate each path parameter by its rule (``core/names.py``); 400 with the rule."""
    rules = {"stream": names.stream, "round_id": names.round_id}
    rules |= {"dag_id": names.dag_id, "run_id": names.run_id}
    try:
        for kind, value in values.items():
            rules[kind](value)
    except InvalidNameError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc


def _read(fn: Any, *args: Any, conn: str | None = None, **kwargs: Any) -> Any:
    """Run one read against the Redis of connection ``conn`` (default: the configured one) and
    map failures to HTTP errors that name no secret."""
    (default, prefix), conn_id = settings(), _conn(conn)
    try:
        client = _client(conn_id)
    except ConfigurationError as exc:  # no such connection, or not of type redis
        # The configured one: the server is misconfigured (503); one the client chose: 404.
        code = (
            status.HTTP_503_SERVICE_UNAVAILABLE if conn_id == default else status.HTTP_404_NOT_FOUND
        )
        raise HTTPException(code, scrub(str(exc))) from exc
    try:
        return fn(client, prefix, *args, **kwargs)
    except view.Forbidden as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from exc
    except replays.Busy as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc)) from exc
    except view.NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
    except view.Conflict as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except view.StateLost as exc:
        raise HTTPException(status.HTTP_410_GONE, str(exc)) from exc
    except InvalidNameError as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
    except ConfigurationError as exc:  # connection missing or of the wrong type
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, scrub(str(exc))) from exc
    except (redis.RedisError, StoreUnavailableError) as exc:
        _forget(conn_id)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"Redis of connection {conn_id!r} is unavailable: {type(exc).__name__}: "
            f"{scrub(str(exc))}",
        ) from exc


def _unauthenticated_page(request: Request, exc: StarletteHTTPException) -> HTMLResponse:
    page = str(request.url)
    try:
        login = get_auth_manager().get_url_login(next_url=page)
    except Exception:
        login = "/"
    body = (
        "<!doctype html><title>Keyset traversals</title>"
        f"<p>{html.escape(str(exc.detail))}.</p>"
        f'<p><a href="{html.escape(login, quote=True)}">Sign in to Airflow</a> to see the keyset traversals.</p>'
    )
    return HTMLResponse(body, status_code=exc.status_code, headers=exc.headers)


def create_app() -> FastAPI:
    """The app the plugin mounts (see the module docstring for routes and guarantees)."""
    app = FastAPI(title="Keyset traversals", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handler(app)
    _add_page_routes(app)
    _add_api_routes(app)
    return app


def _add_error_handler(app: FastAPI) -> None:
    """HTTP errors as JSON, except a browser's unauthenticated visit to the page (a login hint)."""

    @app.exception_handler(StarletteHTTPException)
    async def _errors(request: Request, exc: StarletteHTTPException) -> Response:
        wants_html = "text/html" in request.headers.get("accept", "")
        if (
            wants_html
            and request.url.path.rstrip("/") == request.scope.get("root_path", "").rstrip("/")
            and exc.status_code in (401, 403)
        ):
            return _unauthenticated_page(request, exc)
        return JSONResponse(
            {"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
        )


def _ui_base(request: Request) -> str:
    """The Airflow UI's base path: the mount point (``root_path``) without ``URL_PREFIX``."""
    root = request.scope.get("root_path", "").rstrip("/")
    return (root[: -len(URL_PREFIX)] if root.endswith(URL_PREFIX) else root) + "/"


def _add_page_routes(app: FastAPI) -> None:
    """The page (a redirect into the Airflow UI), its bundle, its icon, the per-run redirect."""

    @app.get("/", include_in_schema=False)
    def page(request: Request, _user: AuthorizedUser) -> Response:
        query = request.url.query
        target = f"{_ui_base(request)}plugin/{UI_ROUTE}" + (f"?{query}" if query else "")
        return RedirectResponse(target, status_code=307)

    @app.get(f"/static/{BUNDLE_FILE}", include_in_schema=False)
    def bundle() -> Response:
        js = (resources.files(__package__) / "static" / "ui" / BUNDLE_FILE).read_bytes()
        # The bundle URL carries the sources' hash (keyset.BUNDLE_URL), so a new build is a new URL.
        return Response(js, media_type="text/javascript", headers={"Cache-Control": "max-age=3600"})

    @app.get("/icon.svg", include_in_schema=False)
    def icon() -> Response:
        svg = (resources.files(__package__) / "static" / "icon.svg").read_bytes()
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "max-age=3600"})

    @app.get("/run/{dag_id}/{run_id}", include_in_schema=False)
    def run_page(request: Request, dag_id: str, run_id: str, user: AuthorizedUser) -> Response:
        _checked(dag_id=dag_id, run_id=run_id)
        return _run_page(request, dag_id, run_id, user)


def _add_api_routes(app: FastAPI) -> None:
    """The JSON API the page reads (and, for editors, pause/resume)."""

    @app.get("/api/connections")
    def connections(_user: AuthorizedUser) -> dict[str, Any]:
        default, prefix = settings()
        return {"default": default, "key_prefix": prefix, "connections": redis_conn_ids(default)}

    @app.get("/api/streams")
    def streams(_user: AuthorizedUser, conn: ConnParam = None) -> dict[str, Any]:
        conn_id, prefix = _conn(conn), settings()[1]
        found = _read(view.streams, conn=conn_id)
        return {"redis_conn_id": conn_id, "key_prefix": prefix, "streams": found}

    @app.get("/api/streams/{stream}")
    def stream(
        stream: str,
        user: AuthorizedUser,
        closed: Annotated[int, Query(ge=0, le=20)] = 3,
        conn: ConnParam = None,
    ) -> dict[str, Any]:
        _checked(stream=stream)
        out: dict[str, Any] = _read(view.stream_view, stream, closed, conn=conn)
        out["can_edit"] = can_edit(user)
        return out

    @app.post("/api/streams/{stream}/pause")
    def pause(
        stream: str, body: PauseRequest, user: JsonEditor, conn: ConnParam = None
    ) -> dict[str, Any]:
        _checked(stream=stream)
        who = f"ui:{getattr(user, 'get_name', lambda: '?')()}"
        return {"control": _read(view.pause_stream, stream, body.reason, who, conn=conn)}

    @app.post("/api/streams/{stream}/resume")
    def resume(
        stream: str,
        _user: JsonEditor,
        _body: Annotated[ResumeRequest | None, Body()] = None,
        conn: ConnParam = None,
    ) -> dict[str, Any]:
        _checked(stream=stream)
        return {"control": _read(view.resume_stream, stream, conn=conn)}

    @app.post("/api/streams/{stream}/rounds/{round_id}/ranges/{range_id}/requeue-dead")
    def requeue_dead(
        stream: str,
        round_id: str,
        range_id: Annotated[int, Path(ge=0, le=names.MAX_RANGE_ID)],
        _user: JsonEditor,
        _body: Annotated[RequeueRequest | None, Body()] = None,
        conn: ConnParam = None,
    ) -> dict[str, Any]:
        _checked(stream=stream, round_id=round_id)
        out: dict[str, Any] = _read(view.requeue_dead, stream, round_id, range_id, conn=conn)
        return out

    @app.post("/api/streams/{stream}/rounds/{round_id}/ranges/{range_id}/replay-dead")
    def replay_dead(
        stream: str,
        round_id: str,
        range_id: Annotated[int, Path(ge=0, le=names.MAX_RANGE_ID)],
        user: JsonEditor,
        _body: Annotated[ReplayRequest | None, Body()] = None,
        conn: ConnParam = None,
    ) -> Response:
        _checked(stream=stream, round_id=round_id)
        who = f"ui:{getattr(user, 'get_name', lambda: '?')()}"
        out: dict[str, Any] = _read(
            replays.replay_range,
            stream,
            round_id,
            range_id,
            conn=conn,
            conn_id=_conn(conn),
            who=who,
            authorize=lambda dag_id: _may_edit_dag(user, dag_id),
        )
        code = status.HTTP_202_ACCEPTED if out["state"] == "running" else status.HTTP_200_OK
        return JSONResponse(out, status_code=code)

    @app.get("/api/streams/{stream}/rounds/{round_id}")
    def round_(
        stream: str,
        round_id: str,
        _user: AuthorizedUser,
        dead: Annotated[int, Query(ge=0, le=50)] = 3,
        conn: ConnParam = None,
    ) -> dict[str, Any]:
        _checked(stream=stream, round_id=round_id)
        out: dict[str, Any] = _read(view.round_view, stream, round_id, dead, conn=conn)
        return out

    @app.get("/api/streams/{stream}/preview")
    def preview(stream: str, user: AuthorizedUser) -> dict[str, Any]:
        """The stream's latest preview (``PreviewRoundOperator``'s XCom ``keyset_preview``) among
        the DAGs whose XComs the user may read; ``{"preview": null}`` when there is none."""
        _checked(stream=stream)
        return {"stream": stream, "preview": latest_preview(user, stream)}

    @app.get("/api/runs/{dag_id}/{run_id}")
    def run_rounds(
        dag_id: str, run_id: str, user: AuthorizedUser, conn: ConnParam = None
    ) -> dict[str, Any]:
        _checked(dag_id=dag_id, run_id=run_id)
        out: dict[str, Any] = _read(
            runs.run_view, dag_id, run_id, planned_by_airflow(user, dag_id, run_id), conn=conn
        )
        return out


#: ``AIRFLOW_CONN_<ID>``: a connection defined in the environment (Airflow's own lookup).
_ENV_CONN_PREFIX = "AIRFLOW_CONN_"


def redis_conn_ids(default: str) -> list[str]:
    """The Redis connections the page offers: ``default`` first, then, sorted, every Airflow
    connection of type ``redis`` in the metadata database and in ``AIRFLOW_CONN_*`` variables
    (one query and one pass over the environment: no DAG is parsed, no Redis is contacted).
    Connections of a secrets backend are not listed (they cannot be enumerated); a user may
    still read one by id with ``?conn=``."""
    import os

    from airflow.models.connection import Connection
    from airflow.utils.session import create_session
    from sqlalchemy import select

    found: set[str] = set()
    with create_session() as session:
        query = select(Connection.conn_id).where(Connection.conn_type == "redis")
        found.update(str(c) for c in session.scalars(query))
    for name, value in os.environ.items():
        if name.startswith(_ENV_CONN_PREFIX) and _is_redis(value):
            found.add(name[len(_ENV_CONN_PREFIX) :].lower())
    found = {c for c in found if names.CONN_ID.ok(c)}
    return [default, *sorted(found - {default})]


def _is_redis(value: str) -> bool:
    """Is this ``AIRFLOW_CONN_*`` value (JSON or URI) a connection of type redis?"""
    import json

    text = value.strip()
    if text.startswith("{"):
        try:
            return str(json.loads(text).get("conn_type", "")).lower() == "redis"
        except (ValueError, AttributeError):
            return False
    return text.lower().startswith(("redis://", "rediss://"))


def planned_by_airflow(user: BaseUser, dag_id: str, run_id: str) -> list[dict[str, Any]] | None:
    """The rounds the run's plan tasks recorded in Airflow's metadata database (their XCom
    ``keyset_round``); None when the user may not read the DAG's XComs (then only Redis tells)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    if not get_auth_manager().is_authorized_dag(
        method="GET", access_entity=DagAccessEntity.XCOM, details=DagDetails(id=dag_id), user=user
    ):
        return None
    query = select(XComModel).where(
        XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.key == ROUND_XCOM_KEY
    )
    out = []
    with create_session() as session:
        for row in session.scalars(query):
            value = XComModel.deserialize_value(row)
            if isinstance(value, dict) and value.get("round_id") and value.get("stream"):
                out.append(
                    {
                        "stream": str(value["stream"]),
                        "round_id": str(value["round_id"]),
                        "key_prefix": value.get("key_prefix"),
                        "task_id": row.task_id,
                        "map_index": None if row.map_index < 0 else row.map_index,
                    }
                )
    return sorted(out, key=lambda p: (p["task_id"], p["map_index"] or -1))


#: previews looked at (newest first) to find a stream's latest one
_PREVIEWS_SCANNED = 200


def latest_preview(user: BaseUser, stream: str) -> dict[str, Any] | None:
    """The newest ``keyset_preview`` XCom of ``stream`` in Airflow's metadata database that the
    user may read (XCom access to its DAG), with the DAG, run and task it came from; None when
    there is none. Reads the metadata database only (no Redis, no source)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = (
        select(XComModel)
        .where(XComModel.key == PREVIEW_XCOM_KEY)
        .order_by(XComModel.timestamp.desc())
        .limit(_PREVIEWS_SCANNED)
    )
    allowed: dict[str, bool] = {}
    with create_session() as session:
        for row in session.scalars(query):
            if row.dag_id not in allowed:
                allowed[row.dag_id] = get_auth_manager().is_authorized_dag(
                    method="GET",
                    access_entity=DagAccessEntity.XCOM,
                    details=DagDetails(id=row.dag_id),
                    user=user,
                )
            if not allowed[row.dag_id]:
                continue
            value = XComModel.deserialize_value(row)
            if isinstance(value, dict) and value.get("stream") == stream:
                return {**value, "dag_id": row.dag_id, "run_id": row.run_id, "task_id": row.task_id}
    return None


def _page_url(request: Request, stream: str, round_id: str) -> str:
    """The page (under the mount point) filtered to one round."""
    base = request.scope.get("root_path", "").rstrip("/") + "/"
    return f"{base}?{urlencode({'stream': stream, 'round': round_id}, quote_via=quote)}"


def _run_page(request: Request, dag_id: str, run_id: str, user: BaseUser) -> Response:
    """One round: redirect to it on the page; several (one per plan task): a list of links;
    none: 404 saying why (``runs.run_view``: never planned, lost, another key prefix)."""
    found = _read(runs.run_view, dag_id, run_id, planned_by_airflow(user, dag_id, run_id))
    rounds = found["rounds"]
    if len(rounds) == 1:
        r = rounds[0]
        return RedirectResponse(_page_url(request, r["stream"], r["round_id"]), status_code=307)
    esc = html.escape
    if not rounds:
        body = f"<p>{esc(found['absent_message'])}</p>"
        return HTMLResponse(_small_page(body), status_code=status.HTTP_404_NOT_FOUND)
    items = "".join(
        f'<li><a href="{esc(_page_url(request, r["stream"], r["round_id"]), quote=True)}">'
        f"{esc(r['task_id'])}: stream {esc(r['stream'])}, round {esc(r['round_id'])}</a></li>"
        for r in rounds
    )
    return HTMLResponse(
        _small_page(f"<p>Rounds planned by run <code>{esc(run_id)}</code>:</p><ul>{items}</ul>")
    )


def _small_page(body: str) -> str:
    return f"<!doctype html><meta charset=utf-8><title>Keyset traversals</title>{body}"
