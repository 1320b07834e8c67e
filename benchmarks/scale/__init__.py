"""The scale proof (issue #22): one round of 10^8 rows on one machine, and under a real scheduler.

``python -m benchmarks.scale build --rows N`` builds (or reuses) the table; ``... round`` runs the
measured round; ``... airflow`` runs the same DAG shape on a real Airflow deployment. Never in CI:
``make bench-100m`` runs the 10^8-row build and round on demand.
"""
