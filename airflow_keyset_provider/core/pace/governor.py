"""The stream's throughput governor: one token bucket in Redis shared by every task of a stream.

``max_rows_per_second`` is a budget of the *stream*, not of a task: 4 tasks or 400 draw from the
same bucket, so the database sees at most that many rows per second (plus one burst) however many
workers Airflow runs. The bucket lives at ``<control key>:bucket`` (``CursorStore.bucket_key``)
under the stream's hash tag and is moved only by the ``TAKE`` script below, on the Redis server's
clock (``TIME``): worker clocks never enter the arithmetic.

Rows are charged after they were read (the size of a chunk is known only then), and the bucket may
go into debt: a task that takes more than is left owes the difference and waits it out before its
next chunk, and so does every task that charges after it until the debt is repaid. Over any
window longer than a chunk the stream's rate is therefore at most ``rate`` (plus ``burst`` once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..store.cursor_store import CursorStore


TAKE = """
-- Charge rows to the stream's shared token bucket (debt allowed); say how long to wait.
-- KEYS[1] bucket hash (tokens, ts_us)
-- ARGV[1] rate: tokens per second (> 0)  ARGV[2] burst: most tokens kept  ARGV[3] rows taken
-- Returns the milliseconds the caller waits before its next chunk (0: within the budget).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local rate, burst, take = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts_us')
local tokens = tonumber(b[1]) or burst
local ts = tonumber(b[2]) or now
if now > ts then tokens = math.min(burst, tokens + (now - ts) * rate / 1000000) end
tokens = tokens - take
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens),
           'ts_us', string.format('%.0f', math.max(now, ts)))
redis.call('PEXPIRE', KEYS[1], 600000)
if tokens >= 0 then return 0 end
return math.ceil(-tokens * 1000 / rate)
"""


class Governor:
    """Charges rows to the stream's bucket. ``charge`` is one Redis round trip; callers make it
    only when a rate is set (the rate itself is read by the light poller, not per chunk)."""

    def __init__(self, store: CursorStore) -> None:
        self.store = store
        self.key = store.bucket_key
        self._take = store.script(TAKE)

    def charge(self, rows: int, rate: float, burst: float | None = None) -> float:
        """Take ``rows`` tokens at ``rate`` rows/s; returns the seconds to wait before the next
        chunk (0.0 when within the budget). ``burst`` (default: one second of ``rate``) is the
        most an idle stream saves up."""
        if rows <= 0 or rate <= 0:
            return 0.0
        cap = max(rate if burst is None else burst, 1.0)
        ms = self._take(keys=[self.key], args=[repr(float(rate)), repr(float(cap)), int(rows)])
        return max(int(ms), 0) / 1000.0

    def reset(self) -> None:
        """Forget the bucket (its debt too): the next charge starts with a full burst."""
        self.store.reset_bucket()


def burst_for(rate: float, chunk_rows: int) -> float:
    """One second of the rate, but at least one chunk, so a slow rate still admits whole chunks
    without starving any task."""
    return float(max(rate, chunk_rows, 1))


__all__ = ["TAKE", "Governor", "burst_for"]
