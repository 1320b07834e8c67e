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

from ..chunk import Chunk, ChunkResult, check_result
from ..keys import as_tuple, encode_key
from .report import ProcessorTrial

#: how many distinct failure reasons a preview lists (the rest are counted under "other")
MAX_REASONS = 10
_REASON_CHARS = 200


def _short(text: str, limit: int = _REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def try_processor(processor: Any, chunks: list[Chunk], target: sa.Engine | None) -> ProcessorTrial:
    """Call ``processor`` on each sample chunk with ``chunk.connection`` in a transaction on
    ``target``, then roll the transaction back whatever happened; the keys' outcomes as the round
    would count them, summed over the chunks (``ProcessorTrial``).

    A first call on the sample's first row warms up what a running round has warm already (the
    target's connection, a write-back helper's reflected table); then one call per chunk, each
    in a transaction of its own (begin and rollback timed, as a round's call times its begin and
    commit). The first chunk's call is not timed when there are more (it prepares the full-size
    statement a running round has prepared); ``timed_keys`` says how many keys the time covers.
    Each call is rolled back. A call that raises ends the trial. (Timing the same rows twice
    would time them behind the dead row versions the first call left: each chunk is called
    once.)"""
    if processor is None:
        return ProcessorTrial(False, "no processor given")
    if target is None:
        return ProcessorTrial(
            False,
            "no target database (target_url, the operator's target_conn_id): the processor's "
            "writes could not be rolled back, so it was not run",
        )
    chunks = [c for c in chunks if len(c)]
    if not chunks:
        return ProcessorTrial(False, "the sample is empty: nothing to run the processor on")
    _, _, raised = _call_rolled_back(processor, chunks[0].head(1), target)  # the warm-up
    keys, seconds, timed = 0, 0.0, 0
    failed: dict[Any, str] = {}
    skipped: set[Any] = set()
    for i, chunk in enumerate(chunks if raised is None else []):
        took, result, raised = _call_rolled_back(processor, chunk, target)
        keys += len(chunk)
        if i or len(chunks) == 1:  # the first full call prepares what the round has prepared
            seconds, timed = seconds + took, timed + len(chunk)
        if raised is not None:
            break
        in_chunk = set(chunk.keys)
        bad = {k: r for k, r in (result.failed.items() if result else ()) if k in in_chunk}
        failed.update(bad)
        skipped |= {k for k in (result.skipped if result else ()) if k in in_chunk} - set(bad)
    if raised is not None:
        return ProcessorTrial(
            True, keys=keys or 1, raised=raised, seconds=seconds, rolled_back=True
        )
    counted = Counter(_short(r) for r in failed.values())
    reasons = dict(counted.most_common(MAX_REASONS))
    other = sum(counted.values()) - sum(reasons.values())
    if other:
        reasons["(other reasons)"] = other
    return ProcessorTrial(
        True,
        keys=keys,
        applied=keys - len(failed) - len(skipped),
        not_applied=len(skipped),
        failed=len(failed),
        reasons=reasons,
        seconds=seconds,
        rolled_back=True,
        timed_keys=timed,
    )


def _call_rolled_back(
    processor: Any, chunk: Chunk, target: sa.Engine
) -> tuple[float, ChunkResult | None, str | None]:
    """One call in a transaction that is rolled back: its seconds, its verdict or what it
    raised."""
    result = None
    raised: str | None = None
    started = time.monotonic()  # the transaction's begin and end count, as in a round's call
    with target.connect() as conn:
        trans = conn.begin()
        try:
            chunk.connection = conn
            result = check_result(processor(chunk), "the preview's sample")
        except Exception as exc:  # a dependency failure or a bug: the round retries the chunk
            raised = _short(f"{type(exc).__name__}: {exc}", 500)
        finally:
            chunk.connection = None
            trans.rollback()
    if result is not None and (result.failed or result.skipped):
        # the round's own work on such a verdict: every key of the chunk encoded once
        arity = len(chunk.keys[0]) if isinstance(chunk.keys[0], tuple) else 1
        {encode_key(as_tuple(k, arity)) for k in chunk.keys}
    return time.monotonic() - started, result, raised
