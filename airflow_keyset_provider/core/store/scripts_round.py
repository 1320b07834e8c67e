"""The cursor store's round scripts: create, close, mark unrecoverable, refresh the totals, raise the
counter, restore from the mirror, delete (``store_scripts.py`` is the import surface; the key
layout and the guarantees are in ``store.py``).
"""

from __future__ import annotations

from .lua import _FIELDS, _INTACT, _NOW

CREATE_ROUND = (
    """
-- Create a round and its ranges, or return the round that already answers this request.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash
-- KEYS[5..] one range hash per range, in range order
-- ARGV[1] round id  ARGV[2] idempotency key ('' = none)  ARGV[3] chained ('1'/'0')
-- ARGV[4] start  ARGV[5] end  ARGV[6] source fingerprint  ARGV[7] key arity
-- ARGV[8..] lo, hi per range
-- Returns {'existing', id} when the idempotency key or the open chained round already has a
-- round (nothing written), {'taken'} when a round or range hash of this id already exists (the
-- round counter was lost and handed out a used id: nothing written, the caller re-derives the
-- counter), else {'created', id}.
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
for i = 1, n + 1 do
  local k = KEYS[1]
  if i > 1 then k = KEYS[3 + i] end
  if redis.call('EXISTS', k) == 1 then return {'taken'} end
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'state', 'open', 'chained', ARGV[3],
  'start', ARGV[4], 'end', ARGV[5], 'source', ARGV[6], 'arity', ARGV[7],
  'n_ranges', n, 'round_key', ARGV[2], 'created_ms', now)
for i = 1, n do
  local lo, hi = ARGV[6 + 2 * i], ARGV[7 + 2 * i]
  local state = 'pending'
  if lo == hi then state = 'complete' end
  redis.call('HSET', KEYS[4 + i], 'lo', lo, 'hi', hi, 'cursor', lo, 'state', state,
    'dead', 0, 'retries', 0)
end
redis.call('SADD', KEYS[2], ARGV[1])
if ARGV[3] == '1' then redis.call('SET', KEYS[3], ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[2], ARGV[1]) end
return {'created', ARGV[1]}
"""
)

RESTORE_ROUND = (
    """
-- Rebuild what Redis lost of a round from its durable mirror, never overwriting intact state:
-- the whole round when its hash is gone, else only the ranges that are not intact (a range hash,
-- retry hash or dead list evicted or deleted on its own); an intact range is left as it is.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash  KEYS[5] seq
-- then per range: range hash, retry hash, dead list
-- ARGV[1] round info (JSON)  ARGV[2..] one JSON document per range (all values strings)
-- Owners of rewritten ranges are cleared (every old token is fenced out); running -> pending;
-- 'merged_into' (a range coalesced into another at claim time) is kept.
-- Returns {round rewritten 0/1, ranges rewritten}; {0, 0} means nothing was written.
"""
    + _INTACT
    + """
local whole = redis.call('EXISTS', KEYS[1]) == 0
local info = cjson.decode(ARGV[1])
if whole then
  for k, v in pairs(info) do redis.call('HSET', KEYS[1], k, v) end
  if info.state ~= 'closed' then
    redis.call('SADD', KEYS[2], info.id)
    if info.chained == '1' then redis.call('SET', KEYS[3], info.id) end
  end
  if info.round_key and info.round_key ~= '' then
    redis.call('HSET', KEYS[4], info.round_key, info.id)
  end
  local num = tonumber(string.sub(info.id, 2))
  if num and num > tonumber(redis.call('GET', KEYS[5]) or '0') then
    redis.call('SET', KEYS[5], num)
  end
end
local rewritten = 0
for i = 1, #ARGV - 1 do
  local rk, tk, dk = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  if whole or not intact(rk, tk, dk) then
    local d = cjson.decode(ARGV[i + 1])
    local state = d.state
    if state == 'running' then state = 'pending' end
    redis.call('DEL', rk, tk, dk)
    local retries = 0
    for key, v in pairs(d.retry) do
      redis.call('HSET', tk, key, v)
      retries = retries + 1
    end
    for _, letter in ipairs(d.dead_letters) do redis.call('RPUSH', dk, letter) end
    redis.call('HSET', rk, 'lo', d.lo, 'hi', d.hi, 'cursor', d.cursor, 'state', state, 'owner', '',
      'lineage', '', 'epoch', d.epoch, 'lease_until', 0, 'heartbeat_ms', 0, 'done', d.done,
      'skipped', d.skipped, 'dead', d.dead, 'takeovers', d.takeovers, 'chunks', d.chunks,
      'retries', retries, 'restored', 1)
    -- a range coalesced into another (empty, complete) stays marked as such
    if d.merged_into and d.merged_into ~= '' then
      redis.call('HSET', rk, 'merged_into', d.merged_into)
    end
    rewritten = rewritten + 1
  end
end
if whole then return {1, rewritten} end
return {0, rewritten}
"""
)

