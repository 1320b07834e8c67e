"""UI test harness: a real Airflow API server on loopback and a real headless Chromium.

``airflow_api_server`` (module scope) starts ``airflow api-server`` in a subprocess with a throwaway
``AIRFLOW_HOME`` (migrated SQLite metadata DB), SimpleAuthManager with one ``viewer`` user whose
password the fixture writes into the passwords file, the Redis connection ``keyset_ui_redis``
(an ``AIRFLOW_CONN_*`` variable pointing at the test Redis) and ``[keyset]`` configured to read it
under a key prefix of its own. Nothing of the test process's Airflow environment leaks in.

``chromium`` (function scope) is Debian's ``chromium`` in headless mode, driven over the DevTools
protocol on ``--remote-debugging-pipe`` (fd 3 in, fd 4 out, NUL-terminated JSON): the standard
library is enough, no websocket client or browser driver is needed. It lets the test set the same
``_token`` cookie Airflow's login page sets, wait until the page says it has rendered, read the
DOM and take a screenshot.

Install Chromium with ``scripts/install-chromium.sh``; without it these tests fail (never skip).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import select
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
from sqlalchemy.engine import make_url

SERVER_START_TIMEOUT_S = 90
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio", "--force-device-scale-factor=1",
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

    def http(self, method: str, path: str, *, headers: dict[str, str] | None = None,
             body: Any = None) -> tuple[int, dict[str, str], bytes]:
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

    def token(self) -> str:
        """A JWT from the server's own login endpoint (``POST /auth/token``)."""
        status, _, raw = self.http("POST", "/auth/token",
                                   body={"username": self.username, "password": self.password})
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


def _redis_conn(redis_url: str) -> str:
    url = make_url(redis_url)
    return json.dumps({"conn_type": "redis", "host": url.host, "port": url.port,
                       "extra": {"db": int(url.database or 0)}})




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


@pytest.fixture(scope="module")
def ui_key_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix for this module (the server is told to read it); wiped afterwards."""
    prefix = f"kstui{uuid.uuid4().hex[:8]}"
    yield prefix
    _services.delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def airflow_api_server(redis_url: str, ui_key_prefix: str) -> Iterator[ApiServer]:
    home = Path(tempfile.mkdtemp(prefix="keyset-ui-airflow-"))
    password = secrets.token_urlsafe(12)
    (home / "passwords.json").write_text(json.dumps({"viewer": password}))
    (home / "dags").mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "KEYSET_AIRFLOW", "KEYSET_EXAMPLE"))}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "viewer:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__KEYSET__REDIS_CONN_ID": "keyset_ui_redis",
        "AIRFLOW__KEYSET__KEY_PREFIX": ui_key_prefix,
        "AIRFLOW_CONN_KEYSET_UI_REDIS": _redis_conn(redis_url),
    })
    log = home / "api-server.log"
    migrate = subprocess.run([*_airflow_cmd(), "db", "migrate"], env=env, capture_output=True,
                             text=True, timeout=300)
    if migrate.returncode != 0:
        pytest.fail(f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_airflow_cmd(), "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = ApiServer(f"http://127.0.0.1:{port}", "viewer", password, ui_key_prefix, "keyset_ui_redis", home, log)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"airflow api-server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if server.http("GET", "/api/v2/monitor/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"airflow api-server did not answer on {server.base_url} within "
                            f"{SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(0.3)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(home, ignore_errors=True)


# --------------------------------------------------------------------------- Chromium over CDP


class CdpError(RuntimeError):
    pass


class Chromium:
    """Headless Chromium with one page, driven over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, profile: Path, log: Path, width: int = 1280, height: int = 900) -> None:
        cmd_r, self._cmd_w = os.pipe()  # we write commands; the browser reads them on fd 3
        self._out_r, out_w = os.pipe()  # the browser writes replies and events on fd 4
        args = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                "--remote-debugging-pipe", "about:blank"]
        # bash, not sh: dash only redirects single-digit descriptors, and ours may be higher.
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{cmd_r} 4>&{out_w}', "chromium", *args],
                pass_fds=(cmd_r, out_w), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        os.close(cmd_r)
        os.close(out_w)
        self.log = log
        self._buf = b""
        self._next_id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def call(self, method: str, params: dict[str, Any] | None = None, *, session: bool = False,
             timeout: float = 30) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == msg["id"]:
                    if "error" in reply:
                        raise CdpError(f"{method}: {reply['error']}")
                    return dict(reply.get("result", {}))
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise CdpError(f"{method}: no reply (browser exit code {self.proc.poll()}); log:\n"
                               + self.log.read_text(errors="replace")[-2000:])
            ready, _, _ = select.select([self._out_r], [], [], left)
            if ready:
                chunk = os.read(self._out_r, 1 << 20)
                if not chunk:
                    raise CdpError(f"{method}: the browser closed the pipe; log:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
                self._buf += chunk

    def set_cookie(self, url: str, name: str, value: str) -> None:
        ok = self.call("Network.setCookie", {"url": url, "name": name, "value": value, "path": "/",
                                             "sameSite": "Lax"}, session=True)
        assert ok.get("success", True), ok

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True}, session=True)
        if "exceptionDetails" in res:
            raise CdpError(f"evaluate {expression!r}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def open(self, url: str, ready: str, timeout: float = 45) -> None:
        """Navigate and wait until the JS expression ``ready`` is true."""
        nav = self.call("Page.navigate", {"url": url}, session=True)
        if nav.get("errorText"):
            raise CdpError(f"navigate {url}: {nav['errorText']}")
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"document.readyState === 'complete' && !!({ready})"):
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise CdpError(f"{url}: not ready ({ready}) after {timeout} s; page text: {text!r:.1500}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(CdpError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            _stop(self.proc)
        for fd in (self._cmd_w, self._out_r):
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Chromium]:
    binary = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
    if binary is None:
        pytest.fail("chromium is not installed: run `bash scripts/install-chromium.sh` (Debian package "
                    "`chromium`), then re-run the UI tests")
    browser = Chromium(binary, tmp_path / "chromium-profile", tmp_path / "chromium.log")
    try:
        yield browser
    finally:
        browser.close()
