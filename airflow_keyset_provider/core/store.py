"""The cursor store: rounds, ranges, leases and cursors in Redis, moved only by small Lua scripts.

Redis is the *recovery layer*, not the truth: the truth is the source's key order, the round's
fixed bounds and the committed cursors. Every state change is one Lua script, so a cursor and its
counters always move together, and every script touches the keys of one stream only, all sharing
the hash tag ``{<stream>}``, so the scripts run unchanged on Redis Cluster.

Key layout (``P`` is the key prefix, ``ks`` by default; ``S`` the stream)::

    P:{S}:watermark                 string  encoded end of the contiguous completed prefix
    P:{S}:seq                       string  round id counter
    P:{S}:open                      set     ids of open rounds
    P:{S}:chained                   string  id of the open round that started at the watermark
    P:{S}:by_key                    hash    idempotency key (e.g. Airflow run id) -> round id
    P:{S}:ahead                     hash    closed rounds above a gap: round id -> "start|end"
    P:{S}:round:R                   hash    start, end, n_ranges, state, chained, source, totals
    P:{S}:round:R:range:I           hash    lo, hi, cursor, owner, lineage, epoch, lease_until,
                                            heartbeat_ms, done, skipped, dead, state, takeovers
    P:{S}:round:R:retry:I           hash    encoded key -> "attempts|last error"   (sparse)
    P:{S}:round:R:dead:I            list    JSON dead letters, newest first, capped (sparse)
    P:{S}:events                    channel "R:I:complete" (a hint to wake a barrier, never truth)

Why owner tokens (the timeline ``redis.lock`` taught us)::

    t0  worker A claims range 3 (token a1, epoch 1, lease 60 s), reads chunk (100, 200]
    t1  A stalls (GC pause, SIGSTOP, network partition) for longer than its lease
    t2  worker B claims range 3: the lease expired, so B gets token b1, epoch 2, cursor 100
    t3  B processes (100, 200] and advances the cursor to 200, then to 300
    t4  A wakes up and tries to advance 100 -> 200 with token a1
        -> refused: the owner is b1 (and the cursor is no longer 100). A stops.

Without the token A's late write would move the cursor *backwards* to 200 and B's work on
(200, 300] would be replayed or, worse, a later worker would skip past keys on a stale cursor.
Leases are measured on the Redis server's clock (``TIME``), never on a worker's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .errors import (
    ConfigurationError,
    CursorConflictError,
    LeaseLostError,
    RoundNotFoundError,
    RoundStateLostError,
    StoreUnavailableError,
)

_STREAM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")

# --------------------------------------------------------------------------------------------
# Lua scripts. Each one: which KEYS, which ARGV, what it returns. Times come from redis TIME.
# --------------------------------------------------------------------------------------------

_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

CREATE_ROUND = (
    """
-- Create a round and its ranges, or return the round that already answers this request.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash
-- KEYS[5..] one range hash per range, in range order
-- ARGV[1] round id  ARGV[2] idempotency key ('' = none)  ARGV[3] chained ('1'/'0')
-- ARGV[4] start  ARGV[5] end  ARGV[6] source fingerprint  ARGV[7] key arity
-- ARGV[8..] lo, hi per range
-- Returns {'existing', id} when the idempotency key or the open chained round already has a
-- round (nothing written), else {'created', id}.
"""
    + _NOW
    + """
if ARGV[2] ~= '' then
  local known = redis.call('HGET', KEYS[4], ARGV[2])
  if known then return {'existing', known} end
end
if ARGV[3] == '1' then
  local open = redis.call('GET', KEYS[3])
  if open then
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[2], open) end
    return {'existing', open}
  end
end
local n = #KEYS - 4
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'state', 'open', 'chained', ARGV[3],
  'start', ARGV[4], 'end', ARGV[5], 'source', ARGV[6], 'arity', ARGV[7],
  'n_ranges', n, 'round_key', ARGV[2], 'created_ms', now)
for i = 1, n do
  local lo, hi = ARGV[6 + 2 * i], ARGV[7 + 2 * i]
  local state = 'pending'
  if lo == hi then state = 'complete' end
  redis.call('HSET', KEYS[4 + i], 'lo', lo, 'hi', hi, 'cursor', lo, 'state', state,
    'owner', '', 'lineage', '', 'epoch', 0, 'lease_until', 0, 'heartbeat_ms', 0,
    'done', 0, 'skipped', 0, 'dead', 0, 'takeovers', 0, 'chunks', 0)
