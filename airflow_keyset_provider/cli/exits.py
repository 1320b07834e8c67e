"""Exit codes of ``airflow-keyset`` and the error that carries one."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_LOST = 4
EXIT_NOT_FOUND = 5
EXIT_REFUSED = 6

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_ERROR: "error: Redis unreachable, bad source or processor, unexpected failure",
    EXIT_USAGE: "usage: bad or missing arguments (including reset-round without --yes)",
    EXIT_INCOMPLETE: "round incomplete: --check found unfinished ranges, or a replay left dead "
    "letters; preview: it lists a problem",
    EXIT_LOST: "round state lost: the stream is in Redis but one of its rounds is not (evicted, "
    "deleted)",
    EXIT_NOT_FOUND: "not found: no such stream or round under this key prefix; also a Redis that "
    "lost the stream's every key (it cannot be told from a typo)",
    EXIT_REFUSED: "refused: a live owner holds a range (reset-round without --force, replay)",
}


class CliError(Exception):
    """An error with the exit code the CLI reports for it."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code
