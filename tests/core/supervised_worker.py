"""A supervisor and its task process, started the way Airflow 3.3 starts a task instance.

Run as ``python supervised_worker.py <spec.json>``. This process plays the *supervisor*: it forks
the *task process* and waits for it, nothing else. The task process puts itself in a process group
of its own (``os.setpgid(0, 0)``, mirrored by the supervisor, exactly as Airflow's
``WatchedSubprocess.start(new_process_group=True)`` does), so a SIGKILL of the supervisor's process
group leaves it running, orphaned. It runs one ``traverse`` of range 0 of ``spec["round_id"]``
under a ``SupervisorWatch``, wired as ``TraverseRangeOperator`` wires it, and writes its outcome
to ``spec["result_path"]``; it logs to stderr (the supervisor's, which the test redirects).

The processor appends one JSON line per call to ``spec["calls_path"]`` *before* it does anything
else: the chunk's first and last key and ``time.time()`` at the call's start. From key
``spec["fail_after"]`` on (if set) it raises ``RetryableError``, so the run sits in a long
backoff wait.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _task(spec: dict[str, Any]) -> None:
    from airflow_keyset_provider.core import Chunk, KeysetTraversal, RetryableError
    from airflow_keyset_provider.core.run.supervision import SupervisorWatch

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    t = KeysetTraversal(
        spec["source_url"],
        table="events",
        key="seq",
        redis_url=spec["redis_url"],
        stream=spec["stream"],
        key_prefix=spec["key_prefix"],
    )
    calls = Path(spec["calls_path"]).open("a")  # noqa: SIM115 - open for the process's life
    fail_after = spec.get("fail_after")

    def processor(chunk: Chunk) -> None:
        keys = list(chunk.keys)
        calls.write(json.dumps({"first": keys[0], "last": keys[-1], "at": time.time()}) + "\n")
        calls.flush()
        if fail_after is not None and keys[-1] > fail_after:
            raise RetryableError("dispatch-api answers 503")

    watch = SupervisorWatch(t.request_stop, f"round {spec['round_id']} range 0")
    with watch:
        res = t.traverse(spec["round_id"], 0, watch.guard(processor), **spec["traverse"])
    outcome = {
        "stopped": res.stopped,
        "complete": res.complete,
        "cursor": t.decode(res.cursor),
        "done": res.done,
        "supervisor_died": watch.died,
        "supervisor": watch.supervisor,
    }
    tmp = Path(spec["result_path"] + ".tmp")
    tmp.write_text(json.dumps(outcome))
    tmp.rename(spec["result_path"])
    t.close()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = os.fork()
    if pid == 0:  # the task process
        code = 0
        try:
            os.setpgid(0, 0)
            _task(spec)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    tmp = Path(spec["pid_path"] + ".tmp")
    tmp.write_text(str(pid))
    tmp.rename(spec["pid_path"])
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
