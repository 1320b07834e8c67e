"""Rows per second of a processor at several chunk sizes, on the first N rows of a table.

    python chunk_size_probe.py SOURCE_URL TABLE KEY package.module:processor [ROWS]

Run it against a staging copy: the processor really runs (several times over the same rows).
"""

import sys
import time

from airflow_keyset_provider.testing import run_processor

source_url, table, key, processor = sys.argv[1:5]
rows = int(sys.argv[5]) if len(sys.argv) > 5 else 20_000
print(f"{'chunk_size':>10} {'rows/s':>10} {'ms/chunk':>9}")
for chunk_size in (100, 500, 1_000, 5_000, 10_000):
    started = time.perf_counter()
    run = run_processor(processor, source_url, table, key, rows=rows, chunk_size=chunk_size)
    seconds = time.perf_counter() - started
    print(
        f"{chunk_size:>10} {run.rows_read / seconds:>10,.0f} {1000 * seconds / max(run.chunks, 1):>9.1f}"
    )