end
redis.call('SADD', KEYS[2], ARGV[1])
if ARGV[3] == '1' then redis.call('SET', KEYS[3], ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[2], ARGV[1]) end
return {'created', ARGV[1]}
"""
)

CLAIM = (
    """
-- Take (or keep) ownership of a range.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash
-- ARGV[1] owner token (unique per attempt)  ARGV[2] lineage ('' = none; a new attempt of the
--         same lineage, e.g. the same Airflow task instance, may take over at once: the old
--         attempt is fenced by the new token)  ARGV[3] lease ms
-- Returns {'lost'} | {'complete', cursor, done, skipped, dead}
--       | {'held', owner, ms left} | {'ok', cursor, epoch, done, skipped, dead, takeover, retries}
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return {'lost'} end
local r = redis.call('HMGET', KEYS[2], 'state', 'owner', 'lineage', 'lease_until', 'cursor',
  'done', 'skipped', 'dead', 'epoch')
if r[1] == 'complete' then return {'complete', r[5], r[6], r[7], r[8]} end
local lease_until = tonumber(r[4])
if r[2] ~= '' and r[2] ~= ARGV[1] and lease_until > now and (ARGV[2] == '' or r[3] ~= ARGV[2]) then
  return {'held', r[2], lease_until - now}
end
local takeover = 0
if r[2] ~= '' and r[2] ~= ARGV[1] then takeover = 1 end
local epoch = tonumber(r[9]) + 1
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'lineage', ARGV[2], 'epoch', epoch, 'state', 'running',
  'lease_until', now + tonumber(ARGV[3]), 'heartbeat_ms', now, 'claimed_ms', now)
if takeover == 1 then redis.call('HINCRBY', KEYS[2], 'takeovers', 1) end
return {'ok', r[5], epoch, r[6], r[7], r[8], takeover, redis.call('HLEN', KEYS[3])}
"""
)

HEARTBEAT = (
    """
-- Extend the lease, only for the current owner and only while the lease is still valid.
-- KEYS[1] range hash  ARGV[1] owner token  ARGV[2] lease ms
-- Returns 1 (extended) or 0 (this token no longer owns the range: stop).
"""
    + _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'owner', 'lease_until')
if r[1] ~= ARGV[1] or tonumber(r[2]) <= now then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]), 'heartbeat_ms', now)
return 1
"""
)

