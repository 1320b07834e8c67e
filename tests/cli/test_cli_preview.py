"""``airflow-keyset preview``: the next round's bounds, estimates, plan, sample, processor verdict
and ETA from the command line, writing nothing (the table and Redis compared before and after);
exit 3 when the preview lists a problem (here: keys the processor failed)."""

from __future__ import annotations

import io
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from cli_support import make_events

from airflow_keyset_provider.cli import main
from airflow_keyset_provider.cli.exits import EXIT_INCOMPLETE, EXIT_OK

PROCESSOR = """
from airflow_keyset_provider import ChunkResult
import sqlalchemy as sa

def process(chunk):
    chunk.connection.execute(
        sa.text("UPDATE events SET payload = 'done' WHERE seq = :s"),
        [{"s": k} for k in chunk.keys],
    )
    return ChunkResult(failed={k: "seq divisible by 9" for k in chunk.keys if k % 9 == 0})
"""


@pytest.fixture
def processor_module(tmp_path: Path) -> Iterator[None]:
    (tmp_path / "preview_proc.py").write_text(textwrap.dedent(PROCESSOR))
    sys.path.insert(0, str(tmp_path))
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop("preview_proc", None)


def _snapshot(url: str, client: redis.Redis, prefix: str) -> tuple:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            rows = [tuple(r) for r in c.exec_driver_sql("SELECT * FROM events ORDER BY seq")]
    finally:
        engine.dispose()
    keys = {k: client.dump(k) for k in client.scan_iter(match=f"{prefix}:*")}
    return rows, keys


def test_preview_from_the_command_line(
    pg_schema_url: str, redis_url: str, key_prefix: str, processor_module: None
) -> None:
    make_events(pg_schema_url, 300)
    client = redis.Redis.from_url(redis_url)
    argv = [
        "preview", "events-nightly", "--source-url", pg_schema_url, "--table", "events",
        "--key", "seq", "--max-ranges", "3", "--chunk-size", "50", "--new-stream",
        "--redis-url", redis_url, "--key-prefix", key_prefix,
    ]  # fmt: skip
    try:
        before = _snapshot(pg_schema_url, client, key_prefix)
        out, err = io.StringIO(), io.StringIO()
        code = main([*argv, "--json"], stdout=out, stderr=err)
        assert code == EXIT_OK, err.getvalue()
        doc = json.loads(out.getvalue())
        assert (doc["start_key"], doc["end_key"], len(doc["ranges"])) == (None, 300, 3)
        assert doc["sample"]["rows"] == 100 and not doc["processor"]["ran"]  # range 0: 2 chunks

        with_processor = [*argv, "--processor", "preview_proc:process"]
        out, err = io.StringIO(), io.StringIO()
        code = main([*with_processor, "--target-url", pg_schema_url], stdout=out, stderr=err)
        text = out.getvalue()
        assert code == EXIT_INCOMPLETE, err.getvalue()  # the processor failed keys: a problem
        assert "89 applied, 0 not applied, 11 failed" in text, text  # 9, 18, ..., 99
        assert "failed x11: seq divisible by 9" in text and "PROBLEM:" in text
        assert "ETA" in text and "chunk query: index range" in text
        after = _snapshot(pg_schema_url, client, key_prefix)
    finally:
        client.close()
    assert after == before