CLOSE_ROUND = (
    """
-- Close a round if, and only if, every range is complete and the ranges cover (start, end]
-- with no gap and no overlap; then move the stream's watermark forward (never backwards), and
-- only over the contiguous completed prefix: a round that starts above the watermark is parked
-- in the "ahead" hash and absorbed once the rounds below it have closed.
-- KEYS[1] round hash  KEYS[2] watermark  KEYS[3] open set  KEYS[4] chained id  KEYS[5] ahead hash
-- KEYS[6..] per range (ids 0..n-1): range hash, retry hash, dead list. Ranges are walked in key
-- order (sorted by lo), not by id: a split appends a range whose keys sit inside the old ones.
-- Returns {'lost'} (round missing or a range not intact) | {'unrecoverable', reason}
--       | {'gap', range id} (in key order, the first range whose lo is not the previous hi, or
--         that overlaps it; n_ranges: end not reached)
--       | {'incomplete', range ids...} | {'closed', done, skipped, dead, watermark}
--       (idempotent once closed: the stored totals and the current watermark, '' if none)
"""
    + _NOW
    + _INTACT
    + _FIELDS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'start', 'end', 'id', 'chained')
local wm = redis.call('GET', KEYS[2])
if rnd[1] == 'closed' then
  local t = redis.call('HMGET', KEYS[1], 'done', 'skipped', 'dead')
  return {'closed', t[1], t[2], t[3], wm or ''}
end
if rnd[1] == 'unrecoverable' then
  return {'unrecoverable', redis.call('HGET', KEYS[1], 'reason') or ''}
end
local expect = rnd[2]
local done, skipped, dead = 0, 0, 0
local lagging = {}
local n = (#KEYS - 5) / 3
local walk = {}
for j = 0, n - 1 do
  local rk = KEYS[6 + 3 * j]
  if not intact(rk, KEYS[7 + 3 * j], KEYS[8 + 3 * j]) then return {'lost'} end
  local r = fields(rk, 'lo', 'hi', 'cursor', 'state', 'done', 'skipped', 'dead')
  r.id = j
  table.insert(walk, r)
end
-- key order; equal lo: the empty range first (a range coalesced into its neighbour keeps
-- lo = hi = the neighbour's end), then by id, so the walk stops on an overlap deterministically
table.sort(walk, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a.id < b.id
end)
for _, r in ipairs(walk) do
  if r[1] ~= expect or r[2] < r[1] then return {'gap', tostring(r.id)} end
  expect = r[2]
  if r[4] ~= 'complete' or r[3] ~= r[2] then table.insert(lagging, tostring(r.id)) end
  done, skipped, dead = done + tonumber(r[5]), skipped + tonumber(r[6]), dead + tonumber(r[7])
end
if expect ~= rnd[3] then return {'gap', tostring(n)} end
table.sort(lagging, function(a, b) return tonumber(a) < tonumber(b) end)
if #lagging > 0 then return {'incomplete', unpack(lagging)} end
redis.call('HSET', KEYS[1], 'state', 'closed', 'closed_ms', now, 'done', done,
  'skipped', skipped, 'dead', dead)
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

MARK_UNRECOVERABLE = """
-- The source lost rows the round still had to read: the round can never close.
-- KEYS[1] round hash  ARGV[1] reason
-- Returns 'marked' | 'lost' (no round: nothing written) | 'closed' (a closed round was proven
-- complete before the loss: it stays closed).
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'lost' end
if state == 'closed' then return 'closed' end
redis.call('HSET', KEYS[1], 'state', 'unrecoverable', 'reason', ARGV[1])
return 'marked'
"""

REFRESH_TOTALS = (
    """
-- Recompute a round's done/skipped/dead totals from its ranges (after a dead-letter replay).
-- KEYS[1] round hash  KEYS[2..] range hashes
-- Returns {done, skipped, dead}, or {} when the round or a range is missing (nothing written).
"""
    + _FIELDS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local done, skipped, dead = 0, 0, 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {} end
  local r = fields(KEYS[i], 'done', 'skipped', 'dead')
  done, skipped, dead = done + tonumber(r[1]), skipped + tonumber(r[2]), dead + tonumber(r[3])
end
redis.call('HSET', KEYS[1], 'done', done, 'skipped', skipped, 'dead', dead)
return {done, skipped, dead}
"""
)

RAISE_COUNTER = """
-- Move the round counter up to at least a value (after it was lost); never down.
-- KEYS[1] seq  ARGV[1] value.  Returns the counter.
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want > cur then
  redis.call('SET', KEYS[1], want)
  return want
end
return cur
"""

DELETE_ROUND = """
-- Remove one round's keys and its index entries; never touches the watermark.
-- KEYS[1] open set  KEYS[2] chained id  KEYS[3] by_key hash  KEYS[4..] the round's keys
-- ARGV[1] round id  ARGV[2] idempotency key ('' = none)
-- Returns the number of keys removed.
local n = 0
for i = 4, #KEYS do n = n + redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('HDEL', KEYS[3], ARGV[2]) end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return n
"""

__all__ = [
    "CLOSE_ROUND",
    "CREATE_ROUND",
    "DELETE_ROUND",
    "MARK_UNRECOVERABLE",
    "RAISE_COUNTER",
    "REFRESH_TOTALS",
    "RESTORE_ROUND",
]
