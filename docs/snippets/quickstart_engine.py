"""Traverse a table with the engine alone: plan a round, traverse its ranges, close the round.

Needs a table ``events (seq bigint PRIMARY KEY, payload text NOT NULL)``.
"""

import os

from airflow_keyset_provider import ChunkResult
from airflow_keyset_provider.core import KeysetTraversal

SOURCE_URL = os.environ.get(
    "KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("KEYSET_REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("KEYSET_KEY_PREFIX", "ks")


def process(chunk):
    """Called with up to chunk_size rows in key order. May run again for the same rows: idempotent."""
    bad = {row["seq"]: "empty payload" for row in chunk.rows if not row["payload"]}
    return ChunkResult(failed=bad)  # keys not named here count as done


t = KeysetTraversal(
    SOURCE_URL,
    table="events",
    key="seq",
    redis_url=REDIS_URL,
    stream="events-nightly",
    columns=["payload"],
    key_prefix=KEY_PREFIX,
)
# (watermark, max(seq)] in up to 4 ranges of about equal row counts. new_stream=True: the stream's
# first plan; without it a stream Redis has no state of is restored or refused, never restarted
rnd = t.plan(max_ranges=4, new_stream=True)
print(f"round {rnd.round_id}: ({rnd.start_key}, {rnd.end_key}] in {len(rnd.ranges)} ranges")
for spec in rnd.ranges:  # under Airflow, each range is one mapped task, run in parallel
    res = t.traverse(rnd.round_id, spec.range_id, process, chunk_size=1000)
    print(f"{spec.label}: done {res.done}, skipped {res.skipped}, dead {res.dead}")
totals = t.close_round(
    rnd.round_id
)  # refuses (RoundIncompleteError) unless every range is complete
print(
    f"closed {totals.round_id}: done {totals.done}, skipped {totals.skipped}, dead {totals.dead}; "
    f"watermark {t.watermark()}"
)
t.close()