ADVANCE = (
    """
-- Commit the outcome of one chunk (or of one retry pass): cursor, counters, item failures and
-- dead letters in one step, fenced by the owner token and the expected cursor.
-- KEYS[1] range hash  KEYS[2] retry hash  KEYS[3] dead list  KEYS[4] events channel
-- ARGV[1] token  ARGV[2] expected cursor  ARGV[3] new cursor (= expected for a retry pass)
-- ARGV[4] done  ARGV[5] skipped  ARGV[6] lease ms  ARGV[7] max item attempts  ARGV[8] dead cap
-- ARGV[9] label for the event ('R:I')  ARGV[10] number of resolved retry keys N
-- ARGV[11..10+2N] key, outcome ('d' done / 's' skipped) for keys leaving the retry set
-- then F = count, then F pairs of key, error for items that failed in this pass
-- Refusals change nothing: {'lost'} {'not_owner', owner} {'expired'} {'cursor', actual}
--   {'backwards'} {'past_hi', hi}
-- Returns {'ok', cursor, done, skipped, dead, retries, state}.
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
local r = redis.call('HMGET', KEYS[1], 'owner', 'lease_until', 'cursor', 'hi')
if r[1] ~= ARGV[1] then return {'not_owner', r[1]} end
if tonumber(r[2]) <= now then return {'expired'} end
if r[3] ~= ARGV[2] then return {'cursor', r[3]} end
local new = ARGV[3]
if new < r[3] then return {'backwards'} end
if new > r[4] then return {'past_hi', r[4]} end
local done, skipped, dead = tonumber(ARGV[4]), tonumber(ARGV[5]), 0
local n = tonumber(ARGV[10])
local i = 11
for _ = 1, n do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then
    if ARGV[i + 1] == 'd' then done = done + 1 else skipped = skipped + 1 end
  end
  i = i + 2
end
local f = tonumber(ARGV[i])
i = i + 1
local max_attempts = tonumber(ARGV[7])
for _ = 1, f do
  local key, err = ARGV[i], ARGV[i + 1]
  local prev = redis.call('HGET', KEYS[2], key)
  local attempts = 1
  if prev then attempts = tonumber(string.match(prev, '^(%d+)|')) + 1 end
  if attempts >= max_attempts then
    redis.call('HDEL', KEYS[2], key)
    redis.call('LPUSH', KEYS[3], cjson.encode({key = key, error = err, attempts = attempts, at_ms = now}))
    dead = dead + 1
  else
    redis.call('HSET', KEYS[2], key, attempts .. '|' .. err)
  end
  i = i + 2
end
if dead > 0 then redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[8]) - 1) end
redis.call('HSET', KEYS[1], 'cursor', new, 'lease_until', now + tonumber(ARGV[6]), 'heartbeat_ms', now)
local c = redis.call('HMGET', KEYS[1], 'done', 'skipped', 'dead')
done = tonumber(c[1]) + done
skipped = tonumber(c[2]) + skipped
dead = tonumber(c[3]) + dead
redis.call('HSET', KEYS[1], 'done', done, 'skipped', skipped, 'dead', dead)
redis.call('HINCRBY', KEYS[1], 'chunks', 1)
local retries = redis.call('HLEN', KEYS[2])
local state = 'running'
if new == r[4] and retries == 0 then
  state = 'complete'
  redis.call('HSET', KEYS[1], 'state', state, 'completed_ms', now)
  redis.call('PUBLISH', KEYS[4], ARGV[9] .. ':complete')
end
return {'ok', new, done, skipped, dead, retries, state}
"""
)

REQUEUE_DEAD = (
    """
-- Move dead letters back into the range's retry set (attempts reset) so a normal, fenced
-- traverse processes them again; the range is no longer complete until they reach a terminal
-- state. Refused while a live owner holds the range.
-- KEYS[1] range hash  KEYS[2] dead list  KEYS[3] retry hash   ARGV[1] max letters to move
-- Returns {'lost'} | {'held', owner} | {'ok', moved}
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
local r = redis.call('HMGET', KEYS[1], 'owner', 'lease_until', 'state')
if r[1] ~= '' and tonumber(r[2]) > now then return {'held', r[1]} end
local moved = 0
for _ = 1, tonumber(ARGV[1]) do
  local raw = redis.call('RPOP', KEYS[2])
  if not raw then break end
  local d = cjson.decode(raw)
  redis.call('HSET', KEYS[3], d.key, '0|replay of: ' .. d.error)
  moved = moved + 1
end
if moved > 0 then
  redis.call('HINCRBY', KEYS[1], 'dead', -moved)
  if r[3] == 'complete' then redis.call('HSET', KEYS[1], 'state', 'pending') end
end
return {'ok', moved}
"""
)

RESTORE_ROUND = """
-- Rebuild a round that Redis lost from its durable mirror, only if it is really gone.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash  KEYS[5] seq
-- then per range: range hash, retry hash, dead list
-- ARGV[1] round info (JSON)  ARGV[2..] one JSON document per range (all values strings)
-- Owners are cleared (every old token is fenced out); a range that was running is pending.
-- Returns 1 if restored, 0 if the round exists (nothing written).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local info = cjson.decode(ARGV[1])
for k, v in pairs(info) do redis.call('HSET', KEYS[1], k, v) end
if info.state ~= 'closed' then
  redis.call('SADD', KEYS[2], info.id)
  if info.chained == '1' then redis.call('SET', KEYS[3], info.id) end
end
if info.round_key and info.round_key ~= '' then redis.call('HSET', KEYS[4], info.round_key, info.id) end
local num = tonumber(string.sub(info.id, 2))
if num and num > tonumber(redis.call('GET', KEYS[5]) or '0') then redis.call('SET', KEYS[5], num) end
for i = 1, #ARGV - 1 do
  local d = cjson.decode(ARGV[i + 1])
  local rk, tk, dk = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  local state = d.state
  if state == 'running' then state = 'pending' end
  redis.call('HSET', rk, 'lo', d.lo, 'hi', d.hi, 'cursor', d.cursor, 'state', state, 'owner', '',
    'lineage', '', 'epoch', d.epoch, 'lease_until', 0, 'heartbeat_ms', 0, 'done', d.done,
    'skipped', d.skipped, 'dead', d.dead, 'takeovers', d.takeovers, 'chunks', d.chunks,
    'restored', 1)
  for key, v in pairs(d.retry) do redis.call('HSET', tk, key, v) end
  for _, letter in ipairs(d.dead_letters) do redis.call('RPUSH', dk, letter) end
end
return 1
"""

