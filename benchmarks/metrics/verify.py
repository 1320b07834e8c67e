"""Issue 31, verification: the verify scan costs no more than the traversal's read of the round.

Same run, interleaved, on the bigint-keyed table (``(0, N]``, N = ``--rows``; the issue's figure
is at 10^6): ``traverse`` is one ``traverse`` of a fresh one-range round with a no-op processor
(its reads, the cursor advances and the fixed costs: what the round's read costs); ``verify`` is
``KeysetTraversal.verify_round`` of one such round whose range is complete, with the predicate
``payload < 0`` (no row matches, so every row is scanned and the round verifies), in chunks of
the same ``--chunk-size``, paced by the stream's governor (no rate set: one control read per
chunk). Verdict: ``verify seconds / traverse seconds`` (target <= 1.0x).
"""

from __future__ import annotations

import os

from benchmarks import project
from benchmarks.context import BenchContext
from benchmarks.data import ensure_table
from benchmarks.report import Metric
from benchmarks.timing import Sample, Stopwatch, interleaved, median_seconds, spread

PREDICATE = "payload < 0"


def run(ctx: BenchContext) -> list[Metric]:
    load_before = os.getloadavg()
    table = ensure_table(ctx, "seq")
    hi, n = ctx.rows, ctx.chunk_size
    t, rnd = project.plan(ctx, table, "seq", 0, hi, stream="verify")
    try:
        project.traverse_range(t, rnd, 0, project.noop, n)  # the round to verify; warms the cache

        def verify() -> Sample:
            with Stopwatch() as sw:
                v = t.verify_round(rnd.round_id, PREDICATE, chunk_size=n)
            if not v.verified:
                raise RuntimeError(f"the benchmark round did not verify: {v.describe()}")
            return Sample(sw.seconds, v.rows_scanned)

        s = interleaved(
            {
                "traverse": lambda: project.traverse_once(ctx, table, "seq", 0, hi),
                "verify": verify,
            },
            ctx.repeat,
        )
    finally:
        t.close()
    for name, samples in s.items():
        if any(x.rows != ctx.rows for x in samples):
            raise RuntimeError(f"{name} read {[x.rows for x in samples]} rows, expected {ctx.rows}")
    verify_s, traverse_s = median_seconds(s["verify"]), median_seconds(s["traverse"])
    ratio = verify_s / traverse_s
    load = f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    return [
        Metric(
            "verify_vs_traverse",
            "verify",
            "verify scan time vs the traversal's read of the same round",
            verify_s,
            traverse_s,
            "s",
            ratio,
            "<= 1.00x",
            ratio <= 1.0,
            f"{ctx.rows:,} rows, chunk {n}, predicate {PREDICATE!r}; {load}",
            {name: spread(v, rate=False) for name, v in s.items()},
        )
    ]
