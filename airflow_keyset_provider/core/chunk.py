"""The processor contract: what a processor receives (``Chunk``) and returns (``ChunkResult``),
its type (``Processor``) and how a reference to one is resolved (``load_processor``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError, ProcessorContractError

Key = Any  # a scalar for a one-column key, a tuple for a composite key


@dataclass(frozen=True)
class ChunkResult:
    """A processor's verdict on a chunk. Keys not named here are *done*.

    - ``failed``: ``{key: reason}``, items that failed on their own (bad data, a 4xx). They are
      retried later in the same range, up to ``max_item_attempts``, then dead-lettered with the
      reason. The cursor moves on.
    - ``skipped``: keys that reached a terminal state without the business effect (the row no
      longer applies, lost a race). Counted as *skipped*, never retried.

    For a failed *dependency* (the whole chunk cannot be processed now) raise ``RetryableError``.
    """

    failed: Mapping[Hashable, str] = field(default_factory=dict)
    skipped: Sequence[Hashable] = ()


class Chunk:
    """A bounded, ordered slice of one range: ``cursor < key <= last key``.

    ``keys`` are the key values in order (scalars for a one-column key, tuples for a composite
    key). ``rows`` are mappings of the fetched columns. Both are built on first access, so a
    processor that uses neither pays nothing for them. ``attempt`` is 1 on the first delivery of
    these rows in this process and grows on re-delivery after a dependency failure; a chunk may also
    be delivered again after a crash (at-least-once), so processors must be idempotent.

    ``connection``: with a target database (``KeysetTraversal(target_url=...)``, the operator's
    ``target_conn_id``), a SQLAlchemy ``Connection`` inside a transaction the engine began for
    this call: the engine commits it when the processor returns (a ``ChunkResult`` included: the
    writes for the keys it did not fail stand) and rolls it back when the processor raises. The
    processor never commits it. None without a target.
    """

    __slots__ = (
        "_keys",
        "_rows",
        "_values",
        "attempt",
        "columns",
        "connection",
        "key_of",
        "range_id",
        "round_id",
    )

    def __init__(
        self,
        round_id: str,
        range_id: int,
        columns: Sequence[str],
        values: Sequence[tuple],
        key_of: Callable[[tuple], Key],
        attempt: int = 1,
    ) -> None:
        self.round_id = round_id
        self.range_id = range_id
        self.columns = tuple(columns)
        self._values: Any = values
        self.key_of = key_of
        self.attempt = attempt
        self._rows: list[dict[str, Any]] | None = None
        self._keys: list[Key] | None = None
        self.connection: Any = None  # set by the engine for one call (see the class docstring)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def values(self) -> list[tuple]:
        """Raw row tuples in ``columns`` order (the cheapest view)."""
        materialize = getattr(self._values, "materialize", None)
        if materialize is not None:  # still in the driver's buffer: convert on first access
            self._values = materialize()
        return self._values

    @property
    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            cols = self.columns
            self._rows = [dict(zip(cols, v, strict=True)) for v in self.values]
        return self._rows

    @property
    def keys(self) -> list[Key]:
        if self._keys is None:
            key_of = self.key_of
            self._keys = [key_of(v) for v in self.values]
        return self._keys

    def head(self, n: int) -> Chunk:
        """The first ``n`` rows as a chunk of the same range (a preview's warm-up call)."""
        return Chunk(
            self.round_id, self.range_id, self.columns, self.values[:n], self.key_of, self.attempt
        )

    def __repr__(self) -> str:
        return f"Chunk(round={self.round_id!r}, range={self.range_id}, rows={len(self)})"


def check_result(result: Any, where: str = "the chunk") -> ChunkResult | None:
    """``result`` if it has the shape of a processor's verdict: None, or a ``ChunkResult`` whose
    ``failed`` is a mapping of hashable keys to ``str`` reasons and whose ``skipped`` is a
    collection (list, tuple, set) of hashable keys. Anything else raises
    ``ProcessorContractError`` naming the field, the expected type and what was given: a bug in
    the processor, refused at once (never retried, nothing of the chunk committed: the engine
    checks it before it commits the call's transaction). ``where`` names the chunk's range."""
    if result is None:
        return None
    done = f" Nothing of {where} was committed."
    if not isinstance(result, ChunkResult):
        raise ProcessorContractError(
            f"processor returned {type(result).__name__}; it must return ChunkResult or None.{done}"
        )
    if not isinstance(result.failed, Mapping):
        raise ProcessorContractError(
            f"ChunkResult.failed is {type(result.failed).__name__}; expected a mapping "
            f"{{key: reason (str)}}, e.g. ChunkResult(failed={{key: 'why'}}).{done}"
        )
    for key, reason in result.failed.items():
        _hashable(key, "failed", done)
        if not isinstance(reason, str):
            raise ProcessorContractError(
                f"ChunkResult.failed has a reason of type {type(reason).__name__}; expected "
                f"str.{done}"
            )
    skipped = result.skipped
    if isinstance(skipped, str | bytes | Mapping) or not isinstance(
        skipped, Sequence | set | frozenset
    ):
        raise ProcessorContractError(
            f"ChunkResult.skipped is {type(skipped).__name__}; expected a list, tuple or set "
            f"of keys (an empty tuple for none).{done}"
        )
    for key in skipped:
        _hashable(key, "skipped", done)
    return result


def checked(
    processor: Callable[[Chunk], Any], where: str = "the chunk"
) -> Callable[[Chunk], ChunkResult | None]:
    """``processor`` whose every return value goes through ``check_result`` as it returns."""

    def call(chunk: Chunk) -> ChunkResult | None:
        return check_result(processor(chunk), where)

    return call


def _hashable(key: Any, field_name: str, done: str) -> None:
    if not isinstance(key, Hashable) or isinstance(key, list | dict | set):
        raise ProcessorContractError(
            f"ChunkResult.{field_name} has a key of type {type(key).__name__}; expected a key "
            f"of the chunk (a scalar, or a tuple for a composite key).{done}"
        )


Processor = Callable[[Chunk], "ChunkResult | None"]
"""A processor: called with each chunk, returns ``ChunkResult`` (or None: every key done), raises
``RetryableError`` when a dependency fails. It must be idempotent (at-least-once delivery)."""


#: The attribute through which a wrapper names the processor it wraps (``@task.keyset_traverse``
#: sets it): the engine calls what it names, never the wrapper.
PROCESSOR_ATTRIBUTE = "__keyset_processor__"


def as_processor(processor: Any) -> Callable[..., Any]:
    """The callable the engine calls for ``processor``: the function a wrapper names through
    ``PROCESSOR_ATTRIBUTE`` (a ``@task.keyset_traverse`` task), else ``processor`` itself;
    ``ConfigurationError`` when it is not callable."""
    fn = getattr(processor, PROCESSOR_ATTRIBUTE, processor)
    if not callable(fn):
        raise ConfigurationError(
            f"processor must be callable (chunk) -> ChunkResult | None, got {processor!r}"
        )
    return fn


def load_processor(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable, or ``"package.module:function"`` (also ``package.module.function``); a
    ``@task.keyset_traverse`` task gives its function (``as_processor``)."""
    if callable(ref):
        return as_processor(ref)
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigurationError(
            f"processor must be a callable or 'package.module:function', got {ref!r}"
        )
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, _, attr = ref.rpartition(".")
    if not module_name or not attr:
        raise ConfigurationError(f"processor {ref!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"processor {ref!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    fn = getattr(module, attr, None)
    fn = getattr(fn, PROCESSOR_ATTRIBUTE, fn)
    if not callable(fn):
        raise ConfigurationError(
            f"processor {ref!r}: module {module_name!r} has no callable {attr!r}"
        )
    return fn