RELEASE = """
-- Give the range up so the next worker need not wait for the lease to expire.
-- KEYS[1] range hash  ARGV[1] owner token.  Returns 1 if released, 0 if not the owner.
local r = redis.call('HMGET', KEYS[1], 'owner', 'state')
if r[1] ~= ARGV[1] then return 0 end
local state = r[2]
if state == 'running' then state = 'pending' end
redis.call('HSET', KEYS[1], 'owner', '', 'lease_until', 0, 'state', state)
return 1
"""

CLOSE_ROUND = (
    """
-- Close a round if, and only if, every range is complete and the ranges cover (start, end]
-- with no gap and no overlap; then move the stream's watermark forward (never backwards), and
-- only over the contiguous completed prefix: a round that starts above the watermark is parked
-- in the "ahead" hash and absorbed once the rounds below it have closed.
-- KEYS[1] round hash  KEYS[2] watermark  KEYS[3] open set  KEYS[4] chained id  KEYS[5] ahead hash
-- KEYS[6..] range hashes in range order.
-- Returns {'lost'} | {'incomplete', range ids...} | {'gap', range id}
--       | {'closed', done, skipped, dead, watermark}  (idempotent once closed)
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'start', 'end', 'id', 'chained')
local wm = redis.call('GET', KEYS[2])
if rnd[1] == 'closed' then
  local t = redis.call('HMGET', KEYS[1], 'done', 'skipped', 'dead')
  return {'closed', t[1], t[2], t[3], wm or ''}
end
if rnd[1] == 'unrecoverable' then return {'unrecoverable', redis.call('HGET', KEYS[1], 'reason') or ''} end
local expect = rnd[2]
local done, skipped, dead = 0, 0, 0
local lagging = {}
for i = 6, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {'lost'} end
  local r = redis.call('HMGET', KEYS[i], 'lo', 'hi', 'cursor', 'state', 'done', 'skipped', 'dead')
  if r[1] ~= expect then return {'gap', tostring(i - 6)} end
  expect = r[2]
  if r[4] ~= 'complete' or r[3] ~= r[2] then table.insert(lagging, tostring(i - 6)) end
  done, skipped, dead = done + tonumber(r[5]), skipped + tonumber(r[6]), dead + tonumber(r[7])
end
if expect ~= rnd[3] then return {'gap', tostring(#KEYS - 5)} end
if #lagging > 0 then return {'incomplete', unpack(lagging)} end
redis.call('HSET', KEYS[1], 'state', 'closed', 'closed_ms', now, 'done', done, 'skipped', skipped, 'dead', dead)
redis.call('SREM', KEYS[3], rnd[4])
if redis.call('GET', KEYS[4]) == rnd[4] then redis.call('DEL', KEYS[4]) end
local function reaches(start) return (wm == false and start == '') or (wm and start <= wm) end
if (rnd[5] == '1') or reaches(rnd[2]) then
  if wm == false or rnd[3] > wm then wm = rnd[3] end
  -- absorb parked rounds that now touch the prefix, until none does
  local moved = true
  while moved do
    moved = false
    local ahead = redis.call('HGETALL', KEYS[5])
    for j = 1, #ahead, 2 do
      local s, e = string.match(ahead[j + 1], '^([^|]*)|(.*)$')
      if reaches(s) then
        if e > wm then wm = e; moved = true end
        redis.call('HDEL', KEYS[5], ahead[j])
      end
    end
  end
  redis.call('SET', KEYS[2], wm)
else
  redis.call('HSET', KEYS[5], rnd[4], rnd[2] .. '|' .. rnd[3])
end
return {'closed', done, skipped, dead, wm or ''}
"""
)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class Claim:
    """What a successful claim hands the worker: the cursor to resume from and the range's
    counters so far. ``takeover`` is true when a previous owner's lease was broken."""

    token: str
    cursor: str
    epoch: int
    done: int
    skipped: int
    dead: int
    takeover: bool
    retries: int
    complete: bool = False


