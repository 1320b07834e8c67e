"""Supervisor death (issue #11): a task process whose supervisor died notices within one chunk and
stops (``core/run/supervision.py``, wired in ``TraverseRangeOperator``).

Real processes, as Airflow 3.3 starts them (``supervised_worker.py``): a *supervisor* process forks
the *task process*, which leads a process group of its own and traverses one range under a
``SupervisorWatch``. The test SIGKILLs the supervisor's process group, the way a worker is killed
(``kill -9 -<pgid>``, an OOM kill); the task process is not in that group and survives, orphaned.
The processor logs every call (first/last key, start time) to a file: the independent record.

Checked: the orphan exits by itself; at most one processor call started after the supervisor was
dead; the committed cursor is the last key of the last call (every processed chunk committed,
nothing after it); the lease is released; the ERROR names the dead supervisor; a new traverse
(Airflow's retry) resumes at cursor + 1 and completes the range with no key lost or repeated. A
second test kills the supervisor while the run waits out a long backoff: the wait ends, the
cursor stays.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import sqlalchemy as sa
from core_support import Recorder, traversal

from airflow_keyset_provider.core import KeysetTraversal, Round

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parents[1]
ROWS = 30_000
CHUNK = 10  # chunks of a few ms: many of them fit in one poll of the watch thread (0.2 s)
KILL_AFTER_CHUNKS = 50
WAIT_S = 30.0  # bound on every wait; a hang fails the test instead of blocking the run


def _create_events(engine: sa.Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE events (seq bigint PRIMARY KEY, payload text NOT NULL)")
        c.exec_driver_sql(
            f"INSERT INTO events SELECT g, 'e' || g FROM generate_series(1, {ROWS}) g"
        )
        c.exec_driver_sql("ANALYZE events")


class Supervised:
    """The supervisor process (started by the test) and its task process (known by pid)."""

    def __init__(self, tmp: Path, spec: dict[str, Any]) -> None:
        self.paths = {name: tmp / name for name in ("spec", "pid", "calls", "result", "log")}
        spec = {
            **spec,
            **{f"{n}_path": str(p) for n, p in self.paths.items() if n not in ("spec", "log")},
        }
        self.paths["spec"].write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        with self.paths["log"].open("wb") as log:
            self.supervisor = subprocess.Popen(
                [sys.executable, str(HERE / "supervised_worker.py"), str(self.paths["spec"])],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.task_pid = int(_wait_for("the task process's pid", self._pid, self))

    def _pid(self) -> str | None:
        path = self.paths["pid"]
        return path.read_text() if path.exists() else None

    def calls(self) -> list[dict[str, Any]]:
        path = self.paths["calls"]
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]

    def kill_supervisor_group(self) -> float:
        """SIGKILL the supervisor's process group; -> time.time() once the supervisor is dead."""
        assert os.getpgid(self.task_pid) != self.supervisor.pid, "the task shares the group"
        os.killpg(self.supervisor.pid, signal.SIGKILL)
        self.supervisor.wait(timeout=WAIT_S)
        return time.time()

    def task_gone(self) -> bool:
        try:
            return psutil.Process(self.task_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def result(self) -> dict[str, Any]:
        return json.loads(self.paths["result"].read_text())

    def log(self) -> str:
        return self.paths["log"].read_text(errors="replace")

    def cleanup(self) -> None:
        """Kill what the test started and is still running (after a failure)."""
        if self.supervisor.poll() is None:
            os.killpg(self.supervisor.pid, signal.SIGKILL)
            self.supervisor.wait(timeout=WAIT_S)
        if not self.task_gone():
            os.kill(self.task_pid, signal.SIGKILL)


def _wait_for(what: str, check: Any, sup: Supervised | None = None) -> Any:
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        if sup is not None and sup.supervisor.poll() is not None:
            pytest.fail(f"the supervisor exited before {what}:\n{sup.log()[-4000:]}")
        time.sleep(0.02)
    pytest.fail(f"no {what} after {WAIT_S:.0f} s" + (f":\n{sup.log()[-4000:]}" if sup else ""))


@pytest.fixture
def start(
    tmp_path: Path, pg_engine: sa.Engine, pg_schema_url: str, redis_url: str, key_prefix: str
) -> Iterator[Any]:
    """``start(**traverse_kwargs, fail_after=None)`` -> (traversal, round, Supervised)."""
    _create_events(pg_engine)
    started: list[Supervised] = []
    traversals: list[KeysetTraversal] = []

    def _start(fail_after: int | None = None, **traverse: Any) -> tuple[Any, Round, Supervised]:
        t = traversal(pg_schema_url, redis_url, key_prefix)
        traversals.append(t)
        rnd = t.plan(max_ranges=1, start_key=0, end_key=ROWS)
        spec = {
            "source_url": pg_schema_url,
            "redis_url": redis_url,
            "stream": "events-nightly",
            "key_prefix": key_prefix,
            "round_id": rnd.round_id,
            "fail_after": fail_after,
            "traverse": {"chunk_size": CHUNK, **traverse},
        }
        sup = Supervised(tmp_path, spec)
        started.append(sup)
        return t, rnd, sup

    try:
        yield _start
    finally:
        for sup in started:
            sup.cleanup()
        for t in traversals:
            t.close()


def _range(t: KeysetTraversal, rnd: Round) -> Any:
    return t.control.range_status(rnd.round_id)[0]


def test_orphaned_task_process_stops_within_one_chunk(start: Any) -> None:
    t, rnd, sup = start()
    _wait_for(
        f"{KILL_AFTER_CHUNKS} committed chunks",
        lambda: _range(t, rnd).chunks >= KILL_AFTER_CHUNKS,
        sup,
    )
    dead_at = sup.kill_supervisor_group()
    _wait_for("exit of the orphaned task process", sup.task_gone)

    result, calls, status = sup.result(), sup.calls(), _range(t, rnd)
    started_after = [c for c in calls if c["at"] > dead_at]
    print(
        f"\norphan: {len(calls)} chunk(s) processed, {len(started_after)} started after the "
        f"supervisor died; committed cursor {t.decode(status.cursor_encoded)}, owner "
        f"{status.owner!r}; outcome {result}"
    )
    assert result["supervisor_died"] and result["supervisor"] == sup.supervisor.pid, result
    assert result["stopped"] and not result["complete"], result
    assert len(started_after) <= 1, started_after
    # Every chunk it processed is committed, nothing after the last one; the lease is free.
    last = calls[-1]["last"]
    assert result["cursor"] == last == t.decode(status.cursor_encoded), (result, calls[-3:])
    assert status.done == last and status.state != "complete" and status.owner == "", status
    assert f"supervisor process {sup.supervisor.pid} died" in sup.log(), sup.log()[-4000:]

    # The retry resumes at the committed cursor + 1: every key once, none lost, none repeated.
    rec = Recorder()
    res = t.traverse(rnd.round_id, 0, rec, chunk_size=1000)
    assert res.complete and res.done == ROWS
    assert rec.chunks[0][0] == last + 1
    delivered = [k for c in calls for k in range(c["first"], c["last"] + 1)]
    delivered += [k for c in rec.chunks for k in c]
    assert sorted(delivered) == list(range(1, ROWS + 1))


def test_orphan_in_a_backoff_wait_stops_at_once(start: Any) -> None:
    """The run waits out a backoff of 60-120 s (the processor raises ``RetryableError`` after key
    200) when its supervisor dies: the watch thread ends the wait, the cursor stays at 200."""
    t, rnd, sup = start(fail_after=200, backoff_base=120.0, backoff_max=240.0, prefetch=False)
    _wait_for("a failing chunk", lambda: any(c["last"] > 200 for c in sup.calls()), sup)
    dead_at = sup.kill_supervisor_group()
    _wait_for("exit of the orphaned task process", sup.task_gone)

    result, calls, status = sup.result(), sup.calls(), _range(t, rnd)
    assert result["supervisor_died"] and result["stopped"], result
    assert [c for c in calls if c["at"] > dead_at] == [], calls[-3:]
    assert result["cursor"] == 200 == t.decode(status.cursor_encoded), result
    assert (status.done, status.owner) == (200, ""), status
    assert f"supervisor process {sup.supervisor.pid} died" in sup.log(), sup.log()[-4000:]
