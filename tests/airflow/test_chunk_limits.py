"""An absurd chunk size is refused when the DAG is parsed, by the operator and by the decorator
(a mapped task builds its operator only when it runs, so the decorator checks the numbers it
was given itself), with the limit and the fix in the message."""

from __future__ import annotations

import pytest

from airflow_keyset_provider.core.errors import ConfigurationError


def _noop(chunk):
    return None


def test_the_operator_refuses_an_absurd_chunk_size_at_parse_time():
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_keyset_provider.operators.traverse import TraverseRangeOperator

    common = dict(round_id="r1", range_id=0, processor=_noop, source_conn_id="s", table="t")
    with pytest.raises(AirflowFailException, match=r"chunk_size must be at most 1,000,000 rows"):
        TraverseRangeOperator(task_id="big", key="id", chunk_size=50_000_000, **common)
    with pytest.raises(AirflowFailException, match=r"max_chunk_bytes must be a positive integer"):
        TraverseRangeOperator(task_id="zero", key="id", max_chunk_bytes=0, **common)
    op = TraverseRangeOperator(task_id="ok", key="id", max_chunk_bytes=2**20, **common)
    assert op.options.max_chunk_bytes == 2**20


def test_the_decorator_refuses_an_absurd_chunk_size_when_the_dag_is_parsed():
    from airflow_keyset_provider.decorators.keyset import keyset_traverse_task

    with pytest.raises(ConfigurationError, match=r"chunk_size must be at most 1,000,000 rows"):
        keyset_traverse_task(chunk_size=10**8)(_noop)
    task = keyset_traverse_task(chunk_size=5000, max_chunk_bytes=None)(_noop)
    with pytest.raises(ConfigurationError, match=r"max_chunk_size must be at most"):
        task.override(max_chunk_size=10**7)
    assert task.override(chunk_size=10).traverse_kwargs["chunk_size"] == 10
