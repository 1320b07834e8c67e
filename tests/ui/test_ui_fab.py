"""The Keyset UI page under the FAB auth manager (``apache-airflow-providers-fab``), against a real
``airflow api-server`` on loopback with its own ``AIRFLOW_HOME`` (SQLite metadata DB migrated by
``airflow db migrate``, which also creates FAB's tables), real Redis and users made with the real
CLI.

Scenario (what a FAB admin does, step by step, and what each user then gets):

1. ``airflow roles create KeysetReader``; ``airflow roles add-perms KeysetReader -r Keyset -a
   can_read`` is refused ("Resource named 'Keyset' does not exist"): FAB knows only the resources
   its own views and Airflow declare, and nothing declares the plugin's custom view.
2. The permission ``can_read`` on ``Keyset`` is created once through FAB's security manager
   (``create_permission``, the snippet in docs/howto-monitoring.md); the same ``add-perms`` then
   succeeds; so does ``-r Plugins -a can_read`` (the Airflow UI lists plugin pages through
   ``/api/v2/plugins``, which needs it; FAB's ``Viewer`` has it).
3. ``airflow users create``: ``reader`` (role ``KeysetReader`` only), ``viewer`` (FAB's built-in
   ``Viewer``), ``editor`` (``User``, then ``airflow users add-role`` ``KeysetReader``: ``users
   create`` takes one role).
4. Each logs in at ``POST /auth/token`` (FAB's login endpoint, username and password) and asks
   for ``/keyset/api/streams``, a stream, the page, and pause/resume:
   reader 200 everywhere it reads, 403 on pause (no DAG edit); viewer 403 (``Viewer`` has no
   ``can_read`` on ``Keyset``); editor reads and pauses/resumes (``User`` may edit DAGs);
   no credential 401. Headless Chromium then renders the page as ``reader``, inside the
   Airflow UI (the plugin's React app).

Skipped, with the reason, when the FAB provider cannot be imported, except under
``KEYSET_REQUIRE_SERVICES=1`` (CI), where that fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _services
import pytest
import sqlalchemy as sa
from keyset_page import open_in_airflow
from sqlalchemy.engine import make_url

from airflow_keyset_provider.core import KeysetTraversal
from airflow_keyset_provider.plugins.app import RESOURCE_NAME

REPO = Path(__file__).resolve().parents[2]
FAB_AUTH_MANAGER = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"
SERVER_START_TIMEOUT_S = 90
CLI_TIMEOUT_S = 120
ROLE = "KeysetReader"
PLUGINS_RESOURCE = "Plugins"
STREAM = "ui-fab"
#: Creates the FAB permission (action + resource) once; ``airflow roles add-perms`` needs it.
CREATE_PERMISSION = f"""
from airflow.providers.fab.auth_manager.cli_commands.utils import get_application_builder
with get_application_builder() as appbuilder:
    appbuilder.sm.create_permission("can_read", "{RESOURCE_NAME}")
