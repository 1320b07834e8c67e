
-- An idle task asks the live owner of a running range to split it at its next chunk boundary.
-- KEYS[1] round hash  KEYS[2] range hash  ARGV[1] requester token  ARGV[2] ms after which an
-- unanswered request of another requester may be replaced  ARGV[3] call id ('' = none)
-- Returns 'lost' | 'closed' (round not open) | 'not_running' (complete, pending, released or
--   lease expired: claim it instead) | 'busy' (another request is pending) | 'asked'
-- Safe to run twice: 'asked' writes 'split_req_call' = the call id in the range hash, so its
-- second run writes nothing and answers 'asked' again: it does not clear the answer the owner
-- may have given in between (which a fresh request of the same requester would clear).
--!include now.lua

if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 'lost' end
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return 'closed' end
local call = ARGV[3] or ''
if call ~= '' and redis.call('HGET', KEYS[2], 'split_req_call') == call then return 'asked' end
local r = redis.call('HMGET', KEYS[2], 'state', 'owner', 'lease_until', 'split_req', 'split_req_ms')
if r[1] ~= 'running' or (r[2] or '') == '' or tonumber(r[3] or '0') <= now then
  return 'not_running'
end
if (r[4] or '') ~= '' and r[4] ~= ARGV[1] and now - tonumber(r[5] or '0') < tonumber(ARGV[2]) then
  return 'busy'
end
redis.call('HSET', KEYS[2], 'split_req', ARGV[1], 'split_req_ms', now)
if call ~= '' then redis.call('HSET', KEYS[2], 'split_req_call', call) end
-- this requester's answer to an earlier request goes: SPLIT_ANSWER must not return it again
local answer = redis.call('HGET', KEYS[2], 'split_answer') or ''
if string.sub(answer, 1, #ARGV[1] + 1) == ARGV[1] .. '|' then
  redis.call('HSET', KEYS[2], 'split_answer', '')
end
return 'asked'
