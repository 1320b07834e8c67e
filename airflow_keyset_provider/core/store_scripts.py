"""The cursor store's Lua scripts (see ``store.py`` for the key layout and the guarantees).

Each script is headed by the KEYS it touches (all of one stream, sharing its hash tag), its ARGV
and what it returns. Times come from the Redis server's ``TIME``. The state strings are those of
``core/status.py``: rounds ``open``/``closed``/``unrecoverable``, ranges ``pending``/``running``/
``complete``.
"""

from __future__ import annotations

from .store_layout import COMPACT_LUA, FIELDS_LUA

# --------------------------------------------------------------------------------------------
# Lua scripts. Each one: which KEYS, which ARGV, what it returns. Times come from redis TIME.
# --------------------------------------------------------------------------------------------

_NOW = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# A range is intact when its hash exists and the counts it keeps beside what they count agree:
# ``retries`` = HLEN of its retry hash, ``dead`` = LLEN of its dead list (every script that
# changes one changes the other in the same step). A piece evicted or deleted on its own (one
# retry hash, one dead list) breaks the equality and reads as lost, never as "nothing left".
# A range written before the counts were kept (no ``retries`` field) is checked for existence only.
_INTACT = """
local function intact(range, retry, dead)
  if redis.call('EXISTS', range) == 0 then return false end
  local c = redis.call('HMGET', range, 'retries', 'dead')
  if not c[1] then return true end
  return tonumber(c[1]) == redis.call('HLEN', retry) and tonumber(c[2]) == redis.call('LLEN', dead)
end
"""

# Range fields at their default may be missing: every script that reads a range's fields reads
# them with ``fields`` (defaults filled in); RELEASE and CLAIM ``compact`` a complete range
# (``store_layout.py``).
_FIELDS = FIELDS_LUA + COMPACT_LUA

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

CLAIM = (
    """
-- Take (or keep) ownership of a range.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash  KEYS[4] dead list
-- ARGV[1] owner token (unique per attempt)  ARGV[2] lineage ('' = none; a new attempt of the
--         same lineage, e.g. the same Airflow task instance, may take over at once: the old
--         attempt is fenced by the new token)  ARGV[3] lease ms
-- Returns {'lost'} (round missing or range not intact) | {'complete', cursor, done, skipped, dead}
--       | {'held', owner, ms left}
--       | {'ok', cursor, epoch, done, skipped, dead, takeover, retries, lo, hi}
"""
    + _NOW
    + _INTACT
    + _FIELDS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or not intact(KEYS[2], KEYS[3], KEYS[4]) then
  return {'lost'}
end
local r = fields(KEYS[2], 'state', 'owner', 'lineage', 'lease_until', 'cursor',
  'done', 'skipped', 'dead', 'epoch', 'lo', 'hi')
local lease_until = tonumber(r[4])
if r[1] == 'complete' then
  -- an owner that completed the range but never released it (it died): its fields go now
  if r[2] ~= '' and (lease_until <= now or (ARGV[2] ~= '' and r[3] == ARGV[2])) then
    compact(KEYS[2])
  end
  return {'complete', r[5], r[6], r[7], r[8]}
end
if r[2] ~= '' and r[2] ~= ARGV[1] and lease_until > now and (ARGV[2] == '' or r[3] ~= ARGV[2]) then
  return {'held', r[2], lease_until - now}
end
local takeover = 0
if r[2] ~= '' and r[2] ~= ARGV[1] then takeover = 1 end
local epoch = tonumber(r[9]) + 1
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'lineage', ARGV[2], 'epoch', epoch,
  'state', 'running', 'lease_until', now + tonumber(ARGV[3]), 'heartbeat_ms', now,
  'claimed_ms', now)
if takeover == 1 then redis.call('HINCRBY', KEYS[2], 'takeovers', 1) end
-- a split request was made of the previous owner: the new one does not inherit it (the requester
-- reads 'no' and claims or rescues elsewhere)
if r[2] ~= ARGV[1] then redis.call('HDEL', KEYS[2], 'split_req', 'split_req_ms') end
return {'ok', r[5], epoch, r[6], r[7], r[8], takeover, redis.call('HLEN', KEYS[3]), r[10], r[11]}
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
-- ARGV[4] done  ARGV[5] skipped  ARGV[6] lease ms  ARGV[7] max item attempts
-- ARGV[8] dead cap: the most dead letters the range may hold (letters are never trimmed)
-- ARGV[9] label for the event ('R:I')  ARGV[10] number of resolved retry keys N
-- ARGV[11..10+2N] key, outcome ('d' done / 's' skipped) for keys leaving the retry set
-- then F = count, then F pairs of key, error for items that failed in this pass
-- then '1' to release the range when this step completes it (as RELEASE: compacted, the owner's
-- fields gone) unless a split request waits for the owner's answer; '' or absent: keep it
-- Refusals change nothing: {'lost'} (range not intact) {'not_owner', owner} {'expired'}
--   {'cursor', actual} {'backwards'} {'past_hi', hi}
--   {'dead_cap', dead now, letters this step would add, cap}
-- Returns {'ok', cursor, done, skipped, dead, retries, state, split request ('' = none),
--   released (1/0)}.
"""
    + _NOW
    + _INTACT
    + _FIELDS
    + """
