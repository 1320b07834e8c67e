"""UI test harness: a real Airflow API server on loopback and a real headless Chromium.

``airflow_api_server`` is one ``airflow api-server``, started once per session (for every test
module that uses it) in a subprocess with a throwaway ``AIRFLOW_HOME`` (migrated SQLite metadata
DB), SimpleAuthManager with one ``viewer`` user whose password the fixture writes into the
passwords file, the Redis connection ``keyset_ui_redis`` (an ``AIRFLOW_CONN_*`` variable pointing
at the test Redis) and ``[keyset]`` configured to read it under a key prefix of its own. Nothing
of the test process's Airflow environment leaks in. The tests share the server, not their Redis
state: everything under the server's key prefix is deleted after each test, so each one starts
with no stream.

``chromium`` (function scope) is Debian's ``chromium`` in headless mode, driven by selenium through
Debian's ``chromedriver`` (no download: both paths are given). It lets the test set the same
``_token`` cookie Airflow's login page sets, wait until the page says it has rendered, read the
DOM, size the viewport, read the console and take a screenshot.

Install both with ``scripts/install-chromium.sh``. Without them the browser tests are skipped with
that advice, except under ``KEYSET_REQUIRE_SERVICES=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _services
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver import ChromeOptions, ChromeService
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy.engine import make_url

SERVER_START_TIMEOUT_S = 90
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
    "--force-device-scale-factor=1",
]


# --------------------------------------------------------------------------- Airflow API server


@dataclass
class ApiServer:
    base_url: str
    username: str
    password: str
    key_prefix: str
    redis_conn_id: str
    home: Path
    log: Path
    editor_password: str = ""  # user "editor", role "user": may edit DAGs (pause/resume streams)
    #: A second Redis connection (another db of the test Redis, same key prefix): the page's
    #: connection selector must show the streams of both.
    second_conn_id: str = "keyset_ui_redis_b"
    second_redis_url: str = ""

    def http(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, body: Any = None
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; returns ``(status, headers, body)`` for every status (no raising)."""
        data = None
        hdrs = dict(headers or {})
        if body is not None:
            data = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def token(self, username: str | None = None, password: str | None = None) -> str:
        """A JWT from the server's own login endpoint (``POST /auth/token``); the viewer's by
        default."""
        status, _, raw = self.http(
            "POST",
            "/auth/token",
            body={"username": username or self.username, "password": password or self.password},
        )
        assert status == 201, f"login failed: {status} {raw[:300]!r}"
        return str(json.loads(raw)["access_token"])

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _airflow_cmd() -> list[str]:
    airflow_bin = Path(sys.executable).with_name("airflow")
    return [str(airflow_bin)] if airflow_bin.exists() else [sys.executable, "-m", "airflow"]


def second_redis_url(redis_url: str) -> str:
    """The test Redis's next database (the second connection's Redis)."""
    url = make_url(redis_url)
    return url.set(database=str((int(url.database or 0) + 1) % 16)).render_as_string(
        hide_password=False
    )


def _redis_conn(redis_url: str) -> str:
    url = make_url(redis_url)
    return json.dumps(
        {
            "conn_type": "redis",
            "host": url.host,
            "port": url.port,
            "extra": {"db": int(url.database or 0)},
        }
    )


#: The SQLite file (in the server's home) of connection ``keyset_ui_sql``.
SOURCE_DB = "source.db"

#: The checkout under test. The API server's processes import the provider from here first: an
#: editable install of another checkout in the same venv must not serve its plugin instead.
REPO = Path(__file__).resolve().parents[2]


