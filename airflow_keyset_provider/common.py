"""What the Airflow adapters share: XCom keys, the context key of a range's label, the mapping of
engine errors to Airflow's, and how a key is written in task logs.

Operators, sensors and triggers import these from here (never from each other), so a sensor does
not load the operators and the names cannot drift apart.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from .core import names
from .core.errors import (
    ConfigurationError,
    ProcessorContractError,
    RetentionError,
    RoundStateLostError,
)
from .core.keys import key_label, to_json
from .core.run.supervision import SupervisorWatch

#: Context variable set by ``TraverseRangeOperator.execute``; the default ``map_index_template``
#: renders it, e.g. ``range 3 (1000, 2000]``.
RANGE_LABEL_CONTEXT_KEY = "keyset_range_label"
DEFAULT_MAP_INDEX_TEMPLATE = "{{ " + RANGE_LABEL_CONTEXT_KEY + " }}"
#: XCom key under which ``PlanRangesOperator`` pushes the round's id (the return value holds the
#: ranges) and, under ``ROUND_XCOM_KEY``, where to find the round (stream, key prefix, bounds).
ROUND_ID_XCOM_KEY = "round_id"
ROUND_XCOM_KEY = "keyset_round"
#: ``PreviewRoundOperator`` pushes its preview under this key too (the UI page reads it by stream)
PREVIEW_XCOM_KEY = "keyset_preview"
#: Key prefix of the engine's Redis keys when neither a task nor ``[keyset] key_prefix`` names one.
DEFAULT_KEY_PREFIX = "ks"
#: The provider's configuration section (``[keyset]``; environment ``AIRFLOW__KEYSET__*``).
CONFIG_SECTION = "keyset"


def configured_key_prefix() -> str:
    """``[keyset] key_prefix`` (``AIRFLOW__KEYSET__KEY_PREFIX``), else ``ks``: the prefix a plan
    uses when its DAG names none, and the one the UI page reads, so the two agree by default."""
    from airflow.sdk.configuration import conf

    return conf.get(CONFIG_SECTION, "key_prefix", fallback=DEFAULT_KEY_PREFIX) or DEFAULT_KEY_PREFIX


_NAME_RULES = {"stream": names.stream, "key_prefix": names.key_prefix, "round_id": names.round_id}


def check_names(**values: Any) -> None:
    """Check an operator's literal names when the DAG is parsed (``core/names.py``: a full match;
    ``InvalidNameError`` names the rule). A value that is not a plain string yet (a Jinja
    template, an ``XComArg``, None) is checked when it is rendered, by the store."""
    for kind, value in values.items():
        if isinstance(value, str) and "{{" not in value and "{%" not in value:
            _NAME_RULES[kind](value)


#: Engine errors no retry can fix: the task fails at once, without retries.
FATAL_ERRORS: tuple[type[Exception], ...] = (
    ConfigurationError,
    ProcessorContractError,
    RoundStateLostError,
    RetentionError,
)


def run_key(context: Any) -> str:
    """``<dag_id>/<run_id>/<task_id>[/<map_index>]`` of the running task instance: the plan's round
    key and a traverse try's owner lineage."""
    ti = context["ti"]
    suffix = f"/{ti.map_index}" if getattr(ti, "map_index", -1) not in (-1, None) else ""
    return f"{ti.dag_id}/{ti.run_id}/{ti.task_id}{suffix}"


@contextlib.contextmanager
def airflow_errors() -> Iterator[None]:
    """Turn engine errors that no retry can fix (``FATAL_ERRORS``) into ``AirflowFailException``
    (fail now, no retries); everything else propagates and is retried by Airflow as usual."""
    try:
        yield
    except FATAL_ERRORS as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def forked_by_task_supervisor() -> bool:
    """True when this code runs in a task process that Airflow's task supervisor forked (a Celery
    or LocalExecutor worker's): the task runner then talks to its supervisor over a socket
    (``task_runner.SUPERVISOR_COMMS`` is a ``CommsDecoder``). False in-process (``dag.test()``:
    the supervisor is this very process) and outside a task runner (a direct ``execute``)."""
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.comms import CommsDecoder
    except ImportError:  # another Airflow layout: nothing known to watch
        return False
    return isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), CommsDecoder)


def supervisor_watch(request_stop: Callable[[], None], what: str) -> SupervisorWatch:
    """A ``SupervisorWatch`` for a traverse task: enabled only in a process forked by Airflow's
    task supervisor (``forked_by_task_supervisor``), whose death it then turns into a stop."""
    return SupervisorWatch(
        request_stop,
        what,
        then=(
            "Airflow's retry of this task instance takes the range over from the committed "
            "cursor, once the scheduler has timed out the dead supervisor's heartbeats"
        ),
        enabled=forked_by_task_supervisor(),
    )


_UTC_ISO = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d(?::\d\d(?:\.\d+)?)?)\+00:00$")


def compact_key(value: Any) -> str:
    """A key on one line, as the Map Index column and the Keyset page show it (the page's
    ``compactKey``, ``ui/src/format.js``): a composite key's columns joined by `` · ``, a UTC
    timestamp ending in ``Z``: ``2024-05-01T10:00:00Z · 41235``; ``None`` (open end) ``-inf``.
    Other keys read as ``key_label`` writes them (``42``, ``abc``)."""
    if value is None:
        return "-inf"
    parts = value if isinstance(value, (list, tuple)) else [value]
    return " · ".join(_UTC_ISO.sub(r"\1Z", str(to_json(v))) for v in parts)


__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_MAP_INDEX_TEMPLATE",
    "FATAL_ERRORS",
    "PREVIEW_XCOM_KEY",
    "RANGE_LABEL_CONTEXT_KEY",
    "ROUND_ID_XCOM_KEY",
    "ROUND_XCOM_KEY",
    "airflow_errors",
    "compact_key",
    "configured_key_prefix",
    "forked_by_task_supervisor",
    "key_label",
    "run_key",
    "supervisor_watch",
]