if not intact(KEYS[1], KEYS[2], KEYS[3]) then return {'lost'} end
local r = fields(KEYS[1], 'owner', 'lease_until', 'cursor', 'hi', 'dead')
if r[1] ~= ARGV[1] then return {'not_owner', r[1]} end
if tonumber(r[2]) <= now then return {'expired'} end
if r[3] ~= ARGV[2] then return {'cursor', r[3]} end
local new = ARGV[3]
if new < r[3] then return {'backwards'} end
if new > r[4] then return {'past_hi', r[4]} end
local done, skipped, dead = tonumber(ARGV[4]), tonumber(ARGV[5]), 0
local n = tonumber(ARGV[10])
local f = tonumber(ARGV[11 + 2 * n])
local max_attempts = tonumber(ARGV[7])
-- first the failures' attempts (reads only), so a refusal below writes nothing
local failures = {}
local dying = 0
local i = 12 + 2 * n
for _ = 1, f do
  local key, err = ARGV[i], ARGV[i + 1]
  local prev = redis.call('HGET', KEYS[2], key)
  local attempts = 1
  if prev then attempts = tonumber(string.match(prev, '^(%d+)|')) + 1 end
  if attempts >= max_attempts then dying = dying + 1 end
  table.insert(failures, {key, err, attempts})
  i = i + 2
end
if dying > 0 and tonumber(r[5]) + dying > tonumber(ARGV[8]) then
  return {'dead_cap', r[5], dying, ARGV[8]}
end
i = 11
for _ = 1, n do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then
    if ARGV[i + 1] == 'd' then done = done + 1 else skipped = skipped + 1 end
  end
  i = i + 2
end
for _, x in ipairs(failures) do
  if x[3] >= max_attempts then
    redis.call('HDEL', KEYS[2], x[1])
    local letter = {key = x[1], error = x[2], attempts = x[3], at_ms = now}
    redis.call('LPUSH', KEYS[3], cjson.encode(letter))
    dead = dead + 1
  else
    redis.call('HSET', KEYS[2], x[1], x[3] .. '|' .. x[2])
  end
end
redis.call('HSET', KEYS[1], 'cursor', new, 'lease_until', now + tonumber(ARGV[6]),
  'heartbeat_ms', now)
local c = fields(KEYS[1], 'done', 'skipped', 'dead')
done = tonumber(c[1]) + done
skipped = tonumber(c[2]) + skipped
dead = tonumber(c[3]) + dead
redis.call('HSET', KEYS[1], 'done', done, 'skipped', skipped, 'dead', dead)
redis.call('HINCRBY', KEYS[1], 'chunks', 1)
local retries = redis.call('HLEN', KEYS[2])
redis.call('HSET', KEYS[1], 'retries', retries)
local state = 'running'
if new == r[4] and retries == 0 then
  state = 'complete'
  redis.call('HSET', KEYS[1], 'state', state, 'completed_ms', now)
  redis.call('PUBLISH', KEYS[4], ARGV[9] .. ':complete')
end
local split_req = redis.call('HGET', KEYS[1], 'split_req') or ''
local released = 0
if state == 'complete' and ARGV[12 + 2 * n + 2 * f] == '1' and split_req == '' then
  compact(KEYS[1])
  released = 1
end
return {'ok', new, done, skipped, dead, retries, state, split_req, released}
"""
)

REQUEUE_DEAD = (
    """
-- Move dead letters back into the range's retry set (attempts reset) so a normal, fenced
-- traverse processes them again; the range is no longer complete until they reach a terminal
-- state. Refused while a live owner holds the range.
-- KEYS[1] range hash  KEYS[2] dead list  KEYS[3] retry hash   ARGV[1] max letters to move
-- Returns {'lost'} (range not intact) | {'held', owner} | {'ok', moved}
"""
    + _NOW
    + _INTACT
    + _FIELDS
    + """
