"""A round's verification as recorded (``core/rounds/verification.py`` runs it): the
settings' names and checks, the states, and the record the status model reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..errors import ConfigurationError
from ..keys import display_key

#: the first matching keys kept by default
DEFAULT_VERIFY_KEYS = 20
#: rows per verification statement by default
DEFAULT_VERIFY_CHUNK = 10_000
#: the round hash's fields: the planned predicate and the last verification's result
VERIFY_FIELD = "verify"
VERIFICATION_FIELD = "verification"


class VerifyState(StrEnum):
    """The outcome of a round's verification."""

    VERIFIED = "verified"  #: no row of the round matches the predicate
    FAILED = "failed"  #: ``matching`` rows still match (``first_keys`` lists the lowest)


class OnVerifyFailure(StrEnum):
    """What a failed verification does."""

    FAIL = "fail"  #: the barrier fails with the count and the keys; the round stays open
    REPAIR = "repair"  #: one repair pass through the processor, then verify again


def check_verify_options(
    verify: Any, on_failure: Any = OnVerifyFailure.FAIL, max_keys: Any = DEFAULT_VERIFY_KEYS
) -> None:
    """Refuse a malformed verify setting, naming it (before anything runs)."""
    if verify is not None and (not isinstance(verify, str) or not verify.strip()):
        raise ConfigurationError(
            f"verify must be None or a non-empty SQL predicate, e.g. \"status = 'open'\", got {verify!r}"
        )
    if on_failure not in {m.value for m in OnVerifyFailure}:
        raise ConfigurationError(
            f"on_verify_failure must be 'fail' or 'repair', got {on_failure!r}"
        )
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or not 1 <= max_keys <= 10_000:
        raise ConfigurationError(
            f"verify_keys must be an integer from 1 to 10000, got {max_keys!r}"
        )


@dataclass(frozen=True)
class Verification:
    """A round's verification as recorded: JSON-safe through ``as_record``/``from_record``."""

    state: str
    matching: int
    first_keys: tuple[str, ...] = ()  #: encoded keys, lowest first
    repaired: int | None = None  #: keys a repair pass reported done (None: no repair pass)
    repair_failed: int = 0  #: keys the repair pass's processor named failed after every attempt
    rows_scanned: int = 0  #: rows read by the last scan
    seconds: float = 0.0  #: the last scan's duration
    checked_ms: int = 0  #: when it finished (Redis clock)
    arity: int = 1

    @property
    def verified(self) -> bool:
        return self.state == VerifyState.VERIFIED

    @property
    def key_labels(self) -> list[str]:
        return [display_key(k, self.arity) for k in self.first_keys]

    def describe(self) -> str:
        """One line: ``verified`` / ``failed: 3 row(s) still match (first keys: 4, 9, 12)``."""
        repaired = "" if self.repaired is None else f" after repairing {self.repaired} key(s)"
        if self.verified:
            return f"verified{repaired}: no row still matches ({self.rows_scanned} rows scanned)"
        more = "" if len(self.first_keys) >= self.matching else ", ..."
        failed = f", {self.repair_failed} failed in the repair pass" if self.repair_failed else ""
        return (
            f"failed{repaired}{failed}: {self.matching} row(s) still match (first keys: "
            f"{', '.join(self.key_labels)}{more})"
        )

    def as_record(self) -> str:
        return json.dumps(
            {
                "state": str(self.state),
                "matching": self.matching,
                "first_keys": list(self.first_keys),
                "repaired": self.repaired,
                "repair_failed": self.repair_failed,
                "rows_scanned": self.rows_scanned,
                "seconds": round(self.seconds, 3),
                "checked_ms": self.checked_ms,
            }
        )

    @classmethod
    def from_record(cls, raw: str | None, arity: int) -> Verification | None:
        if not raw:
            return None
        try:
            d = json.loads(raw)
            return cls(
                state=str(d["state"]),
                matching=int(d["matching"]),
                first_keys=tuple(str(k) for k in d.get("first_keys") or ()),
                repaired=None if d.get("repaired") is None else int(d["repaired"]),
                repair_failed=int(d.get("repair_failed") or 0),
                rows_scanned=int(d.get("rows_scanned") or 0),
                seconds=float(d.get("seconds") or 0.0),
                checked_ms=int(d.get("checked_ms") or 0),
                arity=arity,
            )
        except (ValueError, KeyError, TypeError):
            return None

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe, for the status model, the barrier's XCom and its asset event."""
        return {
            "state": str(self.state),
            "matching": self.matching,
            "first_keys": self.key_labels,
            "repaired": self.repaired,
            "repair_failed": self.repair_failed,
            "rows_scanned": self.rows_scanned,
            "seconds": round(self.seconds, 3),
        }


__all__ = [
    "DEFAULT_VERIFY_CHUNK",
    "DEFAULT_VERIFY_KEYS",
    "VERIFICATION_FIELD",
    "VERIFY_FIELD",
    "OnVerifyFailure",
    "Verification",
    "VerifyState",
    "check_verify_options",
]
