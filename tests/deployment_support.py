"""A real Airflow 3.3 deployment for the tests in ``tests/scheduler`` and ``tests/celery``.

One module for what both need, so the two harnesses cannot drift apart:

- ``start_deployment``: four processes, each started as ``airflow <component>`` in a session of
  its own (``spawn``): the scheduler (LocalExecutor, ``parallelism`` 2, unless ``extra_env`` says
  otherwise), the DAG processor, the triggerer and the API server (which also serves the
  Execution API the task processes talk to). Nothing is imported from Airflow in the pytest
  process: the deployment is driven over its REST API, as an operator would.
- ``AIRFLOW_HOME`` is the test's ``tmp_path``; the metadata database is a throwaway PostgreSQL
  database ``airflow_<hex>`` on the test server (``Deployments``), dropped (``WITH (FORCE)``)
  afterwards. With a ``MetadataTemplate`` (one per test session, fixture
  ``airflow_metadata_template``) it is ``CREATE DATABASE ... TEMPLATE`` of a database that
  ``airflow db migrate`` migrated once (a copy of the same bytes, in well under a second);
  without one it is created empty and migrated for the test.
- Every port is picked free on 127.0.0.1 (``free_ports``: API server, the log servers of worker
  and triggerer), so runs on a shared machine do not collide; authentication is off
  (``simple_auth_manager_all_admins``), the API listens on loopback only.
- Task heartbeats are shortened so a worker that dies without a word is found in seconds:
  ``[workers] min_heartbeat_interval`` 2 s, ``[scheduler] task_instance_heartbeat_timeout`` 15 s,
  checked every 2 s (``task_instance_heartbeat_timeout_detection_interval``).
- Teardown (``AirflowDeployment.stop``) stops every process the deployment started (components
  and anything added to ``procs``, e.g. Celery workers), even when the test failed: SIGTERM to
  each one's process group, then SIGKILL to whatever is left in their sessions (task processes
  run in process groups of their own, but never leave their session).

The environment of the components is the test process's minus every ``AIRFLOW_*`` and
``KEYSET_*`` variable (another conftest may have pointed them at its own throwaway home), plus the
settings above and ``extra_env`` passed by the test (connections, the DAG's settings).

Also here: the ``AIRFLOW_CONN_*`` JSON of the test's PostgreSQL schema and Redis, and the REST
reads every scenario makes (task instance paths, XComs, heartbeat-timeout events).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import psutil
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

_AIRFLOW_BIN = Path(sys.executable).with_name("airflow")
AIRFLOW_CMD = [str(_AIRFLOW_BIN)] if _AIRFLOW_BIN.exists() else [sys.executable, "-m", "airflow"]
COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")

HEARTBEAT_TIMEOUT_S = 15
READY_TIMEOUT_S = 150
READY_POLL_S = 0.25  # two loopback requests a poll: cheap, and a ready deployment waits less
MIGRATE_TIMEOUT_S = 180
STOP_GRACE_S = 3  # SIGTERM first, but a throwaway deployment need not exit cleanly: SIGKILL then


# --------------------------------------------------------------------------- processes


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (all held open until all are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)
        ]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def tail(path: Path, chars: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path}: {exc})"
    return text if len(text) <= chars else "..." + text[-chars:]


def spawn(
    cmd: Sequence[str], env: Mapping[str, str], out: Path, cwd: Path
) -> subprocess.Popen[bytes]:
    """``cmd`` in a session (and process group) of its own, stdout and stderr to ``out``."""
    with out.open("wb") as sink:
        return subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
        )


def alive(p: psutil.Process) -> bool:
    """Running and not a zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- the deployment


