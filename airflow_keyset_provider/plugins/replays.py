"""The page's replay of one range's dead letters, through the DAG's own traverse task.

What runs is ``cli.replay.DagReplay``, what ``airflow-keyset replay-dead-letters --dag-id`` runs
(one implementation): the DAG that planned the round (its round key ``<dag_id>/<run_id>/
<task_id>``) is parsed from its file (``DagModel.fileloc`` when this server has it, else the
DAGs folder), and its traverse task of the stream gives the processor (decorator functions
included), the target connection, ``exactly_once`` and the tuning; its plan gives the table,
key and ``where``. Nothing of it comes from Redis or the browser: the round's record is only
compared with it (a round planned over other rows is refused before any letter moves). The
replay uses the Redis connection the page reads, and only under the page's key prefix (a DAG
whose plan writes under another prefix is refused).

Where it runs: in the API server, off the request thread, in a pool of ``REPLAY_WORKERS``
threads per API server process. At most that many replays run at once (another is refused with
``Busy``, 429) and one per range (a second request for a range being replayed: ``Conflict``).
The request waits up to ``REPLAY_WAIT_S`` for the outcome; a longer replay goes on in the
background (``state`` ``running``): the page shows the range owned by the replay
(``keyset-page-replay:<job>``) and its counts, and the outcome is logged by the API server. A
replay is bounded: at most ``REQUEUE_LIMIT`` letters, each with the task's
``max_item_attempts``, and a dependency failure stops it after the task's
``retry_budget_seconds``.

Outcomes (``state``): ``succeeded`` (the range's counts after it), ``failed`` (the replay failed
and put back the letters it moved, as they were: ``ReplayFailedError``'s message says so and
how many), ``running``, ``nothing`` (no dead letters). Refusals, before any letter moves, raise
``status.NotFound`` (no such range; a DAG this server cannot find or import, or one with no
traverse task of the stream), ``status.Conflict`` (a round planned outside Airflow, several
traverse tasks of the stream, a templated ``where``, another key prefix, another source than the round's, a live
owner holds the range, a replay of the range already running) or ``Busy``; ``authorize`` raises
``status.Forbidden``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis

from ..cli.exits import EXIT_NOT_FOUND, CliError
from ..core.errors import (
    ConfigurationError,
    LeaseHeldError,
    ReplayFailedError,
    RoundStateLostError,
    StoreUnavailableError,
)
from ..core.redaction import scrub
from .status import REQUEUE_LIMIT, Conflict, NotFound, StateLost, planning_dag, round_range

log = logging.getLogger(__name__)

#: Replays one API server process runs at once (each in its own thread).
REPLAY_WORKERS = 2
#: Seconds a request waits for its replay's outcome before answering ``running``.
REPLAY_WAIT_S = 20.0
#: The owner lineage of a page replay (no ``/``: not read as an Airflow task instance).
LINEAGE = "keyset-page-replay:{job}"

_pool = ThreadPoolExecutor(max_workers=REPLAY_WORKERS, thread_name_prefix="keyset-replay")
_running: dict[tuple[str, ...], str] = {}
_lock = threading.Lock()


class Busy(RuntimeError):
    """Every replay slot of this API server process is taken (the message says how many)."""


def replay_range(
    client: Any,
    prefix: str,
    stream: str,
    round_id: str,
    range_id: int,
    *,
    conn_id: str,
    who: str,
    authorize: Callable[[str], None],
    wait_s: float = REPLAY_WAIT_S,
) -> dict[str, Any]:
    """Replay the range's dead letters through the DAG that planned the round (see the module
    docstring). ``authorize(dag_id)`` raises when the user may not edit that DAG."""
    _ctl, state, info = round_range(client, prefix, stream, round_id, range_id)
    dag_id = planning_dag(info)
    if dag_id is None:
        raise Conflict(
            f"round {round_id} of stream {stream!r} was not planned by an Airflow DAG (no round "
            "key), so there is no DAG task to replay through: use airflow-keyset "
            f"replay-dead-letters {stream} {round_id} --range {range_id} --processor pkg.mod:fn "
            "with the source flags"
        )
    authorize(dag_id)
    key = (conn_id, prefix, stream, round_id, str(range_id))
    job = uuid.uuid4().hex[:12]
    with _lock:
        if key in _running:
            raise Conflict(
                f"round {round_id} range {range_id} is being replayed already (job "
                f"{_running[key]}); wait for it to end"
            )
        if len(_running) >= REPLAY_WORKERS:
            raise Busy(
                f"this API server runs {REPLAY_WORKERS} replays at once already; try again when "
                "one has ended"
            )
        _running[key] = job
    head = {
        "stream": stream,
        "round_id": round_id,
        "range_id": range_id,
        "dag_id": dag_id,
        "round_state": state,
        "job": job,
    }
    log.info(
        "page replay %s by %s: stream %s round %s range %d through DAG %s (Redis connection %s)",
        job, who, stream, round_id, range_id, dag_id, conn_id,
    )  # fmt: skip
    try:
        future = _pool.submit(_run, stream, round_id, range_id, dag_id, conn_id, prefix, job)
    except BaseException:
        with _lock:
            _running.pop(key, None)
        raise
    future.add_done_callback(lambda f: _finished(key, job, f))
    try:
        result = future.result(timeout=wait_s)
    except FutureTimeout:
        return {
            **head,
            "state": "running",
            "message": (
                f"the replay of round {round_id} range {range_id} through DAG {dag_id} is still "
                f"running in the API server (owner {LINEAGE.format(job=job)}); the range's "
                "counts show its progress and the API server's log its outcome. If it fails, "
                "its letters are put back as dead letters."
            ),
        }
    except ReplayFailedError as exc:
        return {**head, "state": "failed", "message": scrub(str(exc))}
    except LeaseHeldError as exc:
        raise Conflict(scrub(str(exc))) from exc
    except RoundStateLostError as exc:
        raise StateLost(str(exc)) from exc
    except ConfigurationError as exc:
        raise Conflict(f"DAG {dag_id}: {scrub(str(exc))}") from exc
    except CliError as exc:
        error = NotFound if exc.code == EXIT_NOT_FOUND else Conflict
        raise error(f"DAG {dag_id}: {scrub(str(exc))}") from exc
    except (redis.RedisError, StoreUnavailableError):
        raise
    except Exception as exc:  # the DAG's task could not be prepared: before any letter moved
        raise Conflict(
            f"the replay through DAG {dag_id} could not start ({type(exc).__name__}: "
            f"{scrub(str(exc))}); no letter moved"
        ) from exc
    return {**head, **_succeeded(round_id, range_id, dag_id, result)}


def _succeeded(round_id: str, range_id: int, dag_id: str, result: dict[str, Any]) -> dict[str, Any]:
    rows, task_id = result["ranges"], result["task_id"]
    if not rows:
        return {
            "state": "nothing",
            "ranges": [],
            "message": f"round {round_id} range {range_id} has no dead letters to replay",
        }
    r = rows[0]
    return {
        "state": "succeeded",
        "ranges": rows,
        "task_id": task_id,
        "message": (
            f"round {round_id} range {range_id} replayed through DAG {dag_id} task {task_id}: "
            f"now done {r['done']:,}, skipped {r['skipped']:,}, dead {r['dead']:,}"
            + (" (letters that failed again are dead letters again)" if r["dead"] else "")
        ),
    }


def _run(
    stream: str, round_id: str, range_id: int, dag_id: str, conn_id: str, prefix: str, job: str
) -> dict[str, Any]:
    """The job: prepare the DAG's replay, check its key prefix, run it (``DagReplay``)."""
    from ..cli.replay import DagReplay

    replay = DagReplay.prepare(stream, dag_id, dag_file=_dag_file(dag_id), redis_conn_id=conn_id)
    try:
        assert replay.task is not None
        if replay.task.key_prefix != prefix:
            raise ConfigurationError(
                f"task {replay.task.task_id} plans under key prefix {replay.task.key_prefix!r}; "
                f"this page reads {prefix!r} ([keyset] key_prefix): the round shown is not its"
            )
        rows = replay.run(round_id, range_id, LINEAGE.format(job=job), limit=REQUEUE_LIMIT)
        return {"ranges": rows, "task_id": replay.task.task_id}
    finally:
        replay.close()


def _finished(key: tuple[str, ...], job: str, future: Future[dict[str, Any]]) -> None:
    with _lock:
        _running.pop(key, None)
    exc = future.exception()
    if exc is None:
        log.info("page replay %s succeeded: %s", job, future.result()["ranges"])
    else:
        log.warning("page replay %s failed: %s: %s", job, type(exc).__name__, scrub(str(exc)))


def _dag_file(dag_id: str) -> str | None:
    """The DAG's file as Airflow's metadata database records it, when this server has that
    file; None: parse the DAGs folder (``cli.dag_task.load_dag``)."""
    import os

    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        fileloc = session.scalar(select(DagModel.fileloc).where(DagModel.dag_id == dag_id))
    return fileloc if fileloc and os.path.isfile(fileloc) else None