if not intact(KEYS[1], KEYS[3], KEYS[2]) then return {'lost'} end
local r = fields(KEYS[1], 'owner', 'lease_until', 'state', 'cursor')
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
  redis.call('HSET', KEYS[1], 'retries', redis.call('HLEN', KEYS[3]))
  if r[3] == 'complete' then redis.call('HSET', KEYS[1], 'state', 'pending', 'cursor', r[4]) end
end
return {'ok', moved}
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
-- Owners of rewritten ranges are cleared (every old token is fenced out); running -> pending.
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
    rewritten = rewritten + 1
  end
end
if whole then return {1, rewritten} end
return {0, rewritten}
"""
)

RELEASE = (
    """
-- Give the range up so the next worker need not wait for the lease to expire. A complete range
-- is compacted (its owner's fields go); an unfinished one keeps its lineage (a later try of
-- the same lineage finds it) and its last heartbeat.
-- KEYS[1] range hash  ARGV[1] owner token.  Returns 1 if released, 0 if not the owner.
"""
    + _FIELDS
    + """
local r = redis.call('HMGET', KEYS[1], 'owner', 'state')
if r[1] ~= ARGV[1] then return 0 end
if r[2] == 'complete' then
  compact(KEYS[1])
  return 1
end
redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
redis.call('HSET', KEYS[1], 'state', 'pending')
return 1
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
-- key order; equal lo (an overlap) sorts by id so the walk stops on it deterministically
table.sort(walk, function(a, b) if a[1] == b[1] then return a.id < b.id end return a[1] < b[1] end)
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

SNAPSHOT_RANGES = """
-- An atomic read of ranges for the mirror and the status readers (a batch of ranges per call,
-- ``store_reads.READ_BATCH``): each range hash, its retry hash (entries, or only its size) and
-- its dead list (letters, or only its length).
-- KEYS per range: range hash, retry hash, dead list   ARGV[1] '1' = entries, '0' = sizes only
-- Returns per range {hash as a flat list, retry (flat list or size), dead (list or length)}.
local out = {}
for j = 1, #KEYS, 3 do
  if ARGV[1] == '1' then
    table.insert(out, {redis.call('HGETALL', KEYS[j]), redis.call('HGETALL', KEYS[j + 1]),
      redis.call('LRANGE', KEYS[j + 2], 0, -1)})
  else
    table.insert(out, {redis.call('HGETALL', KEYS[j]), redis.call('HLEN', KEYS[j + 1]),
      redis.call('LLEN', KEYS[j + 2])})
  end
end
return out
"""

NEXT_UNCLAIMED = """
-- Hand out the next range id of a round that this counter never handed out (a hint for tasks
-- that pull ranges: the claim that follows is fenced per range as always).
-- KEYS[1] round hash.  Returns {'lost'} (no round: nothing written) | {'closed'} (round not open)
--       | {'ok', id, n_ranges} (id >= n_ranges: every range was handed out once).
if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return {'closed'} end
return {'ok', redis.call('HINCRBY', KEYS[1], 'next', 1) - 1, redis.call('HGET', KEYS[1], 'n_ranges')}
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

OPEN_BRIEFS = (
    """
-- The fields a pulling task reads of each range of one batch that is not complete (it never
-- claims, rescues or splits a complete one), so its polls at a round's end return what is left,
-- not every range. KEYS range hashes of ids ARGV[1], ARGV[1] + 1, ...  ARGV[2..] field names
-- Returns {'lost', id} (a range has no state) | {'ok', now, id, values..., id, values..., ...}
-- (missing fields as '').
"""
    + _NOW
    + """
local first = tonumber(ARGV[1])
local names = {}
for j = 2, #ARGV do names[#names + 1] = ARGV[j] end
local out = {'ok', now}
for k = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[k], 'lo', 'hi', 'state', unpack(names))
  if not v[1] and not v[2] then return {'lost', first + k - 1} end
  if v[3] ~= 'complete' then
    out[#out + 1] = first + k - 1
    for j = 4, #v do out[#out + 1] = v[j] or '' end
  end
end
return out
"""
)

REQUEST_SPLIT = (
    """
-- An idle task asks the live owner of a running range to split it at its next chunk boundary.
-- KEYS[1] round hash  KEYS[2] range hash  ARGV[1] requester token  ARGV[2] ms after which an
-- unanswered request of another requester may be replaced
-- Returns 'lost' | 'closed' (round not open) | 'not_running' (complete, pending, released or
--   lease expired: claim it instead) | 'busy' (another request is pending) | 'asked'
"""
    + _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 'lost' end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return 'closed' end
local r = redis.call('HMGET', KEYS[2], 'state', 'owner', 'lease_until', 'split_req', 'split_req_ms')
if r[1] ~= 'running' or (r[2] or '') == '' or tonumber(r[3] or '0') <= now then
  return 'not_running'
end
if (r[4] or '') ~= '' and r[4] ~= ARGV[1] and now - tonumber(r[5] or '0') < tonumber(ARGV[2]) then
  return 'busy'
end
redis.call('HSET', KEYS[2], 'split_req', ARGV[1], 'split_req_ms', now)
return 'asked'
"""
)

