"""``PreviewRoundOperator``: what the next round would be and do, before anything is written.

A task of its own, so a DAG reads ``preview >> approve >> plan >> traverse >> barrier`` and a
person (Airflow's ``ApprovalOperator``) decides on what the preview found. The engine does the
work (``KeysetTraversal.preview``, ``core/preview/``); this adapter reads the connections, returns
the preview as its XCom and pushes a Markdown rendering for an approval's ``body``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context

from airflow_keyset_provider.common import (
    PREVIEW_XCOM_KEY,
    airflow_errors,
    check_names,
    configured_key_prefix,
)
from airflow_keyset_provider.core import load_processor
from airflow_keyset_provider.core.keys import parse_bound
from airflow_keyset_provider.core.preview.render import markdown, text_lines
from airflow_keyset_provider.durable_record import asset_name, read_record
from airflow_keyset_provider.hooks.keyset import KeysetHook
from airflow_keyset_provider.operators.plan import _check_max_ranges, _typed_bound

#: XCom key of the preview's Markdown rendering (for ``ApprovalOperator(body=...)``)
PREVIEW_MARKDOWN_XCOM_KEY = "keyset_preview_markdown"


class PreviewRoundOperator(BaseOperator):
    """Preview the round ``PlanRangesOperator`` would plan, and the processor on a sample of it.

    Returns (XCom ``return_value``) ``KeysetTraversal.preview(...).as_dict()``: the bounds the
    plan would fix (or the open round it would return), the ranges with the database's row
    estimates, the chunk query's plan (a full scan is listed under ``problems``), a sample chunk
    read and timed, the processor's verdict on it (applied / not applied / failed with reasons)
    in a target transaction that is rolled back, and the round's ETA. Pushes the same as Markdown
    under XCom key ``keyset_preview_markdown``, for an approval's body::

        approve = ApprovalOperator(
            task_id="approve",
            subject="Cancel stale orders?",
            body="{{ ti.xcom_pull(task_ids='preview', key='keyset_preview_markdown') }}",
        )

    The same document goes under XCom key ``keyset_preview``: the UI page shows a stream's latest
    preview from it. Writes nothing: not to the source, not to the target, not to Redis. The processor runs only
    with ``target_conn_id`` (its writes through ``chunk.connection`` are rolled back); a
    processor that writes anywhere else must not be previewed.

    Give it the plan's arguments (``source_conn_id``, ``table``, ``key``, ``stream``, ``where``,
    ``start_key``, ``end_key``, ``max_ranges``, ``key_prefix``) and the traversal's
    (``processor``, ``target_conn_id``, ``chunk_size``, ``columns``). ``plan_task_id``: the plan
    task of the same DAG run, so a preview run again after the plan ran shows that round.
    ``workers``: how many traverse tasks run at once (the ETA's parallelism; default: the plan's
    ``max_tasks``, else ``max_ranges``, which Airflow's parallelism and pools may lower).
    ``sample_chunks``: how many chunks of ``chunk_size`` the sample reads and the processor
    tries (default 8; the ETA is the rate over them).
    """

    template_fields: Sequence[str] = (
        "table",
        "key",
        "where",
        "columns",
        "start_key",
        "end_key",
        "stream",
    )
    ui_color = "#f3ecd8"

    def __init__(
        self,
        *,
        source_conn_id: str,
        table: str,
        key: str | Sequence[str],
        processor: Callable[..., Any] | str | None = None,
        target_conn_id: str | None = None,
        redis_conn_id: str = "redis_default",
        stream: str | None = None,
        where: str | None = None,
        where_params: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        start_key: Any = None,
        end_key: Any = None,
        max_ranges: int = 16,
        max_tasks: int | None = None,
        chunk_size: int = 1000,
        workers: int | None = None,
        sample_chunks: int = 8,
        key_prefix: str | None = None,
        plan_task_id: str | None = "plan",
        commit_wait_timeout: float = 60.0,
        settle_seconds: float = 0.0,
        new_stream: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_max_ranges(max_ranges, max_tasks)
        self.source_conn_id, self.table, self.key = source_conn_id, table, key
        self.processor, self.target_conn_id = processor, target_conn_id
        self.redis_conn_id, self.stream = redis_conn_id, stream
        self.where, self.where_params, self.columns = where, where_params, columns
        self.start_key, self.end_key = start_key, end_key
        self.max_ranges, self.max_tasks = max_ranges, max_tasks
        self.chunk_size, self.sample_chunks = chunk_size, sample_chunks
        self.workers = workers if workers is not None else (max_tasks or max_ranges)
        self.key_prefix = key_prefix if key_prefix is not None else configured_key_prefix()
        check_names(stream=stream, key_prefix=self.key_prefix)
        self.plan_task_id = plan_task_id
        self.commit_wait_timeout, self.settle_seconds = commit_wait_timeout, settle_seconds
        self.new_stream = new_stream
        self._declare_stream_asset(stream)

    def _declare_stream_asset(self, stream: str | None) -> None:
        """The stream's asset as an inlet, as on the plan: the preview reads the same durable
        record of the stream (Airflow's asset state) the plan reads, so it sees the same start."""
        name = stream if stream is not None else (self.dag_id if self.has_dag() else None)
        if not isinstance(name, str) or not name or "{{" in name:
            return
        asset = Asset(asset_name(name))
        if not any(isinstance(i, Asset) and i.name == asset.name for i in self.inlets):
            self.inlets = [*self.inlets, asset]

    def execute(self, context: Context) -> dict[str, Any]:
        stream = self.stream or self.dag_id
        key = list(self.key) if not isinstance(self.key, str) else self.key
        ti = context["ti"]
        round_key = f"{ti.dag_id}/{ti.run_id}/{self.plan_task_id}" if self.plan_task_id else None
        with airflow_errors():
            processor = load_processor(self.processor) if self.processor is not None else None
            hook = KeysetHook(
                self.source_conn_id, self.redis_conn_id, target_conn_id=self.target_conn_id
            )
            t = hook.traversal(
                table=self.table,
                key=key,
                stream=stream,
                where=self.where,
                where_params=self.where_params,
                columns=list(self.columns) if self.columns is not None else None,
                key_prefix=self.key_prefix,
                commit_wait_timeout=self.commit_wait_timeout,
                settle_seconds=self.settle_seconds,
            )
            try:
                start, end = parse_bound(self.start_key), parse_bound(self.end_key)
                if start is not None or end is not None:
                    t.source.validate()
                    start = _typed_bound(t, "start_key", start)
                    end = _typed_bound(t, "end_key", end)
                preview = t.preview(
                    self.max_ranges,
                    start,
                    end,
                    processor=processor,
                    chunk_size=self.chunk_size,
                    workers=self.workers,
                    sample_chunks=self.sample_chunks,
                    round_key=round_key,
                    new_stream=self.new_stream,
                    record=read_record(stream, t) if start is None else None,
                )
            finally:
                t.close()
        doc = preview.as_dict()
        for line in text_lines(doc):
            self.log.info("%s", line)
        ti.xcom_push(key=PREVIEW_MARKDOWN_XCOM_KEY, value=markdown(doc))
        ti.xcom_push(key=PREVIEW_XCOM_KEY, value=doc)
        return doc


__all__ = ["PREVIEW_MARKDOWN_XCOM_KEY", "PREVIEW_XCOM_KEY", "PreviewRoundOperator"]
