
-- Put back the dead letters a failed replay moved (requeue_dead.lua) and did not bring to a
-- terminal state: each letter whose key is still in the range's retry hash leaves it and goes
-- back to the tail of the dead list as it was (requeue took it from there). A letter that
-- failed again was dead-lettered anew, one that succeeded was counted: neither is put back.
-- A range left with no retries and its cursor at hi is complete again.
-- KEYS[1] range hash  KEYS[2] dead list  KEYS[3] retry hash
-- ARGV[1..N] the letters requeue_dead.lua returned (JSON, newest-moved last)
-- Returns {'lost'} (range not intact) | {'held', owner} | {'ok', restored, state}
-- Safe to run twice: the second run finds none of the keys in the retry hash and moves nothing.
--!include now.lua

--!include intact.lua
--!include fields.lua

if not intact(KEYS[1], KEYS[3], KEYS[2]) then return {'lost'} end
local r = fields(KEYS[1], 'owner', 'lease_until', 'state', 'cursor', 'hi')
if r[1] ~= '' and tonumber(r[2]) > now then return {'held', r[1]} end
local restored = 0
for i = #ARGV, 1, -1 do  -- requeue popped the tail first: push back in reverse
  local d = cjson.decode(ARGV[i])
  if redis.call('HDEL', KEYS[3], d.key) == 1 then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    restored = restored + 1
  end
end
local state = r[3]
if restored > 0 then
  redis.call('HINCRBY', KEYS[1], 'dead', restored)
  local retries = redis.call('HLEN', KEYS[3])
  redis.call('HSET', KEYS[1], 'retries', retries)
  if retries == 0 and r[4] == r[5] and state ~= 'complete' then
    state = 'complete'
    redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
    redis.call('HSET', KEYS[1], 'state', state)
  end
end
return {'ok', restored, state}
