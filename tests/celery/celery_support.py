"""A real Airflow 3.3 deployment with the CeleryExecutor and two Celery workers.

Built on ``tests/deployment_support.py`` (shared with ``tests/scheduler``): the same API server,
scheduler, DAG processor and triggerer, each in a session of its own, on a throwaway
``AIRFLOW_HOME`` and PostgreSQL metadata database, driven over REST and stopped by process group.
On top of that:

- ``[core] executor`` ``CeleryExecutor``; the broker is the test Redis with the kombu transport
  option ``global_keyprefix`` = ``<key_prefix>:celery:`` (every broker key and pub/sub channel of
  the test lives under the test's own prefix, which the ``key_prefix`` fixture deletes); the result
  backend is ``db+postgresql+psycopg2://`` on the throwaway metadata database.
- ``start_workers`` starts ``airflow celery worker -H <name>@keyset-celery -c <n>`` in a session
  (and process group) of its own, ``n`` being ``[celery] worker_concurrency`` (1 unless the test
  sets it), with ``[core] hostname_callable`` = ``worker_host.hostname`` so the
  task instances it runs show its own ``hostname`` (``<name>.keyset-celery``), as on separate
  machines. Logs are not served (``-s``): the whole deployment shares one ``AIRFLOW_HOME``.
- ``kill_machine`` kills a worker the way a machine failure does, and reports what a SIGKILL of
  the worker's process group alone left running and what it did meanwhile.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deployment_support as ds
import psutil
import pytest
from sqlalchemy.engine import make_url

HERE = Path(__file__).resolve().parent
DAGS_DIR = HERE / "dags"
WORKER_READY_TIMEOUT_S = 90
FIGURES: list[str] = []  # lines printed in the terminal summary (the measured figures)


def worker_host(name: str) -> str:
    """The ``hostname`` task instances run by worker ``name`` report."""
    return f"{name}.keyset-celery"


def celery_env(broker_url: str, broker_prefix: str, metadata_url: str) -> dict[str, str]:
    """Settings that turn the shared deployment into a CeleryExecutor deployment."""
    backend = make_url(metadata_url).set(drivername="postgresql+psycopg2")
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + backend.render_as_string(hide_password=False),
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
        "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__GLOBAL_KEYPREFIX": broker_prefix,
    }


# --------------------------------------------------------------------------- workers


def start_workers(
    dep: ds.AirflowDeployment, names: list[str]
) -> dict[str, subprocess.Popen[bytes]]:
    """Start one Celery worker (concurrency ``[celery] worker_concurrency`` of the deployment's
    environment) per name, all at once, and wait until each is ready to consume the queue (its
    log says ``<name>@keyset-celery ready.``)."""
    concurrency = dep.env.get("AIRFLOW__CELERY__WORKER_CONCURRENCY", "1")
    procs = {}
    for name in names:
        env = dict(dep.env)
        env.update(
            {
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "worker_host.hostname",
                "KEYSET_CELERY_WORKER_HOST": worker_host(name),
                "PYTHONPATH": os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(HERE)) if p),
            }
        )
        cmd = [
            *ds.AIRFLOW_CMD,
            "celery",
            "worker",
            "-H",
            f"{name}@keyset-celery",
            "-c",
            concurrency,
            "-s",
            "--pid",
            str(dep.home / f"worker-{name}.pid"),
            "--without-gossip",
            "--without-mingle",
        ]
        procs[name] = ds.spawn(cmd, env, dep.home / f"worker-{name}.out", dep.home)
        # stopped (and its session swept) with the deployment
        dep.procs[f"worker-{name}"] = procs[name]
    waiting = set(names)
    end = time.monotonic() + WORKER_READY_TIMEOUT_S
    while waiting and time.monotonic() < end:
        for name in sorted(waiting):
            out_path = dep.home / f"worker-{name}.out"
            if procs[name].poll() is not None:
                pytest.fail(
                    f"celery worker {name} exited {procs[name].returncode}\n{ds.tail(out_path, 4000)}"
                )
            if f"{name}@keyset-celery ready." in out_path.read_text(errors="replace"):
                waiting.discard(name)
        time.sleep(0.5)
    if waiting:
        pytest.fail(
            f"celery workers {sorted(waiting)} not ready after {WORKER_READY_TIMEOUT_S} s\n"
            + "\n".join(ds.tail(dep.home / f"worker-{n}.out", 4000) for n in sorted(waiting))
        )
    return procs


@dataclass
class MachineKill:
    """What ``kill_machine`` did: the worker's process group, the processes outside it, timing."""

    worker: str
    group: list[int] = field(default_factory=list)  # pids in the worker's process group
    names: dict[int, str] = field(default_factory=dict)  # pid -> process title, for the report
    outside_group: dict[int, int] = field(default_factory=dict)  # descendant pid -> its own pgid
    survived_group_kill: list[int] = field(default_factory=list)  # alive after the group SIGKILL
    killed_at: float = 0.0  # time.time() of the group SIGKILL
    observed: Any = None  # what ``between`` returned


