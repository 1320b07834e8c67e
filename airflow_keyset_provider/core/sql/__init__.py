"""The SQL side: a table read in key order, and everything the engine proves from the database.

Owns the chunk read (``source``, the compiled DBAPI hot path in ``fetch``), the key checks that
refuse a key without a stable total order (``key_checks``, reading the catalog through
``catalog``; the one list of accepted key types per database is ``key_types``), the wait until every key at or below a round's end has committed
(``commit_order``) and the planner's row estimates and quantiles (``sampling``). Per-database
differences live behind one interface, ``dialects.base.Dialect``, one module per database in
``dialects/`` (PostgreSQL, SQLite, MySQL/MariaDB), and nowhere else. May use the shared vocabulary (``core.keys``,
``core.errors``); knows nothing of Redis, ranges' owners or Airflow.
"""