@dataclass
class AirflowDeployment:
    """A running deployment: REST access, the processes, and diagnostics for failure messages."""

    home: Path
    api_url: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    # ---- REST --------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        """``method`` ``/api/v2<path>`` with a JSON body; returns the decoded JSON answer."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.api_url}/api/v2{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    # ---- processes ---------------------------------------------------------------------------
    def sessions(self) -> set[int]:
        """Session ids of the components (each is its session's leader)."""
        return {p.pid for p in self.procs.values()}

    def owns(self, pid: int) -> bool:
        """True if ``pid`` is a live process of this deployment (in one of its sessions)."""
        try:
            return os.getsid(pid) in self.sessions()
        except ProcessLookupError:
            return False

    def members(self) -> list[psutil.Process]:
        """Every live process of the deployment's sessions (components, workers, task processes)."""
        out = []
        sids = self.sessions()
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(ProcessLookupError, psutil.Error):
                if os.getsid(proc.pid) in sids:
                    out.append(proc)
        return out

    def dead_components(self) -> list[str]:
        return [
            f"{name} (exit {p.returncode})"
            for name, p in self.procs.items()
            if p.poll() is not None
        ]

    def stop(self) -> None:
        """SIGTERM each component's group, wait, then SIGKILL everything left in its sessions."""
        if not self.procs:
            return
        leftovers = self.members()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        end = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))
        for proc in {p.pid: p for p in [*leftovers, *self.members()]}.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()

    # ---- diagnostics -------------------------------------------------------------------------
    def diagnostics(self, dag_id: str | None = None, chars: int = 4000) -> str:
        """Tails of every component's output and of every task (and trigger) log of ``dag_id``."""
        parts = [f"dead components: {self.dead_components() or 'none'}"]
        for name in COMPONENTS:
            parts.append(
                f"----- {name} (last {chars} chars)\n{tail(self.home / f'{name}.out', chars)}"
            )
        pattern = f"dag_id={dag_id}/**/*.log*" if dag_id else "dag_id=*/**/*.log*"
        for path in sorted((self.home / "logs").glob(pattern)):
            parts.append(
                f"----- task log {path.relative_to(self.home / 'logs')}\n{tail(path, chars)}"
            )
        return "\n".join(parts)


def component_env(
    home: Path, db_url: str, ports: list[int], dags_dir: Path, extra_env: Mapping[str, str]
) -> dict[str, str]:
    api_port, worker_log_port, trigger_log_port = ports
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW_", "AIRFLOW__", "KEYSET_"))
    }
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "2",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_dir),
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(api_port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(64),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(worker_log_port),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(trigger_log_port),
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            # a worker that dies silently is detected within ~HEARTBEAT_TIMEOUT_S
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        }
    )
    env.update(extra_env)
    return env


def _wait_ready(dep: AirflowDeployment, dag_id: str) -> None:
    """Until the API answers, scheduler/triggerer/DAG processor are healthy and ``dag_id`` is
    parsed and unpaused; fails (with the components' output) after READY_TIMEOUT_S."""
    end = time.monotonic() + READY_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < end:
        if dep.dead_components():
            break
        try:
            health = dep.get("/monitor/health")
            unhealthy = [
                k
                for k in ("metadatabase", "scheduler", "triggerer", "dag_processor")
                if (health.get(k) or {}).get("status") != "healthy"
            ]
            if unhealthy:
                last = f"not healthy yet: {unhealthy}"
            else:
                dag = dep.get(f"/dags/{dag_id}")
                if not dag.get("is_paused") and not dag.get("is_stale"):
                    return
                last = f"dag {dag_id}: paused={dag.get('is_paused')} stale={dag.get('is_stale')}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code} {exc.reason}"
            if exc.code == 404:
                with contextlib.suppress(Exception):
                    errors = dep.get("/importErrors").get("import_errors")
                    last += f"; import errors: {errors}"
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(READY_POLL_S)
    pytest.fail(
        f"Airflow deployment not ready after {READY_TIMEOUT_S} s ({last})\n{dep.diagnostics()}"
    )


def migrate_db(env: Mapping[str, str]) -> None:
    """``airflow db migrate`` of the database in ``env``; fails the test with its output."""
    migrate = subprocess.run(
        [*AIRFLOW_CMD, "db", "migrate"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT_S,
        check=False,
    )
    if migrate.returncode != 0:
        pytest.fail(
            f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}"
        )


