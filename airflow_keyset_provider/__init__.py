"""airflow-keyset-provider: stable, resumable, parallel keyset traversal for Apache Airflow.

Names are exported lazily so that ``import airflow_keyset_provider.core`` (the engine) never loads
Airflow; only touching an operator, sensor or trigger does.
"""

from __future__ import annotations

import importlib
from typing import Any

# The one version source: pyproject.toml reads it (`[tool.setuptools.dynamic]`), and so do
# get_provider_info and the CLI's --version.
__version__ = "0.1.0"

_EXPORTS = {
    "Chunk": "airflow_keyset_provider.core.chunk",
    "ChunkResult": "airflow_keyset_provider.core.chunk",
    "RetryableError": "airflow_keyset_provider.core.errors",
    "KeysetTraversal": "airflow_keyset_provider.core.traversal",
    "TraverseOptions": "airflow_keyset_provider.core.options",
    "PlanRangesOperator": "airflow_keyset_provider.operators.plan",
    "PreviewRoundOperator": "airflow_keyset_provider.operators.preview",
    "TraverseRangeOperator": "airflow_keyset_provider.operators.traverse",
    "BarrierSensor": "airflow_keyset_provider.sensors.keyset",
    "stream_asset": "airflow_keyset_provider.sensors.keyset",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'airflow_keyset_provider' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
