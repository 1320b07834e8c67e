"""The round's ETA from the preview's sample and the stream's governor budget (``estimate``).

One chunk of a round costs its read, its processor call in its transaction and one Redis round
trip (the fenced advance); the sample measured the first two on its chunks (the processor on
the chunks after the first, ``ProcessorTrial.timed_keys``) and the preview timed a Redis ``PING``
for the third. A task's rate is one row over that cost per row
(what the target's commit adds over the rollback the preview does is not in it: on a disk that
flushes slowly and with small chunks the ETA is optimistic); ``workers`` tasks run at once (at most one per
range); the stream's ``max_rows_per_second`` (``core/pace/governor.py``) caps the sum. The ETA
assumes the rows ahead cost what the sample cost and that the tasks scale, which a busy database
may not do: it is an estimate, and the preview says what it rests on.
"""

from __future__ import annotations

from .report import Eta, ProcessorTrial, SampleRead


def estimate(
    rows: int,
    sample: SampleRead | None,
    trial: ProcessorTrial,
    redis_seconds: float,
    ranges: int,
    workers: int,
    budget: float | None,
) -> Eta:
    """The ``Eta`` of ``rows`` rows over ``ranges`` ranges (see the module docstring)."""
    tasks = max(1, min(workers, ranges)) if ranges else 1
    if rows <= 0:
        return Eta(0.0, 0, None, None, tasks, budget, "empty round")
    if sample is None or sample.rows <= 0:
        return Eta(None, rows, None, None, tasks, budget, "no sample")
    per_row = (sample.seconds + redis_seconds * sample.chunks) / sample.rows
    if trial.ran and trial.raised is None and trial.timed_keys:
        per_row += trial.seconds / trial.timed_keys
    task_rate = 1.0 / max(per_row, 1e-12)
    rate = task_rate * tasks
    limited_by = "sample rate"
    if budget is not None and budget > 0 and budget < rate:
        rate, limited_by = budget, "governor budget"
    return Eta(rows / rate, rows, rate, task_rate, tasks, budget, limited_by)
