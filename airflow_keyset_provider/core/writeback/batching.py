"""Input checks and batch splitting shared by the helpers."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from airflow_keyset_provider.core.errors import ConfigurationError

#: Most rows (keys) one statement writes, so a chunk of up to 10k rows is one round trip. Larger
#: inputs are split; the driver's bound-parameter limit (and SQLite's CASE cost) may split further.
DEFAULT_BATCH_SIZE = 10_000


def check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigurationError(f"batch_size must be a positive int, got {batch_size!r}.")


def as_mapping(row: Any) -> Mapping[str, Any]:
    mapping = getattr(row, "_mapping", row)  # accept SQLAlchemy Row objects too
    if not isinstance(mapping, Mapping):
        raise ConfigurationError(f"rows must be mappings of column name to value, got {row!r}.")
    return mapping


def as_mappings(rows: Any) -> list[Mapping[str, Any]]:
    """``rows`` as a list of mappings (:func:`as_mapping` each, unless all are dicts already)."""
    items = rows if isinstance(rows, list) else list(rows)
    if set(map(type, items)) <= {dict}:
        return items
    return [as_mapping(r) for r in items]


def group_by_columns(
    rows: list[Mapping[str, Any]],
) -> list[tuple[tuple[str, ...], list[Mapping[str, Any]]]]:
    """Rows that set the same columns go in one statement (first-seen order kept)."""
    groups: dict[frozenset[str], tuple[tuple[str, ...], list[Mapping[str, Any]]]] = {}
    for row in rows:
        group = groups.get(frozenset(row))
        if group is None:
            group = groups[frozenset(row)] = (tuple(row), [])
        group[1].append(row)
    return list(groups.values())


def split(
    items: list, batch_size: int, max_params: int, per_item: int, fixed: int
) -> Iterator[list]:
    """``items`` in consecutive batches of at most ``batch_size``, fewer if ``per_item`` bound
    parameters per item plus ``fixed`` would pass ``max_params``."""
    size = batch_size
    if per_item:
        size = min(size, max(1, (max_params - fixed) // per_item))
    for start in range(0, len(items), size):
        yield items[start : start + size]


def guard_params(expected: Any) -> int:
    """Bound parameters a guard adds to a statement: one per ``{column: value}`` entry."""
    return len(expected) if isinstance(expected, Mapping) else 0
