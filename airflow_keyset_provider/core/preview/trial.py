"""The processor run on the preview's sample inside a target transaction that is always rolled
back (``try_processor``).

What is rolled back: every write the processor makes through ``chunk.connection`` (the target
transaction the engine hands it, as in a round). What cannot be: a write through another
connection, a call to another system, a processor that commits ``chunk.connection`` itself
(against the processor contract). So the processor runs only with a target database
(``target_url`` / ``target_conn_id``); without one the preview says so and does not call it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import sqlalchemy as sa

from ..chunk import Chunk, check_result
from .report import ProcessorTrial

#: how many distinct failure reasons a preview lists (the rest are counted under "other")
MAX_REASONS = 10
_REASON_CHARS = 200


def _short(text: str, limit: int = _REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def try_processor(processor: Any, chunk: Chunk | None, target: sa.Engine | None) -> ProcessorTrial:
    """Call ``processor`` on ``chunk`` with ``chunk.connection`` in a transaction on ``target``,
    then roll the transaction back whatever happened; the keys' outcomes as the round would count
    them (``ProcessorTrial``)."""
    if processor is None:
        return ProcessorTrial(False, "no processor given")
    if target is None:
        return ProcessorTrial(
            False,
            "no target database (target_url, the operator's target_conn_id): the processor's "
            "writes could not be rolled back, so it was not run",
        )
    if chunk is None or not len(chunk):
        return ProcessorTrial(False, "the sample is empty: nothing to run the processor on")
    keys = chunk.keys
    result = None
    raised: str | None = None
    with target.connect() as conn:
        trans = conn.begin()
        started = time.monotonic()
        try:
            chunk.connection = conn
            result = check_result(processor(chunk), "the preview's sample")
        except Exception as exc:  # a dependency failure or a bug: the round retries the chunk
            raised = _short(f"{type(exc).__name__}: {exc}", 500)
        finally:
            seconds = time.monotonic() - started
            chunk.connection = None
            trans.rollback()
    if raised is not None:
        return ProcessorTrial(
            True, keys=len(keys), raised=raised, seconds=seconds, rolled_back=True
        )
    in_chunk = set(keys)
    failed = {k: r for k, r in (result.failed.items() if result else ()) if k in in_chunk}
    skipped = {k for k in (result.skipped if result else ()) if k in in_chunk} - set(failed)
    counted = Counter(_short(r) for r in failed.values())
    reasons = dict(counted.most_common(MAX_REASONS))
    other = sum(counted.values()) - sum(reasons.values())
    if other:
        reasons["(other reasons)"] = other
    return ProcessorTrial(
        True,
        keys=len(keys),
        applied=len(in_chunk) - len(failed) - len(skipped),
        not_applied=len(skipped),
        failed=len(failed),
        reasons=reasons,
        seconds=seconds,
        rolled_back=True,
    )
