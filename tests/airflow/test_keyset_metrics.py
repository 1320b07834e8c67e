"""The Airflow adapter sends the engine's metrics to Airflow's Stats: here a real StatsD UDP socket."""

from __future__ import annotations

import socket

from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
from airflow.sdk.observability.metrics.statsd_logger import get_statsd_logger
from airflow.sdk.observability.stats import initialize

from airflow_keyset_provider.hooks.keyset import AirflowStatsMetrics


def test_metrics_reach_statsd(monkeypatch):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    initialize(factory=get_statsd_logger, export_legacy_names=False)
    try:
        metrics = AirflowStatsMetrics()
        metrics.incr("rows.done", 250, tags={"stream": "events"})
        metrics.timing("chunk.process", 12.5, tags={"stream": "events"})
        packets = {sock.recv(512).decode() for _ in range(2)}
    finally:
        initialize(factory=NoStatsLogger, export_legacy_names=False)
        sock.close()
    assert "airflow.keyset.rows.done:250|c" in packets
    assert any(
        p.startswith("airflow.keyset.chunk.process:12.5") and p.endswith("|ms") for p in packets
    ), packets
