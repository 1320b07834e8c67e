
-- Commit the outcome of one chunk (or of one retry pass): cursor, counters, item failures and
-- dead letters in one step, fenced by the owner token and the expected cursor.
-- KEYS[1] range hash  KEYS[2] retry hash  KEYS[3] dead list  KEYS[4] events channel
-- KEYS[5] the stream's released list (call ids of the last steps that released a range)
-- ARGV[1] token  ARGV[2] expected cursor  ARGV[3] new cursor (= expected for a retry pass)
-- ARGV[4] done  ARGV[5] skipped  ARGV[6] lease ms  ARGV[7] max item attempts
-- ARGV[8] dead cap: the most dead letters the range may hold (letters are never trimmed)
-- ARGV[9] label for the event ('R:I')  ARGV[10] number of resolved retry keys N
-- ARGV[11..10+2N] key, outcome ('d' done / 's' skipped) for keys leaving the retry set
-- then F = count, then F pairs of key, error for items that failed in this pass
-- then '1' to release the range when this step completes it (as RELEASE: compacted, the owner's
-- fields gone) unless a split request waits for the owner's answer; '' or absent: keep it
-- then the call id (unique per call, '' = none): kept in the range's 'call' field with the step
-- Refusals change nothing: {'lost'} (range not intact) {'not_owner', owner} {'expired'}
--   {'cursor', actual} {'backwards'} {'past_hi', hi}
--   {'dead_cap', dead now, letters this step would add, cap}
-- Returns {'ok', cursor, done, skipped, dead, retries, state, split request ('' = none),
--   released (1/0)}.
-- Safe to run twice (redis-py sends it again when the reply is lost): a step that committed
-- wrote its call id in the range's 'call' field, so a second run with that id writes nothing
-- and returns {'ok', ...} with the range's state now (cursor, counters, retries, state, split
-- request; released = complete with no owner left): no failure's attempt is counted again, no
-- dead letter appended again, and the caller sees success, not a cursor conflict. The field is
-- overwritten by the range's next claim, step, split, release or requeue (one per range, not
-- per call). A step that releases the range compacts it, which drops the field: its call id
-- goes to the stream's released list instead (KEYS[5], capped, includes/released.lua), where
-- its second run finds it. A refusal writes nothing, so its second run decides afresh.
--!include now.lua

--!include intact.lua
--!include fields.lua
--!include compact.lua
--!include released.lua

if not intact(KEYS[1], KEYS[2], KEYS[3]) then return {'lost'} end
local n = tonumber(ARGV[10])
local f = tonumber(ARGV[11 + 2 * n])
local call = ARGV[13 + 2 * n + 2 * f] or ''
local seen = redis.call('HMGET', KEYS[1], 'call', 'owner', 'state')
if call ~= '' and (seen[1] == call
    or (seen[3] == 'complete' and (seen[2] or '') == '' and released_call(KEYS[5], call))) then
  local s = fields(KEYS[1], 'cursor', 'done', 'skipped', 'dead', 'retries', 'state', 'owner')
  local released = 0
  if s[6] == 'complete' and s[7] == '' then released = 1 end
  local split_req = redis.call('HGET', KEYS[1], 'split_req') or ''
  return {'ok', s[1], s[2], s[3], s[4], s[5], s[6], split_req, released}
end
local r = fields(KEYS[1], 'owner', 'lease_until', 'cursor', 'hi', 'dead')
if r[1] ~= ARGV[1] then return {'not_owner', r[1]} end
if tonumber(r[2]) <= now then return {'expired'} end
if r[3] ~= ARGV[2] then return {'cursor', r[3]} end
local new = ARGV[3]
if new < r[3] then return {'backwards'} end
if new > r[4] then return {'past_hi', r[4]} end
local done, skipped, dead = tonumber(ARGV[4]), tonumber(ARGV[5]), 0
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
if call ~= '' then redis.call('HSET', KEYS[1], 'call', call) end
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
  if call ~= '' then remember_released(KEYS[5], call) end
  released = 1
end
return {'ok', new, done, skipped, dead, retries, state, split_req, released}
