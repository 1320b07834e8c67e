"""Stop a traversal when the process that supervises it dies.

Why the parent process is the supervisor, and why the task process does not die with it (checked
against Airflow 3.3.2, ``airflow/sdk/execution_time/supervisor.py``): the supervisor (the Celery
worker's pool process, or the LocalExecutor's worker process) starts each task instance with
``ActivitySubprocess.start(new_process_group=True)``, which calls ``os.fork()``; the child runs
the task (on macOS it ``execv``s a fresh interpreter first: same pid, same parent). So the task
process's parent *is* its supervisor, the process that heartbeats the task instance and talks to
the Execution API. The child then calls ``os.setpgid(0, 0)`` (the parent mirrors it with
``os.setpgid(pid, pid)``): the task process leads a process group of its own, and no parent-death
signal (``PR_SET_PDEATHSIG``) is set. A SIGKILL of the worker's process group (``kill -9 -<pgid>``,
an OOM kill of the supervisor) therefore leaves the task process running, orphaned: it keeps
processing, committing chunks and renewing its Redis lease until Airflow's retry (after the
scheduler's heartbeat timeout) takes the range over and fences it.

When a process's parent dies, the kernel reparents it (to init, or the nearest subreaper), so
``os.getppid()`` no longer returns the pid recorded at start: that is the check. It is made after
every processor call (``SupervisorWatch.guard``: however fast the chunks, at most one starts after
the death) and every ``poll_seconds`` in a daemon thread (so a wait, a backoff, a held lease or a
throttle, also ends within ``poll_seconds``). On a change it calls the traversal's
``request_stop``: the run finishes and commits the chunk in hand, releases its lease and returns
``stopped`` (``range_run``; docs/contract.md, "Stop requests").

Imports nothing from Airflow; the operator decides whether its process has a supervisor to watch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..chunk import Chunk, Processor

log = logging.getLogger("airflow_keyset_provider")

#: What happens to the range after the stop, unless the caller says better (``then``).
DEFAULT_THEN = "a new traverse of the range resumes from the committed cursor"


class SupervisorWatch:
    """Watch this process's parent (its supervisor); when it dies, stop the traversal.

    Guarantee: once the parent process has died, at most one processor call starts (the chunk in
    hand, or the next one if the death fell between two chunks); that chunk is committed at the
    chunk boundary, the lease released, and the traversal returns ``stopped``. A wait in progress
    (backoff, a range held by another owner, throttling) ends within ``poll_seconds``. The
    watch logs one ERROR naming the dead supervisor, ``what`` was stopped and ``then`` (what
    takes the range over).

    ``enabled=False`` makes every method a no-op (a process without a supervisor to watch).
    Use ``start()``/``stop()`` or ``with``; wrap the processor with ``guard``.
    """

    def __init__(
        self,
        request_stop: Callable[[], None],
        what: str,
        *,
        then: str = DEFAULT_THEN,
        poll_seconds: float = 0.2,
        enabled: bool = True,
    ) -> None:
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive, got {poll_seconds!r}")
        self.supervisor = os.getppid()  #: the parent's pid when the watch was made
        self.enabled = enabled
        self._request_stop = request_stop
        self._what = what
        self._then = then
        self._poll = poll_seconds
        self._died = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def died(self) -> bool:
        """True once the watch saw the supervisor die (and asked the traversal to stop)."""
        return self._died.is_set()

    def start(self) -> SupervisorWatch:
        """Start the polling thread (a daemon: it never keeps the process alive)."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="keyset-supervisor-watch", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the polling thread; ``check`` still works."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> SupervisorWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check(self) -> bool:
        """True if the supervisor died; the first time, request the stop and log it. Cheap (one
        ``getppid`` system call), safe from any thread."""
        if not self.enabled:
            return False
        if self._died.is_set():
            return True
        parent = os.getppid()
        if parent == self.supervisor:
            return False
        with self._lock:
            if self._died.is_set():
                return True
            self._died.set()
        self._request_stop()  # first: logging may fail
        # the stop is requested; the message is a courtesy (its reader may be the dead supervisor)
        with contextlib.suppress(Exception):
            log.error(
                "supervisor process %d died (this process's parent is now %d): stopping %s at "
                "the next chunk boundary; the chunk in hand is committed and the lease released, "
                "nothing after it is processed by this process. Then %s.",
                self.supervisor,
                parent,
                self._what,
                self._then,
            )
        return True

    def guard(self, processor: Processor) -> Processor:
        """``processor``, checking the supervisor after every call (also a failed one)."""
        if not self.enabled:
            return processor

        def guarded(chunk: Chunk) -> Any:
            try:
                return processor(chunk)
            finally:
                self.check()

        return guarded

    def _run(self) -> None:
        while not self._done.wait(self._poll):
            if self.check():
                return


__all__ = ["DEFAULT_THEN", "SupervisorWatch"]
