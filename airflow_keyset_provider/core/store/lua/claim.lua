
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
-- ARGV[7] call id (unique per call, '' = none)
-- Coalescing (pull mode): KEYS[5..] range hash, retry hash, dead list of the ranges that follow
-- this one by id. While the round is open, each of them that is
-- fresh (pending, never claimed, nothing committed, no retries or dead letters) and starts where
-- this range now ends is absorbed: this range's hi moves to its hi, and it is written anew as an
-- empty complete range (lo = hi = that hi, 'merged_into' this id), so the ranges still
-- partition the round. Stops at the first that is not. The round hash records 'skip:<id>' = the
-- first id after the run, and moves 'next' past the run if it is inside it, so NEXT_UNCLAIMED
-- does not hand out what this claim absorbed.
-- The round hash keeps 'first_claim_ms', the time of its first successful claim (HSETNX).
-- Returns {'lost'} (round missing or range not intact) | {'complete', cursor, done, skipped, dead}
--       | {'held', owner, ms left}
--       | {'ok', cursor, epoch, done, skipped, dead, takeover, retries, lo, hi, absorbed}
-- Safe to run twice (redis-py sends it again when the reply is lost): an 'ok' claim writes
-- 'call' = '<call id>|<takeover>|<absorbed>' in the range hash, so a second run with that id,
-- while this token still owns the range, writes nothing and returns the same 'ok' (the epoch
-- is not raised again, the takeover and the ranges absorbed are still reported, so the caller
-- mirrors them). 'complete' compacts a dead owner's fields at most once and 'held' writes
-- nothing: their second run decides afresh, to the same answer.
--!include now.lua

--!include intact.lua
--!include fields.lua
--!include compact.lua

if redis.call('EXISTS', KEYS[1]) == 0 or not intact(KEYS[2], KEYS[3], KEYS[4]) then
  return {'lost'}
end
local call = ARGV[7] or ''
if call ~= '' then
  local seen = redis.call('HMGET', KEYS[2], 'call', 'owner')
  local head = call .. '|'
  if seen[1] and seen[2] == ARGV[1] and string.sub(seen[1], 1, #head) == head then
    local t, a = string.match(string.sub(seen[1], #head + 1), '^(%d+)|(%d+)$')
    local s = fields(KEYS[2], 'cursor', 'epoch', 'done', 'skipped', 'dead', 'lo', 'hi')
    local retries = redis.call('HLEN', KEYS[3])
    return {'ok', s[1], tonumber(s[2]), s[3], s[4], s[5], tonumber(t), retries, s[6], s[7],
      tonumber(a)}
  end
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
    -- fresh and intact in two calls (a missing field is at its default, layout.py): its
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
-- the round's first claim: where its processing rate starts (status, not planning time)
redis.call('HSETNX', KEYS[1], 'first_claim_ms', now)
if call ~= '' then
  redis.call('HSET', KEYS[2], 'call', call .. '|' .. takeover .. '|' .. absorbed)
end
return {'ok', r[5], epoch, r[6], r[7], r[8], takeover, redis.call('HLEN', KEYS[3]), r[10], hi,
  absorbed}