def server_pythonpath(env: dict[str, str]) -> str:
    """``PYTHONPATH`` for an Airflow subprocess: this checkout, then what the caller had."""
    return os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
    """Stop a process this harness started (and its children: it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@pytest.fixture(scope="session")
def ui_key_prefix(redis_url: str) -> Iterator[str]:
    """The Redis key prefix the shared server is told to read; wiped afterwards."""
    prefix = f"kstui{uuid.uuid4().hex[:8]}"
    yield prefix
    _services.delete_prefix(redis_url, prefix)
    _services.delete_prefix(second_redis_url(redis_url), prefix)


@pytest.fixture
def airflow_api_server(ui_api_server: ApiServer, redis_url: str) -> Iterator[ApiServer]:
    """The session's API server for one test; what the test wrote under the server's key prefix
    is deleted afterwards (the next test sees no stream)."""
    yield ui_api_server
    _services.delete_prefix(redis_url, ui_api_server.key_prefix)
    _services.delete_prefix(ui_api_server.second_redis_url, ui_api_server.key_prefix)


@pytest.fixture(scope="session")
def ui_api_server(redis_url: str, ui_key_prefix: str) -> Iterator[ApiServer]:
    """The API server itself (session scope); tests use ``airflow_api_server``."""
    home = Path(tempfile.mkdtemp(prefix="keyset-ui-airflow-"))
    password = secrets.token_urlsafe(12)
    editor_password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(
        json.dumps({"viewer": password, "editor": editor_password})
    )
    (home / "dags").mkdir()
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
            "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "viewer:viewer,editor:user",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "AIRFLOW__KEYSET__REDIS_CONN_ID": "keyset_ui_redis",
            "AIRFLOW__KEYSET__KEY_PREFIX": ui_key_prefix,
            "AIRFLOW_CONN_KEYSET_UI_REDIS": _redis_conn(redis_url),
            "AIRFLOW_CONN_KEYSET_UI_REDIS_B": _redis_conn(second_redis_url(redis_url)),
            "AIRFLOW_CONN_KEYSET_UI_NOT_REDIS": "postgres://u@127.0.0.1:1/x",
            # a SQL database the server's DAGs may read and write (the page's replay runs there)
            "AIRFLOW_CONN_KEYSET_UI_SQL": json.dumps(
                {"conn_type": "sqlite", "host": str(home / SOURCE_DB)}
            ),
            "PYTHONPATH": server_pythonpath(env),
        }
    )
    log = home / "api-server.log"
    migrate = subprocess.run(
        [*_airflow_cmd(), "db", "migrate"], env=env, capture_output=True, text=True, timeout=300
    )
    if migrate.returncode != 0:
        pytest.fail(
            f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}"
        )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *_airflow_cmd(),
                "api-server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = ApiServer(
        f"http://127.0.0.1:{port}",
        "viewer",
        password,
        ui_key_prefix,
        "keyset_ui_redis",
        home,
        log,
        editor_password,
        second_redis_url=second_redis_url(redis_url),
    )
    try:
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
                    f"airflow api-server did not answer on {server.base_url} within "
                    f"{SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}"
                )
            time.sleep(0.3)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(home, ignore_errors=True)


# --------------------------------------------------------------------------- Chromium (selenium)


CHROMIUM_INSTALL_HINT = (
    "run `bash scripts/install-chromium.sh` (Debian packages `chromium` and `chromium-driver`)"
)


def find_browser() -> tuple[str, str] | str:
    """``(chromium, chromedriver)`` paths, or a sentence saying what is missing."""
    found = {
        name: shutil.which(name)
        or next(
            (p for p in (f"/usr/bin/{name}", f"/usr/lib/chromium/{name}") if os.access(p, os.X_OK)),
            None,
        )
        for name in ("chromium", "chromedriver")
    }
    missing = [name for name, path in found.items() if path is None]
    if missing:
        return f"{' and '.join(missing)} not installed: {CHROMIUM_INSTALL_HINT}"
    return str(found["chromium"]), str(found["chromedriver"])


class Browser:
    """Headless Chromium with one page, driven by selenium through Debian's chromedriver."""

    def __init__(
        self,
        binary: str,
        driver_path: str,
        profile: Path,
        log: Path,
        width: int = 1280,
        height: int = 900,
    ) -> None:
        options = ChromeOptions()
        options.binary_location = binary
        for flag in (
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
        ):
            options.add_argument(flag)
        # Console messages of every level, read back with driver.get_log("browser").
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = ChromeService(executable_path=driver_path, log_output=str(log))
        self.log = log
        self.driver = webdriver.Chrome(options=options, service=service)
        self.resize(width, height)

    def resize(self, width: int, height: int) -> None:
        """Make the page's viewport exactly ``width`` x ``height`` CSS pixels."""
        self.driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the top document (a Promise is awaited: WebDriver spec)."""
        return self.driver.execute_script(f"return ({expression});")

    def wait(self, condition: str, timeout: float = 45) -> None:
        """Wait until the JS expression ``condition`` is true (fail with the page's text)."""
        try:
            WebDriverWait(self.driver, timeout, poll_frequency=0.2).until(
                lambda d: d.execute_script(f"return !!({condition});")
            )
        except TimeoutException:
            text = self.evaluate("document.body ? document.body.innerText : ''")
            raise AssertionError(
                f"{self.driver.current_url}: not ({condition}) after {timeout} s; "
                f"page text: {text!r:.1500}"
            ) from None

    def open(self, url: str, ready: str, timeout: float = 45) -> None:
        """Navigate and wait until the document is loaded and the JS expression ``ready`` is true."""
        self.driver.get(url)
        self.wait(f"document.readyState === 'complete' && ({ready})", timeout)

    def set_cookie(self, name: str, value: str) -> None:
        """A cookie for the current page's origin (open a page of that origin first)."""
        self.driver.add_cookie({"name": name, "value": value, "path": "/", "sameSite": "Lax"})

    def console(self) -> list[dict[str, Any]]:
        """Console entries since the last call (chromedriver empties its buffer on read)."""
        return list(self.driver.get_log("browser"))

    def screenshot(self, path: Path) -> Path:
        assert self.driver.save_screenshot(str(path)), f"no screenshot written to {path}"
        return path

    def close(self) -> None:
        with contextlib.suppress(WebDriverException, OSError):
            self.driver.quit()


@pytest.fixture(scope="session")
def browser_paths() -> tuple[str, str]:
    """``(chromium, chromedriver)``. Missing: the test is skipped with the reason, except under
    ``KEYSET_REQUIRE_SERVICES=1`` (CI, whose .ci/run installs them), where it fails. Session
    scope, so the check runs before any module-scoped server is started for nothing."""
    found = find_browser()
    if isinstance(found, str):
        if _services._flag(os.environ, _services.ENV_REQUIRE):
            pytest.fail(f"{found} ({_services.ENV_REQUIRE}=1: the UI tests must run)")
        pytest.skip(found)
    return found


@pytest.fixture
def chromium(browser_paths: tuple[str, str], tmp_path: Path) -> Iterator[Browser]:
    """A fresh headless Chromium with its own profile, closed after the test."""
    binary, driver_path = browser_paths
    browser = Browser(
        binary, driver_path, tmp_path / "chromium-profile", tmp_path / "chromedriver.log"
    )
    try:
        yield browser
    finally:
        browser.close()
