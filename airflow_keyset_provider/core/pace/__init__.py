"""Pacing: how fast a stream may go, decided between chunks.

Owns pause, resume and throttle and the pacer every traversal consults (``stream_control``), the
stream-wide token bucket (``governor``), the health checks of the source (``health``) and the
adaptive chunk size (``adaptive``). May use ``core.store`` (the control hash, the bucket) and the
shared vocabulary; knows nothing of ranges' cursors or Airflow.
"""
