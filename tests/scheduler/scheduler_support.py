"""A real Airflow 3.3 deployment for the scheduler test (used by the fixture ``airflow_deployment``).

Four processes, each started as ``airflow <component>`` in a session of its own: the scheduler
(LocalExecutor, ``parallelism`` 2), the DAG processor, the triggerer and the API server (which
also serves the Execution API the task processes talk to). Nothing is imported from Airflow in
the pytest process: the deployment is driven over its REST API, as an operator would.

- ``AIRFLOW_HOME`` is the test's ``tmp_path``; the metadata database is a throwaway PostgreSQL
  database ``airflow_<hex>`` on the test server, created and migrated for the test and dropped
  (``WITH (FORCE)``) afterwards (``KEYSET_SCHEDULER_METADATA=sqlite``: a SQLite file in the home
  instead). The DAGs folder is ``tests/scheduler/dags``.
- Every port is picked free on 127.0.0.1 (API server, the log servers of worker and triggerer),
  so runs on a shared machine do not collide; authentication is off
  (``simple_auth_manager_all_admins``), the API listens on loopback only.
- Task heartbeats are shortened so a worker that dies without a word is found in seconds:
  ``[workers] min_heartbeat_interval`` 2 s, ``[scheduler] task_instance_heartbeat_timeout`` 15 s,
  checked every 2 s (``task_instance_heartbeat_timeout_detection_interval``).
- Teardown stops every process the fixture started, even when the test failed: SIGTERM to each
  component's process group, then SIGKILL to whatever is left in the components' sessions (task
  processes run in process groups of their own, but never leave their session).

The environment of the components is the test process's minus every ``AIRFLOW_*`` and
``KEYSET_*`` variable (another conftest may have pointed them at its own throwaway home), plus the
settings above and ``extra_env`` passed by the test (connections, the DAG's settings).
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

HERE = Path(__file__).resolve().parent
DAGS_DIR = HERE / "dags"
_AIRFLOW_BIN = Path(sys.executable).with_name("airflow")
AIRFLOW_CMD = [str(_AIRFLOW_BIN)] if _AIRFLOW_BIN.exists() else [sys.executable, "-m", "airflow"]
COMPONENTS = ("scheduler", "dag-processor", "triggerer", "api-server")

ENV_METADATA = "KEYSET_SCHEDULER_METADATA"  # "postgres" (default) or "sqlite"
HEARTBEAT_TIMEOUT_S = 15
READY_TIMEOUT_S = 150
MIGRATE_TIMEOUT_S = 180
STOP_GRACE_S = 15

FIGURES: list[str] = []  # lines printed in the terminal summary (the measured figures)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (all held open until all are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)
        ]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _tail(path: Path, chars: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path}: {exc})"
    return text if len(text) <= chars else "..." + text[-chars:]


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
                f"----- {name} (last {chars} chars)\n{_tail(self.home / f'{name}.out', chars)}"
            )
        pattern = f"dag_id={dag_id}/**/*.log*" if dag_id else "dag_id=*/**/*.log*"
        for path in sorted((self.home / "logs").glob(pattern)):
            parts.append(
                f"----- task log {path.relative_to(self.home / 'logs')}\n{_tail(path, chars)}"
            )
        return "\n".join(parts)


def _component_env(
    home: Path, db_url: str, ports: list[int], extra_env: Mapping[str, str]
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
            "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS_DIR),
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
        time.sleep(1)
    pytest.fail(
        f"Airflow deployment not ready after {READY_TIMEOUT_S} s ({last})\n{dep.diagnostics()}"
    )


def start_deployment(
    home: Path,
    db_url: str,
    extra_env: Mapping[str, str],
    dag_id: str,
    started: list[AirflowDeployment],
) -> AirflowDeployment:
    """Migrate ``db_url`` (an empty database), start the components in ``home`` and wait until
    ``dag_id`` is ready. The deployment is appended to ``started`` before any process starts,
    so the caller can stop it even when this fails."""
    home.mkdir()
    ports = _free_ports(3)
    env = _component_env(home, db_url, ports, extra_env)
    dep = AirflowDeployment(home=home, api_url=f"http://127.0.0.1:{ports[0]}", env=env)
    started.append(dep)
    migrate = subprocess.run(
        [*AIRFLOW_CMD, "db", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=MIGRATE_TIMEOUT_S,
        check=False,
    )
    if migrate.returncode != 0:
        pytest.fail(
            f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}"
        )
    for name in COMPONENTS:
        with (home / f"{name}.out").open("wb") as out:
            dep.procs[name] = subprocess.Popen(
                [*AIRFLOW_CMD, name],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=home,
            )
    _wait_ready(dep, dag_id)
    return dep
