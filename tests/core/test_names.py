"""Every name that reaches a Redis key is validated by a full match, one rule per kind
(``core/names.py``; issue 28, item 4). A trailing newline, a key separator (``:``) in a round
id, a glob or a hash-tag brace is refused wherever the name enters: the store (what operators
and the page go through) and the CLI's arguments (tests/cli/test_cli_fuzz.py walks those)."""

from __future__ import annotations

import pytest
import redis

from airflow_keyset_provider.core import names
from airflow_keyset_provider.core.errors import ConfigurationError, InvalidNameError
from airflow_keyset_provider.core.store.cursor_store import CursorStore

GOOD = {
    names.STREAM: ["events-nightly", "a", "A.b_c-9", "x" * 200],
    names.KEY_PREFIX: ["ks", "team:etl", "a.b-c_d"],
    names.ROUND_ID: ["r1", "r12", "r" + "9" * 18],
    names.DAG_ID: ["nightly_orders", "a.b-c", "commandes_été"],
    names.RUN_ID: ["manual__2026-01-01T00:00:00+00:00", "scheduled__x~1"],
    names.CONN_ID: ["redis_default", "keyset_ui_redis_b", "Redis.prod-2", "x" * 250],
}
# each bad value is bad for every rule it is listed under
BAD_EVERYWHERE = ["", "a\n", "a\r", "a\x00", " a", "a b", "a*", "a?", "a{b}", "a/b", "a\n\n"]
BAD = {
    names.STREAM: [*BAD_EVERYWHERE, "-a", ".a", "a:b", "x" * 201, "a\u2028", "é"],
    names.KEY_PREFIX: [*BAD_EVERYWHERE, "x" * 65, "é"],
    names.ROUND_ID: [
        *BAD_EVERYWHERE,
        "r1:range:0",
        "r1\n",
        "1",
        "r",
        "R1",
        "r-1",
        "r1x",
        "r" + "9" * 19,
    ],
    names.DAG_ID: [*BAD_EVERYWHERE, "a:b", "x" * 251],
    names.RUN_ID: [*BAD_EVERYWHERE, "x" * 251, "é"],
    names.CONN_ID: [
        *BAD_EVERYWHERE,
        "x" * 251,
        "-a",
        ".a",
        "é",
        "redis://h:6379/0",
        "a:b",
        "../x",
    ],
}


@pytest.mark.parametrize("rule", list(GOOD), ids=lambda r: r.kind)
def test_each_rule_takes_its_names_and_refuses_the_rest_by_a_full_match(rule) -> None:
    for value in GOOD[rule]:
        assert rule.check(value) == value
    for value in [*BAD[rule], None, 1, b"r1", ["r1"]]:
        with pytest.raises(InvalidNameError) as raised:
            rule.check(value)
        assert rule.kind in str(raised.value) and "use " in str(raised.value)
        assert isinstance(raised.value, ConfigurationError)


def test_range_ids_are_whole_numbers_in_range() -> None:
    assert names.range_id(0) == 0 and names.range_id(10**9) == 10**9
    for bad in (-1, 10**9 + 1, True, 1.0, "0", None):
        with pytest.raises(InvalidNameError):
            names.range_id(bad)


def test_the_store_refuses_a_malformed_round_id_before_it_builds_a_key(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """``r1:range:0`` would name range 0's hash as if it were a round (the page answered 500)."""
    store = CursorStore(redis_client, "s1", prefix=key_prefix)
    for bad in ("r1:range:0", "r1\n", "r*", "{r1}"):
        for build in (
            store.round_key,
            store.round_state,
            store.round_info,
            lambda r: store.range_key(r, 0),
            lambda r: store.dead_key(r, 0),
        ):
            with pytest.raises(InvalidNameError, match="round id"):
                build(bad)


@pytest.mark.parametrize(("stream", "prefix"), [("s1\n", "ks"), ("s1", "ks\n"), ("{s1}", "ks")])
def test_the_store_refuses_a_stream_or_prefix_with_a_trailing_newline(
    redis_client: redis.Redis, stream: str, prefix: str
) -> None:
    with pytest.raises(InvalidNameError):
        CursorStore(redis_client, stream, prefix=prefix)