"""


def _require_fab() -> None:
    try:
        found = importlib.util.find_spec(FAB_AUTH_MANAGER.rsplit(".", 1)[0]) is not None
    except ImportError:
        found = False
    if found:
        return
    reason = "apache-airflow-providers-fab is not installed (pip install the `test` extra)"
    if _services._flag(os.environ, _services.ENV_REQUIRE):
        pytest.fail(f"{reason} ({_services.ENV_REQUIRE}=1: the FAB UI test must run)")
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def _airflow_cmd() -> list[str]:
    airflow_bin = Path(sys.executable).with_name("airflow")
    return [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_conn(redis_url: str) -> str:
    url = make_url(redis_url)
    extra = {"db": int(url.database or 0)}
    return json.dumps({"conn_type": "redis", "host": url.host, "port": url.port, "extra": extra})


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """Stop the server this module started, by its process group (it leads its own session)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass
class FabServer:
    base_url: str
    key_prefix: str
    passwords: dict[str, str]
    log: Path

    def http(
        self, method: str, path: str, *, token: str | None = None, body: Any = None
    ) -> tuple[int, bytes]:
        """One request; ``(status, body)`` for every status."""
        hdrs = {"Authorization": f"Bearer {token}"} if token else {}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def token(self, username: str) -> str:
        """A JWT from FAB's login endpoint (``POST /auth/token``, username + password)."""
        status, raw = self.http(
            "POST",
            "/auth/token",
            body={"username": username, "password": self.passwords[username]},
        )
        assert status == 201, f"login of {username} failed: {status} {raw[:300]!r}"
        return str(json.loads(raw)["access_token"])

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*_airflow_cmd(), *args], env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )
    if check and done.returncode != 0:
        pytest.fail(
            f"airflow {' '.join(args[:2])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return done


@pytest.fixture(scope="module")
def fab_api_server(redis_url: str) -> Iterator[FabServer]:
    _require_fab()
    home = Path(tempfile.mkdtemp(prefix="keyset-ui-fab-"))
    (home / "dags").mkdir()
    prefix = f"kstfab{secrets.token_hex(4)}"
    passwords = {u: secrets.token_urlsafe(12) for u in ("reader", "viewer", "editor")}
    port = _free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "KEYSET_AIRFLOW", "KEYSET_EXAMPLE"))
    }
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
            "AIRFLOW__CORE__AUTH_MANAGER": FAB_AUTH_MANAGER,
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW__KEYSET__REDIS_CONN_ID": "keyset_ui_redis",
            "AIRFLOW__KEYSET__KEY_PREFIX": prefix,
            "AIRFLOW_CONN_KEYSET_UI_REDIS": _redis_conn(redis_url),
            # this checkout's provider first, as conftest.server_pythonpath does
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        }
    )
    log = home / "api-server.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        _cli(env, "db", "migrate")  # with FabAuthManager configured this creates FAB's tables too
        _cli(env, "roles", "create", ROLE)
        refused = _cli(
            env, "roles", "add-perms", ROLE, "-r", RESOURCE_NAME, "-a", "can_read", check=False
        )
        assert refused.returncode != 0, refused.stdout
        assert f"Resource named '{RESOURCE_NAME}' does not exist" in refused.stdout + refused.stderr
        created = subprocess.run(
            [sys.executable, "-c", CREATE_PERMISSION],
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        assert created.returncode == 0, created.stderr[-2000:]
        _cli(env, "roles", "add-perms", ROLE, "-r", RESOURCE_NAME, "-a", "can_read")
        # The Airflow UI learns of plugin pages from /api/v2/plugins, which needs this (Viewer
        # and every role above it have it): without it the page's route is a 404 in the UI.
        _cli(env, "roles", "add-perms", ROLE, "-r", PLUGINS_RESOURCE, "-a", "can_read")
        for user, role in (("reader", ROLE), ("viewer", "Viewer"), ("editor", "User")):
            _cli(
                env,
                # "--password=": a token_urlsafe password may start with "-" (1 in 64), which
                # argparse would read as an option and refuse the command
                *("users", "create", "--username", user, f"--password={passwords[user]}"),
                *("--role", role, "--firstname", user, "--lastname", "test"),
                *("--email", f"{user}@example.org"),
            )
        _cli(env, "users", "add-role", "--username", "editor", "--role", ROLE)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    *_airflow_cmd(),
                    *("api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        server = FabServer(f"http://127.0.0.1:{port}", prefix, passwords, log)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"airflow api-server exited with {proc.returncode}:\n{server.log_tail()}"
                )
            try:
                if server.http("GET", "/api/v2/monitor/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"api-server not up within {SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}"
                )
            time.sleep(0.3)
        yield server
    finally:
        if proc is not None:
            _stop(proc)
        _services.delete_prefix(redis_url, prefix)
        shutil.rmtree(home, ignore_errors=True)


def _stream(sqlite_url: str, redis_url: str, prefix: str) -> KeysetTraversal:
    engine = sa.create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE fab_events (seq INTEGER PRIMARY KEY, payload TEXT)")
        conn.exec_driver_sql("INSERT INTO fab_events VALUES (1, 'a'), (2, 'b')")
    engine.dispose()
    t = KeysetTraversal(
        sqlite_url, "fab_events", "seq", redis_url=redis_url, stream=STREAM, key_prefix=prefix
    )
    t.plan(max_ranges=1, new_stream=True)
    return t


def test_fab_role_needs_can_read_on_the_keyset_view(
    fab_api_server: FabServer, sqlite_url: str, redis_url: str
) -> None:
    srv = fab_api_server
    t = _stream(sqlite_url, redis_url, srv.key_prefix)
    reader, viewer, editor = (srv.token(u) for u in ("reader", "viewer", "editor"))
    base = f"/keyset/api/streams/{STREAM}"

    # No credential: 401.
    assert srv.http("GET", "/keyset/api/streams")[0] == 401
    assert srv.http("GET", "/keyset/")[0] == 401

    # can_read on Keyset: the listing, the stream and the page; but no pause (no DAG edit).
    status, body = srv.http("GET", "/keyset/api/streams", token=reader)
    assert status == 200, body
    assert STREAM in json.dumps(json.loads(body)["streams"])
    status, body = srv.http("GET", base, token=reader)
    assert status == 200, body
    assert json.loads(body)["can_edit"] is False
    status, body = srv.http("GET", "/keyset/", token=reader)
    assert status == 200 and b"<html" in body.lower(), body[:300]
    assert srv.http("POST", f"{base}/pause", token=reader, body={"reason": "x"})[0] == 403
    assert t.control.control_state().paused is False

    # FAB's Viewer has no can_read on Keyset: 403 on everything, the page included.
    for path in ("/keyset/api/streams", base, "/keyset/"):
        status, body = srv.http("GET", path, token=viewer)
        assert status == 403, (path, status, body[:300])

    # User (edits DAGs) + KeysetReader: sees can_edit and may pause and resume.
    status, body = srv.http("GET", base, token=editor)
    assert status == 200 and json.loads(body)["can_edit"] is True, body
    status, body = srv.http("POST", f"{base}/pause", token=editor, body={"reason": "deploy"})
    assert status == 200, body
    state = t.control.control_state()
    assert state.paused and state.reason == "deploy" and state.paused_by == "ui:editor"
    assert srv.http("POST", f"{base}/resume", token=editor, body={})[0] == 200
    assert t.control.control_state().paused is False


def test_fab_reader_page_renders_in_headless_chromium(
    fab_api_server: FabServer, chromium: Any
) -> None:
    """The reader (``can_read`` on ``Keyset`` only) gets the page in the Airflow UI, its data
    loaded: no error box, the key prefix the server reads named."""
    srv = fab_api_server
    open_in_airflow(chromium, srv.base_url, "plugin/keyset?refresh=0", srv.token("reader"))
    shown = chromium.evaluate(
        "({text: document.querySelector('#keyset-app').innerText,"
        " error: !!document.querySelector('#keyset-app #error')})"
    )
    assert not shown["error"] and "not authorized" not in shown["text"].lower(), shown
    assert f"key prefix {srv.key_prefix}" in shown["text"], shown


def test_docs_show_the_steps_this_module_runs() -> None:
    """docs/howto-monitoring.md shows the permission snippet and the grant this module runs."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "howto-monitoring.md").read_text()
    assert CREATE_PERMISSION.strip() in doc
    assert f"airflow roles add-perms {ROLE} -r {RESOURCE_NAME} -a can_read" in doc
    assert f"airflow roles create {ROLE}" in doc
    assert f"airflow roles add-perms {ROLE} -r {PLUGINS_RESOURCE} -a can_read" in doc
