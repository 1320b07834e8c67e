"""``airflow_keyset_provider.testing.run_processor`` against real SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import redis
from cli_support import make_events, poison_processor

from airflow_keyset_provider import RetryableError, testing
from airflow_keyset_provider.core import (
    ConfigurationError,
    DependencyFailedError,
    KeyValidationError,
    ProcessorContractError,
)
from airflow_keyset_provider.testing import run_processor


@pytest.fixture(params=["sqlite", "postgresql"])
def events_url(request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_schema_url")
    make_events(url, 400)
    return url


@pytest.fixture
def run_prefix(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pin the helper's throwaway key prefix so the test can look for leftovers."""
    run_id = uuid.uuid4().hex[:12]
    monkeypatch.setattr(testing, "_new_run_id", lambda: run_id)
    return f"ks-test-{run_id}"


def _keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{prefix}:*", count=1000))


def test_run_processor_returns_totals_and_dead_letters(
    events_url: str, redis_url: str, redis_client: redis.Redis, run_prefix: str
) -> None:
    during: list[int] = []

    def processor(chunk):  # type: ignore[no-untyped-def]
        during.append(len(_keys_under(redis_client, run_prefix)))
        return poison_processor(chunk)

    run = run_processor(processor, events_url, "events", "seq", redis_url=redis_url, chunk_size=64)
    assert min(during) > 0  # the round really lived under that prefix ...
    assert _keys_under(redis_client, run_prefix) == []  # ... and nothing of it is left
    assert run.key_prefix == run_prefix
    assert (run.done, run.skipped, run.dead) == (400 - 10 - 8, 8, 10)
    assert run.items == 400 and run.rows_read == 400
    assert run.dead_keys == [37, 74, 111, 148, 185, 222, 259, 296, 333, 370]
    assert all(d["attempts"] == 3 and d["error"].startswith("poison") for d in run.dead_letters)
    assert (run.start_key, run.end_key) == (None, 400)


def test_where_rows_and_bounds_restrict_the_round(events_url: str, redis_url: str) -> None:
    seen: list[int] = []

    def record(chunk):  # type: ignore[no-untyped-def]
        seen.extend(chunk.keys)

    run = run_processor(
        record,
        events_url,
        "events",
        "seq",
        redis_url=redis_url,
        where="seq % 2 = 0",
        rows=10,
        max_ranges=3,
        chunk_size=4,
    )
    assert seen == list(range(2, 21, 2)) and run.done == 10 and run.end_key == 20
    seen.clear()
    run = run_processor(record, events_url, "events", "seq", redis_url=redis_url, start_key=390)
    assert seen == list(range(391, 401)) and run.done == 10
    seen.clear()
    run = run_processor(
        record, events_url, "events", "seq", redis_url=redis_url, start_key=100, end_key=105
    )
    assert seen == [101, 102, 103, 104, 105]
    seen.clear()
    run = run_processor(record, events_url, "events", "seq", redis_url=redis_url, rows=0)
    assert seen == [] and run.items == 0


def test_errors_propagate_and_keys_are_still_cleaned_up(
    events_url: str, redis_url: str, redis_client: redis.Redis, run_prefix: str
) -> None:
    def down(chunk):  # type: ignore[no-untyped-def]
        raise RetryableError("downstream API answers 503")

    with pytest.raises(DependencyFailedError, match="downstream API answers 503"):
        run_processor(down, events_url, "events", "seq", redis_url=redis_url, max_chunk_attempts=2)
    with pytest.raises(ProcessorContractError):
        run_processor(
            lambda chunk: {"failed": []}, events_url, "events", "seq", redis_url=redis_url
        )
    with pytest.raises(KeyValidationError, match="payload"):
        run_processor(lambda chunk: None, events_url, "events", "payload", redis_url=redis_url)
    with pytest.raises(ConfigurationError, match="rows or end_key"):
        run_processor(
            lambda chunk: None, events_url, "events", "seq", redis_url=redis_url, rows=3, end_key=9
        )
    assert _keys_under(redis_client, run_prefix) == []


def test_processor_given_as_a_dotted_path_and_no_airflow_import(
    sqlite_url: str, redis_url: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    make_events(sqlite_url, 30)
    (tmp_path / "my_dag_processors.py").write_text(
        textwrap.dedent("""
        from airflow_keyset_provider import ChunkResult

        def enrich(chunk):
            return ChunkResult(skipped=[k for k in chunk.keys if k > 25])
    """)
    )
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from airflow_keyset_provider.testing import run_processor
        run = run_processor("my_dag_processors:enrich", {sqlite_url!r}, "events", "seq", redis_url={redis_url!r})
        assert (run.done, run.skipped, run.dead) == (25, 5, 0), run
        assert not [m for m in sys.modules if m == "airflow" or m.startswith("airflow.")]
        print("ok")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
