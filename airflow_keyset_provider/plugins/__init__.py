"""Airflow plugin of the keyset provider: the "Keyset traversals" page in the Airflow UI.

``keyset.KeysetPlugin`` is registered through the ``airflow.plugins`` entry point. It mounts a
small FastAPI app (``app.py``) on the Airflow API server under ``/keyset`` and adds a navigation
entry (Browse > Keyset traversals) that shows that app's page inside the Airflow UI.
"""