def kill_machine(
    proc: subprocess.Popen[bytes],
    worker: str,
    task_pid: int,
    between: Callable[[list[int]], Any] | None = None,
) -> MachineKill:
    """SIGKILL worker ``proc``'s whole process group, then every descendant that survived it.

    A machine failure takes every process of the worker with it. SIGKILL of the worker's process
    group alone does not: Airflow 3.3's supervisor puts each task process in a process group of
    its own (``setpgid``), so it keeps running, orphaned, after its supervisor is gone. The report
    says which processes were outside the group and which survived the group kill; ``between``
    (called with the survivors' pids after the group kill, before they are killed) may observe
    what they do meanwhile. ``task_pid`` (the task process) must be one of the worker's descendants.
    """
    root = psutil.Process(proc.pid)
    pgid = os.getpgid(proc.pid)
    tree = [root, *root.children(recursive=True)]
    assert task_pid in {p.pid for p in tree}, (
        f"task process {task_pid} is not a descendant of worker {worker}"
    )
    report = MachineKill(worker)
    for p in tree:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            p_pgid = os.getpgid(p.pid)
            report.names[p.pid] = " ".join(p.cmdline())[:60] or p.name()
            if p_pgid == pgid:
                report.group.append(p.pid)
            else:
                report.outside_group[p.pid] = p_pgid
    os.killpg(pgid, signal.SIGKILL)
    report.killed_at = time.time()
    psutil.wait_procs([p for p in tree if p.pid in report.group], timeout=10)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    report.survived_group_kill = [p.pid for p in tree if p.pid not in report.group and ds.alive(p)]
    if between is not None:
        report.observed = between(report.survived_group_kill)
    for p in tree:  # the machine is gone: so is everything it ran
        with contextlib.suppress(psutil.Error):
            if ds.alive(p):
                p.kill()
    psutil.wait_procs(tree, timeout=10)
    return report


def unacked_messages(client: Any, broker_prefix: str) -> list[str]:
    """The broker's unacknowledged messages, each as ``task_id[map_index] try N`` of the Airflow
    task instance its workload names (Celery protocol 2 on kombu's Redis transport)."""
    out = []
    for raw in client.hvals(f"{broker_prefix}unacked"):
        message = json.loads(raw)[0]
        body = json.loads(base64.b64decode(message["body"]))
        ti = json.loads(body[0][0])["ti"]
        out.append(f"{ti['task_id']}[{ti['map_index']}] try {ti['try_number']}")
    return sorted(out)


_EXECUTING = re.compile(
    r"\[([0-9a-f-]{36})\] Executing workload in Celery: .*?task_id='([^']+)'.*?"
    r"try_number=(\d+).*?map_index=(-?\d+)"
)
_IGNORED = re.compile(
    r"\[([0-9a-f-]{36})\] Task already running elsewhere, ignoring redelivered message"
)


@dataclass
class Delivery:
    """One Celery delivery of an Airflow workload to a worker, from the worker's log."""

    worker: str
    celery_id: str
    task: str  # ``task_id[map_index] try N``
    ignored: (
        bool  # the worker logged "Task already running elsewhere, ignoring redelivered message"
    )


def deliveries(dep: ds.AirflowDeployment, workers: list[str]) -> list[Delivery]:
    """Every workload each worker started executing, in log order, and whether it ignored it."""
    out = []
    for name in workers:
        text = (dep.home / f"worker-{name}.out").read_text(errors="replace")
        ignored = set(_IGNORED.findall(text))
        for celery_id, task_id, try_number, map_index in _EXECUTING.findall(text):
            out.append(
                Delivery(
                    name,
                    celery_id,
                    f"{task_id}[{map_index}] try {try_number}",
                    celery_id in ignored,
                )
            )
    return out


def diagnostics(dep: ds.AirflowDeployment, dag_id: str, chars: int = 4000) -> str:
    """The scheduler harness's diagnostics plus the tail of each worker's output."""
    parts = [dep.diagnostics(dag_id, chars)]
    for path in sorted(dep.home.glob("worker-*.out")):
        parts.append(f"----- {path.stem} (last {chars} chars)\n{ds.tail(path, chars)}")
    return "\n".join(parts)
