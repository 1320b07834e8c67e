"""Throwaway ``redis-server`` processes for tests that must change a server's configuration
(eviction policy, renamed commands) or need a Redis Cluster: never the shared server.

Each server runs on a free 127.0.0.1 port, keeps nothing on disk, and is stopped by its PID.
Without a ``redis-server`` binary the caller skips (printing why), unless
``KEYSET_REQUIRE_SERVICES`` is set: then it fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import _services
import pytest
import redis

START_TIMEOUT_S = 20


def redis_server_binary() -> str:
    """The ``redis-server`` path; skips (or fails under KEYSET_REQUIRE_SERVICES) without one."""
    path = shutil.which("redis-server")
    if path is None:
        reason = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get(_services.ENV_REQUIRE, "").strip().lower() in {"1", "true", "yes", "on"}:
            pytest.fail(f"{reason}, and {_services.ENV_REQUIRE} is set")
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return path


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _start_one(args: Sequence[str], workdir: Path) -> tuple[int, subprocess.Popen[bytes]]:
    binary = redis_server_binary()
    for _ in range(5):
        port = _services._free_port()
        log = workdir / f"redis-{port}.log"
        cmd = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(workdir),
            "--logfile",
            str(log),
            *args,
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                redis.Redis(port=port, socket_connect_timeout=1).ping()
                return port, proc
            except redis.ConnectionError:
                time.sleep(0.05)
            except redis.ResponseError:  # e.g. loading; it answers
                return port, proc
        _stop(proc)
    raise RuntimeError(f"redis-server {' '.join(args)} did not start: {_services._tail(log)}")


def start_redis(*args: str) -> tuple[str, Callable[[], None]]:
    """A standalone throwaway server with extra ``redis-server`` arguments; returns (url, stop)."""
    workdir = Path(tempfile.mkdtemp(prefix="keyset-redis-"))
    port, proc = _start_one(args, workdir)

    def stop() -> None:
        _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)

    return f"redis://127.0.0.1:{port}/0", stop


def start_cluster(masters: int = 3) -> tuple[list[int], Callable[[], None]]:
    """A real Redis Cluster of ``masters`` primaries (no replicas), state ok; returns
    (ports, stop)."""
    workdir = Path(tempfile.mkdtemp(prefix="keyset-cluster-"))
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []

    def stop() -> None:
        for p in procs:
            _stop(p)
        shutil.rmtree(workdir, ignore_errors=True)

    try:
        for _ in range(masters):
            port = _services._free_port()
            p_port, proc = _start_one(
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(workdir / f"nodes-{port}.conf"),
                ],
                workdir,
            )
            procs.append(proc)
            ports.append(p_port)
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (it creates the cluster)")
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = [redis.Redis(port=p).cluster("info").get("cluster_state") for p in ports]
            if all(s == "ok" for s in states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not reach cluster_state:ok: {states}")
            time.sleep(0.1)
    except BaseException:
        stop()
        raise
    return ports, stop