SPLIT = (
    """
-- The owner splits its range at a chunk boundary: (lo, hi] becomes (lo, at] and a new range
-- (at, hi], pending and unowned, is appended to the round; or it declines the pending request.
-- The owner passes an ``at`` above every key it has read (prefetch included); the script
-- refuses one that is not strictly between the committed cursor and hi, so no committed key,
-- retry or dead letter (all <= cursor) changes range, and the ranges still partition the round.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash  KEYS[4] dead list
-- KEYS[5] new range hash  KEYS[6] new retry hash  KEYS[7] new dead list  KEYS[8] events channel
-- ARGV[1] owner token  ARGV[2] at ('' = decline the request)  ARGV[3] new range id (= n_ranges
-- as the caller read it)  ARGV[4] this range's id
-- Returns {'lost'} | {'not_owner', owner} | {'expired'} | {'closed'} (round not open)
--       | {'declined'} | {'moved', n_ranges} (another split took that id: read n again)
--       | {'bad_key', cursor, hi} | {'taken'} (the new range's keys exist) | {'ok', new id}
"""
    + _NOW
    + _INTACT
    + """
if redis.call('EXISTS', KEYS[1]) == 0 or not intact(KEYS[2], KEYS[3], KEYS[4]) then
  return {'lost'}
end
local r = redis.call('HMGET', KEYS[2], 'owner', 'lease_until', 'cursor', 'hi', 'split_req')
if r[1] ~= ARGV[1] then return {'not_owner', r[1] or ''} end
if tonumber(r[2]) <= now then return {'expired'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'n_ranges')
if rnd[1] ~= 'open' then return {'closed'} end
local asked = r[5] or ''
local at = ARGV[2]
if at == '' then
  if asked ~= '' then redis.call('HSET', KEYS[2], 'split_req', '', 'split_answer', asked .. '|no') end
  return {'declined'}
end
if rnd[2] ~= ARGV[3] then return {'moved', rnd[2]} end
if not (at > r[3] and at < r[4]) then return {'bad_key', r[3], r[4]} end
if redis.call('EXISTS', KEYS[5], KEYS[6], KEYS[7]) > 0 then return {'taken'} end
redis.call('HSET', KEYS[5], 'lo', at, 'hi', r[4], 'cursor', at, 'state', 'pending',
  'dead', 0, 'retries', 0, 'split_from', ARGV[4], 'created_ms', now)
local answer = ''
if asked ~= '' then answer = asked .. '|' .. ARGV[3] end
redis.call('HSET', KEYS[2], 'hi', at, 'split_req', '', 'split_answer', answer)
redis.call('HSET', KEYS[1], 'n_ranges', tonumber(ARGV[3]) + 1)
redis.call('HINCRBY', KEYS[1], 'splits', 1)
redis.call('PUBLISH', KEYS[8], ARGV[4] .. ':split:' .. ARGV[3])
return {'ok', ARGV[3]}
"""
)

SPLIT_ANSWER = (
    """
-- Read-only: the answer to a split request. KEYS[1] range hash  ARGV[1] requester token
-- Returns {'pending'} (asked, the owner is live and has not reached a chunk boundary yet)
--       | {'ok', new range id} | {'no'} (declined, or the request is moot: the range completed,
--         its owner released it or its lease ran out, or another request replaced this one)
"""
    + _NOW
    + """
local r = redis.call('HMGET', KEYS[1], 'state', 'owner', 'lease_until', 'split_req', 'split_answer')
local answer = r[5] or ''
local head = ARGV[1] .. '|'
if string.sub(answer, 1, #head) == head then
  local v = string.sub(answer, #head + 1)
  if v == 'no' then return {'no'} end
  return {'ok', v}
end
if r[4] == ARGV[1] and r[1] == 'running' and (r[2] or '') ~= '' and tonumber(r[3] or '0') > now then
  return {'pending'}
end
return {'no'}
"""
)
