"""Starting benchmark children and reading the machine's CPU accounting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.context import BenchContext

ROOT = Path(__file__).resolve().parent.parent
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def child_args(ctx: BenchContext, **extra: Any) -> dict[str, Any]:
    return {
        "pg_url": ctx.pg_url,
        "redis_url": ctx.redis_url,
        "prefix": ctx.prefix,
        "chunk_size": ctx.chunk_size,
        **extra,
    }


def spawn(command: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.child", command, json.dumps(args, default=str)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def run_child(command: str, args: dict[str, Any]) -> dict[str, Any]:
    return result(spawn(command, args))


def server_cpu_seconds(names: tuple[str, ...] = ("postgres", "redis-server")) -> float:
    """CPU seconds used so far by every process of these names (PostgreSQL backends, Redis).

    Includes the CPU of exited children each process has reaped (``cutime``/``cstime``), so a
    backend whose connection closed still counts, via the postmaster. Machine-wide: other
    users' queries count too, so read it as an indication."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if comm.startswith(names):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / _CLK_TCK


def cpus() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def wait_ready(children: list[subprocess.Popen[str]]) -> None:
    """Wait until every child has said "ready" (imported, connected, reflected the table)."""
    for child in children:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("benchmark child did not get ready")


def release(children: list[subprocess.Popen[str]]) -> None:
    """Let every waiting child go at once."""
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()


def start_together(children: list[subprocess.Popen[str]]) -> None:
    """Wait until every child is ready, then let them all go."""
    wait_ready(children)
    release(children)
