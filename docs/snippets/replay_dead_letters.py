"""Replay a round's dead letters with a fixed processor (what ``airflow-keyset replay-dead-letters`` does)."""

import os

from coupon_processors import expire_coupons

from airflow_keyset_provider.core import KeysetTraversal

t = KeysetTraversal(
    os.environ.get("KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"),
    table="coupons",
    key="id",
    columns=["currency"],
    stream="coupons-expiry",
    redis_url=os.environ.get("KEYSET_REDIS_URL", "redis://127.0.0.1:6379/0"),
    key_prefix=os.environ.get("KEYSET_KEY_PREFIX", "ks"),
)
round_id = os.environ.get("KEYSET_ROUND", "r1")
for spec in t.round(round_id).ranges:
    for letter in t.dead_letters(round_id, spec.range_id):
        print(
            f"range {spec.range_id}: key {letter['key']}: {letter['error']} ({letter['attempts']} attempts)"
        )
# Back to the retry set, then a normal fenced traverse of each range that had letters
# (refused with LeaseHeldError while a live worker owns the range). At-least-once, like any traverse.
for res in t.replay_dead_letters(round_id, expire_coupons, item_retry_delay=0.1):
    print(f"range {res.range_id}: done {res.done}, skipped {res.skipped}, dead {res.dead}")
t.close()
