"""The traversal engine. Imports nothing from Airflow: usable from any orchestrator or script."""

from .chunk import Chunk, ChunkResult, load_processor
from .control import RoundCheck, StreamControl
from .errors import (
    CommitOrderTimeoutError,
    ConfigurationError,
    CursorConflictError,
    DeadLetterCapError,
    DependencyFailedError,
    EvictionPolicyError,
    KeysetError,
    KeyValidationError,
    LeaseHeldError,
    LeaseLostError,
    ProcessorContractError,
    RetentionError,
    RetryableError,
    RoundIncompleteError,
    RoundNotFoundError,
    RoundStateLostError,
    StoreUnavailableError,
    UnsupportedKeyTypeError,
)
from .options import TraverseOptions
from .traversal import KeysetTraversal, RangeResult, RangeSpec, Round, RoundTotals

__all__ = [
    "Chunk",
    "ChunkResult",
    "CommitOrderTimeoutError",
    "ConfigurationError",
    "CursorConflictError",
    "DeadLetterCapError",
    "DependencyFailedError",
    "EvictionPolicyError",
    "KeyValidationError",
    "KeysetError",
    "KeysetTraversal",
    "LeaseHeldError",
    "LeaseLostError",
    "ProcessorContractError",
    "RangeResult",
    "RangeSpec",
    "RetentionError",
    "RetryableError",
    "Round",
    "RoundCheck",
    "RoundIncompleteError",
    "RoundNotFoundError",
    "RoundStateLostError",
    "RoundTotals",
    "StoreUnavailableError",
    "StreamControl",
    "TraverseOptions",
    "UnsupportedKeyTypeError",
    "load_processor",
]
