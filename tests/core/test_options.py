"""``TraverseOptions`` (``core/options.py``): every traverse setting is checked once, when the
options are built, and a refusal names the setting; the settings are keyword-only, so two of the
same type cannot be swapped by position."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from airflow_keyset_provider.core import ConfigurationError, TraverseOptions
from airflow_keyset_provider.core.options import OPTION_NAMES
from airflow_keyset_provider.testing import run_processor

BAD_VALUES = [
    ("chunk_size", 0),
    ("chunk_size", -5),
    ("chunk_size", 1.5),
    ("chunk_size", "10"),
    ("chunk_size", True),
    ("lease_seconds", 0),
    ("lease_seconds", 0.5),
    ("lease_seconds", "60"),
    ("max_chunk_attempts", 0),
    ("max_chunk_attempts", 2.5),
    ("retry_budget_seconds", 0),
    ("retry_budget_seconds", "90"),
    ("max_item_attempts", -1),
    ("owner_lineage", None),
    ("claim_timeout", -1),
    ("chunk_timeout", 0),
    ("chunk_timeout", float("nan")),
    ("backoff_base", -0.1),
    ("backoff_max", float("nan")),
    ("item_retry_delay", "0.5"),
    ("outage_failure_ratio", -0.5),
    ("prefetch", "yes"),
    ("exactly_once", "yes"),
    ("log_every_seconds", -1),
    ("dead_cap", -1),
    ("dead_cap", 2.0),
    ("group_commit_chunks", 0),
    ("group_commit_seconds", -1.0),
    ("control_poll_seconds", 0),
    ("yield_after_seconds", -1),
    ("health_checks", ["SELECT 1"]),
    ("health_checks", "SELECT 1"),
    ("health_poll_seconds", 0),
    ("target_chunk_seconds", 0),
    ("min_chunk_size", 0),
    ("max_chunk_size", 1.5),
    ("max_chunk_size", 10_000_000),
    ("chunk_size", 1_000_001),
    ("max_chunk_bytes", 0),
    ("max_chunk_bytes", 1.5),
    ("max_task_seconds", 0),
    ("max_task_seconds", "3600"),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_a_bad_setting_is_refused_by_name(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^{name} must be"):
        TraverseOptions(**{name: value})


def test_every_setting_is_checked() -> None:
    """Each field of ``TraverseOptions`` has at least one refused value above."""
    assert {name for name, _ in BAD_VALUES} == OPTION_NAMES


def test_defaults_and_boundaries_are_accepted() -> None:
    TraverseOptions()
    TraverseOptions(lease_seconds=1, dead_cap=0, backoff_base=0, item_retry_delay=0)
    TraverseOptions(claim_timeout=0, group_commit_seconds=0, outage_failure_ratio=2)
    assert TraverseOptions(chunk_timeout=float("inf")).chunk_timeout_seconds == float("inf")
    assert TraverseOptions(lease_seconds=30).chunk_timeout_seconds == 300


def test_settings_are_keyword_only() -> None:
    """``backoff_base``, ``backoff_max``, ``item_retry_delay`` and ``outage_failure_ratio`` are
    all floats: by position they could be swapped silently, so no position is accepted."""
    with pytest.raises(TypeError):
        TraverseOptions(0.5, 30.0, 0.5, 0.5)  # type: ignore[misc]
    options = TraverseOptions(backoff_base=0.1, backoff_max=2.0, item_retry_delay=0.3)
    assert (options.backoff_base, options.backoff_max, options.item_retry_delay) == (0.1, 2.0, 0.3)


def test_options_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TraverseOptions().chunk_size = 5  # type: ignore[misc]


def test_from_kwargs_names_an_unknown_setting() -> None:
    assert TraverseOptions.from_kwargs(chunk_size=7) == TraverseOptions(chunk_size=7)
    with pytest.raises(
        ConfigurationError, match=r"unknown traverse option.*chunksize.*known: .*chunk_size"
    ):
        TraverseOptions.from_kwargs(chunksize=7)


def test_run_processor_refuses_a_bad_setting_before_touching_anything() -> None:
    """The options are built first: nothing is connected or written for a bad setting."""
    with pytest.raises(ConfigurationError, match=r"^max_item_attempts must be"):
        run_processor(lambda chunk: None, "sqlite://", "t", "k", max_item_attempts=0)
