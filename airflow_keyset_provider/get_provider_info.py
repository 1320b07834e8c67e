"""Provider metadata, registered through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-keyset-provider",
        "name": "Keyset traversal",
        "description": (
            "Resumable, parallel keyset traversal of huge changing tables in a stable total order, "
            "with fenced Redis cursors and a barrier that proves no key was skipped."
        ),
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "Keyset traversal",
                "external-doc-url": "https://pypi.org/project/airflow-keyset-provider/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Keyset traversal",
                "python-modules": ["airflow_keyset_provider.operators.keyset"],
            }
        ],
        "sensors": [
            {
                "integration-name": "Keyset traversal",
                "python-modules": ["airflow_keyset_provider.sensors.keyset"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Keyset traversal",
                "python-modules": ["airflow_keyset_provider.triggers.keyset"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Keyset traversal",
                "python-modules": ["airflow_keyset_provider.hooks.keyset"],
            }
        ],
    }
