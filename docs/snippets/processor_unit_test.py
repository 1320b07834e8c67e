"""A DAG author's pytest test of a processor, against a real database, in a few lines."""

import os

from coupon_processors import expire_coupons

from airflow_keyset_provider.testing import run_processor

SOURCE_URL = os.environ.get(
    "KEYSET_SOURCE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def test_expire_coupons_expires_active_skips_the_rest_and_dead_letters_bad_currencies():
    run = run_processor(
        expire_coupons, SOURCE_URL, "coupons", "id", columns=["currency"], chunk_size=100
    )
    assert run.dead_keys == [13, 15]  # the two coupons in "XXX"
    assert run.dead_letters[0]["error"] == "unknown currency 'XXX'"
    assert (run.done, run.skipped) == (98, 100)  # 98 ACTIVE expired, 100 already EXPIRED left alone