@dataclass(frozen=True)
class Advanced:
    cursor: str
    done: int
    skipped: int
    dead: int
    retries: int
    complete: bool


class CursorStore:
    """Fenced, atomic round/range state for one stream in Redis.

    Guarantees (each enforced inside one Lua script, so they hold under any interleaving):

    - a cursor moves only forward, never past its range's ``hi``, only from the value the
      worker expected, and only by the current owner while its lease is valid;
    - a cursor and its counters move in the same step;
    - a round closes only when its ranges cover ``(start, end]`` exactly and are all complete;
    - the watermark only moves forward;
    - missing state raises ``RoundStateLostError``; it is never read as "nothing left to do".
    """

    def __init__(self, client: redis.Redis, stream: str, prefix: str = "ks") -> None:
        if not _STREAM_RE.match(stream or ""):
            raise ConfigurationError(
                f"stream name {stream!r} is not valid: use 1-200 characters of letters, digits, "
                "'_', '.', '-', starting with a letter or digit (e.g. 'events-nightly')"
            )
        if not re.match(r"^[A-Za-z0-9_.\-:]{1,64}$", prefix):
            raise ConfigurationError(f"key prefix {prefix!r} is not valid")
        self.client = client
        self.stream = stream
        self.base = f"{prefix}:{{{stream}}}"
        self._create = client.register_script(CREATE_ROUND)
        self._claim = client.register_script(CLAIM)
        self._heartbeat = client.register_script(HEARTBEAT)
        self._advance = client.register_script(ADVANCE)
        self._release = client.register_script(RELEASE)
        self._close = client.register_script(CLOSE_ROUND)
        self._requeue = client.register_script(REQUEUE_DEAD)
        self._restore = client.register_script(RESTORE_ROUND)

    # ---- key names -------------------------------------------------------------------------
    @property
    def watermark_key(self) -> str:
        return f"{self.base}:watermark"

    @property
    def events_channel(self) -> str:
        return f"{self.base}:events"

    def round_key(self, round_id: str) -> str:
        return f"{self.base}:round:{round_id}"

    def range_key(self, round_id: str, range_id: int) -> str:
        return f"{self.base}:round:{round_id}:range:{range_id}"

    def retry_key(self, round_id: str, range_id: int) -> str:
        return f"{self.base}:round:{round_id}:retry:{range_id}"

    def dead_key(self, round_id: str, range_id: int) -> str:
        return f"{self.base}:round:{round_id}:dead:{range_id}"

    def _call(self, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return script(keys=list(keys), args=list(args))
        except redis.ConnectionError as exc:
            raise StoreUnavailableError(
                f"Redis is unreachable ({exc}); nothing was written. Check the Redis connection."
            ) from exc

    def ping(self) -> None:
        try:
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(
                f"Redis is unreachable ({exc}); nothing was written. Check the Redis connection "
                "(host, port, password, TLS) and that the server is running."
            ) from exc

    # ---- rounds ----------------------------------------------------------------------------
    def watermark(self) -> str | None:
        v = self.client.get(self.watermark_key)
        return None if v is None else _s(v)

    def lookup(self, idempotency_key: str | None, chained: bool) -> str | None:
        """The round that a plan request with this key (or for the chained stream) already has."""
        if idempotency_key:
            known = self.client.hget(f"{self.base}:by_key", idempotency_key)
            if known is not None:
                return _s(known)
        if chained:
            open_id = self.client.get(f"{self.base}:chained")
            if open_id is not None:
                if idempotency_key:  # this request now belongs to that round, even after it closes
                    self.client.hsetnx(f"{self.base}:by_key", idempotency_key, open_id)
                return _s(open_id)
        return None

    def create_round(
        self,
        *,
        idempotency_key: str | None,
        chained: bool,
        start: str,
        end: str,
        source: str,
        arity: int,
        bounds: Sequence[tuple[str, str]],
    ) -> tuple[str, bool]:
        """Save a new round atomically; returns ``(round_id, created)``. If the idempotency key or
        the stream's open chained round already has a round, returns that one unchanged."""
        round_id = f"r{int(self.client.incr(f'{self.base}:seq'))}"
        keys = [self.round_key(round_id), f"{self.base}:open", f"{self.base}:chained", f"{self.base}:by_key"]
        keys += [self.range_key(round_id, i) for i in range(len(bounds))]
        args: list[Any] = [round_id, idempotency_key or "", "1" if chained else "0", start, end, source, arity]
        for lo, hi in bounds:
            args += [lo, hi]
        status, rid = self._call(self._create, keys, args)
        return _s(rid), _s(status) == "created"

    def round_info(self, round_id: str) -> dict[str, str]:
        raw = self.client.hgetall(self.round_key(round_id))
        if not raw:
            raise self._missing_round(round_id)
        return {_s(k): _s(v) for k, v in raw.items()}

    def _missing_round(self, round_id: str) -> Exception:
        # A round id that the counter has handed out but whose hash is gone was lost, not unknown.
        seq = self.client.get(f"{self.base}:seq")
        issued = seq is not None and round_id.startswith("r") and round_id[1:].isdigit() \
            and int(round_id[1:]) <= int(seq)
        if issued or seq is None:
            return RoundStateLostError(
                f"round {round_id} of stream {self.stream!r} has no state in Redis (flushed, evicted "
                "or restarted without persistence). Nothing was read as complete. Re-plan the round "
                "or restore it from its checkpoint mirror (see docs/reliability.md)."
            )
        return RoundNotFoundError(f"stream {self.stream!r} has no round {round_id!r}")

    def ranges(self, round_id: str, n_ranges: int | None = None) -> list[dict[str, str]]:
        if n_ranges is None:
            n_ranges = int(self.round_info(round_id)["n_ranges"])
        pipe = self.client.pipeline(transaction=False)
        for i in range(n_ranges):
            pipe.hgetall(self.range_key(round_id, i))
            pipe.hlen(self.retry_key(round_id, i))
        out = pipe.execute()
        result = []
        for i in range(n_ranges):
            raw, retries = out[2 * i], out[2 * i + 1]
            if not raw:
                raise RoundStateLostError(
                    f"range {i} of round {round_id} (stream {self.stream!r}) has no state in Redis"
                )
            d = {_s(k): _s(v) for k, v in raw.items()}
            d["range_id"] = str(i)
            d["retries"] = str(retries)
            result.append(d)
        return result

    def range(self, round_id: str, range_id: int) -> dict[str, str]:
        """One range's hash (a single read, whatever the number of ranges)."""
        raw = self.client.hgetall(self.range_key(round_id, range_id))
        if not raw:
            raise RoundStateLostError(f"range {range_id} of round {round_id} (stream {self.stream!r}) has no state in Redis")
        return {_s(k): _s(v) for k, v in raw.items()}

    def open_rounds(self) -> list[str]:
        return sorted((_s(x) for x in self.client.smembers(f"{self.base}:open")),
                      key=lambda r: int(r[1:]) if r[1:].isdigit() else 0)

    # ---- one range -------------------------------------------------------------------------
    def claim(self, round_id: str, range_id: int, token: str, lineage: str, lease_ms: int) -> Claim | tuple[str, int]:
        """Returns a ``Claim``, or ``(owner, ms_left)`` when a live owner holds the range."""
        res = self._call(
            self._claim,
            [self.round_key(round_id), self.range_key(round_id, range_id), self.retry_key(round_id, range_id)],
            [token, lineage, lease_ms],
        )
        status = _s(res[0])
        if status == "lost":
            raise RoundStateLostError(
                f"range {range_id} of round {round_id} (stream {self.stream!r}) has no state in "
                "Redis; it was lost, not finished. Re-plan or restore from the checkpoint mirror."
            )
        if status == "complete":
            return Claim(token, _s(res[1]), 0, int(res[2]), int(res[3]), int(res[4]), False, 0, True)
        if status == "held":
            return _s(res[1]), int(res[2])
        return Claim(token, _s(res[1]), int(res[2]), int(res[3]), int(res[4]), int(res[5]),
                     bool(int(res[6])), int(res[7]))

    def heartbeat(self, round_id: str, range_id: int, token: str, lease_ms: int) -> bool:
        return bool(self._call(self._heartbeat, [self.range_key(round_id, range_id)], [token, lease_ms]))

    def advance(
        self,
        round_id: str,
        range_id: int,
        token: str,
        expected: str,
        new: str,
        *,
        done: int,
        skipped: int,
        lease_ms: int,
        max_item_attempts: int,
        dead_cap: int = 1000,
        resolved: Iterable[tuple[str, str]] = (),
        failed: Iterable[tuple[str, str]] = (),
    ) -> Advanced:
        """Commit one chunk's outcome. Raises ``LeaseLostError`` or ``CursorConflictError`` (and
        changes nothing) when the fence refuses it."""
        args: list[Any] = [token, expected, new, done, skipped, lease_ms, max_item_attempts, dead_cap,
                           f"{round_id}:{range_id}"]
        res_list = list(resolved)
        args.append(len(res_list))
        for k, outcome in res_list:
            args += [k, outcome]
        fail_list = list(failed)
        args.append(len(fail_list))
        for k, err in fail_list:
            args += [k, err.replace("\n", " ")[:500]]
        res = self._call(
            self._advance,
            [self.range_key(round_id, range_id), self.retry_key(round_id, range_id),
             self.dead_key(round_id, range_id), self.events_channel],
            args,
        )
        status = _s(res[0])
        where = f"range {range_id} of round {round_id} (stream {self.stream!r})"
        if status == "ok":
            return Advanced(_s(res[1]), int(res[2]), int(res[3]), int(res[4]), int(res[5]),
                            _s(res[6]) == "complete")
        if status == "lost":
            raise RoundStateLostError(f"{where} has no state in Redis; nothing was committed")
        if status == "not_owner":
            raise LeaseLostError(f"{where} is now owned by {_s(res[1]) or 'nobody'}; this worker "
                                 "lost its lease and its advance was refused (fencing)")
        if status == "expired":
            raise LeaseLostError(f"the lease on {where} expired before the advance; refused (fencing)")
        if status == "cursor":
            raise CursorConflictError(f"{where}: cursor is {_s(res[1])!r}, expected {expected!r}; refused")
        if status == "backwards":
            raise CursorConflictError(f"{where}: advance from {expected!r} to {new!r} moves backwards; refused")
        raise CursorConflictError(f"{where}: advance to {new!r} passes hi {_s(res[1])!r}; refused")

    def release(self, round_id: str, range_id: int, token: str) -> bool:
        return bool(self._call(self._release, [self.range_key(round_id, range_id)], [token]))

    def retry_entries(self, round_id: str, range_id: int, limit: int) -> list[tuple[str, int, str]]:
        """Up to ``limit`` pending item retries: ``(encoded key, attempts, last error)``."""
        out = []
        for k, v in self.client.hscan_iter(self.retry_key(round_id, range_id), count=limit):
            attempts, _, err = _s(v).partition("|")
            out.append((_s(k), int(attempts), err))
            if len(out) >= limit:
                break
        out.sort()
        return out

    def requeue_dead(self, round_id: str, range_id: int, limit: int) -> int | str:
        """Move up to ``limit`` dead letters back to the retry set; returns how many, or the owner
        that holds the range (then nothing moved)."""
        res = self._call(self._requeue, [self.range_key(round_id, range_id), self.dead_key(round_id, range_id),
                                         self.retry_key(round_id, range_id)], [limit])
        status = _s(res[0])
        if status == "lost":
            raise RoundStateLostError(f"range {range_id} of round {round_id} (stream {self.stream!r}) has no state")
        return _s(res[1]) if status == "held" else int(res[1])

    def snapshot_range(self, round_id: str, range_id: int) -> dict[str, Any]:
        """One consistent (MULTI) read of a range, its retries and dead letters, for the mirror."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.range_key(round_id, range_id))
        pipe.hgetall(self.retry_key(round_id, range_id))
        pipe.lrange(self.dead_key(round_id, range_id), 0, -1)
        raw, retry, dead = pipe.execute()
        if not raw:
            raise RoundStateLostError(f"range {range_id} of round {round_id} (stream {self.stream!r}) has no state")
        doc: dict[str, Any] = {_s(k): _s(v) for k, v in raw.items()}
        doc.update(range_id=str(range_id), retry={_s(k): _s(v) for k, v in retry.items()},
                   dead_letters=[_s(x) for x in dead])
        for field in ("epoch", "takeovers", "chunks"):
            doc.setdefault(field, "0")
        return doc

    def restore_round(self, info: dict[str, str], ranges: list[dict[str, Any]]) -> bool:
        """Write a mirrored round back if Redis has no trace of it. Returns True if restored."""
        round_id = info["id"]
        keys = [self.round_key(round_id), f"{self.base}:open", f"{self.base}:chained", f"{self.base}:by_key",
                f"{self.base}:seq"]
        for r in ranges:
            i = int(r["range_id"])
            keys += [self.range_key(round_id, i), self.retry_key(round_id, i), self.dead_key(round_id, i)]
        docs = [json.dumps({**r, "retry": r.get("retry") or {}, "dead_letters": r.get("dead_letters") or []})
                for r in ranges]
        # cjson turns an empty {} into an array, harmless here: pairs() over it does nothing
        return bool(self._call(self._restore, keys, [json.dumps(info), *docs]))

    def restore_watermark(self, watermark: str) -> bool:
        """Put back a lost watermark; never overwrites one that exists."""
        return bool(self.client.set(self.watermark_key, watermark, nx=True))

    def refresh_totals(self, round_id: str) -> None:
        """Recompute a closed round's totals from its ranges (after a dead-letter replay)."""
        ranges = self.ranges(round_id)
        self.client.hset(self.round_key(round_id), mapping={
            f: sum(int(r[f]) for r in ranges) for f in ("done", "skipped", "dead")})

    def dead_letters(self, round_id: str, range_id: int, limit: int = 100) -> list[dict[str, Any]]:
        raw = self.client.lrange(self.dead_key(round_id, range_id), 0, limit - 1)
        return [json.loads(_s(x)) for x in raw]

    # ---- closing ---------------------------------------------------------------------------
    def close_round(self, round_id: str) -> tuple[str, list[str]]:
        """Returns ``('closed', [done, skipped, dead, watermark])``, ``('incomplete', ids)``,
        ``('gap', [id])``; raises ``RoundStateLostError`` when state is missing."""
        info = self.round_info(round_id)
        n = int(info["n_ranges"])
        keys = [self.round_key(round_id), self.watermark_key, f"{self.base}:open", f"{self.base}:chained",
                f"{self.base}:ahead"]
        keys += [self.range_key(round_id, i) for i in range(n)]
        res = self._call(self._close, keys, [])
        status = _s(res[0])
        if status == "lost":
            raise RoundStateLostError(f"round {round_id} of stream {self.stream!r} lost state in Redis")
        return status, [_s(x) for x in res[1:]]

    def mark_unrecoverable(self, round_id: str, reason: str) -> None:
        """The source lost rows the round still had to read: the round can never close."""
        self.client.hset(self.round_key(round_id), mapping={"state": "unrecoverable", "reason": reason[:1000]})

    def delete_round(self, round_id: str) -> int:
        """Remove one round's keys and its index entries; never touches the watermark."""
        info = self.round_info(round_id)
        n = int(info["n_ranges"])
        keys = [self.round_key(round_id)]
        for i in range(n):
            keys += [self.range_key(round_id, i), self.retry_key(round_id, i), self.dead_key(round_id, i)]
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*keys)
        pipe.srem(f"{self.base}:open", round_id)
        if info.get("round_key"):
            pipe.hdel(f"{self.base}:by_key", info["round_key"])
        out = pipe.execute()
        if self.lookup(None, chained=True) == round_id:
            self.client.delete(f"{self.base}:chained")
        return int(out[0])

    def delete_stream(self) -> int:
        """Remove every key of this stream (tests, ``reset``). Returns the number of keys removed."""
        n = 0
        for k in self.client.scan_iter(match=f"{self.base}:*", count=500):
            n += int(self.client.delete(k))
        return n
