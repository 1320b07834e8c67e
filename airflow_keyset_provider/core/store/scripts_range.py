"""The cursor store's range scripts: claim, heartbeat, advance, requeue dead letters, release, and
the atomic snapshot read (``store_scripts.py`` is the import surface; the key layout and the
guarantees are in ``store.py``).
"""

from __future__ import annotations

from .lua import _FIELDS, _INTACT, _NOW

CLAIM = (
    """
-- Take (or keep) ownership of a range.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash  KEYS[4] dead list
-- ARGV[1] owner token (unique per attempt)  ARGV[2] lineage ('' = none; a new attempt of the
--         same lineage, e.g. the same Airflow task instance, may take over at once: the old
--         attempt is fenced by the new token)  ARGV[3] lease ms
-- ARGV[4] this range's id  ARGV[5] '1' = a pulling task's claim: the round hash records
--         'held:<lineage>' = this id, so a retry of the lineage finds what it held
-- ARGV[6] '1' = the caller keeps a checkpoint mirror: a claim that absorbs ranges marks this
--         range 'unmirrored' = how many, until the mirror has recorded them (any later owner's
--         checkpoint then carries them: CursorStore.mirrored_coalescing clears the mark)
-- Coalescing (pull mode): KEYS[5..] range hash, retry hash, dead list of the ranges that follow
-- this one by id. While the round is open, each of them that is
-- fresh (pending, never claimed, nothing committed, no retries or dead letters) and starts where
-- this range now ends is absorbed: this range's hi moves to its hi, and it is written anew as an
-- empty complete range (lo = hi = that hi, 'merged_into' this id), so the ranges still
-- partition the round. Stops at the first that is not. The round hash records 'skip:<id>' = the
-- first id after the run, and moves 'next' past the run if it is inside it, so NEXT_UNCLAIMED
-- does not hand out what this claim absorbed.
-- Returns {'lost'} (round missing or range not intact) | {'complete', cursor, done, skipped, dead}
--       | {'held', owner, ms left}
--       | {'ok', cursor, epoch, done, skipped, dead, takeover, retries, lo, hi, absorbed}
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
if ARGV[5] == '1' and ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'held:' .. ARGV[2], ARGV[4]) end
local hi, absorbed = r[11], 0
if #KEYS > 4 and redis.call('HGET', KEYS[1], 'state') == 'open' then
  for j = 5, #KEYS - 2, 3 do
    -- fresh and intact in two calls (a missing field is at its default, store_layout.py): its
    -- counts are 0 and its retry hash and dead list do not exist
    local c = redis.call('HMGET', KEYS[j], 'lo', 'hi', 'state', 'owner', 'cursor', 'claimed_ms',
      'retries', 'dead')
    if c[1] ~= hi or (c[3] or 'pending') ~= 'pending' or (c[4] or '') ~= ''
      or (c[5] or c[1]) ~= c[1] or (c[6] or '0') ~= '0' or (c[7] or '0') ~= '0'
      or (c[8] or '0') ~= '0' or redis.call('EXISTS', KEYS[j + 1], KEYS[j + 2]) > 0 then
      break
    end
    hi = c[2]
    absorbed = absorbed + 1
  end
  -- the absorbed ranges sit, empty, at the new end: (hi, hi] holds no key, and in key order
  -- (lo, then hi) they come right after this range and before the range that starts at hi
  for k = 1, absorbed do
    local key = KEYS[2 + 3 * k]
    redis.call('DEL', key)
    redis.call('HSET', key, 'lo', hi, 'hi', hi, 'state', 'complete', 'retries', 0, 'dead', 0,
      'merged_into', ARGV[4], 'completed_ms', now)
  end
  if absorbed > 0 then
    redis.call('HSET', KEYS[2], 'hi', hi)
    if ARGV[6] == '1' then redis.call('HSET', KEYS[2], 'unmirrored', absorbed) end
    redis.call('HINCRBY', KEYS[1], 'merged', absorbed)
    -- NEXT_UNCLAIMED jumps from this id past the run it now owns; a counter already inside
    -- the run moves past it now
    local after = tonumber(ARGV[4]) + absorbed + 1
    redis.call('HSET', KEYS[1], 'skip:' .. ARGV[4], after)
    local nxt = tonumber(redis.call('HGET', KEYS[1], 'next') or '0')
    if nxt > tonumber(ARGV[4]) and nxt < after then redis.call('HSET', KEYS[1], 'next', after) end
  end
end
return {'ok', r[5], epoch, r[6], r[7], r[8], takeover, redis.call('HLEN', KEYS[3]), r[10], hi,
  absorbed}
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

__all__ = ["ADVANCE", "CLAIM", "HEARTBEAT", "RELEASE", "REQUEUE_DEAD", "SNAPSHOT_RANGES"]
