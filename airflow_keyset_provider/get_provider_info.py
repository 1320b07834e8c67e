"""Provider metadata, registered through the ``apache_airflow_provider`` entry point.

Besides the modules, it declares the ``[keyset]`` configuration section (every option the provider
reads with ``conf``; Airflow then knows their defaults: ``airflow config get-value keyset ...``,
``airflow config list``) and the UI plugin. It is data, a module constant of which
``get_provider_info`` returns a copy. Kept free of imports beyond the standard library: Airflow
calls it while discovering providers (the package's ``__init__``, which holds the version, imports
nothing else either). ``tests/airflow/test_provider_info.py`` checks it against Airflow's schema,
against the defaults the code falls back to, and through the real ``airflow`` CLI.
"""

from __future__ import annotations

import copy
from typing import Any

from . import __version__ as VERSION  # the one version source (the package's ``__init__``)

# The release that introduced the ``[keyset]`` options: a fact of history, not the current version.
CONFIG_ADDED_IN = "0.1.0"

_PROVIDER_INFO: dict[str, Any] = {
    "package-name": "airflow-keyset-provider",
    "name": "Keyset traversal",
    "description": (
        "Resumable, parallel keyset traversal of huge changing tables in a stable total order, "
        "with fenced Redis cursors and a barrier that proves no key was skipped."
    ),
    "versions": [VERSION],
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
            "python-modules": [
                "airflow_keyset_provider.operators.plan",
                "airflow_keyset_provider.operators.preview",
                "airflow_keyset_provider.operators.traverse",
            ],
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
    "task-decorators": [
        {
            "name": "keyset_traverse",
            "class-name": "airflow_keyset_provider.decorators.keyset.keyset_traverse_task",
        }
    ],
    "extra-links": ["airflow_keyset_provider.links.KeysetRoundLink"],
    "plugins": [
        {
            "name": "keyset",
            "plugin-class": "airflow_keyset_provider.plugins.keyset.KeysetPlugin",
        }
    ],
    "config": {
        "keyset": {
            "description": (
                "The 'Keyset traversals' UI page (API server plugin): which cursor store it "
                "reads. Point it at the same Redis connection and key prefix the operators use."
            ),
            "options": {
                "redis_conn_id": {
                    "description": (
                        "Airflow connection id of the Redis that holds the keyset cursors "
                        "(the operators' redis_conn_id)."
                    ),
                    "version_added": CONFIG_ADDED_IN,
                    "type": "string",
                    "example": "keyset_redis",
                    "default": "redis_default",
                },
                "key_prefix": {
                    "description": (
                        "Redis key prefix of the cursor store (the operators' key_prefix); "
                        "the page shows every stream under it."
                    ),
                    "version_added": CONFIG_ADDED_IN,
                    "type": "string",
                    "example": "nightly",
                    "default": "ks",
                },
            },
        }
    },
}


def get_provider_info() -> dict[str, Any]:
    """The provider's metadata in the format of Airflow's ``provider_info.schema.json`` (a fresh
    copy on each call: a caller may change it without changing the next one)."""
    return copy.deepcopy(_PROVIDER_INFO)