def start_deployment(
    home: Path,
    db_url: str,
    dags_dir: Path,
    extra_env: Mapping[str, str],
    dag_id: str,
    started: list[AirflowDeployment],
    migrate: bool = True,
) -> AirflowDeployment:
    """Migrate ``db_url`` (an empty database; ``migrate=False``: it is migrated already), start
    the components in ``home`` and wait until ``dag_id`` is ready. The deployment is appended to
    ``started`` before any process starts, so the caller can stop it even when this fails."""
    home.mkdir()
    ports = free_ports(3)
    env = component_env(home, db_url, ports, dags_dir, extra_env)
    dep = AirflowDeployment(home=home, api_url=f"http://127.0.0.1:{ports[0]}", env=env)
    started.append(dep)
    if migrate:
        migrate_db(env)
    for name in COMPONENTS:
        dep.procs[name] = spawn([*AIRFLOW_CMD, name], env, home / f"{name}.out", home)
    _wait_ready(dep, dag_id)
    return dep


def _admin_engine(pg_url: str) -> sa.Engine:
    return sa.create_engine(pg_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")


def _db_url(pg_url: str, name: str) -> str:
    return make_url(pg_url).set(database=name).render_as_string(hide_password=False)


def _drop_database(admin: sa.Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.exec_driver_sql("SET lock_timeout = '30s'")
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class MetadataTemplate:
    """A metadata database migrated once (``airflow_tpl_<hex>``, on first use) for every
    deployment of a test session to copy (``CREATE DATABASE ... TEMPLATE``): each deployment
    still gets a database of its own, exactly as ``airflow db migrate`` leaves a fresh one,
    without paying for a migration (an Airflow process start and ~70 tables) each time.
    Nothing connects to it after the migration (PostgreSQL copies a template only then);
    ``drop`` removes it at the end of the session."""

    def __init__(self, pg_url: str, home: Path) -> None:
        self.pg_url = pg_url
        self.home = home
        self.name = f"airflow_tpl_{secrets.token_hex(4)}"
        self._admin = _admin_engine(pg_url)
        self._state = "absent"  # -> "migrated", or "failed" (reported again to each user)

    def database(self) -> str:
        """The template's name, created and migrated on the first call."""
        if self._state == "failed":
            pytest.fail(f"the migration of the metadata template {self.name} failed earlier")
        if self._state == "absent":
            self._state = "failed"
            with self._admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{self.name}"')
            url = _db_url(self.pg_url, self.name)
            migrate_db(component_env(self.home, url, free_ports(3), self.home, {}))
            self._state = "migrated"
        return self.name

    def drop(self) -> None:
        try:
            if self._state != "absent":
                _drop_database(self._admin, self.name)
        finally:
            self._admin.dispose()


class Deployments:
    """The deployments of one test and its throwaway metadata database: ``with Deployments(pg_url,
    template) as d``; ``d.database_url()`` creates ``airflow_<hex>`` (once; a copy of ``template``
    if given, then ``d.migrated`` is true) and returns its URL. On exit every deployment in
    ``d.started`` is stopped, then the database is dropped ``WITH (FORCE)``."""

    def __init__(self, pg_url: str, template: MetadataTemplate | None = None) -> None:
        self.pg_url = pg_url
        self.template = template
        self.name = f"airflow_{secrets.token_hex(4)}"
        self.started: list[AirflowDeployment] = []
        self._admin = _admin_engine(pg_url)
        self._created = False
        self.migrated = False

    def database_url(self) -> str:
        if not self._created:
            source = f' TEMPLATE "{self.template.database()}"' if self.template else ""
            with self._admin.connect() as conn:
                conn.exec_driver_sql(f'CREATE DATABASE "{self.name}"{source}')
            self._created = True
            self.migrated = self.template is not None
        return _db_url(self.pg_url, self.name)

    def __enter__(self) -> Deployments:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for dep in self.started:
                dep.stop()
            if self._created:
                _drop_database(self._admin, self.name)
        finally:
            self._admin.dispose()


def write_figures(terminalreporter: Any, title: str, lines: list[str]) -> None:
    """The figures a test measured, as a section of pytest's terminal summary."""
    if lines:
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


# --------------------------------------------------------------------------- connections


def postgres_conn(pg_url: str, schema: str) -> str:
    """``AIRFLOW_CONN_*`` JSON for the test database with ``search_path`` = ``schema``."""
    url = make_url(pg_url)
    return json.dumps(
        {
            "conn_type": "postgres",
            "host": url.host,
            "port": url.port,
            "login": url.username,
            "password": url.password,
            "schema": url.database,
            "extra": {"sqlalchemy_query": {"options": f"-csearch_path={schema}"}},
        }
    )


def redis_conn(redis_url: str) -> str:
    """``AIRFLOW_CONN_*`` JSON for the test Redis."""
    parts = urlsplit(redis_url)
    conn: dict[str, Any] = {
        "conn_type": "redis",
        "host": parts.hostname,
        "port": parts.port or 6379,
        "extra": {"db": int(parts.path.lstrip("/") or 0)},
    }
    if parts.password:
        conn["password"] = unquote(parts.password)
    return json.dumps(conn)


# --------------------------------------------------------------------------- REST reads


def ti_path(dag_id: str, run_id: str, task_id: str, map_index: int | None = None) -> str:
    path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"
    return path if map_index is None else f"{path}/{map_index}"


def xcom(
    dep: AirflowDeployment,
    dag_id: str,
    run_id: str,
    task_id: str,
    key: str,
    map_index: int | None = None,
) -> Any:
    query = f"?map_index={map_index}" if map_index is not None else ""
    return dep.get(f"{ti_path(dag_id, run_id, task_id)}/xcomEntries/{key}{query}")["value"]


def get_or_none(dep: AirflowDeployment, path: str) -> Any:
    """``GET path``; None if it answers 404."""
    try:
        return dep.get(path)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def since(iso: str | None, epoch: float) -> float:
    """Seconds from ``epoch`` to the ISO 8601 time ``iso`` (nan if unknown)."""
    if not iso:
        return float("nan")
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() - epoch


def heartbeat_timeouts(
    dep: AirflowDeployment, dag_id: str, run_id: str
) -> dict[tuple[int, int], str]:
    """(map_index, try_number) -> when, of the traverse tries failed for lack of heartbeat."""
    logs = dep.get(f"/eventLogs?dag_id={dag_id}&run_id={run_id}&task_id=traverse&limit=100")[
        "event_logs"
    ]
    return {
        (int(e["map_index"]), int(e["try_number"])): e["when"]
        for e in logs
        if e["event"] == "heartbeat timeout"
    }


def effects_coverage(
    conn: Any, events: str, effects: str, ranges: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Coverage by the processor's own record: ``events`` (the source table, ``seq`` key) vs
    ``effects`` (one row per key processed, with its ``range_id``): keys never processed
    (``lost``, ``lost_sample``), effects of no event (``unknown``), effects outside their
    range's bounds (``outside_range``) and the events per range (``rows_in_range``). ``ranges``:
    the round's final ranges (``range_id``, ``lo``, ``hi``); the table names are the test's own."""
    q = lambda sql, **kw: conn.execute(sa.text(sql), kw).all()  # noqa: E731
    out: dict[str, Any] = {"outside_range": 0, "rows_in_range": {}}
    out["lost"] = q(
        f"SELECT count(*) FROM {events} s WHERE NOT EXISTS "
        f"(SELECT 1 FROM {effects} e WHERE e.seq = s.seq)"
    )[0][0]
    out["lost_sample"] = [
        r[0]
        for r in q(f"SELECT seq FROM {events} EXCEPT SELECT seq FROM {effects} ORDER BY 1 LIMIT 10")
    ]
    out["unknown"] = q(
        f"SELECT count(*) FROM {effects} e WHERE NOT EXISTS "
        f"(SELECT 1 FROM {events} s WHERE s.seq = e.seq)"
    )[0][0]
    for spec in ranges:
        lo = -1 if spec["lo"] is None else int(spec["lo"])
        hi, r = int(spec["hi"]), int(spec["range_id"])
        out["outside_range"] += q(
            f"SELECT count(*) FROM {effects} WHERE range_id = :r AND NOT (seq > :lo AND seq <= :hi)",
            r=r,
            lo=lo,
            hi=hi,
        )[0][0]
        out["rows_in_range"][r] = q(
            f"SELECT count(*) FROM {events} WHERE seq > :lo AND seq <= :hi", lo=lo, hi=hi
        )[0][0]
    return out
