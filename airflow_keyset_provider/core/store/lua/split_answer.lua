
-- Read-only: the answer to a split request. KEYS[1] range hash  ARGV[1] requester token
-- Returns {'pending'} (asked, the owner is live and has not reached a chunk boundary yet)
--       | {'ok', new range id} | {'no'} (declined, or the request is moot: the range completed,
--         its owner released it or its lease ran out, or another request replaced this one)
-- Safe to run twice: it writes nothing.
--!include now.lua

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
